"""Causal self-attention of many packed sequences at once (a fresh prefill of a varlen batch).

One SDPA call per sequence costs a launch, a slice and (under autograd) a zero-filled gradient
per sequence; a training batch holds hundreds of short sequences, the cold prefill dozens of
documents. Instead the sequences are grouped by length, each group is gathered into a padded
``[n, L_max]`` batch and runs as one causal call. Padding sits at the end of each sequence, so
causal masking already hides it from every real query; the padded queries' outputs are dropped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from hypic.ops.attention import LONG_BACKENDS, SHORT_BACKENDS, attention, long_length, long_prefill, pad_tokens
from hypic.ops.family import repeat_heads
from hypic.ops.transfer import device_cache, to_device

PAD_BUDGET = 1.25  # a group's padded size may exceed its tokens by at most this factor


class _Group(NamedTuple):
    rows: Tensor  # [n, L_max] packed row of each slot (padding repeats the sequence's last row)
    valid: Tensor  # [tokens of the group] flat slot index of each real token
    length: int  # L_max


class _Plan(NamedTuple):
    groups: list[_Group]
    order: Tensor  # [T] packed row → place in the concatenation of the groups' real tokens


def group_lengths(lengths: list[int], budget: float = PAD_BUDGET) -> list[list[int]]:
    """Sequence indices in groups of similar length: longest first, a group closes when adding the
    next sequence would pad it beyond ``budget`` × its tokens."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    tokens = 0
    for i in order:
        if groups and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= budget * (tokens + lengths[i]):
            groups[-1].append(i)
            tokens += lengths[i]
        else:
            groups.append([i])
            tokens = lengths[i]
    return groups


@device_cache(maxsize=16)
def _plan(cu_key: tuple[int, ...], device: torch.device) -> _Plan:
    cu = torch.tensor(cu_key, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    groups, places, host = [], [], []
    for members in group_lengths(lengths.tolist()):
        idx = torch.tensor(members)
        starts, lens = cu[idx], lengths[idx]
        L = int(lens[0])
        j = torch.arange(L)
        rows = starts[:, None] + torch.minimum(j[None, :], lens[:, None] - 1)  # [n, L]
        valid = (j[None, :] < lens[:, None]).reshape(-1).nonzero()[:, 0]  # host tensors: no device sync
        places.append(rows.reshape(-1)[valid])
        host.append((rows, valid, L))
    places = torch.cat(places) if places else torch.empty(0, dtype=torch.long)
    order = torch.empty(cu_key[-1], dtype=torch.long)
    order[places] = torch.arange(len(places))
    flat = to_device(torch.cat([order] + [t for r, v, _ in host for t in (r.reshape(-1), v)]), device)
    at = len(order)
    for rows, valid, L in host:
        r = flat[at:at + rows.numel()].view(rows.shape)
        at += rows.numel()
        groups.append(_Group(r, flat[at:at + valid.numel()], L))
        at += valid.numel()
    return _Plan(groups, flat[:len(order)])


def causal_prefill_batch(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D(v)] packed by host offsets ``cu_seqlens``, each sequence attending
    causally to itself from position 0 → [T, Hq, Dv]."""
    if q.shape[0] == 0:
        return q.new_empty(0, q.shape[1], v.shape[-1])
    plan = _plan(tuple(cu_seqlens.tolist()), q.device)
    if len(plan.groups) == 1 and plan.groups[0].rows.shape[0] == 1:  # one sequence: no gathering
        return attention(q, k, v, q_positions=None, k_positions=None, scale=scale, causal_prefill=True)
    outs = []
    for g in plan.groups:
        n, L = g.rows.shape
        qg, kg, vg = (x[g.rows.reshape(-1)].view(n, L, *x.shape[1:]) for x in (q, k, v))
        og = _batched(qg, kg, vg, scale)  # [n, L, Hq, Dv]
        outs.append(og.reshape(n * L, *og.shape[2:])[g.valid])
    return torch.cat(outs)[plan.order] if len(outs) > 1 else outs[0][plan.order]


def _batched(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """[n, L, H, D] causal attention through the same backend policy as ``attention``."""
    qi, ki, vi = (x.transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[2] != k.shape[2]
    if gqa and q.dtype == torch.float32:
        ki, vi = (repeat_heads(x, q.shape[2] // k.shape[2], dim=1) for x in (ki, vi))
        gqa = False
    L = q.shape[1]
    long = long_prefill(L, q)
    if long:  # a bucketed length, as in ``attention``
        qi, ki, vi = (pad_tokens(x, long_length(L), dim=2) for x in (qi, ki, vi))
    with sdpa_kernel(LONG_BACKENDS if long else SHORT_BACKENDS, set_priority=long):
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
    return o[:, :, :L].transpose(1, 2)
