"""Triton causal conv over packed sequences with conv tails, for inference on CUDA.

Why not flash-linear-attention's conv: on the H200 its ``causal_conv1d`` cost ≈ 485 µs of host
time per call (an autograd function, input guards, a dispatch layer, an autotuned kernel and a
second kernel for the final state; docs/benchmarks.md, session-4 profile), once per GDN layer of
every forward — ≈ 12 ms of a warm request's host time on the 9B shape, where the whole request is
host-bound. These two kernels take hypic's tail layout as it is (``[N, W−1, D]``, oldest first, no
transposed ``[N, D, W]`` state to build), one fixed launch configuration each, and read each
token's sequence start from a per-token table made once per layout (every layer shares it).

``y_t = act(Σ_w weight[:, w] · x_{t−W+1+w})``: inputs before a sequence's start come from its
initial tail (zeros without one); the new tail is the sequence's last W−1 raw inputs, reaching
into the initial tail when the sequence is shorter than W−1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hypic.ops.transfer import device_cache, to_device


@triton.jit(do_not_specialize=["rows", "sx"])
def _conv_kernel(X, WGT, TAIL, SEQ, START, Y, rows, sx, D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                 BD: tl.constexpr, HAS_TAIL: tl.constexpr, SILU: tl.constexpr):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_t, m_d = o_t < rows, o_d < D
    start = tl.load(START + o_t, mask=m_t, other=0)
    seq = tl.load(SEQ + o_t, mask=m_t, other=0)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for w in tl.static_range(W):
        src = o_t - (W - 1) + w
        own = src >= start  # the input lies in the token's own sequence
        m = m_t[:, None] & m_d[None, :]
        x = tl.load(X + src[:, None].to(tl.int64) * sx + o_d[None, :], mask=m & own[:, None], other=0.0)
        if HAS_TAIL:  # before the start: row (W − 1) − (start − src) of the sequence's tail
            row = seq.to(tl.int64) * (W - 1) + (W - 1) + (src - start)
            x += tl.load(TAIL + row[:, None] * D + o_d[None, :], mask=m & ~own[:, None], other=0.0)
        wt = tl.load(WGT + o_d * W + w, mask=m_d, other=0.0).to(tl.float32)  # weight [D, W]
        acc += x.to(tl.float32) * wt[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(Y + o_t[:, None].to(tl.int64) * D + o_d[None, :], acc.to(Y.dtype.element_ty),
             mask=m_t[:, None] & m_d[None, :])


@triton.jit(do_not_specialize=["sx"])
def _tail_kernel(X, TAIL, CU, OUT, sx, D: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr,
                 HAS_TAIL: tl.constexpr):
    n = tl.program_id(0)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    o_j = tl.arange(0, BW)  # row j of the new tail: input end − (W − 1) + j
    start, end = tl.load(CU + n), tl.load(CU + n + 1)
    src = end - (W - 1) + o_j
    m_j, m_d = o_j < W - 1, o_d < D
    m = m_j[:, None] & m_d[None, :]
    own = src >= start
    x = tl.load(X + src[:, None].to(tl.int64) * sx + o_d[None, :], mask=m & own[:, None], other=0.0)
    if HAS_TAIL:
        row = n.to(tl.int64) * (W - 1) + (W - 1) + (src - start)
        x += tl.load(TAIL + row[:, None] * D + o_d[None, :], mask=m & ~own[:, None], other=0.0)
    tl.store(OUT + (n.to(tl.int64) * (W - 1) + o_j[:, None]) * D + o_d[None, :], x, mask=m)


@device_cache(maxsize=64)
def _rows(cu_key: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Per token its sequence and that sequence's first row; the offsets — on ``device``, one copy."""
    cu = torch.tensor(cu_key, dtype=torch.int32)
    lengths = (cu[1:] - cu[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)
    dev = to_device(torch.cat([seq, cu[:-1][seq.long()], cu]), device, None)
    T = cu_key[-1]
    return dev[:T], dev[T:2 * T], dev[2 * T:]


def causal_conv1d_triton(x: Tensor, weight: Tensor, cu: Tensor, initial_tail: Tensor | None,
                         silu: bool) -> tuple[Tensor, Tensor]:
    """x [T, D] (CUDA; rows may be strided), weight [D, W], host offsets ``cu`` [N + 1],
    initial_tail [N, W−1, D] | None → (y [T, D] in x's dtype, tail [N, W−1, D])."""
    T, D = x.shape
    W, N = weight.shape[1], len(cu) - 1
    if x.stride(1) != 1:  # rows may be strided (a slice of a fused projection's output), columns not
        x = x.contiguous()
    tail_in = None if initial_tail is None else initial_tail.to(x.dtype).contiguous()
    tail_arg = x if tail_in is None else tail_in  # any pointer when there is no tail (never read)
    seq, start, cu_dev = _rows(tuple(cu.tolist()), x.device)
    y = x.new_empty(T, D)
    tail = x.new_empty(N, W - 1, D)
    BD = min(128, triton.next_power_of_2(D))
    if T:
        BT = 32
        _conv_kernel[(triton.cdiv(T, BT), triton.cdiv(D, BD))](
            x, weight.contiguous(), tail_arg, seq, start, y, T, x.stride(0), D=D, W=W, BT=BT, BD=BD,
            HAS_TAIL=tail_in is not None, SILU=silu, num_warps=4)
    if N and W > 1:
        _tail_kernel[(N, triton.cdiv(D, BD))](x, tail_arg, cu_dev, tail, x.stride(0), D=D, W=W,
                                              BW=triton.next_power_of_2(W - 1), BD=BD,
                                              HAS_TAIL=tail_in is not None, num_warps=4)
    return y, tail
