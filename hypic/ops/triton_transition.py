"""A Triton kernel for the transition ``T`` of gated delta rule spans (the CUDA summary path).

Given fla's WY form of a chunk (``w``, with ``u`` the values), the state moves across a chunk as
``h ← e^{g_last}·h + kᵀ·(e^{g_last − g}·(u − w·h))``. ``T`` is that map with ``u = 0`` started
from ``h = I``. fla's general state kernel can compute it (``u = 0``, ``h0 = I``), but then reads a
zero ``u`` and writes every chunk's state, which ``T`` never needs: this kernel keeps only the
running ``[K, BV]`` block in registers and writes the final ``T``, so the pass costs little more
than reading ``k`` and ``w`` once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _gdn_transition_kernel(k, w, g, cu_seqlens, out, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                           BK: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    num_chunks = (length + BT - 1) // BT
    o_k = tl.arange(0, BK)
    o_c = i_v * BV + tl.arange(0, BV)  # the columns of T this program owns
    m_k = o_k < K
    b_h = tl.where(o_k[:, None] == o_c[None, :], 1.0, 0.0).to(tl.float32)  # [BK, BV] = I[:, cols]
    for i_t in range(0, num_chunks):
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < length
        rows = bos + o_t
        b_w = tl.load(w + (rows[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_kt = tl.load(k + (rows[None, :] * H + i_h) * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        last = tl.minimum((i_t + 1) * BT, length) - 1
        b_g_last = tl.load(g + (bos + last) * HV + i_hv).to(tl.float32)
        b_g = tl.load(g + rows * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        b_v = -tl.dot(b_w, b_h.to(b_w.dtype))  # [BT, BV]: u − w·h with u = 0
        b_v = b_v * tl.where(m_t, tl.exp2(b_g_last - b_g), 0.0)[:, None]
        b_h = b_h * tl.exp2(b_g_last)
        b_h = tl.dot(b_kt, b_v.to(b_kt.dtype), b_h)
    p_out = out + (i_nh.to(tl.int64) * K + o_k[:, None]) * K + o_c[None, :]  # int64: N·HV·K² may pass 2³¹
    tl.store(p_out, b_h, mask=m_k[:, None] & (o_c[None, :] < K))


def gdn_transition(k: Tensor, w: Tensor, g_log2: Tensor, cu_seqlens: Tensor, *, chunk_size: int = 64) -> Tensor:
    """T [N, HV, K, K] fp32 of every packed sequence. k [T, H, K], w [T, HV, K] (fla's WY ``w``),
    g_log2 [T, HV]: the chunk-local cumulative log2 decay, as fla's ``chunk_local_cumsum`` gives it."""
    total, H, K = k.shape
    HV, N = w.shape[1], len(cu_seqlens) - 1
    out = torch.empty(N, HV, K, K, dtype=torch.float32, device=k.device)
    BV = 64 if K > 32 else 32
    # One program per (sequence, value head) on the grid's first axis: CUDA caps the other two at
    # 65 535 blocks, and a cold batch of many short segments passes that (16 384 segments at HV = 4).
    grid = (N * HV, triton.cdiv(K, BV))
    _gdn_transition_kernel[grid](k.contiguous(), w.contiguous(), g_log2.contiguous(), cu_seqlens, out, H=H, HV=HV,
                                 K=K, BK=max(16, triton.next_power_of_2(K)), BT=chunk_size, BV=BV, num_warps=4,
                                 num_stages=2)
    return out
