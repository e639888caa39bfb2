"""The tiered segment store: a device tier and a host tier, each with a byte budget.

Inserts go to the device tier; when it is over budget the least recently used unpinned entries
are demoted to the host tier (or dropped when that is full too); a hit in the host tier is
promoted back. Entries a running request uses are pinned and never move. ``check_integrity``
verifies that the bytes each tier accounts equal the sum of its entries and stay in budget.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from hypic.cache.entry import Entry
from hypic.cache.keys import SegmentKey

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


class SegmentStore:
    def __init__(self, device: torch.device, *, device_bytes: int | None = None, host_bytes: int | None = None) -> None:
        for name, budget in (("cache_device_bytes", device_bytes), ("cache_host_bytes", host_bytes)):
            if budget is not None and (not isinstance(budget, int) or budget < 0):
                raise ValueError(f"{name}: expected a non-negative integer or None, got {budget!r}")
        self.device = torch.device(device)
        self.budgets: dict[str, int | None] = {"device": device_bytes, "host": host_bytes}
        self._tiers: dict[str, OrderedDict[SegmentKey, Entry]] = {t: OrderedDict() for t in TIERS}
        self._bytes = {t: 0 for t in TIERS}
        self._pins: dict[SegmentKey, int] = {}
        self._lock = threading.RLock()
        self.hits = self.misses = self.evictions = self.promotions = self.demotions = 0
        self.move_s = 0.0

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

    def _move(self, entry: Entry, device: torch.device | str, tier: str) -> Entry:
        t0 = time.perf_counter()
        moved = entry.to(device, tier)
        self.move_s += time.perf_counter() - t0
        return moved

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
            entry = self._remove(tier, key)
            if tier == "device" and self._fits("host", entry.nbytes) and self._make_room("host", entry.nbytes):
                self._add("host", self._move(entry, "cpu", "host"))
                self.demotions += 1
            else:
                self.evictions += 1
        return self._bytes[tier] + nbytes <= budget

    def insert(self, entry: Entry) -> bool:
        """Cache an entry; False when no tier has room (the caller still holds it for its request)."""
        with self._lock:
            for tier in TIERS:
                if entry.key in self._tiers[tier]:
                    return True
            for tier in TIERS:
                if self._fits(tier, entry.nbytes) and self._make_room(tier, entry.nbytes):
                    self._add(tier, entry if tier == "device" else self._move(entry, "cpu", "host"))
                    return True
            return False

    def lookup(self, key: SegmentKey, token_ids: tuple[int, ...]) -> Entry | None:
        """The entry for these exact tokens, promoted to the device tier when it fits; else None."""
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
                if tier == "host" and self._fits("device", entry.nbytes):
                    self._remove("host", key)  # first, so making room on the device cannot evict it
                    if self._make_room("device", entry.nbytes):
                        entry = self._move(entry, self.device, "device")
                        self._add("device", entry)
                        self.promotions += 1
                    elif self._make_room("host", entry.nbytes):
                        self._add("host", entry)
                    else:
                        self.evictions += 1
                return entry
            self.misses += 1
            return None

    def pin(self, keys: list[SegmentKey]) -> None:
        with self._lock:
            for k in keys:
                self._pins[k] = self._pins.get(k, 0) + 1

    def unpin(self, keys: list[SegmentKey]) -> None:
        with self._lock:
            for k in keys:
                left = self._pins.get(k, 0) - 1
                if left > 0:
                    self._pins[k] = left
                else:
                    self._pins.pop(k, None)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats({t: len(self._tiers[t]) for t in TIERS}, dict(self._bytes), dict(self.budgets),
                              self.hits, self.misses, self.evictions, self.promotions, self.demotions,
                              self.move_s)

    def check_integrity(self) -> bool:
        """Accounted bytes equal the sum of entries per tier, no key is in two tiers, budgets hold
        (a tier may exceed its budget only by pinned entries), and every entry owns exactly the
        memory it is accounted for (no view into a larger buffer that evicting it would not free)."""
        with self._lock:
            seen: set[SegmentKey] = set()
            for tier in TIERS:
                entries = self._tiers[tier]
                if sum(e.nbytes for e in entries.values()) != self._bytes[tier]:
                    return False
                if any(e.storage_bytes != e.nbytes for e in entries.values()):
                    return False
                if seen & entries.keys() or any(e.tier != tier or e.key != k for k, e in entries.items()):
                    return False
                seen |= entries.keys()
                budget = self.budgets[tier]
                unpinned = sum(e.nbytes for k, e in entries.items() if not self._pins.get(k))
                if budget is not None and self._bytes[tier] > budget and unpinned > 0:
                    return False
            return True
