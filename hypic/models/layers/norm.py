"""RMS norms: plain (``w·x̂``), zero-centred (``(1 + w)·x̂``, Qwen3-Next/3.5) and gated (``w·x̂·act(z)``).

Inference on CUDA uses fused Triton norms (one read, one write; ``hypic.ops.triton_norm``)
instead of the PyTorch composition (several fp32 passes): on the H200 the 9B-shaped 32k prefill went
from 1279 ms to 960 ms with fused norms (measured with fla's; docs/benchmarks.md). hypic's own
kernels replaced fla's because those re-autotune for every new row-count bucket (seconds per new
request length). ``HYPIC_FUSED_NORMS=0`` turns them off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hypic.ops.kernels import kernel_device

ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}  # the gated norm's gate


def fused(x: Tensor) -> bool:
    """Training keeps the differentiable PyTorch composition; the kernels have no backward."""
    return kernel_device(x.device) and not torch.is_grad_enabled() and os.environ.get("HYPIC_FUSED_NORMS") != "0"


def rms(x: Tensor, eps: float) -> Tensor:
    """x̂ = x / sqrt(mean(x²) + eps) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, *, zero_centred: bool = False) -> None:
        super().__init__()
        self.eps, self.zero_centred = eps, zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if fused(x):
            from hypic.ops.triton_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, weight_offset=1.0 if self.zero_centred else 0.0)
        w = self.weight.float()
        w = 1.0 + w if self.zero_centred else w
        return (rms(x, self.eps) * w).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``w · x̂ · act(gate)`` per head (the linear-attention output norm)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        if fused(x):
            from hypic.ops.triton_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, gate, self.activation)
        y = self.weight * rms(x, self.eps).to(x.dtype)
        return (y * ACTIVATIONS[self.activation](gate.float())).to(x.dtype)
