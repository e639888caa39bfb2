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

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# EXPERIMENT (reverted in the next commit: slower, docs/benchmarks.md): a CUDA matmul's rows past
# ROW_BUCKET padded up to a multiple of it, so its shapes recur (a new shape costs ≈ 250 µs of host
# time to launch, scripts/mm_shapes.py).
ROW_BUCKET = 64


def row_bucket() -> int:
    """``HYPIC_ROW_BUCKET``: the multiple a CUDA matmul's rows are padded to (0: never padded)."""
    raw = os.environ.get("HYPIC_ROW_BUCKET", str(ROW_BUCKET))
    try:
        bucket = int(raw)
    except ValueError:
        bucket = -1
    if bucket < 0:
        raise ValueError(f"HYPIC_ROW_BUCKET: expected a whole number ≥ 0, got {raw!r}")
    return bucket


def padded_linear(x: Tensor, weight: Tensor, bias: Tensor | None, bucket: int) -> Tensor:
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    pad = -rows % bucket
    flat = F.pad(x.reshape(rows, width), (0, 0, 0, pad))
    return F.linear(flat, weight, bias)[:rows].view(*x.shape[:-1], weight.shape[0])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, bucket: int = 0) -> Tensor:
    if bucket and x.is_cuda and x.shape[-1]:
        rows = x.numel() // x.shape[-1]
        if rows > bucket and rows % bucket:
            return padded_linear(x, weight, bias, bucket)
    return F.linear(x, weight, bias)


class BucketedLinear(nn.Linear):
    bucket: int = 0

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.bucket)


class FusedLinears:
    """``x → (x Wᵢᵀ)ᵢ`` for bias-free linears over the same input, as one matmul and a split."""

    bucket: int = 0

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
        return linear(x, self.weight, None, self.bucket).split(self.sizes, dim=-1)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every module that offers it (a ``fuse()`` method, true when it fused now); returns how
    many were fused. Call it after the model is on its device and dtype: the fused weight is not a
    registered tensor, so a later ``.to()`` would not move it."""
    bucket = row_bucket()
    fused = 0
    for module in model.modules():
        fuse = getattr(module, "fuse", None)
        if callable(fuse) and not isinstance(module, FusedLinears):
            fused += bool(fuse())
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = BucketedLinear
        if isinstance(module, BucketedLinear):
            module.bucket = bucket
        for value in vars(module).values():
            if isinstance(value, FusedLinears):
                value.bucket = bucket
    return fused
