"""Triton kernels for the affine scan of matrix-transition families (CUDA).

One program owns one head and a block of value columns and walks the chain: the running state
``[K, BV]`` stays in registers, each step reads ``T_i`` and ``S_i`` once. ``matrix_chains`` walks
many chains of different lengths in one launch (a combine pass's requests: one per layer instead of
one per request and layer, and the chains side by side on the device instead of one after another —
a lone chain fills ``H × V/BV`` programs, 128 for the 9B shape's 32 heads, of the H200's 132 SMs). The dot products use
three-pass TF32 (``tf32x3``), close to fp32: T is kept in fp32 precisely so composition adds no
error (a bf16 T costs ~4e-3 relative).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


# The chain length and the head count are runtime values: training runs the kernel over
# [chunks, sequences × heads], both of which change with every batch (one binary for all).
@triton.jit(do_not_specialize=["n", "H"])
def _chain_kernel(T, S, X, n, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, PRECISION: tl.constexpr):
    i_v, i_h = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    x = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(0, n):
        row = i * H + i_h  # int64: [chunks × sequences × heads × K × V] passes 2^31 in long training batches
        b_t = tl.load(T + (row * K + o_k[:, None]) * K + o_k[None, :], mask=m_k[:, None] & m_k[None, :], other=0.0)
        b_s = tl.load(S + (row * K + o_k[:, None]) * V + o_v[None, :], mask=m_s, other=0.0)
        x = tl.dot(b_t, x, input_precision=PRECISION) + b_s
        tl.store(X + ((row + H) * K + o_k[:, None]) * V + o_v[None, :], x, mask=m_s)


def matrix_chain(transitions: Tensor, states: Tensor, precision: str = "tf32x3") -> Tensor:
    """transitions [n, H, K, K], states [n, H, K, V] (fp32) → prefix states [n + 1, H, K, V]."""
    n, H, K, V = states.shape
    out = torch.empty(n + 1, H, K, V, dtype=torch.float32, device=states.device)
    out[0].zero_()
    BK = max(16, triton.next_power_of_2(K))
    BV = 32 if BK > 64 else 64
    grid = (triton.cdiv(V, BV), H)
    _chain_kernel[grid](transitions.float().contiguous(), states.float().contiguous(), out, n, H=H, K=K, V=V, BK=BK,
                        BV=BV, PRECISION=precision, num_warps=8 if BK > 64 else 4)
    return out


@triton.jit(do_not_specialize=["H"])
def _chains_kernel(T, S, X, CU, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Chain c holds items CU[c] ≤ i < CU[c+1]; its prefix states are rows CU[c] + c … CU[c+1] + c of X."""
    i_v, i_h, i_c = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    start, end = tl.load(CU + i_c).to(tl.int64), tl.load(CU + i_c + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    x = tl.zeros([BK, BV], dtype=tl.float32)
    tl.store(X + (((start + i_c) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :], x, mask=m_s)
    for i in range(start, end):
        row = i * H + i_h
        b_t = tl.load(T + (row * K + o_k[:, None]) * K + o_k[None, :], mask=m_k[:, None] & m_k[None, :], other=0.0)
        b_s = tl.load(S + (row * K + o_k[:, None]) * V + o_v[None, :], mask=m_s, other=0.0)
        x = tl.dot(b_t, x, input_precision=PRECISION) + b_s
        tl.store(X + (((i + i_c + 1) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :], x, mask=m_s)


def matrix_chains(transitions: Tensor, states: Tensor, cu: Tensor, precision: str = "tf32x3") -> Tensor:
    """Chains packed end to end: transitions [n, H, K, K], states [n, H, K, V] (fp32), ``cu`` [C + 1]
    item offsets (int, on the device) → prefix states [n + C, H, K, V], chain c's at rows
    cu[c] + c … cu[c + 1] + c (its zero start first)."""
    n, H, K, V = states.shape
    C = cu.shape[0] - 1
    out = torch.empty(n + C, H, K, V, dtype=torch.float32, device=states.device)
    BK = max(16, triton.next_power_of_2(K))
    BV = 32 if BK > 64 else 64
    grid = (triton.cdiv(V, BV), H, C)
    _chains_kernel[grid](transitions.float().contiguous(), states.float().contiguous(), out, cu, H=H, K=K, V=V,
                         BK=BK, BV=BV, PRECISION=precision, num_warps=8 if BK > 64 else 4)
    return out
