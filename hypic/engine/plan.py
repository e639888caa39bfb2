"""Planning a request: segments → keys → hits and misses → true positions → the recompute set.

Every non-query segment is cached. A cached segment of length L is reused with seam
``w = min(seam, L − 1)``: its first w tokens are recomputed in context (a *recompute piece*), its
body ``[w, L)`` comes from the entry. A segment computed in context (the query, and misses under
the in-context cold strategy) is one recompute piece of all its tokens. Pieces are laid out in
position order; contiguous pieces form one conv run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypic.cache.entry import Entry
from hypic.cache.keys import SegmentKey


@dataclass
class SegmentPlan:
    token_ids: list[int]
    start: int  # true position of the segment's first token
    key: SegmentKey | None  # None for the query (never cached)
    seam: int  # w for this segment (tokens [0, w) recomputed when the entry is used)
    entry: Entry | None = None  # the cached entry used (hit, or filled by the cold prefill)
    hit: bool = False  # the entry existed before this request
    in_context: bool = False  # computed wholly in context (query, in-context misses)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def recompute(self) -> tuple[int, int]:
        """Local token range computed in context in the combine pass."""
        return (0, self.length) if self.in_context or self.entry is None else (0, self.seam)


@dataclass
class RequestPlan:
    segments: list[SegmentPlan]
    salt: str | None = None
    pinned: list[SegmentKey] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(s.length for s in self.segments)

    @property
    def recompute_tokens(self) -> int:
        return sum(b - a for s in self.segments for a, b in [s.recompute])


def effective_seam(seam: int, length: int) -> int:
    """Cap w ≤ L − 1 so that every cached segment keeps a non-empty body."""
    return max(0, min(seam, length - 1))


def all_seam(seam: int, length: int) -> bool:
    """A segment no longer than the seam is all seam: recomputed in context every time, so caching
    it would save nothing (the engine plans it in context; training's forward does the same)."""
    return seam > 0 and length <= seam
