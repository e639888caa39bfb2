"""The ``prefix`` mode's cache: exact decode states at segment boundaries, keyed by the chain of
segments before them — what SGLang and vLLM give hybrid models. The engine keeps states where a
prompt's head (segment 0) and its context (the segments before the query) end; a later prompt
reuses the longest run of leading segments that ends at a kept state and computes the rest in
context, in one forward per stretch.

Snapshots share everything with the states they came from: a forward replaces linear states and
conv tails rather than writing into them, and key/value buffers only ever write past the rows a
snapshot sees. A state restored from a snapshot gets its own copy of the buffers, once. A kept
linear state or conv tail that is a view into a forward's stacked tensor (every prompt of the call)
is copied out, or it would keep the whole stack alive: n copies of a prompt kept n times its bytes.

The kept states are bounded by count and by bytes (the engine passes what the segment store leaves of
its device budget: the two share it), least recently used out first; they
are a cache of a baseline, so the engine drops them all when the device runs out of memory. They
are not saved with the segment cache (``--cache-dir``).
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable

from torch import Tensor

from hypic.cache.keys import SegmentKey
from hypic.models.context import SequenceState


def snapshot(state: SequenceState, *, copy_kv: bool = False) -> SequenceState:
    kv = {i: b.clone() if copy_kv else b.view() for i, b in state.kv.items()}
    return SequenceState(dict(state.linear), dict(state.conv), kv, state.length)


def _own(t: Tensor) -> Tensor:
    """``t`` in a storage of its own size (a view into a bigger tensor copied out)."""
    return t.clone() if t.untyped_storage().nbytes() > t.nbytes else t


def _storages(state: SequenceState) -> dict[tuple[str, int], int]:
    """The storages a kept state holds: (device, address) → bytes."""
    tensors = [*state.linear.values(), *state.conv.values(),
               *(t for b in state.kv.values() for t in (b.keys, b.values))]
    return {(str(t.device), t.untyped_storage().data_ptr()): t.untyped_storage().nbytes() for t in tensors}


def chain(keys: list[SegmentKey]) -> list[bytes]:
    """chain[i] identifies the prompt prefix made of segments 0..i, in that order."""
    out, h = [], b""
    for k in keys:
        h = hashlib.blake2b(h + k.digest, digest_size=20).digest()
        out.append(h)
    return out


class PrefixCache:
    def __init__(self, max_states: int = 256, max_bytes: Callable[[], int | None] | None = None) -> None:
        """``max_bytes``: read at each ``put``, the bytes the kept states may hold (None: unbounded)."""
        self.max_states = max_states
        self.max_bytes = max_bytes or (lambda: None)
        self._states: OrderedDict[bytes, SequenceState] = OrderedDict()
        self._members: dict[bytes, frozenset[bytes]] = {}  # link → digests of the segments in that prefix
        # the bytes held, kept up to date as states come and go (a put never rescans every state):
        # each storage counted once, however many kept states share it
        self._held: dict[bytes, dict[tuple[str, int], int]] = {}  # link → its storages
        self._refs: Counter[tuple[str, int]] = Counter()
        self._bytes = 0
        self._lock = threading.Lock()

    def longest(self, links: list[bytes]) -> tuple[int, SequenceState | None]:
        """(number of leading segments reused, a copy of the state after them)."""
        with self._lock:
            for i in range(len(links), 0, -1):
                if links[i - 1] in self._states:
                    self._states.move_to_end(links[i - 1])
                    return i, snapshot(self._states[links[i - 1]], copy_kv=True)
        return 0, None

    def put(self, link: bytes, state: SequenceState, members: frozenset[bytes] = frozenset()) -> None:
        """Keep ``state`` as the prefix ``link`` names; ``members``: its segments' key digests (what
        ``discard_containing`` finds it by)."""
        kept = snapshot(state)
        kept.linear = {i: _own(t) for i, t in kept.linear.items()}
        kept.conv = {i: _own(t) for i, t in kept.conv.items()}
        with self._lock:
            if link in self._states:
                self._remove(link)
            self._states[link] = kept
            self._members[link] = members
            self._held[link] = storages = _storages(kept)
            for key, n in storages.items():
                self._bytes += n if self._refs[key] == 0 else 0
                self._refs[key] += 1
            budget = self.max_bytes()
            while self._states and (len(self._states) > self.max_states
                                    or (budget is not None and self._bytes > budget)):
                self._remove(next(iter(self._states)))  # least recently used first

    def _remove(self, link: bytes) -> None:
        """A kept state out (the caller holds the lock); a storage leaves with the last state holding it."""
        del self._states[link]
        self._members.pop(link, None)
        for key, n in self._held.pop(link).items():
            self._refs[key] -= 1
            if self._refs[key] == 0:
                del self._refs[key]
                self._bytes -= n

    def clear(self) -> int:
        """Drop every kept state (the device ran out of memory); how many."""
        with self._lock:
            n = len(self._states)
            for link in list(self._states):
                self._remove(link)
            return n

    def stats(self) -> tuple[int, int]:
        """(states kept, bytes they hold): each tensor storage counted once, as snapshots share the
        linear states, conv tails and key/value buffers of the states they came from."""
        with self._lock:
            return len(self._states), self._bytes

    def discard_containing(self, digests: set[bytes]) -> int:
        """Drop every kept state whose prefix holds one of these segments; how many."""
        with self._lock:
            gone = [link for link, members in self._members.items() if members & digests]
            for link in gone:
                self._remove(link)
            return len(gone)
