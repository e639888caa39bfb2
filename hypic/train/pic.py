"""hypic's warm path at seam ``w`` as one differentiable forward, for training.

A warm hypic request computes every prompt segment before the query on its own (the standalone
cold prefill: attention within the segment, linear states from zero, a conv window that starts at
the segment) and then, in context, each segment's first ``w`` tokens (its *seam*) and everything
from the query on (the combine pass: attention over every earlier key at its true position, linear
states composed exactly from the summaries of the seams and the cached bodies, conv warm-up from
the previous piece's tail). Composing ``(T, S)`` summaries is the linear recurrence itself, so the
whole request is one forward over two layouts of the same tokens:

- *alone*: every segment before the query as its own run (the cold prefill that fills the cache);
- *virtual*, the request in true-position order: per segment its seam computed in context, then
  its body taken from the alone run; then the query onward.

A seam's tokens occur in both, so the forward runs on *physical* rows — the original tokens, then a
copy of every seam, then nothing else — and each mixer computes both layouts (the virtual one by
gathering rows) and gives every row the result it has in the request: seam copies and the query
onward take the virtual result, every other row the alone one. At ``w = 0`` there are no copies and
the virtual layout is the original order. A model trained in context only loses ~15 points under
hypic's reuse; mixing these forwards in teaches it to read documents it did not see in context —
and, at ``w > 0``, to use the seams hypic recomputes. ``tests/train/test_pic.py`` checks it
against the engine's ``hypic`` mode at several ``w``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hypic.engine.plan import all_seam, effective_seam
from hypic.models.context import ForwardContext, LinearRun, RopeSpec
from hypic.ops.attention_batch import causal_prefill_batch
from hypic.ops.conv import causal_conv1d
from hypic.ops.transfer import to_device


def check_segments(lengths: list[int], segments: list[list[int]]) -> None:
    """ValueError unless each ``segments[i]`` cuts sequence i (``lengths[i]`` tokens) into pieces
    of ≥ 0 tokens, the last the query onward: the batches' cut that the training forwards read."""
    for n, segs in zip(lengths, segments, strict=True):
        if sum(segs) != n or any(s < 0 for s in segs) or not segs:
            raise ValueError(f"segments {segs} do not cut a sequence of {n} tokens")


class StandaloneSegmentsContext(ForwardContext):
    """Sequences ``lengths`` packed in order; ``segments[i]`` cuts sequence i into its prompt
    segments before the query, then the rest (query, answer, anything after) as the last entry.
    ``seam`` is hypic's ``w``: a segment of ``L`` tokens gets ``min(w, L − 1)`` seam tokens, or is
    computed in context whole when ``L ≤ w`` (as the engine plans it, ``hypic.engine.plan``).

    Inputs, labels and loss weights follow the physical rows: ``source`` maps each row to its
    original token (gather with it), ``seam_copy`` marks the copies (weight them 0: their tokens are
    scored once already)."""

    def __init__(self, lengths: list[int], segments: list[list[int]], device: torch.device,
                 seam: int = 0) -> None:
        if seam < 0:
            raise ValueError(f"seam: expected w ≥ 0, got {seam}")
        check_segments(lengths, segments)
        source: list[int] = []  # physical row → original token (flat over the batch)
        virtual: list[int] = []  # the request in true-position order, as physical rows
        alone_runs: list[int] = []
        copies: list[bool] = []
        base = 0  # first physical row of this sequence
        for n, segs in zip(lengths, segments, strict=True):
            pre = n - segs[-1]
            offset = len(source)
            source += range(base, base + pre)  # segments before the query, in order
            copy_row = offset + pre
            order: list[int] = []
            a = 0
            for L in segs[:-1]:
                w = L if all_seam(seam, L) else effective_seam(seam, L)  # as the engine plans it
                source += range(base + a, base + a + w)
                order += range(copy_row, copy_row + w)  # the seam, recomputed in context
                order += range(offset + a + w, offset + a + L)  # the body, from the cold prefill
                copy_row += w
                if L:
                    alone_runs.append(L)
                a += L
            seams = copy_row - offset - pre
            if seams:
                alone_runs.append(seams)  # the copies' alone result is never used
            rest = len(source)
            source += range(base + pre, base + n)
            order += range(rest, rest + segs[-1])
            if segs[-1]:
                alone_runs.append(segs[-1])
            copies += [False] * pre + [True] * seams + [False] * segs[-1]
            virtual += order
            base += n
        self.lengths = lengths
        self.cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)  # the virtual layout's runs
        self.cu_alone = torch.tensor([0, *alone_runs]).cumsum(0)
        self.source = torch.tensor(source)
        self.seam_copy = torch.tensor(copies)
        in_request = torch.zeros(len(source), dtype=torch.long)  # physical row → its index in the virtual layout
        in_request[torch.tensor(virtual)] = torch.arange(len(virtual))
        original = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
        self.positions = to_device(original[self.source], device)  # true positions, copies included
        # rows that take the virtual result: seam copies and each sequence's query onward
        after_query = torch.cat([torch.arange(n) >= n - segs[-1] for n, segs in zip(lengths, segments, strict=True)])
        self.in_context = to_device(self.seam_copy | after_query[self.source], device)
        # no seam copies (w = 0): the virtual layout is the physical one, and no row needs gathering
        self.virtual = None if not any(copies) else to_device(torch.tensor(virtual), device)
        self.in_request = None if self.virtual is None else to_device(in_request, device)

    def _request(self, x: Tensor) -> Tensor:
        """Physical rows → the request's true-position order."""
        return x if self.virtual is None else x[self.virtual]

    def _pick(self, whole_virtual: Tensor, alone: Tensor) -> Tensor:
        whole = whole_virtual if self.in_request is None else whole_virtual[self.in_request]  # physical rows
        mask = self.in_context.view(-1, *([1] * (alone.dim() - 1)))
        return torch.where(mask, whole, alone)

    def conv_tails(self, layer: int, raw: Tensor) -> Tensor | None:
        return None

    def save_conv(self, layer: int, tails: Tensor) -> None:
        pass

    def conv(self, layer: int, raw: Tensor, weight: Tensor) -> Tensor:
        whole = causal_conv1d(self._request(raw), weight, cu_seqlens=self.cu_seqlens, activation="silu").y
        alone = causal_conv1d(raw, weight, cu_seqlens=self.cu_alone, activation="silu").y
        return self._pick(whole, alone)

    def linear(self, layer: int, family: str, run: LinearRun, rope: RopeSpec | None) -> Tensor:
        if rope is not None:  # the re-rotation of RoPE'd linear states is not modelled here
            raise ValueError(f"layer {layer}: standalone-segment training supports linear layers without RoPE")
        return self._pick(run(self.cu_seqlens, None, False, self.virtual).o, run(self.cu_alone, None, False).o)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: RopeSpec | None, scale: float) -> Tensor:
        if rope is not None:  # true positions for everything: cached keys are re-roped where they land
            q, k = rope(q, self.positions), rope(k, self.positions)
        whole = causal_prefill_batch(self._request(q), self._request(k), self._request(v), self.cu_seqlens, scale)
        alone = causal_prefill_batch(q, k, v, self.cu_alone, scale)
        return self._pick(whole, alone)
