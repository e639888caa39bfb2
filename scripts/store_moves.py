"""What moving an entry between the store's tiers costs on the GPU, against recomputing it.
A diagnostic behind docs/benchmarks.md's cache-pressure section (9B shape, random weights):
`python3 scripts/store_moves.py [cpu tiny]` (a device and a shape: a smoke run on the CPU). Prints, per operation, the host time to issue it and the time
until the device has finished it, then a store under churn (small budgets, Zipf lookups), then
the store saved to a folder and loaded back (a restart with ``--cache-dir``)."""

import random
import sys
import threading
import time

import torch

from hypic.bench.shapes import SHAPES
from hypic.cache.entry import Entry
from hypic.cache.host_arena import HostArena
from hypic.cache.keys import SegmentKey
from hypic.cache.store import SegmentStore
from hypic.engine.engine import Engine
from hypic.models.random_init import random_model
from hypic.ops.recurrence import Summary


def clone(entry: Entry, n: int) -> Entry:
    c = lambda t: None if t is None else t.clone()  # noqa: E731
    return Entry(SegmentKey(n.to_bytes(20, "little"), entry.length), entry.token_ids, entry.seam,
                 {i: Summary(c(s.transition), c(s.state)) for i, s in entry.summaries.items()},
                 {i: c(t) for i, t in entry.conv_tails.items()}, {i: c(t) for i, t in entry.keys.items()},
                 {i: c(t) for i, t in entry.values.items()})


DEVICE, SHAPE = (sys.argv[1:] + ["cuda", "qwen3.5-9b"][len(sys.argv) - 1:])[:2]


def sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn) -> tuple[float, float, object]:
    """(host ms to issue, ms until the device is done, result)."""
    sync()
    t = time.perf_counter()
    out = fn()
    issued = time.perf_counter()
    sync()
    return 1e3 * (issued - t), 1e3 * (time.perf_counter() - t), out


def main() -> None:
    engine = Engine(random_model(SHAPES[SHAPE], device=DEVICE, dtype=torch.bfloat16),
                    cache_device_bytes=None, cache_host_bytes=None)
    rng = random.Random(0)
    docs = [[rng.randrange(1, engine.model.vocab_size) for _ in range(288)] for _ in range(6)]
    for d in docs[:3]:
        engine.prewarm([d])
    recompute = [timed(lambda d=d: engine.prewarm([d]))[1] for d in docs[3:]]
    (entry,) = [e for e in engine.store._tiers["device"].values()][:1]
    if DEVICE.startswith("cuda"):  # first: see contended()
        for pinning in (False, True, False):
            contended(entry, pinning)
    print(f"entry: {entry.nbytes / 2**20:.1f} MiB in {len(entry._tensors())} tensors, {entry.length} tokens")
    print("| operation | host issue (ms) | until done (ms) |")
    print("|---|---|---|")
    print(f"| recompute a 288-token document (prewarm, cold) | – | {min(recompute):.1f} |")
    copies = [clone(entry, i) for i in range(8)]
    host = []
    for i, e in enumerate(copies[:4]):
        issue, done, h = timed(lambda e=e: e.to("cpu", "host"))
        host.append(h)
        print(f"| demote #{i} (fresh host memory) | {issue:.1f} | {done:.1f} |")
    print(f"pinned: {all(t.is_pinned() for t in host[0]._tensors())}")
    host.clear()  # their pinned blocks return to the caching host allocator
    for i, e in enumerate(copies[4:]):
        issue, done, h = timed(lambda e=e: e.to("cpu", "host"))
        host.append(h)
        print(f"| demote #{i + 4} (host memory freed before) | {issue:.1f} | {done:.1f} |")
    for i, h in enumerate(host):
        issue, done, _ = timed(lambda h=h: h.to(DEVICE, "device"))
        print(f"| promote #{i} | {issue:.1f} | {done:.1f} |")
    if DEVICE.startswith("cuda"):
        for i in range(2):
            print(f"| pin 1 GiB of host memory #{i} | {timed(lambda: torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True))[0]:.0f} | – |")
    # A store under churn: 16 entries fit the device, 32 the host; Zipf lookups over 96 keys; once
    # with the host tier in per-tensor copies (as before the arena), once in the pinned arena.
    for arena in (None, "auto"):
        churn(entry, arena, rng)
    persisted(entry)


def persisted(entry: Entry) -> None:
    """8 entries saved to a folder (``hypic.cache.persist``: a restart's warm cache) and loaded into
    an empty store on the device: time per entry and throughput."""
    import tempfile

    from hypic.cache.persist import Stamp, load, save

    store = SegmentStore(torch.device(DEVICE), device_bytes=None, host_bytes=None)
    for i in range(8):
        store.insert(clone(entry, 900 + i))
    stamp = Stamp("m", "bfloat16", [0.0])
    with tempfile.TemporaryDirectory() as folder:
        _, saved, _ = timed(lambda: save(store, folder, stamp))
        other = SegmentStore(torch.device(DEVICE), device_bytes=None, host_bytes=None)
        _, loaded, n = timed(lambda: load(other, folder, stamp))
    mib = 8 * entry.nbytes / 2**20
    print(f"persist: save 8 entries ({mib:.0f} MiB) {saved:.0f} ms ({mib / saved * 1e3:.0f} MiB/s), "
          f"load {n} {loaded:.0f} ms ({mib / loaded * 1e3:.0f} MiB/s), integrity {other.check_integrity()}")


def contended(entry: Entry, pinning: bool) -> None:
    """40 promotions + demotions through a pinned arena, each waited for, while another thread pins
    6 × 256 MiB of fresh host memory (the arena's growth without its gate) or not. Run before
    anything else pins: freed pinned blocks are cached and would make the other thread's pins free."""
    arena = HostArena(None, background=False)
    arena.grow()
    store = SegmentStore(torch.device(DEVICE), device_bytes=entry.nbytes, host_bytes=None, arena=arena)
    copies = [clone(entry, 500 + i) for i in range(2)]
    for e in copies:
        store.insert(e)  # the second demotes the first
    held: list[torch.Tensor] = []
    pin_ms: list[float] = []

    def pin() -> None:
        for _ in range(6):
            t0 = time.perf_counter()
            held.append(torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True))
            pin_ms.append(1e3 * (time.perf_counter() - t0))

    thread = threading.Thread(target=pin)
    if pinning:
        thread.start()
    each = []
    for i in range(40):  # each lookup promotes one and demotes the other
        each.append(timed(lambda i=i: store.lookup(copies[i % 2].key, entry.token_ids))[1])
    if pinning:
        thread.join()
    print(f"40 promotions + demotions {'while another thread pins' if pinning else 'alone'}: {sum(each):.0f} ms, "
          f"max {max(each):.1f} ms each; pins (ms): {' '.join(f'{t:.0f}' for t in pin_ms) or '–'}")


def churn(entry: Entry, arena, rng: random.Random) -> None:
    size = entry.nbytes
    store = SegmentStore(torch.device(DEVICE), device_bytes=16 * size, host_bytes=32 * size, arena=arena)
    if store.arena is not None:
        store.arena.background = False
        while store.arena.grow():  # all of it pinned before the clock starts
            pass
    pool = [clone(entry, 100 + i) for i in range(96)]
    for e in pool:
        store.insert(e)
    del pool
    weights = [1 / (k + 1) for k in range(96)]
    keys = [SegmentKey((100 + i).to_bytes(20, "little"), entry.length) for i in range(96)]
    picks = rng.choices(range(96), weights, k=300)
    before = store.stats()
    t = time.perf_counter()
    found = sum(store.lookup(keys[i], entry.token_ids) is not None for i in picks)
    sync()
    total = time.perf_counter() - t
    s = store.stats()
    print(f"churn ({'arena' if store.arena else 'per-tensor copies'}): 300 lookups, {found} found, {1e3 * total:.0f} ms in all, move host time "
          f"{1e3 * (s.move_s - before.move_s):.0f} ms, promoted {s.promotions - before.promotions}, "
          f"demoted {s.demotions - before.demotions}, evicted {s.evictions - before.evictions}, "
          f"integrity {store.check_integrity()}")


if __name__ == "__main__":
    main()
