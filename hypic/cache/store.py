"""The tiered segment store: a device tier and a host tier, each with a byte budget.

Inserts go to the device tier; when it is over budget the least recently used unpinned entries
are demoted to the host tier (or dropped when that is full too); a hit in the host tier is
promoted back. Entries a running request uses are pinned and never move. On a GPU the host tier
lives in pinned memory pinned ahead of time (``HostArena``): an entry goes there in one region and
comes back in one copy. ``check_integrity``
verifies that the bytes each tier accounts equal the sum of its entries and stay in budget.

``host_dtype`` (the engine's default on a GPU: bf16, ``hypic.cache.budgets``): the host tier keeps
each entry's summaries (T and S, fp32 on the device: ≈ 96 of the 105 MB an entry takes at the 9B
shape) in bf16 or fp16, so it holds nearly twice the entries. The conversion runs on the device, in
one multi-tensor copy each way, and only entries that went through the host tier carry the
rounding; the device tier, and every kernel reading it, stays fp32. Why: serving a trace whose
pool the tiers cannot hold, each call with a missing document pays a cold prefill
(docs/benchmarks.md, session 19); on the H200 the 1 024-document trace's requests with a miss fell
from 62–74% to 12–26% and its sustained rate from 16–24 to 24 QPS (session 20).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from hypic.cache.entry import Entry
from hypic.cache.host_arena import HostArena
from hypic.cache.keys import SegmentKey
from hypic.cache.layout import (
    HALF,
    HOST_DTYPES,
    convert_buffer,
    convert_into,
    converted,
    header_of,
    owns_memory,
    pack_into,
    retyped,
    unpack,
)

TIERS = ("device", "host")


@dataclass(frozen=True)
class CacheStats:
    entries: dict[str, int]
    bytes: dict[str, int]
    budgets: dict[str, int | None]
    hits: int
    misses: int
    evictions: int
    promotions: int
    demotions: int
    move_s: float = 0.0  # host seconds spent issuing promotions and demotions (copies between tiers)
    host_pinned_bytes: int = 0  # page-locked host memory the host tier's arena holds (used or not)


class SegmentStore:
    def __init__(self, device: torch.device, *, device_bytes: int | None = None, host_bytes: int | None = None,
                 arena: HostArena | None | str = "auto", pin_gate: threading.Lock | None = None,
                 host_dtype: torch.dtype | None = None, promote_after: int = 1) -> None:
        """``arena``: where demoted entries live — "auto" pins host memory in a ``HostArena`` when the
        device is a GPU and keeps entries as they are on the CPU (its "device" tier is host memory
        already, a demotion moves nothing); or an arena (tests), or None (plain copies).
        ``pin_gate``: the auto arena pins only while holding it (the engine's lock).
        ``host_dtype``: the dtype of summaries in the host tier (None or fp32: as on the device).
        ``promote_after``: a host-tier entry moves to the device on this hit since its demotion; the
        hits before are served in place, each from a device copy, so an entry hit once on the host
        pushes no other entry down (1: every host hit promotes)."""
        for name, budget in (("cache_device_bytes", device_bytes), ("cache_host_bytes", host_bytes)):
            if budget is not None and (not isinstance(budget, int) or budget < 0):
                raise ValueError(f"{name}: expected a non-negative integer or None, got {budget!r}")
        if host_dtype is not None and host_dtype not in HOST_DTYPES.values():
            raise ValueError(f"host_dtype: expected one of {list(HOST_DTYPES.values())} or None, got {host_dtype!r}")
        if not isinstance(promote_after, int) or isinstance(promote_after, bool) or promote_after < 1:
            raise ValueError(f"promote_after: expected an integer ≥ 1, got {promote_after!r}")
        self.host_dtype = None if host_dtype == torch.float32 else host_dtype
        self.promote_after = promote_after
        self.device = torch.device(device)
        self.budgets: dict[str, int | None] = {"device": device_bytes, "host": host_bytes}
        if arena == "auto":
            arena = HostArena(host_bytes, gate=pin_gate) if self.device.type == "cuda" else None
        elif arena is not None and not isinstance(arena, HostArena):
            raise ValueError(f"arena: expected 'auto', a HostArena or None, got {arena!r}")
        self.arena: HostArena | None = arena
        self._tiers: dict[str, OrderedDict[SegmentKey, Entry]] = {t: OrderedDict() for t in TIERS}
        self._bytes = {t: 0 for t in TIERS}
        self._pins: dict[SegmentKey, int] = {}
        self._lock = threading.RLock()
        self.hits = self.misses = self.evictions = self.promotions = self.demotions = 0
        self.move_s = 0.0

    def set_budget(self, tier: str, nbytes: int | None) -> None:
        """A tier's budget changed while serving (None: unbounded): entries beyond a smaller one
        leave now, least recently used first (device → host → gone); pinned ones stay (a tier may
        exceed its budget by pinned entries, as always)."""
        if tier not in TIERS:
            raise ValueError(f"set_budget: expected a tier of {TIERS}, got {tier!r}")
        if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0):
            raise ValueError(f"set_budget: expected a non-negative integer or None, got {nbytes!r}")
        with self._lock:
            self.budgets[tier] = nbytes
            try:
                self._make_room(tier, 0)
            except BaseException:  # out of memory mid-move: the budget stops at what is held now
                if nbytes is not None:
                    self.budgets[tier] = max(nbytes, self._bytes[tier])
                raise

    def _fits(self, tier: str, nbytes: int) -> bool:
        budget = self.budgets[tier]
        return budget is None or nbytes <= budget

    def _add(self, tier: str, entry: Entry) -> None:
        entry.tier = tier
        self._tiers[tier][entry.key] = entry
        self._bytes[tier] += entry.nbytes

    def _remove(self, tier: str, key: SegmentKey) -> Entry:
        entry = self._tiers[tier].pop(key)
        self._bytes[tier] -= entry.nbytes
        return entry

    def _release(self, entry: Entry) -> None:
        """The entry leaves the store: its arena region (if any) is free for the next demotion."""
        if entry.region is not None and self.arena is not None:
            self.arena.free(entry.region)
            entry.region = None

    def _evict_lru(self, tier: str) -> int:
        """Drop the least recently used unpinned entry of ``tier``; the bytes freed (0: none could go)."""
        for key in self._tiers[tier]:
            if not self._pins.get(key):
                entry = self._remove(tier, key)
                self._release(entry)
                self.evictions += 1
                return entry.nbytes
        return 0

    def _make_room(self, tier: str, nbytes: int) -> bool:
        """Evict unpinned LRU entries of ``tier`` (device → host → gone) until nbytes fit."""
        budget = self.budgets[tier]
        if budget is None:
            return True
        for key in list(self._tiers[tier]):
            if self._bytes[tier] + nbytes <= budget:
                break
            if self._pins.get(key):
                continue
            # the host copy first: out of memory making it, the entry stays where it was
            host = self._to_host(self._tiers[tier][key]) if tier == "device" else None
            entry = self._remove(tier, key)
            if host is not None:
                self._add("host", host)
                self.demotions += 1
            else:
                self._release(entry)
                self.evictions += 1
        return self._bytes[tier] + nbytes <= budget

    def _to_host(self, entry: Entry) -> Entry | None:
        """A host-tier copy of a device entry (room made in the host tier for the bytes it takes
        there: narrowed, with ``host_dtype``), or None: no room."""
        t0 = time.perf_counter()
        try:
            header = header_of(entry)
            narrow = header if self.host_dtype is None else retyped(header, torch.float32, self.host_dtype)
            if not self._fits("host", narrow.tensor_bytes):
                return None
            if self.arena is not None and not self.arena.slab_holds(narrow.nbytes):
                # no slab can hold it (a region never spans slabs): dropped alone, not after emptying the
                # tier for nothing; allocate asks the thread for a slab of its size, where capacity is left
                region = self.arena.allocate(narrow.nbytes)
                if region is not None:  # the thread pinned a slab that large just now: not this time
                    self.arena.free(region)
                return None
            if not self._make_room("host", narrow.tensor_bytes):
                return None
            staged = None  # else: the bytes to move, converted on the entry's device run by run, laid out by narrow
            if narrow != header:
                staged = converted(entry, narrow, torch.empty(narrow.nbytes, dtype=torch.uint8,
                                                              device=entry._tensors()[0].device))
            if self.arena is None:
                host = entry if staged is None else unpack(narrow, staged)
                host.hits = entry.hits
                return host.to("cpu", "host")
            region, freed = self.arena.allocate(narrow.nbytes), 0
            while region is None and freed < 2 * narrow.nbytes:  # fragmented: free older neighbours' room
                dropped = self._evict_lru("host")
                if not dropped:
                    break
                freed += dropped
                region = self.arena.allocate(narrow.nbytes)
            if region is None:  # not pinned yet (the arena grows in the background): drop, never stall
                return None
            if staged is None:
                host = pack_into(entry, narrow, region.buffer)
            else:  # one block down, unpacked once (host time per move: scripts/store_moves.py)
                host = unpack(narrow, region.buffer.copy_(staged, non_blocking=True))
                host.hits = entry.hits
            host.region, host.tier = region, "host"
            return host
        finally:
            self.move_s += time.perf_counter() - t0

    def _to_device(self, entry: Entry, *, keep: bool = False) -> Entry:
        """A device copy of a host entry (one copy from its arena region); the region is freed unless
        ``keep`` (a hit served in place: the entry stays in the host tier). Summaries the host tier
        narrowed are widened back to fp32 on the device."""
        t0 = time.perf_counter()
        if entry.region is None:
            moved = entry.to(self.device, "device")
        else:
            n, half = entry.header.nbytes, self._half(entry)
            buf = torch.empty(n, dtype=torch.uint8, device=self.device)  # a copy, even on the CPU
            buf.copy_(entry.region.buffer[:n], non_blocking=True)
            if half is None:
                moved = unpack(entry.header, buf)
            else:  # widened on the device run by run, unpacked once
                wide = retyped(entry.header, half, torch.float32)
                out = torch.empty(wide.nbytes, dtype=torch.uint8, device=self.device)
                moved = unpack(wide, convert_buffer(entry.header, buf, wide, out))
            moved.hits = entry.hits
            if not keep:
                self._release(entry)  # after the copy is issued: a later demotion's copy into it runs after it
        moved = self._widened(moved)  # a plain host entry (no arena) narrowed: widened here
        self.move_s += time.perf_counter() - t0
        return moved

    @staticmethod
    def _half(entry: Entry) -> torch.dtype | None:
        """The half-precision dtype of the entry's summaries (the host tier's), else None — read off
        one summary, not the layout: every insert and promotion asks."""
        dtype = next((s.state.dtype for s in entry.summaries.values()), None)
        return dtype if dtype in HALF else None

    @staticmethod
    def _device_nbytes(entry: Entry) -> int:
        """The bytes ``entry`` takes in the device tier: its summaries in fp32, whatever the host keeps."""
        half = SegmentStore._half(entry)
        if half is None:
            return entry.nbytes
        if entry.buffer is not None and entry.header is not None:  # from its layout (cached): no tensor walk
            return retyped(entry.header, half, torch.float32).tensor_bytes
        return entry.nbytes + sum(t.numel() * (4 - t.element_size()) for s in entry.summaries.values()
                                  for t in s if t is not None and t.dtype in HALF)

    def _widened(self, entry: Entry) -> Entry:
        """``entry`` with fp32 summaries: itself, or a copy widened from the host tier's dtype (a
        promotion, or an entry saved from the host tier and loaded back)."""
        half = self._half(entry)
        if half is None:
            return entry
        header = header_of(entry)
        wide = retyped(header, half, torch.float32)
        moved = convert_into(entry, wide, torch.empty(wide.nbytes, dtype=torch.uint8,
                                                      device=entry._tensors()[0].device))
        moved.tier = entry.tier
        return moved

    def insert(self, entry: Entry) -> bool:
        """Cache an entry; False when no tier has room (the caller still holds it for its request).
        An entry whose summaries are in the host tier's dtype (saved from it, loaded back) is widened
        to fp32 first: the device tier holds fp32 summaries only."""
        with self._lock:
            entry = self._widened(entry)
            for tier in TIERS:
                held = self._tiers[tier].get(entry.key)
                if held is None:
                    continue
                if held.token_ids == entry.token_ids:
                    return True
                # other tokens under this key (an entry file damaged on disk, a collision): never served,
                # so it would only block the key — replaced unless a request holds it
                if self._pins.get(entry.key):
                    return False
                self._release(self._remove(tier, entry.key))
            if self._fits("device", entry.nbytes) and self._make_room("device", entry.nbytes):
                self._add("device", entry)
                return True
            host = self._to_host(entry)
            if host is not None:
                self._add("host", host)
                return True
            return False

    def lookup(self, key: SegmentKey, token_ids: tuple[int, ...]) -> Entry | None:
        """The entry for these exact tokens, promoted to the device tier when it fits; else None.
        The caller pins the key before its next lookup: an unpinned entry may move or go."""
        with self._lock:
            for tier in TIERS:
                entry = self._tiers[tier].get(key)
                if entry is None:
                    continue
                if entry.token_ids != token_ids:  # a hash collision: never serve other content
                    break
                self.hits += 1
                entry.hits += 1
                self._tiers[tier].move_to_end(key)
                promote = False
                if tier == "host":
                    entry.host_hits += 1
                    wide = self._device_nbytes(entry)
                    # a pinned entry never moves: a plan holding it may read it in place
                    promote = (entry.host_hits >= self.promote_after and self._fits("device", wide)
                               and not self._pins.get(key))
                if promote:
                    self._remove("host", key)  # first, so making room on the device cannot evict it
                    try:
                        if self._make_room("device", wide):
                            moved = self._to_device(entry)
                            self._add("device", moved)
                            self.promotions += 1
                        elif self._make_room("host", entry.nbytes):
                            moved = entry
                            self._add("host", entry)
                        else:  # no tier keeps it: the request gets its own device copy (the region is freed)
                            moved = self._to_device(entry)
                            self.evictions += 1
                    except BaseException:  # out of memory copying it: it leaves the store, region freed
                        if entry.tier == "host" and key not in self._tiers["host"]:
                            self._release(entry)
                            self.evictions += 1
                        raise
                    entry = moved
                if entry.tier == "host" and (self.device.type != "cpu" or self._half(entry) is not None):
                    # served from the host tier in place: this request gets its own device copy, in
                    # fp32 (the combine pass reads every entry on the engine's device: an fp32 host
                    # entry handed over as it lay, in pinned memory, failed the request)
                    entry = self._to_device(entry, keep=True)
                return entry
            self.misses += 1
            return None

    def holds(self, key: SegmentKey, token_ids: tuple[int, ...]) -> bool:
        """Whether a tier holds the entry for these exact tokens. Nothing moves and no counter or
        recency changes: a look ahead (the serving loop choosing what to prefill), not a use."""
        with self._lock:
            for tier in TIERS:
                entry = self._tiers[tier].get(key)
                if entry is not None:
                    return entry.token_ids == token_ids
            return False

    def discard(self, key: SegmentKey) -> str:
        """Drop the entry under ``key`` from whichever tier holds it (a document changed or must be
        forgotten) — whatever tokens it holds: one holding others (damaged on disk) is never served
        and must not outlive an eviction — "evicted", "absent", or "in_use" — pinned by a request
        being prefilled, which still reads it, so it stays (the engine discards under its lock, when
        nothing is pinned)."""
        with self._lock:
            for tier in TIERS:
                if key not in self._tiers[tier]:
                    continue
                if self._pins.get(key):
                    return "in_use"
                self._release(self._remove(tier, key))
                return "evicted"
            return "absent"

    def pin(self, keys: list[SegmentKey]) -> None:
        with self._lock:
            for k in keys:
                self._pins[k] = self._pins.get(k, 0) + 1

    def unpin(self, keys: list[SegmentKey]) -> None:
        """Release the keys; a tier left over its budget by pinned entries (a budget lowered while a
        request held them) makes room now."""
        with self._lock:
            for k in keys:
                left = self._pins.get(k, 0) - 1
                if left > 0:
                    self._pins[k] = left
                else:
                    self._pins.pop(k, None)
            for tier in TIERS:
                budget = self.budgets[tier]
                if budget is not None and self._bytes[tier] > budget:
                    try:
                        self._make_room(tier, 0)
                    except torch.OutOfMemoryError:  # a demotion's copy: the entries stay, the next insert tries again
                        pass

    def clear(self) -> None:
        """Drop every entry and reset the counters (budgets, pins and the arena's pinned memory stay:
        pinning it again would cost the next demotions ≈ 90 ms each)."""
        with self._lock:
            for tier in TIERS:
                for key in list(self._tiers[tier]):
                    self._release(self._remove(tier, key))
            self.hits = self.misses = self.evictions = self.promotions = self.demotions = 0
            self.move_s = 0.0

    def entries(self) -> list[Entry]:
        """Every entry, least recently used first: the host tier's (demoted, so older), then the
        device tier's."""
        with self._lock:
            return [e for tier in ("host", "device") for e in self._tiers[tier].values()]

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats({t: len(self._tiers[t]) for t in TIERS}, dict(self._bytes), dict(self.budgets),
                              self.hits, self.misses, self.evictions, self.promotions, self.demotions,
                              self.move_s, 0 if self.arena is None else self.arena.pinned_bytes)

    def check_integrity(self) -> bool:
        """Accounted bytes equal the sum of entries per tier, no key is in two tiers, budgets hold
        (a tier may exceed its budget only by pinned entries), every entry owns exactly the memory
        it is accounted for (no view into a larger buffer that evicting it would not free), and the
        arena's used bytes are exactly the host entries' regions."""
        with self._lock:
            seen: set[SegmentKey] = set()
            for tier in TIERS:
                entries = self._tiers[tier]
                if sum(e.nbytes for e in entries.values()) != self._bytes[tier]:
                    return False
                if not all(owns_memory(e) for e in entries.values()):
                    return False
                if seen & entries.keys() or any(e.tier != tier or e.key != k for k, e in entries.items()):
                    return False
                seen |= entries.keys()
                budget = self.budgets[tier]
                unpinned = sum(e.nbytes for k, e in entries.items() if not self._pins.get(k))
                if budget is not None and self._bytes[tier] > budget and unpinned > 0:
                    return False
            if any(e.region is not None for e in self._tiers["device"].values()):
                return False
            if self.arena is not None:
                regions = sum(e.region.nbytes for e in self._tiers["host"].values() if e.region is not None)
                if regions != self.arena.used or not self.arena.check():
                    return False
            return True
