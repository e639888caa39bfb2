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
    """Any device, differentiable: the taps as shifted gathers from a buffer packing [tail_i ; x_i]."""
    (T, D), W, N = x.shape, weight.shape[1], len(cu) - 1
    if initial_tail is None:
        initial_tail = x.new_zeros(N, W - 1, D)
    ext_pos, tail_pos, end_pos = _layout(tuple(cu.tolist()), W, x.device)
    ext = x.new_empty(T + N * (W - 1), D)
    ext[ext_pos] = x
    ext[tail_pos] = initial_tail.to(x.dtype).reshape(-1, D)
    # taps summed and activated in fp32 (at least), rounded once, as the Triton conv and the decode step's conv
    # do: summed in bf16 a prefill and the decode step disagreed on the same token (0.03)
    acc = torch.promote_types(x.dtype, torch.float32)  # fp64 stays fp64 (the exactness references)
    y = x.new_zeros(T, D, dtype=acc) if bias is None else bias.to(acc).expand(T, D).clone()
    for w in range(W):
        y = y + weight[:, w].to(acc) * ext[ext_pos - (W - 1) + w].to(acc)
    new_tail = ext[end_pos].reshape(N, W - 1, D)
    return ConvOutput((F.silu(y) if activation == "silu" else y).to(x.dtype), new_tail)


@device_cache(maxsize=16)
def _layout(cu_key: tuple[int, ...], W: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of the padded buffer ``ext`` that packs ``[tail_i ; x_i]`` per sequence (sequence i starts
    at cu[i] + i·(W−1)): where each token lands, where each initial tail goes, where each new tail
    is read. Made once per layout on ``device`` (every layer of a forward shares it)."""
    cu = torch.tensor(cu_key, dtype=torch.long)
    N, T = len(cu) - 1, cu_key[-1]
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(N), lengths)
    ext_pos = torch.arange(T) + (seq + 1) * (W - 1)
    tail_pos = (cu[:-1] + torch.arange(N) * (W - 1))[:, None] + torch.arange(W - 1)  # [N, W−1]
    end_pos = (tail_pos + lengths[:, None]).reshape(-1)
    idx = to_device(torch.cat([ext_pos, tail_pos.reshape(-1), end_pos]), device)
    return idx[:T], idx[T:T + N * (W - 1)], idx[T + N * (W - 1):]


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
