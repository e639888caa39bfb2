"""GDN's gates in one Triton launch, for inference on CUDA.

``g = −exp(A_log) · softplus(a + dt_bias)`` (the log-decay per token and value head) and
``β = sigmoid(b)``, both fp32 — in PyTorch eight ops per layer (casts, exp, add, softplus, mul,
neg, sigmoid), each a slice of host time in a host-bound warm request. ``a`` and ``b`` may be
strided rows (slices of the fused projection's output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit(do_not_specialize=["rows", "sa", "sb"])
def _gates_kernel(A, B, A_LOG, DT_BIAS, G, BETA, rows, sa, sb, HV: tl.constexpr, BT: tl.constexpr,
                  BH: tl.constexpr):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_h = tl.arange(0, BH)
    m_h = o_h < HV
    m = (o_t[:, None] < rows) & m_h[None, :]
    t64 = o_t[:, None].to(tl.int64)
    a = tl.load(A + t64 * sa + o_h[None, :], mask=m, other=0.0).to(tl.float32)
    b = tl.load(B + t64 * sb + o_h[None, :], mask=m, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(A_LOG + o_h, mask=m_h, other=0.0).to(tl.float32))
    x = a + tl.load(DT_BIAS + o_h, mask=m_h, other=0.0).to(tl.float32)[None, :]
    # softplus as torch computes it (x above 20 passes through), stable for very negative x:
    # max(x, 0) + log(1 + e^−|x|), with log(1 + t) ≈ t − t²/2 where t is tiny
    e = tl.exp(-tl.abs(x))
    soft = tl.maximum(x, 0.0) + tl.where(e < 1e-4, e - 0.5 * e * e, tl.log(1.0 + e))
    soft = tl.where(x > 20.0, x, soft)
    tl.store(G + t64 * HV + o_h[None, :], -decay[None, :] * soft, mask=m)
    tl.store(BETA + t64 * HV + o_h[None, :], tl.sigmoid(b), mask=m)


def gdn_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """a, b [T, HV] (rows may be strided) → g, beta [T, HV] fp32."""
    T, HV = a.shape
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    g = torch.empty(T, HV, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if T:
        BH = triton.next_power_of_2(HV)
        BT = max(1, min(128, 4096 // BH))
        _gates_kernel[(triton.cdiv(T, BT),)](a, b, A_log, dt_bias, g, beta, T, a.stride(0), b.stride(0), HV=HV,
                                            BT=BT, BH=BH, num_warps=4)
    return g, beta
