"""Pinned host memory for the host tier: pinned once, in slabs, off the serving path; reused.

Demoting an entry to host memory must be an asynchronous copy, and only page-locked ("pinned")
memory takes one. But pinning is slow: on the H200 machine, demoting a 9B-shape entry (106 MiB in
88 tensors) into freshly pinned memory cost 80–97 ms of host time, against 1.1–1.4 ms into pinned
memory freed before (``scripts/store_moves.py``, docs/benchmarks.md) — and while the host tier
only grows, every demotion pins fresh memory: 193 demotions stalled one trace block for 16.9 s.

So the arena pins memory in slabs on a background thread and hands out contiguous regions
first-fit from them; a freed region returns to its slab's free list, coalesced with its
neighbours. The thread starts with the first demotion (an engine whose device tier never overflows
pins nothing), or earlier when asked (``pin_ahead``, ``pin_all``), and pins the whole ``capacity``
once (unbounded: ``ahead_bytes`` beyond what is used); after that the host tier never pins again.
``allocate`` never pins on the caller's thread: with no room yet it returns None and the store
evicts the entry rather than stall the request (an eviction costs a recompute later, ≈ 10–90 ms
for a document).

The thread pins only while it holds ``gate`` — the engine's lock, free between engine calls — one
slab of ``slab_bytes`` (1 GiB, ≈ 0.5 s) at a time, so a call that arrives meanwhile waits at most
that long. (Ungated, while the thread pinned 1 GiB slabs, the serving thread's demotions took 55 ms
each instead of ≈ 1: a trace block lost 3.6 s.) Why slabs that large: a region never spans slabs,
so each slab's tail smaller than an entry is lost — with 256 MiB slabs, 17% of the tier for fp32
entries (≈ 106 MiB, two to a slab) and ≈ 14% for bf16 ones (50–65 MiB, four): the 1 024-document
trace's store held ≈ 950 entries where ≈ 1 080 fit (session 20). ``pin_all`` pins everything now
and waits, for a caller that would rather pay it up front (a benchmark, before its warm-up);
``pin_ahead`` starts the thread without waiting (a server, at startup, pins in its idle time).

Stream order is the safety rule: every copy into or out of a region is issued on the device's
current stream (the engine's, under its lock), so a region freed after a promotion's copy was
issued can take the next demotion's copy without an event: the device runs them in order.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import logging
import threading
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from hypic.cache.layout import ALIGN

log = logging.getLogger(__name__)

SLAB_BYTES = 1 << 30  # ≈ 9 fp32 or 18 bf16 9B-shape entries; a larger entry gets a slab of its size
AHEAD_BYTES = 4 << 30


@dataclass(frozen=True)
class Region:
    slab: int
    offset: int
    nbytes: int
    buffer: Tensor  # uint8 [nbytes]: a view into the slab


class HostArena:
    def __init__(self, capacity: int | None, *, slab_bytes: int = SLAB_BYTES, ahead_bytes: int = AHEAD_BYTES,
                 pin: bool = True, background: bool = True, gate: threading.Lock | None = None) -> None:
        """``capacity``: the most bytes ever pinned (None: unbounded); ``pin=False`` takes ordinary
        memory (CPU tests); ``background=False`` grows only when ``grow`` is called (tests);
        ``gate``: a lock held while pinning (the engine's: pin only between its calls)."""
        if slab_bytes <= 0 or slab_bytes % ALIGN:
            raise ValueError(f"slab_bytes: expected a positive multiple of {ALIGN}, got {slab_bytes!r}")
        self.capacity, self.slab_bytes, self.ahead_bytes = capacity, slab_bytes, ahead_bytes
        self.pin, self.background, self.gate = pin, background, gate
        self._largest = 0  # the largest request no slab could hold: the next slab is at least that
        self.slabs: list[Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per slab: sorted (offset, size) free blocks
        self.used = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def pinned_bytes(self) -> int:
        return sum(s.numel() for s in self.slabs)

    def _next_slab(self) -> int:
        """Bytes of the next slab (0: at capacity): ``slab_bytes``, or the largest entry that fit no
        slab when that is more and capacity allows it, or what capacity has left."""
        left = None if self.capacity is None else (self.capacity - self.pinned_bytes) // ALIGN * ALIGN
        want = self.slab_bytes
        if self._largest and (left is None or self._largest <= left):
            want = self._largest
        return want if left is None else max(0, min(want, left))

    def _wants_slab(self) -> bool:
        if self._closed or self._next_slab() <= 0:
            return False
        return self.capacity is not None or self.pinned_bytes - self.used < self.ahead_bytes

    def pin_all(self, timeout: float | None = None) -> bool:
        """Pin up to capacity now (unbounded: ``ahead_bytes``) and wait for it; False on timeout.
        Never call it holding the gate: the thread needs it for every slab."""
        if not self.background:
            while self._wants_slab() and self.grow():
                pass
            return not self._wants_slab()
        self.pin_ahead()
        with self._cond:
            return self._cond.wait_for(lambda: not self._wants_slab(), timeout)

    def pin_ahead(self) -> None:
        """Start pinning now, in the background, rather than at the first demotion: a server calls it
        at startup so the host tier is pinned in its idle time before the load (under back-to-back
        calls the thread gets the gate only between them, and demotions meanwhile drop entries)."""
        with self._cond:
            self._start()
            self._cond.notify_all()

    def grow(self) -> bool:
        """Pin one more slab (slow: the background thread's work); False at capacity."""
        with self._cond:
            size = self._next_slab()
        if size <= 0:
            return False
        try:
            with self.gate or contextlib.nullcontext():  # outside the arena's lock: it takes long
                slab = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError as e:  # the machine would not lock more pages: stay at what is pinned
            with self._cond:
                self.capacity = self.pinned_bytes
            log.warning("host tier: pinning %d more bytes failed (%s); staying at %d", size, e, self.capacity)
            return False
        with self._cond:
            if self._closed or (self.capacity is not None and self.pinned_bytes + size > self.capacity):
                return False
            self.slabs.append(slab)
            self._free.append([(0, size)])
            if size >= self._largest:
                self._largest = 0
            self._cond.notify_all()  # pin_all may be waiting
        return True

    def allocate(self, nbytes: int) -> Region | None:
        """A region of ``nbytes`` (rounded up to ALIGN) from pinned memory; None when none is free."""
        need = nbytes + (-nbytes % ALIGN)
        with self._cond:
            region = self._take(max(need, ALIGN))
            if region is None and need > self.slab_bytes:
                self._largest = max(self._largest, need)
            if self.background and self._wants_slab():
                self._start()
                self._cond.notify_all()
        return region

    def slab_holds(self, nbytes: int) -> bool:
        """Whether a pinned slab is large enough for a region of ``nbytes``: if none is, freeing other
        regions cannot make room (a region never spans slabs; with the capacity pinned in 1 GiB slabs,
        a larger entry has no place however many others leave — ``allocate`` has asked the thread for
        a slab of its size, where capacity is left)."""
        need = nbytes + (-nbytes % ALIGN)
        with self._cond:
            return any(s.numel() >= need for s in self.slabs)

    def _take(self, need: int) -> Region | None:
        for i, blocks in enumerate(self._free):
            for j, (offset, size) in enumerate(blocks):
                if size >= need:
                    if size == need:
                        del blocks[j]
                    else:
                        blocks[j] = (offset + need, size - need)
                    self.used += need
                    return Region(i, offset, need, self.slabs[i][offset:offset + need])
        return None

    def free(self, region: Region) -> None:
        with self._cond:
            blocks = self._free[region.slab]
            j = bisect.bisect(blocks, (region.offset, 0))
            offset, size = region.offset, region.nbytes
            if j < len(blocks) and blocks[j][0] == offset + size:  # merge the next block
                size += blocks.pop(j)[1]
            if j > 0 and blocks[j - 1][0] + blocks[j - 1][1] == offset:  # and the previous one
                j -= 1
                offset, size = blocks[j][0], blocks[j][1] + size
                del blocks[j]
            blocks.insert(j, (offset, size))
            self.used -= region.nbytes

    def check(self) -> bool:
        """Free blocks are in bounds, sorted, disjoint and not adjacent; used + free = pinned."""
        with self._cond:
            free = 0
            for slab, blocks in zip(self.slabs, self._free, strict=True):
                end = -1
                for offset, size in blocks:
                    if offset <= end or size <= 0 or offset + size > slab.numel():
                        return False
                    end, free = offset + size, free + size
            return free + self.used == self.pinned_bytes

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=_grow_ahead, args=(weakref.ref(self),), daemon=True,
                                            name="hypic-host-arena")
            self._thread.start()
            _RUNNING.add(self)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


_RUNNING: weakref.WeakSet[HostArena] = weakref.WeakSet()  # arenas whose thread was started
EXIT_WAIT_S = 30.0  # a slab's pinning is ≈ 0.5 s per GiB (docs/benchmarks.md)


@atexit.register
def close_all(arenas: list[HostArena] | None = None, wait_s: float = EXIT_WAIT_S) -> None:
    """Close the arenas (default: every one whose thread started) and wait for each thread to
    finish the slab it is pinning. At interpreter exit a daemon thread left inside CUDA's host
    allocation runs on while CUDA is torn down, and the process can abort (a GPU run ended
    "terminate called without an active exception", rc 134)."""
    arenas = list(_RUNNING) if arenas is None else arenas
    for arena in arenas:
        arena.close()
    for arena in arenas:
        if arena._thread is not None:
            arena._thread.join(timeout=wait_s)


def _grow_ahead(ref: weakref.ref[HostArena]) -> None:
    """Pin up to capacity (unbounded: ``ahead_bytes`` beyond what is used); ends with the arena (it
    holds only a weak reference between slabs, so a dropped store's arena and slabs are freed)."""
    while True:
        arena = ref()
        if arena is None or arena._closed:
            return
        if arena._wants_slab():
            arena.grow()
        else:
            with arena._cond:
                arena._cond.wait(timeout=1.0)
        del arena
