"""Projections whose weights are held in 8 bits (``quantization="fp8"``).

A weight ``W [out, in]`` is kept as e4m3 values and one fp32 scale per output row (``W ≈ diag(s) Q``);
each call quantizes its input per row (token) the same way, ``x ≈ diag(t) P``, multiplies the two
8-bit matrices with fp32 accumulation (``torch._scaled_mm``: the H200's fp8 tensor cores) and
applies both scales to the product: ``y = diag(t) (P Qᵀ) diag(s)``. Weights take half the memory of
bf16 — what lets an 80B-parameter model (Qwen3-Next) fit on one 141 GB GPU — and matmuls read half
the bytes. Per-row scales (not per tensor) keep one outlier row or token from flattening the rest.

Only what the caches' algebra never sees is quantized: the projections around the mixers and the
experts. The linear layers' recurrences, their states and transitions, the attention keys and
values, norms, routers and the LM head stay in the serving dtype, so every exactness property of
position-independent reuse holds for the quantized model as for any other.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from hypic.ops.kernels import kernel_device

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# cuBLAS's fp8 GEMMs need both matrix dimensions a multiple of 16; a projection that is not stays as it is
ALIGN = 16


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """(e4m3 values, fp32 scale per row) with ``x ≈ values · scale[:, None]`` over the last dim;
    a row of zeros gets scale 1. On CUDA one Triton pass (hypic.ops.triton_fp8)."""
    if x.dim() == 2 and kernel_device(x.device) and os.environ.get("HYPIC_FP8_TRITON") != "0":
        from hypic.ops.triton_fp8 import quantize_rows_triton

        return quantize_rows_triton(x)
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.squeeze(-1)


def write_rows(weight: Tensor, scale: Tensor, values: Tensor) -> None:
    """``values`` (full precision) into an 8-bit ``weight`` and its row ``scale``, quantized on the
    weight's device."""
    q, s = quantize_rows(values.to(device=weight.device, dtype=torch.float32))
    weight.copy_(q)
    scale.copy_(s)


def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """``x Wᵀ`` for ``W = diag(scale) weight`` (e4m3), in ``x``'s dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], weight.shape[0])
    q, t = quantize_rows(rows)
    return _scaled_product(q, t, weight, scale).to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _scaled_product(q: Tensor, t: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """``diag(t) (q weightᵀ) diag(scale)``: on the GPU one fp8 GEMM (cuBLAS's row-wise scaled GEMM
    writes bf16 only); elsewhere the 8-bit values widened to fp32, whose products of two e4m3
    numbers are exact (torch's CPU fp8 GEMM takes one scale per tensor only, before torch 2.13)."""
    if q.is_cuda:
        return torch._scaled_mm(q, weight.t(), scale_a=t[:, None], scale_b=scale[None, :].float(),
                                out_dtype=torch.bfloat16)
    return (q.float() @ weight.float().t()) * t[:, None] * scale[None, :].float()


class Fp8Linear(nn.Module):
    """A bias-free ``nn.Linear`` whose weight is held as e4m3 with a per-row ``weight_scale``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.weight_scale)


def quantizable(linear: nn.Module) -> bool:
    return (type(linear) is nn.Linear and linear.bias is None
            and linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0)


def grouped_fp8(q: Tensor, t: Tensor, weight: Tensor, scale: Tensor, counts: Tensor, dtype: torch.dtype) -> Tensor:
    """Quantized rows (``q``, ``t``: ``quantize_rows``) sorted by expert (``counts`` per expert)
    times their expert's ``W_eᵀ``, ``W_e = diag(scale[e]) weight[e]``, in ``dtype``: one grouped
    fp8 GEMM on the GPU, one GEMM per expert elsewhere."""
    if q.is_cuda:
        offs = counts.cumsum(0).to(torch.int32)
        y = torch._scaled_grouped_mm(q, weight.transpose(1, 2), t, scale.float(), offs=offs,
                                     out_dtype=torch.bfloat16)
        return y.to(dtype)
    out, start = torch.empty(q.shape[0], weight.shape[1], dtype=dtype), 0
    for e, n in enumerate(counts.tolist()):
        if n:
            rows = slice(start, start + n)
            out[rows] = _scaled_product(q[rows], t[rows], weight[e], scale[e]).to(dtype)
        start += n
    return out
