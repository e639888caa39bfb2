"""Random-weight models built straight on a device, for benchmarks at real shapes (no checkpoint
of billions of random numbers is ever written or read).

Initialisation keeps activations in a sane range so timings and numerics resemble a trained
model's: projections ~ N(0, 1/fan_in), norms at their neutral value, GDN/KDA decays spread like
the released models' (A = exp(A_log) ∈ [1, 16], softplus(dt_bias) ∈ [1e-3, 0.1]).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from hypic.models.layers.fp8 import FP8, write_rows
from hypic.models.loader import LoadedModel, materialized
from hypic.models.quantized import check_quantization, resolved_quantization
from hypic.models.registry import resolve


@torch.no_grad()
def random_model(config: dict[str, Any], *, device: str | torch.device, dtype: torch.dtype,
                 seed: int = 0, quantization: str | None = None) -> LoadedModel:
    """``quantization="fp8"``: the projections and experts drawn as any weight is, then held in 8
    bits with row scales (hypic.models.layers.fp8), one tensor at a time."""
    check_quantization(quantization)
    device = torch.device(device)
    quantization = resolved_quantization(quantization, config, device)  # "auto": none for random weights
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):  # storage only in the target dtype: a 48 B-parameter shape in fp32 would not fit
        model = resolve(config).build(config)
    model = materialized(model, dtype, device, quantization)  # every parameter is written below
    zero_centred = {f"{n}.weight" for n, m in model.named_modules() if getattr(m, "zero_centred", False)}
    params = dict(model.named_parameters())
    for name, p in params.items():
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name:
            p.fill_(0.0 if name in zero_centred else 1.0)  # each norm's own neutral value
        elif leaf == "A_log":
            p.copy_(torch.empty(p.shape, device=device).uniform_(0.0, math.log(16.0), generator=gen))
        elif leaf == "dt_bias":
            dt = torch.empty(p.shape, device=device).uniform_(math.log(1e-3), math.log(0.1), generator=gen).exp()
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        elif leaf == "e_score_correction_bias":
            p.zero_()
        elif leaf.endswith("_scale"):
            continue  # written with its 8-bit weight
        elif p.dtype == FP8:
            write_rows(p, params[f"{name}_scale"], torch.randn(p.shape, device=device, generator=gen)
                       / math.sqrt(p.shape[-1]))
        else:
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, device=device, generator=gen) / math.sqrt(fan_in))
    model.eval().requires_grad_(False)
    return LoadedModel(model, config, Path(f"random:{seed}"), None, {}, device, dtype, quantization)
