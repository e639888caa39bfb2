"""Which requests of a ``hypic bench trace`` sweep find a document missing, computed from the trace
alone (no model): the warm-up's documents are cached, then each block's requests in order, a
document cached from its first request on. Exact for a store that never evicts (the 256-document
pool on a GPU); a bound otherwise. Requests in one prefill call that share a new document may
each count it in the engine; here only the first does.

    python scripts/trace_misses.py [--rates 32,48,64,96] [--requests 200] [--warm 48] [--pool 256]
"""

from __future__ import annotations

import argparse

from hypic.bench.trace import TraceLoad, make_trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="32,48,64,96")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--warm", type=int, default=48)
    ap.add_argument("--pool", type=int, default=256)
    args = ap.parse_args()
    rates = sorted(float(r) for r in args.rates.split(","))
    load = TraceLoad(requests=args.requests, warm=args.warm, pool=args.pool)
    requests = make_trace(load, rates).requests
    cached: set[int] = set()
    for r in requests[:load.warm]:
        cached.update(r.doc_ids)
    print(f"after the warm-up: {len(cached)} of {load.pool} documents cached")
    print("| block (rate) | requests with a miss | documents missed |")
    print("|---|---|---|")
    for k, rate in enumerate(rates):
        block = requests[load.warm + k * load.requests:load.warm + (k + 1) * load.requests]
        with_miss = missed = docs = 0
        for r in block:
            new = set(r.doc_ids) - cached
            with_miss, missed, docs = with_miss + bool(new), missed + len(new), docs + len(r.doc_ids)
            cached.update(new)
        print(f"| {k + 1} ({rate:g} QPS) | {with_miss} of {len(block)} | {missed} of {docs} "
              f"({100 * missed / docs:.1f}%) |")


if __name__ == "__main__":
    main()
