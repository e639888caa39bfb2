"""A training forward in which the query cannot attend to the documents: what it knows of them
must come through the linear layers' states.

The bundled model's two attention layers do its retrieval: dropping every linear state the query
inherits costs ~30 points (docs/quality.md, ``zero_state``), and summing zero-start states
(``naive``) only ~16, far from what the same ablation costs real hybrid models (−66.9% in the
published evaluation), whose linear layers carry much of what a prompt said. Mixing in steps where
the attention layers see only the query onward teaches the linear layers to carry documents into
the query — the property hypic's exact ``(T, S)`` composition exists to keep and naive addition
breaks — while the in-context and standalone steps keep attention's retrieval.

Only attention changes: the linear layers and convolutions run over the whole sequence in order
(``SequenceContext``); attention keeps two causal runs per sequence, the segments before the query
and the query onward, at their true positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hypic.models.context import RopeSpec, SequenceContext, SequenceState
from hypic.ops.attention_batch import causal_prefill_batch
from hypic.train.pic import check_segments


class QueryBlindContext(SequenceContext):
    """Sequences ``lengths`` packed in order, each a fresh prefill; ``segments[i]`` cuts sequence i
    as ``StandaloneSegmentsContext`` does (the last entry: the query onward). Attention from a token
    of the query onward sees only the query onward; tokens before it attend causally as usual."""

    def __init__(self, lengths: list[int], segments: list[list[int]], device: torch.device) -> None:
        check_segments(lengths, segments)
        runs = [r for n, segs in zip(lengths, segments, strict=True) for r in (n - segs[-1], segs[-1]) if r]
        super().__init__([SequenceState() for _ in lengths], lengths, device, keep_state=False)
        self.cu_attention = torch.tensor([0, *runs]).cumsum(0)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: RopeSpec | None, scale: float) -> Tensor:
        if rope is not None:  # true positions: the query sits where it sits in the prompt
            q, k = rope(q, self.positions), rope(k, self.positions)
        return causal_prefill_batch(q, k, v, self.cu_attention, scale)
