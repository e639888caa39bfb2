"""Where a trace request's time goes on the GPU, per mode: prefill time of 1, 2, 4 and 8 trace
prompts in one call, and one decode step over 1 and 16 running requests (9B shape, random weights).
A diagnostic behind docs/benchmarks.md's trace section: `python3 scripts/trace_costs.py
[--decode-only]`; the decode step's busiest host and device operations are printed last."""

import sys
import time

import torch
from tokenizers import Tokenizer

from hypic.bench.shapes import SHAPES
from hypic.bench.trace_targets import encode_trace, reset_caches
from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams
from hypic.eval.trace import generate_trace
from hypic.llm import bundled_model_path
from hypic.models.random_init import random_model


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t)


def main() -> None:
    engine = Engine(random_model(SHAPES["qwen3.5-9b"], device="cuda", dtype=torch.bfloat16))
    tok = Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))
    trace = generate_trace(0, num_requests=120, pool_size=256, rate_qps=1.0)
    prompts = encode_trace(trace, tok, engine.model.vocab_size)
    one = SamplingParams(max_tokens=1)
    modes = () if "--decode-only" in sys.argv else ("full", "prefix", "hypic")
    print("| mode | prompts per call | tokens | prefill (ms) | per 1k tokens (ms) |")
    print("|---|---|---|---|---|")
    for mode in modes:
        reset_caches(engine)
        for i in range(0, 48, 8):  # warm-up: kernels, and the caches as the bench leaves them
            engine.generate(prompts[i:i + 8], [one] * 8, mode=mode)
        at = 48
        for n in (1, 1, 2, 4, 8):
            batch = prompts[at:at + n]
            at += n
            tokens = sum(len(s) for p in batch for s in p)
            ms = timed(lambda b=batch: engine.generate(b, [one] * len(b), mode=mode))
            print(f"| {mode} | {n} | {tokens} | {ms:.1f} | {1e3 * ms / tokens:.1f} |", flush=True)
    reset_caches(engine)
    for n in (1, 16):
        runs = engine.start(prompts[:n], [SamplingParams(max_tokens=64)] * n, mode="full")
        engine.step(runs)
        ms = min(timed(lambda r=runs: engine.step(r)) for _ in range(5))
        print(f"decode step, {n} running: {ms:.1f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.step(runs)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10))


if __name__ == "__main__":
    main()
