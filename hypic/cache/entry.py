"""What the cache holds for one segment (DESIGN §4).

For a segment of tokens ``x[0:L)`` with seam ``w`` (``w ≤ L − 1``) the entry keeps the token ids
(collision check), per linear layer the body ``[w, L)`` summary ``(T, S)`` in fp32 and the
segment's conv tail (its last W−1 raw conv inputs), and per full-attention layer the body keys
*before RoPE* and values. Everything is stored at canonical positions (as if the segment started
at position 0) and placed at its true position on reuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hypic.cache.keys import SegmentKey
from hypic.ops.recurrence import Summary

if TYPE_CHECKING:
    from hypic.cache.host_arena import Region
    from hypic.cache.layout import Header


def _nbytes(t: Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass
class Entry:
    key: SegmentKey
    token_ids: tuple[int, ...]
    seam: int  # w: tokens [0, w) are recomputed in context on every reuse
    summaries: dict[int, Summary] = field(default_factory=dict)  # linear layer → body (T [H,..], S [H, K, V])
    conv_tails: dict[int, Tensor] = field(default_factory=dict)  # linear layer → [W−1, D]
    keys: dict[int, Tensor] = field(default_factory=dict)  # attention layer → body keys pre-RoPE [L−w, Hkv, D]
    values: dict[int, Tensor] = field(default_factory=dict)  # attention layer → body values [L−w, Hkv, Dv]
    tier: str = "device"
    hits: int = 0
    host_hits: int = 0  # hits while in the host tier since it was demoted (the store's promotion policy)
    # Unpacked from one byte buffer (``layout.unpack``: the wire, the host tier, a promotion): the
    # buffer its tensors are views into and their layout there, so it moves in one copy. In the host
    # tier, also the arena region that buffer is.
    header: Header | None = None
    buffer: Tensor | None = None
    region: Region | None = None

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def body_length(self) -> int:
        return self.length - self.seam

    def _tensors(self) -> list[Tensor]:
        tensors = [*self.conv_tails.values(), *self.keys.values(), *self.values.values()]
        return tensors + [t for s in self.summaries.values() for t in s if t is not None]

    @property
    def nbytes(self) -> int:
        if self.buffer is not None and self.header is not None:  # laid out once: the store asks often
            return self.header.tensor_bytes
        return sum(_nbytes(t) for t in self._tensors())

    @property
    def storage_bytes(self) -> int:
        """Bytes of the distinct storages behind the entry's tensors: what dropping it frees. Equal to
        ``nbytes`` when the entry owns its memory; more when a tensor is a view into a larger buffer
        (a batch's states), which would stay alive, unaccounted, as long as the entry does. An entry
        in the host arena owns its region (the arena frees it with the entry)."""
        if self.region is not None:
            return self.region.nbytes
        storages = {}
        for t in self._tensors():
            st = t.untyped_storage()
            storages[st.data_ptr(), t.device] = st.nbytes()
        return sum(storages.values())

    def to(self, device: torch.device | str, tier: str) -> Entry:
        """A copy of the entry on another device (demotion to host memory, promotion back)."""
        move = (lambda t: None if t is None else t.to(device, non_blocking=True))  # noqa: E731
        return Entry(self.key, self.token_ids, self.seam,
                     {i: Summary(move(s.transition), move(s.state)) for i, s in self.summaries.items()},
                     {i: move(t) for i, t in self.conv_tails.items()}, {i: move(t) for i, t in self.keys.items()},
                     {i: move(t) for i, t in self.values.items()}, tier, self.hits)
