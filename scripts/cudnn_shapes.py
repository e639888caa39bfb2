"""What `full` prompts of lengths a process has not met cost when attention takes cuDNN (from
``attention.CUDNN_MIN_TOKENS`` tokens on: an execution graph per shape), against lengths met before,
against flash attention, and against cuDNN on bucketed lengths (``attention.LONG_BUCKETS``).

Each arm is a process of its own (cuDNN's graph cache is per process; the Triton cache is shared,
so only the first arm compiles kernels, in its unmeasured priming prompt). Per arm: one priming
prompt of ``CUDNN_MIN_TOKENS`` tokens (what the warm-up sends), then in each length range
``--new`` prompts of new random lengths, each followed by a prompt of the same length again (met)
and by one of another new length in the same bucket of 8 per octave (near: a new shape for cuDNN on
exact lengths, a met one on bucketed lengths).
Prints a table of mean TTFT (ms) per range:

    python3 scripts/cudnn_shapes.py [--model DIR | --shape qwen3.5-9b] [--arms flash,exact,buckets]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

ARMS = {  # environment of each arm's process
    "flash": {"HYPIC_CUDNN_MIN_TOKENS": str(1 << 40)},
    "exact": {"HYPIC_CUDNN_BUCKETS": "0"},
    "buckets": {"HYPIC_CUDNN_BUCKETS": "8"},
}


def child(args: argparse.Namespace) -> dict:
    import torch

    from hypic.bench.shapes import SHAPES
    from hypic.engine.engine import Engine
    from hypic.engine.request import SamplingParams
    from hypic.models.loader import load_model
    from hypic.models.random_init import random_model
    from hypic.ops import attention

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    loaded = (load_model(args.model, device=args.device, dtype=dtype) if args.model
              else random_model(SHAPES[args.shape], device=args.device, dtype=dtype))
    engine = Engine(loaded, seam=8)
    rng = random.Random(args.seed)
    one = SamplingParams(max_tokens=1)

    def ttft(n: int) -> float:
        prompt = [[rng.randrange(10, 1000) for _ in range(n)]]
        return 1e3 * engine.generate([prompt], [one], mode="full")[0].metrics.ttft_s

    prime = ttft(args.prime)
    out: dict = {"prime_ms": prime, "buckets": attention.LONG_BUCKETS, "min_tokens": attention.CUDNN_MIN_TOKENS,
                 "ranges": {}}
    for span in args.ranges.split(","):
        lo, hi = (int(x) for x in span.split("-"))
        new, met, near = [], [], []
        for _ in range(args.new):
            n = rng.randrange(lo, hi)
            bucket = attention.long_length(n, 8)
            step = (1 << (n.bit_length() - 1)) // 8
            m = rng.choice([x for x in range(bucket - step + 1, bucket + 1) if x != n])
            assert attention.long_length(m, 8) == bucket
            new.append(ttft(n))
            met.append(ttft(n))
            near.append(ttft(m))
        out["ranges"][span] = {"new": new, "met": met, "near": near}
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--shape", default="qwen3.5-9b")
    ap.add_argument("--arms", default="flash,exact,buckets")
    ap.add_argument("--ranges", default="8193-16384,16385-32768,32769-65536")
    ap.add_argument("--new", type=int, default=3, help="new lengths per range")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prime", type=int, default=8192, help="tokens of the first, unmeasured prompt")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    rows = {}
    for arm in args.arms.split(","):
        cmd = [sys.executable, __file__, "--child", "--shape", args.shape, "--ranges", args.ranges,
               "--new", str(args.new), "--seed", str(args.seed),
               "--device", args.device, "--prime", str(args.prime)] + (["--model", args.model] if args.model else [])
        env = {**os.environ, **ARMS[arm]}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        if done.returncode or not lines:
            print(f"{arm}: failed (rc {done.returncode})\n{done.stderr[-3000:]}", flush=True)
            continue
        rows[arm] = json.loads(lines[-1][len("RESULT "):])
        print(f"{arm}: {json.dumps(rows[arm])}", flush=True)
    ranges = args.ranges.split(",")

    def mean(xs: list[float]) -> str:
        return f"{sum(xs) / len(xs):.1f}"

    cols = ("new", "met", "near")
    print("\n| arm | prime (ms) | " + " | ".join(f"{r} {c}" for r in ranges for c in cols) + " |")
    print("|---|---|" + "---|" * len(ranges) * len(cols))
    for arm, r in rows.items():
        cells = " | ".join(mean(r["ranges"][s][c]) for s in ranges for c in cols)
        print(f"| {arm} | {r['prime_ms']:.1f} | {cells} |")


if __name__ == "__main__":
    main()
