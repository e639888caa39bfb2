"""hypic's warm path at seam 0 as one differentiable forward, for training.

At seam ``w = 0`` a warm hypic request computes every prompt segment before the query on its own
(the standalone cold prefill: attention within the segment, linear states from zero, a conv
window that starts at the segment) and everything from the query on in context (the combine
pass: attention over every earlier key at its true position, linear states composed exactly from
the segments' summaries, conv warm-up from the previous segment's tail). Composing ``(T, S)``
summaries is the linear recurrence itself, so the whole request equals one forward in which each
mixer is computed twice — once over the segments as separate runs, once over the whole sequence
— and each token takes the segment result before the query and the whole-sequence result from
the query on. This context does exactly that, so training can mix such forwards with ordinary
ones and the model learns to read documents it did not see in context (a model trained only in
context loses ~15 points under hypic's reuse). ``tests/train/test_pic.py`` checks it against
the engine's ``hypic`` mode at ``w = 0``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hypic.models.context import ForwardContext, LinearRun, RopeSpec
from hypic.ops.attention_batch import causal_prefill_batch
from hypic.ops.conv import causal_conv1d
from hypic.ops.transfer import to_device


class StandaloneSegmentsContext(ForwardContext):
    """Sequences ``lengths`` packed in order; ``segments[i]`` cuts sequence i into its prompt
    segments before the query, then the rest (query, answer, anything after) as the last entry."""

    def __init__(self, lengths: list[int], segments: list[list[int]], device: torch.device) -> None:
        for n, segs in zip(lengths, segments, strict=True):
            if sum(segs) != n or any(s < 0 for s in segs) or not segs:
                raise ValueError(f"segments {segs} do not cut a sequence of {n} tokens")
        self.lengths = lengths
        self.cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
        flat = [s for segs in segments for s in segs if s > 0]
        self.cu_segments = torch.tensor([0, *flat]).cumsum(0)
        self.positions = to_device(torch.cat([torch.arange(n) for n in lengths]), device)
        # True from each sequence's last segment (the query) on: those tokens see the whole sequence
        self.in_context = to_device(torch.cat([torch.arange(n) >= n - segs[-1]
                                               for n, segs in zip(lengths, segments, strict=True)]), device)

    def _pick(self, whole: Tensor, alone: Tensor) -> Tensor:
        mask = self.in_context.view(-1, *([1] * (whole.dim() - 1)))
        return torch.where(mask, whole, alone)

    def conv_tails(self, layer: int, raw: Tensor) -> Tensor | None:
        return None

    def save_conv(self, layer: int, tails: Tensor) -> None:
        pass

    def conv(self, layer: int, raw: Tensor, weight: Tensor) -> Tensor:
        whole = causal_conv1d(raw, weight, cu_seqlens=self.cu_seqlens, activation="silu").y
        alone = causal_conv1d(raw, weight, cu_seqlens=self.cu_segments, activation="silu").y
        return self._pick(whole, alone)

    def linear(self, layer: int, family: str, run: LinearRun, rope: RopeSpec | None) -> Tensor:
        if rope is not None:  # the re-rotation of RoPE'd linear states is not modelled here
            raise ValueError(f"layer {layer}: standalone-segment training supports linear layers without RoPE")
        return self._pick(run(self.cu_seqlens, None, False).o, run(self.cu_segments, None, False).o)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: RopeSpec | None, scale: float) -> Tensor:
        if rope is not None:  # true positions for everything: cached keys are re-roped where they land
            q, k = rope(q, self.positions), rope(k, self.positions)
        whole = causal_prefill_batch(q, k, v, self.cu_seqlens, scale)
        alone = causal_prefill_batch(q, k, v, self.cu_segments, scale)
        return self._pick(whole, alone)
