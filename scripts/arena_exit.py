"""Exit a process while the host tier's pinning thread is inside CUDA's host allocation.

Session 24 saw a GPU process end with rc 134 ("terminate called without an active exception"): a
daemon thread left pinning a slab as the interpreter tore CUDA down. ``host_arena.close_all`` (at
exit) closes every arena and waits for its thread. This script makes the bad case on purpose: an
engine on the GPU with a large host tier, its pinning started, and the main thread returning while
the thread is mid-slab. Run it several times (``scripts/gpu_check.sh`` section GPU_ARENA_EXIT); every
run must exit 0. It prints whether the thread was alive when the main thread returned.

    python scripts/arena_exit.py [--slab-gib 2] [--delay-s 0.05] [--no-close]
"""

from __future__ import annotations

import argparse
import atexit
import threading
import time

from hypic import LLM
from hypic.cache import host_arena


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slab-gib", type=float, default=2.0, help="bytes pinned per slab (GiB)")
    ap.add_argument("--delay-s", type=float, default=0.05, help="how long the thread pins before the exit")
    ap.add_argument("--no-close", action="store_true",
                    help="the negative control: unregister host_arena.close_all, so nothing waits for the thread")
    args = ap.parse_args()
    if args.no_close:
        atexit.unregister(host_arena.close_all)
    llm = LLM(device="cuda", cache_device_bytes=2**30, cache_host_bytes=16 * 2**30)
    arena = llm.engine.store.arena
    if arena is None:
        raise SystemExit("no host arena: this needs a CUDA device and a host budget")
    arena.slab_bytes = int(args.slab_gib * 2**30) // host_arena.ALIGN * host_arena.ALIGN
    arena.pin_ahead()
    time.sleep(args.delay_s)
    alive = any(t.name == "hypic-host-arena" and t.is_alive() for t in threading.enumerate())
    print(f"pinning thread alive at exit: {alive}; pinned so far: {arena.pinned_bytes / 2**30:.1f} GiB", flush=True)


if __name__ == "__main__":
    main()
