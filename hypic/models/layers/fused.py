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


class FusedLinears:
    """``x → (x Wᵢᵀ)ᵢ`` for bias-free linears over the same input, as one matmul and a split."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        if any(lin.bias is not None for lin in linears):
            raise ValueError("FusedLinears: only bias-free linears can be fused")
        with torch.no_grad():
            weight = torch.cat([lin.weight for lin in linears])
        self.sizes = [lin.out_features for lin in linears]
        start = 0
        for lin, size in zip(linears, self.sizes, strict=True):
            lin.weight = nn.Parameter(weight[start:start + size], requires_grad=False)
            start += size
        self.weight = weight

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        return F.linear(x, self.weight).split(self.sizes, dim=-1)


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
