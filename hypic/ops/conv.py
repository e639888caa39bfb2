"""Short causal depthwise convolution over packed sequences, with conv tails.

GDN, KDA and Mamba2 convolve their q/k/v projections with a kernel of width W (4) before the
recurrence, so the first W−1 tokens of a span read the previous span's last W−1 *raw* inputs.
A span's ``tail`` is exactly those raw inputs; passing the predecessor's tail as ``initial_tail``
makes a split computation equal to the unsplit one ("conv warm-up").
"""

from __future__ import annotations

import os
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from hypic.ops.linear import check_cu_seqlens, fla_allowed, triton_allowed
from hypic.ops.transfer import device_cache, to_device

# CUDA inference uses hypic's own Triton conv (hypic.ops.triton_conv); HYPIC_FLA_CONV=1 selects
# flash-linear-attention's instead (an A/B switch for benchmarks).
_FLA_CONV = os.environ.get("HYPIC_FLA_CONV") == "1"


class ConvOutput(NamedTuple):
    y: Tensor  # [T, D]
    tail: Tensor  # [N, W-1, D]: each sequence's last W−1 raw inputs, oldest first


def causal_conv1d(x: Tensor, weight: Tensor, *, bias: Tensor | None = None, cu_seqlens: Tensor | None = None,
                  initial_tail: Tensor | None = None, activation: Literal["silu"] | None = None) -> ConvOutput:
    """``y_t = act(bias + Σ_w weight[:, w] · x_{t−W+1+w})`` per sequence; x: [T, D], weight: [D, W].

    Inputs before a sequence's start come from ``initial_tail`` [N, W−1, D] (zeros when None).
    """
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"x: expected a tensor [T, D], got {getattr(x, 'shape', type(x).__name__)}")
    T, D = x.shape
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"weight: expected shape [{D}, W], got {getattr(weight, 'shape', None)}")
    if activation not in (None, "silu"):
        raise ValueError(f"activation: expected None or 'silu', got {activation!r}")
    W = weight.shape[1]
    cu = check_cu_seqlens(cu_seqlens, T)
    N = len(cu) - 1
    if initial_tail is not None and tuple(initial_tail.shape) != (N, W - 1, D):
        raise ValueError(f"initial_tail: expected shape [{N}, {W - 1}, {D}], got {list(initial_tail.shape)}")
    if bias is None and triton_allowed(x.device) and not x.requires_grad and not _FLA_CONV:
        from hypic.ops.triton_conv import causal_conv1d_triton

        return ConvOutput(*causal_conv1d_triton(x, weight, cu, initial_tail, activation == "silu"))
    if fla_allowed(x.device):
        return _fla_conv(x, weight, bias, cu, initial_tail, activation)
    return _torch_conv(x, weight, bias, cu, initial_tail, activation)


def _torch_conv(x: Tensor, weight: Tensor, bias: Tensor | None, cu: Tensor, initial_tail: Tensor | None,
                activation: str | None) -> ConvOutput:
    """Any device, differentiable. The taps run over the whole pack as shifted views summed in place
    (no gathers of the [T, D] input: on the CPU a gather of it costs 3× a copy, and four of them were a
    quarter of a prefill); then each sequence's first W−1 rows, which read the previous sequence
    instead of their own tail, are computed again from a small [N, 2(W−1), D] window and put back."""
    (T, D), W, N = x.shape, weight.shape[1], len(cu) - 1
    # taps summed and activated in fp32 (at least), rounded once, as the Triton conv and the decode step's conv
    # do: summed in bf16 a prefill and the decode step disagreed on the same token (0.03)
    acc = torch.promote_types(x.dtype, torch.float32)  # fp64 stays fp64 (the exactness references)
    xa, wa = x.to(acc), weight.to(acc)
    y = xa * wa[:, W - 1]
    if bias is not None:
        y = y + bias.to(acc)
    for w in range(W - 1):
        shift = W - 1 - w
        if shift < T:
            y[shift:].addcmul_(xa[:T - shift], wa[:, w])
    edges = _edges(tuple(cu.tolist()), W, x.device)
    tails = (x.new_zeros(N * (W - 1), D, dtype=acc) if initial_tail is None
             else initial_tail.to(x.dtype).to(acc).reshape(N * (W - 1), D))  # in x's dtype, as the Triton conv reads it
    pool = torch.cat([tails, xa.index_select(0, edges.x_rows), xa.new_zeros(1, D)])  # what the edges read
    window = pool.index_select(0, edges.window).reshape(N, 2 * (W - 1), D)  # [tail_i ; first W−1 inputs of i]
    heads = window[:, W - 1:] * wa[:, W - 1]
    if bias is not None:
        heads = heads + bias.to(acc)
    for w in range(W - 1):
        heads = heads.addcmul(window[:, w:w + W - 1], wa[:, w])
    y.index_copy_(0, edges.head_rows, heads.reshape(-1, D).index_select(0, edges.head_of_row))
    new_tail = pool.index_select(0, edges.tail).reshape(N, W - 1, D).to(x.dtype)
    return ConvOutput((F.silu(y) if activation == "silu" else y).to(x.dtype), new_tail)


class _Edges(NamedTuple):
    x_rows: Tensor  # rows of x the edges read: each sequence's first and last W−1 inputs (or fewer)
    window: Tensor  # [N·2(W−1)] rows of pool = [tails; x[x_rows]; 0] forming each sequence's [tail ; first inputs]
    head_rows: Tensor  # rows of y that are a sequence's first W−1 (of those it has)
    head_of_row: Tensor  # for each, its row in the [N·(W−1)] heads computed from the windows
    tail: Tensor  # [N·(W−1)] rows of pool forming each sequence's new tail (its last W−1 raw inputs)


@device_cache(maxsize=16)
def _edges(cu_key: tuple[int, ...], W: int, device: torch.device) -> _Edges:
    """Index tables for a layout's sequence edges, made once per layout on ``device`` (every layer of a
    forward shares them). Sequence i's extended input is ``[tail_i ; x_i]``: its row r < W−1 is tail
    row ``i·(W−1) + r`` of pool, its row W−1+j is x row ``cu[i] + j``."""
    N, H = len(cu_key) - 1, W - 1
    x_rows: list[int] = []
    window: list[int] = []
    tail: list[int] = []
    head_rows: list[int] = []
    head_of_row: list[int] = []

    def ext_row(i: int, r: int) -> int:  # row r of sequence i's [tail_i ; x_i], as a pool row (−1: zero row)
        if r < H:
            return i * H + r
        j = r - H
        if j >= cu_key[i + 1] - cu_key[i]:
            return -1
        x_rows.append(cu_key[i] + j)
        return N * H + len(x_rows) - 1

    for i in range(N):
        n = cu_key[i + 1] - cu_key[i]
        window.extend(ext_row(i, r) for r in range(2 * H))
        tail.extend(ext_row(i, n + r) for r in range(H))
        for j in range(min(n, H)):
            head_rows.append(cu_key[i] + j)
            head_of_row.append(i * H + j)
    zero = N * H + len(x_rows)
    window = [zero if r < 0 else r for r in window]
    tail = [zero if r < 0 else r for r in tail]
    parts = [x_rows, window, head_rows, head_of_row, tail]
    flat = to_device(torch.tensor([v for p in parts for v in p], dtype=torch.long), device)
    out, at = [], 0
    for p in parts:
        out.append(flat[at:at + len(p)])
        at += len(p)
    return _Edges(*out)


def _fla_conv(x: Tensor, weight: Tensor, bias: Tensor | None, cu: Tensor, initial_tail: Tensor | None,
              activation: str | None) -> ConvOutput:
    """CUDA: fla's Triton conv (varlen, fused SiLU, fp32 accumulation). Its state is the last W raw
    inputs ``[N, D, W]``; hypic's tail is the last W−1, time-major."""
    from fla.modules.causal_conv1d.ops import causal_conv1d as fla_causal_conv1d

    from hypic.ops.linear_fla import chunk_plan

    N, D = len(cu) - 1, x.shape[1]
    h0 = None
    if initial_tail is not None:
        h0 = torch.cat([initial_tail.new_zeros(N, 1, D), initial_tail], dim=1).transpose(1, 2).to(x.dtype).contiguous()
    # fla builds the conv's chunk indices on the host and copies them from pageable memory, a host
    # stall per layer; the linear kernels' cached plan has them on the device already (both use
    # 64-token chunks).
    plan = chunk_plan(cu, x.device)
    y, final = fla_causal_conv1d(x[None].contiguous(), weight.to(x.dtype).contiguous(),
                                 None if bias is None else bias.to(x.dtype), initial_state=h0, output_final_state=True,
                                 activation=activation, cu_seqlens=plan.cu, cu_seqlens_cpu=cu,
                                 chunk_indices=plan.indices)
    return ConvOutput(y[0], final[:, :, 1:].transpose(1, 2))
