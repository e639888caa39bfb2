"""The ``prefix`` mode's cache: exact decode states at segment boundaries, keyed by the chain of
segments before them — what SGLang and vLLM give hybrid models. The engine keeps states where a
prompt's head (segment 0) and its context (the segments before the query) end; a later prompt
reuses the longest run of leading segments that ends at a kept state and computes the rest in
context, in one forward per stretch.

Snapshots share everything with the states they came from: a forward replaces linear states and
conv tails rather than writing into them, and key/value buffers only ever write past the rows a
snapshot sees. A state restored from a snapshot gets its own copy of the buffers, once.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from hypic.cache.keys import SegmentKey
from hypic.models.context import SequenceState


def snapshot(state: SequenceState, *, copy_kv: bool = False) -> SequenceState:
    kv = {i: b.clone() if copy_kv else b.view() for i, b in state.kv.items()}
    return SequenceState(dict(state.linear), dict(state.conv), kv, state.length)


def chain(keys: list[SegmentKey]) -> list[bytes]:
    """chain[i] identifies the prompt prefix made of segments 0..i, in that order."""
    out, h = [], b""
    for k in keys:
        h = hashlib.blake2b(h + k.digest, digest_size=20).digest()
        out.append(h)
    return out


class PrefixCache:
    def __init__(self, max_states: int = 256) -> None:
        self.max_states = max_states
        self._states: OrderedDict[bytes, SequenceState] = OrderedDict()
        self._members: dict[bytes, frozenset[bytes]] = {}  # link → digests of the segments in that prefix
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
        with self._lock:
            self._states[link] = snapshot(state)
            self._members[link] = members
            self._states.move_to_end(link)
            while len(self._states) > self.max_states:
                old, _ = self._states.popitem(last=False)
                self._members.pop(old, None)

    def stats(self) -> tuple[int, int]:
        """(states kept, bytes they hold): each tensor storage counted once, as snapshots share the
        linear states, conv tails and key/value buffers of the states they came from."""
        with self._lock:
            seen: dict[tuple[str, int], int] = {}
            for state in self._states.values():
                tensors = [*state.linear.values(), *state.conv.values(),
                           *(t for b in state.kv.values() for t in (b.keys, b.values))]
                for t in tensors:
                    storage = t.untyped_storage()
                    seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
            return len(self._states), sum(seen.values())

    def discard_containing(self, digests: set[bytes]) -> int:
        """Drop every kept state whose prefix holds one of these segments; how many."""
        with self._lock:
            gone = [link for link, members in self._members.items() if members & digests]
            for link in gone:
                del self._states[link], self._members[link]
            return len(gone)
