"""Per-row quantization to e4m3 on CUDA in one pass (``hypic.models.layers.fp8.quantize_rows``).

In PyTorch the same step is seven elementwise kernels (abs, row max, the scale, a cast, a divide, a
clamp, the cast to 8 bits), each reading or writing the activations: before every 8-bit matmul that
cost more than the matmul's saving (the 35B-A3B shape's prefill 1.78× slower than bf16, its decode
step 1.57×, docs/benchmarks.md). This kernel reads each row once and writes its 8-bit values and
its scale: one launch, a fixed configuration from the row length (nothing tuned at run time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

E4M3_MAX = tl.constexpr(448.0)  # a global a kernel reads must be a constexpr


@triton.jit(do_not_specialize=["rows"])  # one binary for every row count
def _quantize_rows_kernel(X, Q, S, rows, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m = (o_t[:, None] < rows) & (o_d[None, :] < D)
    at = o_t[:, None].to(tl.int64) * D + o_d[None, :]
    x = tl.load(X + at, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = tl.minimum(tl.maximum(x / scale[:, None], -E4M3_MAX), E4M3_MAX)
    tl.store(Q + at, q.to(Q.dtype.element_ty), mask=m)
    tl.store(S + o_t, scale, mask=o_t < rows)


def quantize_rows_triton(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [rows, D] → (e4m3 [rows, D], fp32 scale [rows]), as ``quantize_rows``."""
    x = x.contiguous()
    rows, D = x.shape
    q = torch.empty(rows, D, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, s
    BD = triton.next_power_of_2(D)
    BT = max(1, min(64, 8192 // BD))
    warps = 8 if BD >= 2048 else 4
    _quantize_rows_kernel[(triton.cdiv(rows, BT),)](x, q, s, rows, D=D, BD=BD, BT=BT, num_warps=warps)
    return q, s
