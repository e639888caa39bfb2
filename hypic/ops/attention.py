"""Softmax attention over packed sequences with position-causal visibility.

A query sees a key of its own sequence when the key's position is ≤ the query's. With keys in
position order this is ordinary causal attention for a prefill, full visibility for a decode step,
and, for the combine pass, exactly what a recomputed seam needs: every earlier segment and its own
seam, never its own body (whose positions come later).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from hypic.ops.family import repeat_heads

# cuDNN's SDPA builds (and caches) an execution graph per distinct shape, ≈ 17 ms of host time each
# on the H200 (measured: 2.8 s forward + 3.9 s backward for one training batch of ~100 sequences).
# Serving and training see a new length at nearly every call, so hypic leaves cuDNN out; flash and
# memory-efficient attention have no per-shape set-up.
# A long causal prefill is the exception: there the set-up is small next to the work, and cuDNN's
# Hopper kernels may be the faster ones, so it is tried first from HYPIC_CUDNN_MIN_TOKENS tokens on.
# (At the 9B shape cuDNN's prefill is 6–15% faster than flash's from 8k to 64k tokens.) Even there a
# new length costs set-up — ≈ 50 ms on the bundled model, hidden behind the queued GPU work at the 9B
# shape — and the first length that is not a multiple of 64 0.6–1 s (docs/benchmarks.md, sessions
# 36–37); serving lengths rarely repeat. So a long prefill is padded at its end to one of
# LONG_BUCKETS lengths per octave, and a process meets a bounded set of aligned shapes, at 1.2–1.7%
# of a 9B prefill and a transient copy of q, k and v. Causal masking hides the padding from every
# real query.
SHORT_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
LONG_BACKENDS = [SDPBackend.CUDNN_ATTENTION, *SHORT_BACKENDS]


def _env_count(name: str, default: int, *, power_of_two: bool = False) -> int:
    raw = os.environ.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected a non-negative integer, got {raw!r}") from None
    if value < 0 or (power_of_two and value & (value - 1)):
        kind = "0 or a power of two" if power_of_two else "a non-negative integer"
        raise ValueError(f"{name}: expected {kind}, got {value}")
    return value


CUDNN_MIN_TOKENS = _env_count("HYPIC_CUDNN_MIN_TOKENS", 8192)
# per octave, a power of two so every bucket is a multiple of a power of two (0: exact lengths)
LONG_BUCKETS = _env_count("HYPIC_CUDNN_BUCKETS", 8, power_of_two=True)
MIN_STEP = 64  # buckets are multiples of at least this (an unaligned length cost cuDNN ≈ 1 s once)


def flash_varlen_fits(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether flash attention's varlen kernel (``aten._flash_attention_forward``) takes these: CUDA
    sm80+, half precision, equal key and value head sizes ≤ 256, query heads a multiple of key heads."""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k.shape[-1] == d == v.shape[-1]
            and d <= 256 and d % 8 == 0 and q.shape[-2] % k.shape[-2] == 0
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


def long_prefill(tokens: int, q: Tensor) -> bool:
    """Whether a causal prefill may use cuDNN: long enough to amortise its per-shape set-up, in half
    precision (cuDNN's only; float32 would be padded for flash to compute), and not under autograd
    (training shapes change every step, and the backward builds a graph too)."""
    return (tokens >= CUDNN_MIN_TOKENS and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and not torch.is_grad_enabled())


def long_length(tokens: int, buckets: int | None = None) -> int:
    """The length a long prefill of ``tokens`` is padded to: the next of ``buckets`` (a power of
    two) evenly spaced lengths per octave, a multiple of 2^(⌊log2 tokens⌋ − log2 buckets) and of
    ``MIN_STEP`` (8 buckets: at most 1/8 more tokens from 512 tokens on); with 0 buckets, ``tokens``."""
    buckets = LONG_BUCKETS if buckets is None else buckets
    if buckets <= 0 or tokens <= 0:
        return tokens
    step = max(MIN_STEP, (1 << (tokens.bit_length() - 1)) // buckets)
    return -(-tokens // step) * step


def pad_tokens(x: Tensor, length: int, dim: int = 0) -> Tensor:
    """``x`` zero-padded at the end of its token axis ``dim`` to ``length`` (itself when it fits)."""
    extra = length - x.shape[dim]
    if extra <= 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
    return F.pad(x, pad)


def attention(q: Tensor, k: Tensor, v: Tensor, *, q_positions: Tensor | None, k_positions: Tensor | None,
              scale: float, causal_prefill: bool = False, all_visible: bool = False, causal_suffix: bool = False,
              visible: Tensor | None = None) -> Tensor:
    """One sequence: q [Tq, Hq, D], k/v [Tk, Hkv, D(v)] → [Tq, Hq, Dv]; Hq a multiple of Hkv (GQA).

    ``causal_prefill``: the keys are exactly the queries' own tokens in order; ``all_visible``:
    every key precedes every query (a decode step); ``causal_suffix``: the queries are the last
    tokens of the keys, in order (a prefill continuing from cached keys: bottom-right causal).
    Each lets the fused kernels run without a materialised mask, and the caller knows it without a
    device sync. Otherwise the mask is ``visible`` [Tq, Tk] when given — bool (True: visible) or an
    additive bias; a caller that attends the same positions in every layer makes it once — else
    it is built from the positions.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q: {q.shape[1]} heads is not a multiple of the {k.shape[1]} key heads")
    # 4-D [1, H, T, D]: the fused SDPA kernels take only batched inputs (3-D falls back to math).
    qi, ki, vi = (x.transpose(0, 1)[None] for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    suffix = causal_suffix and not (causal_prefill or all_visible)
    masked = not (causal_prefill or all_visible or suffix)
    if gqa and (masked or q.dtype == torch.float32 or (suffix and not q.is_cuda)):
        # enable_gqa reaches only the flash kernel (half precision, no mask); elsewhere it would fall
        # to the math kernel, so the key heads are widened here and the efficient kernel runs instead.
        rep = q.shape[1] // k.shape[1]
        ki, vi = (repeat_heads(x, rep, dim=1) for x in (ki, vi))
        gqa = False
    long = causal_prefill and long_prefill(q.shape[0], q)
    if long:  # padded to a bucketed length: see LONG_BUCKETS
        n = long_length(q.shape[0])
        qi, ki, vi = (pad_tokens(x, n, dim=2) for x in (qi, ki, vi))
    with sdpa_kernel(LONG_BACKENDS if long else SHORT_BACKENDS, set_priority=long):
        if suffix:
            bias = causal_lower_right(q.shape[0], k.shape[0])
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=bias, scale=scale, enable_gqa=gqa)
        else:
            o = _sdpa(qi, ki, vi, q_positions, k_positions, scale, causal_prefill, all_visible, gqa, visible)
    return o[0, :, :q.shape[0]].transpose(0, 1)


def _sdpa(qi: Tensor, ki: Tensor, vi: Tensor, q_positions: Tensor | None, k_positions: Tensor | None, scale: float,
          causal_prefill: bool, all_visible: bool, gqa: bool, visible: Tensor | None) -> Tensor:
    if causal_prefill:
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
    elif all_visible:
        o = F.scaled_dot_product_attention(qi, ki, vi, scale=scale, enable_gqa=gqa)
    else:
        mask = visible if visible is not None else k_positions[None, :] <= q_positions[:, None]  # [Tq, Tk]
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o
