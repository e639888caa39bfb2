"""Which requests of a ``hypic bench trace`` sweep find a document missing, computed from the trace
alone (no model): the warm-up's documents are cached, then each block's requests in order, a
document cached from its first request on. ``--capacity N``: the store holds N entries (device and
host tiers together; a 9B-shape entry is ≈ 105 MB), least recently used evicted first, as
``SegmentStore`` does. Exact for a store that never evicts (the 256-document pool on a GPU); an
estimate otherwise (pins and call batching shift a few). Requests in one prefill call that share a
new document may each count it in the engine; here only the first does.

    python scripts/trace_misses.py [--rates 32,48,64,96] [--requests 200] [--warm 48] [--pool 256]
                                   [--capacity N | --device-entries D --host-entries H [--promote-after K]]
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

from hypic.bench.trace import TraceLoad, make_trace


class Store:
    """Which documents are cached: least recently used out first past ``capacity`` (None: never)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity, self.docs = capacity, OrderedDict()

    def touch(self, doc_ids: tuple[int, ...]) -> set[int]:
        """Look a request's documents up and cache them; the ones that missed."""
        missed = {d for d in doc_ids if d not in self.docs}
        for d in doc_ids:
            self.docs[d] = True
            self.docs.move_to_end(d)
        while self.capacity is not None and len(self.docs) > self.capacity:
            self.docs.popitem(last=False)
        return missed


class Tiers:
    """Two LRU tiers as ``SegmentStore`` keeps them (``--device-entries`` + ``--host-entries``): a miss
    goes to the device, the device's LRU down to the host, the host's LRU out; a host hit is copied up
    every time and promoted on the ``promote_after``-th hit since its demotion (before: served in place)."""

    def __init__(self, device: int, host: int, promote_after: int) -> None:
        self.device, self.host, self.promote_after = device, host, promote_after
        self.dev: OrderedDict[int, bool] = OrderedDict()
        self.hst: OrderedDict[int, int] = OrderedDict()  # document → host hits since its demotion
        self.counts = dict(copies_up=0, promotions=0, demotions=0, evictions=0)

    @property
    def docs(self) -> list[int]:
        return [*self.dev, *self.hst]

    def _to_device(self, d: int) -> None:
        self.dev[d] = True
        while len(self.dev) > self.device:
            x, _ = self.dev.popitem(last=False)
            self.hst[x] = 0
            self.counts["demotions"] += 1
            while len(self.hst) > self.host:
                self.hst.popitem(last=False)
                self.counts["evictions"] += 1

    def touch(self, doc_ids: tuple[int, ...]) -> set[int]:
        missed = set()
        for d in doc_ids:
            if d in self.dev:
                self.dev.move_to_end(d)
            elif d in self.hst:
                self.counts["copies_up"] += 1
                self.hst[d] += 1
                self.hst.move_to_end(d)
                if self.hst[d] >= self.promote_after:
                    del self.hst[d]
                    self.counts["promotions"] += 1
                    self._to_device(d)
            else:
                missed.add(d)
                self._to_device(d)
        return missed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="32,48,64,96")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--warm", type=int, default=48)
    ap.add_argument("--pool", type=int, default=256)
    ap.add_argument("--capacity", type=int, help="entries the store holds (default: every one)")
    ap.add_argument("--device-entries", type=int, help="model the two tiers instead: entries on the device …")
    ap.add_argument("--host-entries", type=int, default=0, help="… and in the host tier")
    ap.add_argument("--promote-after", type=int, default=1, help="the host hit since its demotion that promotes")
    args = ap.parse_args()
    rates = sorted(float(r) for r in args.rates.split(","))
    load = TraceLoad(requests=args.requests, warm=args.warm, pool=args.pool)
    requests = make_trace(load, rates).requests
    store = (Tiers(args.device_entries, args.host_entries, args.promote_after) if args.device_entries
             else Store(args.capacity))
    for r in requests[:load.warm]:
        store.touch(r.doc_ids)
    print(f"after the warm-up: {len(store.docs)} of {load.pool} documents cached")
    if isinstance(store, Tiers):
        store.counts = dict.fromkeys(store.counts, 0)  # the blocks' moves, not the warm-up's
        print("| block (rate) | requests with a miss | documents missed | copies up / promotions / demotions / "
              "evictions |")
        print("|---|---|---|---|")
    else:
        print("| block (rate) | requests with a miss | documents missed |")
        print("|---|---|---|")
    for k, rate in enumerate(rates):
        block = requests[load.warm + k * load.requests:load.warm + (k + 1) * load.requests]
        with_miss = missed = docs = 0
        for r in block:
            new = store.touch(r.doc_ids)
            with_miss, missed, docs = with_miss + bool(new), missed + len(new), docs + len(r.doc_ids)
        moves = ""
        if isinstance(store, Tiers):
            moves = " | " + " / ".join(str(store.counts[c]) for c in store.counts)
            store.counts = dict.fromkeys(store.counts, 0)
        print(f"| {k + 1} ({rate:g} QPS) | {with_miss} of {len(block)} | {missed} of {docs} "
              f"({100 * missed / docs:.1f}%){moves} |")


if __name__ == "__main__":
    main()
