"""Sibling projections as one matmul, for inference.

A layer's projections that read the same input (GDN's qkv, z, b, a; attention's q, k, v; the
MLP's gate and up) are separate ``nn.Linear`` modules so that checkpoints load by name. At
inference each is a separate GEMM launch and, on the GPU, a separate slice of host time; a warm
request over the 9B shape runs 32 layers of them and is host-bound (docs/benchmarks.md). Fusing
concatenates the weights once and leaves each module's weight a view into the fused one (no
second copy of the weights), so loading names and shapes stay as they were. A fused model is for
inference: its parameters share storage, which training and safetensors saving do not expect.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hypic.models.layers.fp8 import Fp8Linear, fp8_linear


class FusedLinears:
    """``x → (x Wᵢᵀ)ᵢ`` for bias-free linears over the same input, as one matmul and a split — or
    one per run of neighbours held alike, when some are 8-bit (``Fp8Linear``) and some are not
    (GDN's decay projections stay in the serving dtype: hypic.models.layers.fp8)."""

    def __init__(self, linears: list[nn.Module]) -> None:
        if any(getattr(lin, "bias", None) is not None for lin in linears):
            raise ValueError("FusedLinears: only bias-free linears can be fused")
        self.parts: list[tuple[Tensor, Tensor | None, list[int]]] = []  # (weight, fp8 row scales, sizes)
        run: list[nn.Module] = []
        for lin in [*linears, None]:
            if run and (lin is None or type(lin) is not type(run[0])):
                self.parts.append(self._concatenated(run))
                run = []
            if lin is not None:
                run.append(lin)
        self.weight = self.parts[0][0]

    @staticmethod
    def _concatenated(linears: list[nn.Module]) -> tuple[Tensor, Tensor | None, list[int]]:
        """The run's weights (and 8-bit scales) as one tensor each, every module's now a view of it."""
        names = ("weight", "weight_scale") if isinstance(linears[0], Fp8Linear) else ("weight",)
        sizes = [lin.out_features for lin in linears]
        whole = []
        for name in names:
            with torch.no_grad():
                joined = torch.cat([getattr(lin, name) for lin in linears])
            start = 0
            for lin, size in zip(linears, sizes, strict=True):
                setattr(lin, name, nn.Parameter(joined[start:start + size], requires_grad=False))
                start += size
            whole.append(joined)
        return whole[0], whole[1] if len(whole) > 1 else None, sizes

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        out: list[Tensor] = []
        for weight, scale, sizes in self.parts:
            y = F.linear(x, weight) if scale is None else fp8_linear(x, weight, scale)
            out += y.split(sizes, dim=-1)
        return tuple(out)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every module that offers it (a ``fuse()`` method, true when it fused now); returns how
    many were fused. Call it after the model is on its device and dtype: the fused weight is not a
    registered tensor, so a later ``.to()`` would not move it."""
    fused = 0
    for module in model.modules():
        fuse = getattr(module, "fuse", None)
        if callable(fuse) and not isinstance(module, FusedLinears):
            fused += bool(fuse())
    return fused
