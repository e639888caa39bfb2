"""The ``prefix`` mode's prefill: reuse the longest kept state of a prompt's leading segments, then
compute the rest in context — the way SGLang's and vLLM's caches serve hybrid models.

States are kept where a prompt's head (segment 0) and its context (the segments before the query)
end: where those caches hold states (request and block ends), not after every segment, which would
cost a forward per document. The prompts of a call advance together, one stretch per round (the
head; the context; the query), each round one forward for the sequences that start fresh and one
for those that continue a state — at most four forwards a call, as the peers batch their
prefills. A prompt cannot reuse a state that another prompt of the same call is still computing;
it computes its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hypic.cache.keys import segment_key
from hypic.engine.prefix import chain
from hypic.engine.request import RequestMetrics
from hypic.models.context import SequenceContext, SequenceState
from hypic.ops.transfer import to_device


@dataclass
class _Prompt:
    index: int  # in the call
    segments: list[list[int]]
    links: list[bytes]  # links[i] names the prefix of segments 0..i
    digests: list[bytes]  # the segments' key digests (the query's excluded)
    state: SequenceState
    ends: list[int]  # the last segment of each stretch still to compute, ascending
    start: int  # the first segment of the next stretch

    @property
    def last(self) -> int:
        return len(self.segments) - 1


_HEAD, _CONTEXT, _QUERY = range(3)  # what a stretch ends with: the head, the context, the query


def _phase(p: _Prompt, end: int) -> int:
    return _QUERY if end == p.last else _HEAD if end == 0 else _CONTEXT


class PrefixPrefill:
    def _prefix(self, prompts: list[list[list[int]]], salts: list[str | None],
                metrics: list[RequestMetrics]) -> tuple[Tensor, list[SequenceState]]:
        work = []
        for i, (segments, salt, m) in enumerate(zip(prompts, salts, metrics, strict=True)):
            keys = [segment_key(s, model_fingerprint=self.fingerprint, seam=0, dtype=self.dtype_name, salt=salt)
                    for s in segments[:-1]]
            links = chain(keys)
            reused, state = self.prefix.longest(links)
            m.segment_hits, m.segment_misses = reused, len(keys) - reused
            m.cached_tokens = sum(len(s) for s in segments[:reused])
            m.recomputed_tokens = sum(len(s) for s in segments[reused:])
            last = len(segments) - 1
            ends = sorted({e for e in (0, last - 1, last) if e >= reused})
            work.append(_Prompt(i, segments, links, [k.digest for k in keys], state or SequenceState(), ends, reused))
        logits: list[Tensor | None] = [None] * len(work)
        for phase in (_HEAD, _CONTEXT, _QUERY):
            due = [p for p in work if p.ends and _phase(p, p.ends[0]) == phase]
            # One forward takes sequences that all start fresh or all continue a state: the context
            # stacks every sequence's linear states and conv tails, or none.
            for group in ([p for p in due if p.state.length == 0], [p for p in due if p.state.length > 0]):
                if group:
                    self._prefix_round(group, logits)
        return torch.cat(logits), [p.state for p in work]  # type: ignore[arg-type]

    def _prefix_round(self, group: list[_Prompt], logits: list[Tensor | None]) -> None:
        """Each prompt of ``group`` computes its next stretch, all in one forward."""
        stretches = [[t for s in p.segments[p.start:p.ends[0] + 1] for t in s] for p in group]
        ctx = SequenceContext([p.state for p in group], [len(x) for x in stretches], self.device)
        ids = to_device([t for x in stretches for t in x], self.device)
        done = [k for k, p in enumerate(group) if p.ends[0] == p.last]  # their query: first-token logits
        if done:
            last_rows = (ctx.cu_seqlens[1:] - 1).tolist()
            out = self.model(ids, ctx, to_device([last_rows[k] for k in done], self.device))
            for row, k in enumerate(done):
                logits[group[k].index] = out[row:row + 1]
        else:
            self.model.hidden_states(ids, ctx)
        ctx.finish()
        for p in group:
            end = p.ends.pop(0)
            if end < p.last:
                self.prefix.put(p.links[end], p.state, frozenset(p.digests[:end + 1]))
            p.start = end + 1
