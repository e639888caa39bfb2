"""A cold prefill of one fixed shape — ``n`` slots of ``B`` tokens, each slot one segment padded at
its end — so that one CUDA graph (``cold_graphs``) serves every cold call of that shape.

Why padding changes nothing a cache entry holds: pads come after their segment's real tokens, so
causal attention and the causal conv never carry them into a real token; in a GDN layer a pad
gets log-decay 0 (α = 1) and β = 0, so it leaves the recurrent state, and with it the body's
summary ``(T, S)``, exactly as the real tokens left it. The two things a pad would move are read
where the real tokens end instead: the conv tail (the last W−1 *real* raw inputs) and the keys and
values (the body rows only). Only GDN layers qualify: a family whose decay is not per token
(lightning attention's fixed rates) would decay the state across the pads.

A graph writes the same addresses at every replay, so the context writes its outputs into
``Staging`` buffers, and ``deliver`` copies each real slot's share into its entry.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from hypic.cache.entry import Entry
from hypic.cache.keys import SegmentKey
from hypic.cache.layout import Header
from hypic.engine.cold import ColdContext
from hypic.models.context import LinearRun, RopeSpec
from hypic.ops.attention_batch import causal_prefill_batch
from hypic.ops.conv import causal_conv1d
from hypic.ops.transfer import copy_to, to_device

BLOCK = 64  # padded lengths are multiples of fla's chunk: few shapes, no chunk wasted on pads


def padded_length(length: int) -> int:
    return -(-length // BLOCK) * BLOCK


def tail_width(header: Header) -> int:
    """W − 1: the rows of a conv tail in this model's entries (0 when there is no conv)."""
    return next((shape[0] for slot, _, _, shape, _ in header.fields if slot == "conv"), 0)


class Staging:
    """Where padded cold prefills write, sized for the largest shape served: per linear layer each
    slot's body summary and conv tail, per attention layer every padded row's keys and values (the
    body rows are picked at delivery). Every shape's context writes a prefix of each buffer: the
    prefills run one at a time on one stream, each delivered before the next."""

    def __init__(self, header: Header, slots: int, length: int, device: torch.device) -> None:
        self.buffers: dict[tuple[str, int], Tensor] = {}
        for slot, layer, dtype_name, shape, _ in header.fields:
            lead = (slots * length, *shape[1:]) if slot in ("k", "v") else (slots, *shape)
            self.buffers[slot, layer] = torch.empty(lead, dtype=getattr(torch, dtype_name), device=device)
        self.slots, self.length = slots, length

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class PaddedColdContext(ColdContext):
    """The cold prefill of up to ``slots`` segments of seam ``seam``, each at most ``length`` tokens.
    Its shape is fixed at construction; ``load`` puts a call's segments in, ``deliver`` takes their
    entries out. Reuses ``ColdContext``'s seam pass; everything that writes entries is its own."""

    def __init__(self, slots: int, length: int, seam: int, staging: Staging, tail: int,
                 device: torch.device) -> None:
        if not 1 <= slots <= staging.slots or not 0 < length <= staging.length or not 0 <= seam < length:
            raise ValueError(f"PaddedColdContext: {slots} slots of {length} tokens (seam {seam}) do not fit "
                             f"staging for {staging.slots} × {staging.length}")
        n, B, w = slots, length, seam
        self.slots, self.length, self.seam, self.tail = n, B, w, tail
        self.staging = staging
        self.seams = [w] * n
        self.cu_seqlens = torch.arange(0, (n + 1) * B, B)
        self.linear_cu = torch.tensor([0, *[x for i in range(n) for x in (i * B + w, (i + 1) * B)]])
        self.seam_cu = torch.arange(0, (n + 1) * w, w) if w else torch.zeros(n + 1, dtype=torch.long)
        self.seam_rows = to_device([i * B + r for i in range(n) for r in range(w)], device)
        self.positions = to_device(torch.arange(B).repeat(n), device)
        # the inputs a replay reads: written in place by ``load``
        self.input_ids = torch.zeros(n * B, dtype=torch.long, device=device)
        self.keep = torch.zeros(n * B, dtype=torch.float32, device=device)  # 1 on real tokens, 0 on pads
        self.tail_rows = torch.zeros(n * tail, dtype=torch.long, device=device)
        self._seam_schedule = None
        self.loaded: list[tuple[list[int], int, SegmentKey]] = []

    def fits(self, ids: list[int], seam: int) -> bool:
        return seam == self.seam and max(seam + 1, self.tail) <= len(ids) <= self.length

    def load(self, segments: list[tuple[list[int], int, SegmentKey]]) -> None:
        """This call's segments into the slots (unused slots stay all pad)."""
        n, B, W1 = self.slots, self.length, self.tail
        if not 0 < len(segments) <= n or not all(self.fits(ids, w) for ids, w, _ in segments):
            raise ValueError(f"load: {len(segments)} segments do not fit {n} slots of {B} tokens with seam "
                             f"{self.seam} (each needs seam < length ≤ {B} and ≥ {W1} tokens)")
        ids = torch.zeros(n * B, dtype=torch.long)
        keep = torch.zeros(n * B, dtype=torch.float32)
        tails = (torch.arange(n)[:, None] * B + torch.arange(W1)[None, :])  # unused slots: any rows of their own
        for i, (tokens, _, _) in enumerate(segments):
            L = len(tokens)
            ids[i * B:i * B + L] = torch.tensor(tokens, dtype=torch.long)
            keep[i * B:i * B + L] = 1.0
            tails[i] += L - W1
        copy_to(self.input_ids, ids)
        copy_to(self.keep, keep)
        copy_to(self.tail_rows, tails.reshape(-1))
        self.loaded = list(segments)

    def _out(self, slot: str, layer: int) -> Tensor:
        buf = self.staging.buffers[slot, layer]
        return buf[: self.slots * self.length] if slot in ("k", "v") else buf[: self.slots]

    def save_conv(self, layer: int, tails: Tensor) -> None:
        raise NotImplementedError("PaddedColdContext reads conv tails where the real tokens end (conv)")

    def conv(self, layer: int, raw: Tensor, weight: Tensor) -> Tensor:
        y = causal_conv1d(raw, weight, cu_seqlens=self.cu_seqlens, activation="silu").y
        self._out("conv", layer).copy_(raw[self.tail_rows].view(self.slots, self.tail, raw.shape[1]))
        return y

    def linear(self, layer: int, family: str, run: LinearRun, rope: RopeSpec | None) -> Tensor:
        if family != "gdn" or rope is not None or run.g is None or run.beta is None:
            raise ValueError(f"layer {layer}: padded cold prefills need GDN layers without RoPE, got {family!r}")
        keep = self.keep[:, None]  # pads: log-decay 0 and β 0, an identity step
        run = dataclasses.replace(run, g=run.g * keep, beta=run.beta * keep.to(run.beta.dtype))
        out = run(self.linear_cu, self._initial_states(family, run, rope), True)
        T, S = out.summary
        dst, src = [self._out("S", layer)], [S[1::2]]  # rows 2i + 1: slot i's body
        if T is not None:
            dst.append(self._out("T", layer))
            src.append(T[1::2])
        torch._foreach_copy_(dst, src)
        return out.o

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: RopeSpec | None, scale: float) -> Tensor:
        qr, kr = (q, k) if rope is None else (rope(q, self.positions), rope(k, self.positions))
        out = causal_prefill_batch(qr, kr, v, self.cu_seqlens, scale)  # every slot from position 0
        torch._foreach_copy_([self._out("k", layer), self._out("v", layer)], [k, v])  # keys before RoPE
        return out

    def deliver(self, entries: list[Entry]) -> None:
        """Copy each loaded segment's share of the staging into its entry (allocated by the caller in
        the model's layout, in ``load``'s order), in one multi-tensor copy."""
        if len(entries) != len(self.loaded):
            raise ValueError(f"deliver: {len(entries)} entries for {len(self.loaded)} loaded segments")
        B, w = self.length, self.seam
        dst: list[Tensor] = []
        src: list[Tensor] = []
        for i, (entry, (ids, _, _)) in enumerate(zip(entries, self.loaded, strict=True)):
            for layer, s in entry.summaries.items():
                dst.append(s.state)
                src.append(self._out("S", layer)[i])
                if s.transition is not None:
                    dst.append(s.transition)
                    src.append(self._out("T", layer)[i])
            for layer, t in entry.conv_tails.items():
                dst.append(t)
                src.append(self._out("conv", layer)[i])
            rows = slice(i * B + w, i * B + len(ids))
            for layer in entry.keys:
                dst += [entry.keys[layer], entry.values[layer]]
                src += [self._out("k", layer)[rows], self._out("v", layer)[rows]]
        torch._foreach_copy_(dst, src)
