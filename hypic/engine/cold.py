"""Cold standalone prefill: every missing segment computed on its own, from position 0 and zero
state, all in one varlen batch, producing its cache entry.

Attention is block-diagonal (each segment sees only itself), so the cost is Σ L_i², and the
segments are independent work. Linear layers run over the packed segments split into
``[seam_i | body_i]`` sequences: each body starts where its seam ends and returns outputs with the
body's summary ``(T, S)``. On the torch backend that is one pass from zero with each output's map
from its initial state (``linear.restart`` then starts the bodies at their seams' end states);
elsewhere two passes: the first from zero gives each seam's end state, the second starts each body
there. For GDN layers on
a GPU the first pass is the fused combine kernel's token steps (``ops.triton_gdn_combine``): one
launch that reads the seams' rows in place and writes the second pass's initial states directly
(zero before each seam, the seam's end state before its body) — no row gathers, no fla wrapper,
no interleaving copy: a call with a cold part pays its host work on every GDN layer.

Given the model's entry layout (``entry_template``), each entry is one buffer of its own from the
start (``layout.allocate``) and every layer is copied into its views with one multi-tensor copy —
no allocation per tensor (≈ 88 an entry at the 9B shape), and the entry moves between tiers, over
the wire and to disk as one block. Without one (the probe that learns the layout), each layer's
rows are copied into tensors of their own (``owned``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hypic.cache.entry import Entry
from hypic.cache.keys import SegmentKey
from hypic.cache.layout import Header, allocate, layout, resized
from hypic.models.context import ForwardContext, LinearRun, RopeSpec
from hypic.ops.attention_batch import causal_prefill_batch
from hypic.ops.kernels import combine_precision, fused_combine, kernel_device
from hypic.ops.linear import input_map_supported, restart
from hypic.ops.recurrence import Summary
from hypic.ops.transfer import to_device

if TYPE_CHECKING:
    from hypic.models.hybrid import HybridLM


def owned(views: list[Tensor]) -> list[Tensor]:
    """Copies of ``views`` (rows of a batch's tensors) that own their memory, made by one batched
    copy instead of a clone each (~90 tensors per entry at a 9B shape, each a launch and a dispatch
    on the host). Copies, not views: a view would keep the whole batch's T and S alive (twice the
    entries' bytes, the seams' rows included) for as long as any one entry stays on the device — on
    the H200 that put 50 GiB outside a 60 GiB store budget and ran the device out of memory
    (``SegmentStore.check_integrity`` now refuses it)."""
    out = [torch.empty_like(v, memory_format=torch.contiguous_format) for v in views]
    if out:
        torch._foreach_copy_(out, views)  # the optimizers' multi-tensor copy: few launches for all
    return out


def entry_template(model: HybridLM, device: torch.device) -> Header:
    """The layout of ``model``'s cache entries, learned from a probe: a 4-token segment (seam 1)
    prefilled standalone. Its keys' and values' rows are its body's 3 (``layout.resized`` sets them
    per segment); every other field has one shape for every segment."""
    probe = ColdContext([([0, 1, 2, 3], 1, SegmentKey(b"probe", 4))], device)
    with torch.no_grad():
        model.hidden_states(probe.input_ids, probe)
    header = layout(probe.entries[0])
    for slot, layer, _, shape, _ in header.fields:
        if slot in ("k", "v") and (not shape or shape[0] != 3):
            raise ValueError(f"entry_template: {slot} of layer {layer} has shape {shape}: "
                             "expected the body's rows first")
    return header


class ColdContext(ForwardContext):
    def __init__(self, segments: list[tuple[list[int], int, SegmentKey]], device: torch.device,
                 template: Header | None = None) -> None:
        """segments: (token ids, seam w, key) of every cold segment; ``template``: the model's entry
        layout, to build each entry in one buffer of its own (else tensor by tensor)."""
        self.preallocated = template is not None
        self.entries = ([allocate(resized(template, key, tuple(ids), w), device) for ids, w, key in segments]
                        if template is not None else [Entry(key, tuple(ids), w) for ids, w, key in segments])
        lengths = [len(ids) for ids, _, _ in segments]
        self.seams = [w for _, w, _ in segments]
        self.cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
        split = [n for (_, w, _), L in zip(segments, lengths, strict=True) for n in (w, L - w)]
        self.linear_cu = torch.tensor([0, *split]).cumsum(0)  # [seam_0, body_0, seam_1, ...]
        starts = self.cu_seqlens[:-1].tolist()
        self.seam_cu = torch.tensor([0, *[w for _, w, _ in segments]]).cumsum(0)
        self.seam_rows = to_device([r for s, (_, w, _) in zip(starts, segments, strict=True)
                                    for r in range(s, s + w)], device)
        self.positions = to_device(torch.cat([torch.arange(L) for L in lengths]), device)
        self.input_ids = to_device([t for ids, _, _ in segments for t in ids], device)
        self._seam_schedule: tuple[Tensor, Tensor, Tensor] | None = None  # the fused seam pass's, built once

    def conv_tails(self, layer: int, raw: Tensor) -> Tensor | None:
        return None  # each segment starts with no history

    def save_conv(self, layer: int, tails: Tensor) -> None:
        if self.preallocated:
            torch._foreach_copy_([e.conv_tails[layer] for e in self.entries], list(tails.unbind(0)))
            return
        for entry, tail in zip(self.entries, owned(list(tails.unbind(0))), strict=True):
            entry.conv_tails[layer] = tail

    def _fused_seams(self, family: str, rope: RopeSpec | None) -> bool:
        return family == "gdn" and rope is None and fused_combine() and kernel_device(self.positions.device)

    def _initial_states(self, family: str, run: LinearRun, rope: RopeSpec | None) -> Tensor:
        """The state entering each ``[seam | body]`` sequence [2n, HV, K, V]: zero before a seam, the
        seam's end state (from zero) before its body."""
        dev = self.positions.device
        if self._fused_seams(family, rope):
            from hypic.ops import triton_gdn_combine as fused

            if self._seam_schedule is None:  # request 2i: nothing (its state stays zero); 2i + 1: seam i
                starts = self.cu_seqlens[:-1].tolist()
                requests = [r for a, w in zip(starts, self.seams, strict=True)
                            for r in ([], [(fused.RUN, a, a + w)] if w else [])]
                self._seam_schedule = (*fused.schedule(requests, dev), torch.zeros(1, dtype=torch.long, device=dev))
            items, cu, no_bodies = self._seam_schedule
            x = run.tokens()
            scale = run.scale if run.scale is not None else x["k"].shape[-1] ** -0.5
            return fused.gdn_combine(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, no_bodies, no_bodies, items,
                                     cu, precision=combine_precision())[1]
        seams = run(self.seam_cu, None, False, self.seam_rows).final_state  # [n, HV, K, V]: seams only
        initial = torch.zeros(2 * len(self.seams), *seams.shape[1:], dtype=seams.dtype, device=seams.device)
        initial[1::2] = seams
        return initial

    def linear(self, layer: int, family: str, run: LinearRun, rope: RopeSpec | None) -> Tensor:
        if not self._fused_seams(family, rope) and input_map_supported(family, self.positions.device):
            # one pass: every sequence from zero (a seam's end state is its final state), then each
            # body moved to start where its seam ends. On the CPU the seams' own pass cost as much as
            # a body pass of 10× their tokens (a call's fixed cost).
            out = run(self.linear_cu, None, True, input_map=True)
            bodies = list(range(1, len(self.linear_cu) - 1, 2))
            o, _ = restart(family, out, self.linear_cu, bodies, out.final_state[0::2], run.v.dtype)
        else:
            out = run(self.linear_cu, self._initial_states(family, run, rope), True)
            o = out.o
        T, S = out.summary  # a body's S is from zero either way: its seam moves its outputs, not its summary
        n = len(self.entries)
        rows = [S[2 * i + 1] for i in range(n)] + ([] if T is None else [T[2 * i + 1] for i in range(n)])
        if self.preallocated:
            dst = [e.summaries[layer] for e in self.entries]
            torch._foreach_copy_([s.state for s in dst] + ([] if T is None else [s.transition for s in dst]), rows)
            return o
        bodies = owned(rows)
        for i, entry in enumerate(self.entries):
            entry.summaries[layer] = Summary(None if T is None else bodies[n + i], bodies[i])
        return o

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: RopeSpec | None, scale: float) -> Tensor:
        qr, kr = (q, k) if rope is None else (rope(q, self.positions), rope(k, self.positions))
        out = causal_prefill_batch(qr, kr, v, self.cu_seqlens, scale)  # every segment from position 0
        cu, n = self.cu_seqlens.tolist(), len(self.entries)
        bodies = [(a + e.seam, b) for e, a, b in zip(self.entries, cu[:-1], cu[1:], strict=True)]
        rows = [k[a:b] for a, b in bodies] + [v[a:b] for a, b in bodies]  # keys before RoPE: placed anywhere
        if self.preallocated:
            torch._foreach_copy_([e.keys[layer] for e in self.entries] + [e.values[layer] for e in self.entries], rows)
            return out
        kv = owned(rows)
        for i, entry in enumerate(self.entries):
            entry.keys[layer], entry.values[layer] = kv[i], kv[n + i]
        return out
