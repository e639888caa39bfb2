"""The first requests of a fresh process, with and without the warm-up (``hypic.engine.warm_up``).

Each arm runs in a process of its own with an empty Triton cache (``TRITON_CACHE_DIR``, a fresh
folder: a new machine or container), builds the engine, warms it up or not, then answers two rounds
of a RAG prompt, each round on documents never seen before: `full`, a cold `hypic` request, the same
documents warm in another order, `prefix` (the second of two requests sharing all but the query),
16 decoded tokens and an echo scoring. Round 1 is what a server's first users wait; round 2 the
steady state. Prints a table (ms; load and warm-up in s):

    python3 scripts/first_requests.py --shape qwen3.5-9b --device cuda [--arms off,on] [--docs 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROWS = ("full", "cold", "warm", "prefix", "decode_per_token", "scoring")


def child(args: argparse.Namespace) -> dict:
    import torch

    from hypic.bench.shapes import SHAPES
    from hypic.bench.ttft import RagShape, rag_prompts
    from hypic.engine.engine import Engine
    from hypic.engine.request import SamplingParams
    from hypic.engine.warm_up import warm_up
    from hypic.models.loader import load_model
    from hypic.models.random_init import random_model

    t0 = time.perf_counter()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    loaded = (load_model(args.model, device=args.device, dtype=dtype) if args.model
              else random_model(SHAPES[args.shape], device=args.device, dtype=dtype))
    engine = Engine(loaded, seam=8)
    out: dict = {"load_s": time.perf_counter() - t0, "warm_up_s": None}
    if args.warm_up == "on":
        out["warm_up_s"] = warm_up(engine).seconds
    shape = RagShape(args.docs, args.doc_tokens, args.head_tokens, 64)
    one = SamplingParams(max_tokens=1)

    def ttft(prompt, mode: str) -> float:
        return 1e3 * engine.generate([prompt], [one], mode=mode)[0].metrics.ttft_s

    def timed(fn) -> float:
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        t = time.perf_counter()
        fn()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        return 1e3 * (time.perf_counter() - t)

    def compiled() -> set[str]:  # the Triton kernels compiled so far: one metadata file each in the cache
        folder = os.environ.get("TRITON_CACHE_DIR")
        if not folder or not os.path.isdir(folder):
            return set()
        return {f"{d}/{f}" for d in os.listdir(folder) for f in os.listdir(os.path.join(folder, d))
                if f.endswith(".json") and not f.startswith("__grp__")}

    seen = compiled()
    out["compiled_before"] = len(seen)
    for r in (1, 2):
        p0, p1, p2 = rag_prompts(shape, engine.model.vocab_size, 3, seed=100 + r)  # new documents each round
        row = {"full": ttft(p0, "full"), "cold": ttft(p0, "hypic"), "warm": ttft(p1, "hypic")}
        ttft(p0, "prefix")
        row["prefix"] = ttft([*p0[:-1], p2[-1]], "prefix")  # all but the query kept
        many = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
        outs = []
        total = timed(lambda: outs.extend(engine.generate([p1], [many], mode="hypic")))  # noqa: B023
        row["decode_per_token"] = (total - 1e3 * outs[0].metrics.ttft_s) / 15
        row["scoring"] = timed(lambda: engine.prompts_logprobs([p0[:3]], 1))  # noqa: B023
        out[f"round{r}"] = row
        now = compiled()
        out[f"compiled_round{r}"] = sorted(k.split("/", 1)[1].removesuffix(".json") for k in now - seen)
        seen = now
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--shape", default="qwen3.5-9b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--head-tokens", type=int, default=512)
    ap.add_argument("--arms", default="off,on", help="warm-up off/on per process, in this order")
    ap.add_argument("--warm-up", choices=["on", "off"], help=argparse.SUPPRESS)  # a child's arm
    args = ap.parse_args()
    if args.warm_up is not None:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    results = []
    for arm in args.arms.split(","):
        with tempfile.TemporaryDirectory() as cache:
            cmd = [sys.executable, __file__, "--warm-up", arm, "--shape", args.shape, "--device", args.device,
                   "--docs", str(args.docs), "--doc-tokens", str(args.doc_tokens),
                   "--head-tokens", str(args.head_tokens), *(["--model", args.model] if args.model else [])]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env={**os.environ, "TRITON_CACHE_DIR": cache}, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"arm {arm} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
                continue
            res = json.loads(line[7:])
            res["arm"], res["process_s"] = arm, time.perf_counter() - t0
            results.append(res)
            print(f"arm {arm}: {json.dumps(res)}", flush=True)
    head = "| warm-up | load (s) | warm-up (s) | round | " + " | ".join(ROWS) + " |"
    lines = [head, "|" + "---|" * (4 + len(ROWS))]
    for res in results:
        for r in (1, 2):
            row = res[f"round{r}"]
            wu = "—" if res["warm_up_s"] is None else f"{res['warm_up_s']:.1f}"
            lines.append(f"| {res['arm']} | {res['load_s']:.1f} | {wu} | {r} | "
                         + " | ".join(f"{row[k]:.1f}" for k in ROWS) + " |")
    print("\n".join(lines))
    for res in results:
        print(f"warm-up {res['arm']}: {res['compiled_before']} Triton kernels compiled before round 1; in round 1 "
              f"{len(res['compiled_round1'])} more: {', '.join(res['compiled_round1'])}; in round 2 "
              f"{len(res['compiled_round2'])}: {', '.join(res['compiled_round2'])}")


if __name__ == "__main__":
    main()
