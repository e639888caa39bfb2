"""Which requests of a ``hypic bench trace`` sweep find a document missing, computed from the trace
alone (no model): the warm-up's documents are cached, then each block's requests in order, a
document cached from its first request on. ``--capacity N``: the store holds N entries (device and
host tiers together; a 9B-shape entry is ≈ 105 MB), least recently used evicted first, as
``SegmentStore`` does. Exact for a store that never evicts (the 256-document pool on a GPU); an
estimate otherwise (pins and call batching shift a few). Requests in one prefill call that share a
new document may each count it in the engine; here only the first does.

    python scripts/trace_misses.py [--rates 32,48,64,96] [--requests 200] [--warm 48] [--pool 256]
                                   [--capacity N]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="32,48,64,96")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--warm", type=int, default=48)
    ap.add_argument("--pool", type=int, default=256)
    ap.add_argument("--capacity", type=int, help="entries the store holds (default: every one)")
    args = ap.parse_args()
    rates = sorted(float(r) for r in args.rates.split(","))
    load = TraceLoad(requests=args.requests, warm=args.warm, pool=args.pool)
    requests = make_trace(load, rates).requests
    store = Store(args.capacity)
    for r in requests[:load.warm]:
        store.touch(r.doc_ids)
    print(f"after the warm-up: {len(store.docs)} of {load.pool} documents cached")
    print("| block (rate) | requests with a miss | documents missed |")
    print("|---|---|---|")
    for k, rate in enumerate(rates):
        block = requests[load.warm + k * load.requests:load.warm + (k + 1) * load.requests]
        with_miss = missed = docs = 0
        for r in block:
            new = store.touch(r.doc_ids)
            with_miss, missed, docs = with_miss + bool(new), missed + len(new), docs + len(r.doc_ids)
        print(f"| {k + 1} ({rate:g} QPS) | {with_miss} of {len(block)} | {missed} of {docs} "
              f"({100 * missed / docs:.1f}%) |")


if __name__ == "__main__":
    main()
