"""Host time per move between the store's tiers, fp32 and bf16 host tiers, on the CPU: entries of
the 9B layer pattern (32 layers, every 4th attention) at the tiny shape's width, so the copies
themselves are negligible and what is left is the per-move Python and dispatch work. A store of 4
device and 36 host entries takes 2 000 random lookups (each host hit promotes one and demotes
another). The H200 host pays the same work per move (docs/benchmarks.md, session 20).

    python scripts/store_move_host_time.py [--lookups 2000]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from store_moves import clone  # a sibling script (run from scripts/): an entry copied under another key

from hypic.bench.shapes import SHAPES
from hypic.cache.host_arena import HostArena
from hypic.cache.store import SegmentStore
from hypic.engine.engine import Engine
from hypic.models.random_init import random_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lookups", type=int, default=2000)
    args = ap.parse_args()
    engine = Engine(random_model(dict(SHAPES["tiny"], num_hidden_layers=32), device="cpu", dtype=torch.float32),
                    seam=2)
    engine.prewarm([list(range(5, 205))])
    template = engine.store.entries()[0]
    print("| host tier | moves | host ms per move |")
    print("|---|---|---|")
    for dtype in (None, torch.bfloat16):
        arena = HostArena(None, slab_bytes=1 << 24, pin=False, background=False)
        store = SegmentStore(torch.device("cpu"), device_bytes=4 * template.nbytes, host_bytes=None, arena=arena,
                             host_dtype=dtype)
        arena.pin_all()
        entries = [clone(template, i) for i in range(40)]
        for e in entries:
            store.insert(e)
        rng, before = random.Random(0), store.stats()
        store.move_s = 0.0
        t0 = time.perf_counter()
        for _ in range(args.lookups):
            e = entries[rng.randrange(len(entries))]
            store.lookup(e.key, e.token_ids)
        wall = time.perf_counter() - t0
        s = store.stats()
        moves = s.promotions + s.demotions - before.promotions - before.demotions
        print(f"| {'float32' if dtype is None else 'bfloat16'} | {moves} | {1e3 * store.move_s / moves:.3f} "
              f"(lookups {1e3 * wall / args.lookups:.3f} ms each) |")


if __name__ == "__main__":
    main()
