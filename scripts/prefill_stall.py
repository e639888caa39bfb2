"""What a long cold prompt costs the requests already decoding, with and without prefilling its
documents ahead in slices (the serving loop's ``max_prefill_tokens``, ``Engine.prefill_ahead``).

Per arm, through the serving loop (``Scheduler``) on one engine (9B shape, random bf16 weights,
CUDA): ``--running`` requests decode (warm prompts, ``ignore_eos``); then one prompt of ``--docs``
fresh documents of ``--doc-tokens`` tokens arrives. Reported: the running requests' longest gap
between two tokens and their gaps' p50 and p99 while it was prefilled (from its arrival to its first
token), its TTFT, and its TTFT alone (nothing running) as the slicing's own cost. With
``--behind K``, K warm prompts (the running requests' documents, a new query) arrive just after it,
and their TTFT is reported too: what a cheap request queued behind a sliced one waits.

    python3 scripts/prefill_stall.py [--caps none,2048,4096,8192] [--running 16] [--docs 32]
        [--doc-tokens 512] [--behind 0] [--reps 3] [--shape qwen3.5-9b] [--device cuda]
"""

import argparse
import random
import time

import torch

from hypic.bench.shapes import SHAPES
from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams
from hypic.engine.scheduler import Scheduler
from hypic.models.random_init import random_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--caps", default="none,2048,4096,8192")
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--behind", type=int, default=0, help="warm prompts arriving just after the long one")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shape", default="qwen3.5-9b")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    caps = [None if c == "none" else int(c) for c in args.caps.split(",")]
    engine = Engine(random_model(SHAPES[args.shape], device=args.device,
                                 dtype=torch.bfloat16 if args.device == "cuda" else torch.float32))
    vocab, rng = engine.model.vocab_size, random.Random(0)

    def doc(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def long_prompt() -> list[list[int]]:  # new documents every time: cold
        return [doc(256), *(doc(args.doc_tokens) for _ in range(args.docs)), doc(32)]

    short = [[doc(256), doc(512), doc(32)] for _ in range(args.running)]
    decoding = SamplingParams(max_tokens=100_000, ignore_eos=True)
    one = SamplingParams(max_tokens=1)
    # warm-up, unmeasured: kernels for cold slices of every size, the combine pass and decode steps
    for cap in caps:
        sched = Scheduler(engine, max_running=args.running + 1 + args.behind, max_prefill_tokens=cap)
        list(sched.submit(long_prompt(), one).stream(timeout=600))
        subs = [sched.submit(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in short]
        for s in subs:
            list(s.stream(timeout=600))
        sched.shutdown()

    rows = []
    for rep in range(args.reps):
        for cap in caps:
            engine.store.clear()
            sched = Scheduler(engine, max_running=args.running + 1 + args.behind, max_prefill_tokens=cap)
            alone = sched.submit(long_prompt(), one)
            t0 = time.monotonic()
            ev = list(alone.stream(timeout=600))
            ttft_alone = ev[0].at - t0
            subs = [sched.submit(p, decoding) for p in short]
            for s in subs:
                next(s.stream(timeout=600))  # each one running
            time.sleep(0.3)  # a steady decode batch
            for s in subs:  # what they made so far
                while not s.events.empty():
                    s.events.get_nowait()
            with sched._cv:  # one burst: the long prompt, then the warm ones behind it
                arrival = time.monotonic()
                long = sched.submit(long_prompt(), one)
                behind = [sched.submit([*short[i % len(short)][:2], doc(32)], one) for i in range(args.behind)]
            ev = list(long.stream(timeout=600))
            first = ev[0].at
            waited = sorted(list(b.stream(timeout=600))[0].at - arrival for b in behind)
            time.sleep(0.1)
            gaps, last = [], {}
            for s in subs:
                s.cancel()
            for i, s in enumerate(subs):
                stamps = [e.at for e in s.stream(timeout=600) if e.kind == "token"]
                prev = None
                for at in stamps:
                    if prev is not None and arrival <= at and prev <= first:
                        gaps.append(at - prev)
                    prev = at
                last[i] = prev
            sched.shutdown()
            gaps.sort()
            rows.append((rep, cap, 1e3 * (first - arrival), 1e3 * ttft_alone, 1e3 * gaps[-1],
                         1e3 * gaps[len(gaps) // 2], 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], len(gaps),
                         1e3 * waited[len(waited) // 2] if waited else float("nan")))
            print(rows[-1], flush=True)
    tokens = 256 + args.docs * args.doc_tokens + 32
    print(f"\n{args.running} running; the new prompt: {args.docs} documents x {args.doc_tokens} tokens "
          f"({tokens} tokens, all cold); medians over {args.reps} repetitions\n")
    print("| max_prefill_tokens | its TTFT (ms) | its TTFT alone (ms) | running: longest gap (ms) | gap p50 (ms) "
          "| gap p99 (ms) | gaps | behind it: TTFT p50 (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for cap in caps:
        mine = [r for r in rows if r[1] == cap]

        def med(i: int, mine=mine) -> float:
            return sorted(r[i] for r in mine)[len(mine) // 2]
        print(f"| {cap or 'none'} | {med(2):.0f} | {med(3):.0f} | {med(4):.0f} | {med(5):.1f} | {med(6):.1f} "
              f"| {med(7):.0f} | {med(8):.0f} |")


if __name__ == "__main__":
    main()
