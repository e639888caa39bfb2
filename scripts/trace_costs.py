"""Where a trace request's time goes on the GPU, per mode: prefill time of 1, 2, 4 and 8 trace
prompts in one call, and one decode step over 1 and 16 running requests (9B shape, random weights).
A diagnostic behind docs/benchmarks.md's trace section: `python3 scripts/trace_costs.py
[--decode-only [--legacy-draw] | --pressure]`; the decode step's busiest host and device operations are printed last.
`--pressure`: instead, `hypic` calls on a 2 048-document pool with a 60 GiB store (a quarter of the
segments miss), the cold prefill of 1–16 documents alone, and a profile of one call.
`--cold-alone`: the cold prefill of fresh documents alone (``Engine.prewarm``, nothing evicted), timed
several times per size, then one profiled by Python function (cProfile) and by aten op.
`--warm-profile`: calls of trace prompts whose documents are all cached (the regime that bounds
`hypic`'s rate), timed per call size through the combine pass's general path, with its GDN layers
in one kernel (``HYPIC_FUSED_COMBINE``), with attention by runs too (``HYPIC_COMBINE_FLASH``), and
with the fused kernel's dots in bf16x3 (``HYPIC_COMBINE_PRECISION``), then a call of 8 profiled (the
defaults) by phase and by kernel."""

import os
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

import hypic.engine.engine as engine_module
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


def label(owner, name: str) -> None:
    """Wrap ``owner.name`` in a profiler range, so the profile splits a call by phase."""
    fn = getattr(owner, name)

    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(f"hypic::{getattr(owner, '__name__', type(owner).__name__)}.{name}"):
            return fn(*args, **kwargs)
    setattr(owner, name, wrapped)


def pressure(engine: Engine, tok: Tokenizer) -> None:
    from hypic.engine.cold import ColdContext
    from hypic.engine.combine import CombineContext
    for owner, names in ((engine, ("_plan", "_scatter", "_cold_context")), (engine.store, ("insert", "lookup")),
                         (ColdContext, ("linear", "attend", "save_conv", "__init__")),
                         (CombineContext, ("linear", "attend", "save_conv", "__init__"))):
        for name in names:
            label(owner, name)
    trace = generate_trace(0, num_requests=120, pool_size=2048, rate_qps=1.0)
    prompts = encode_trace(trace, tok, engine.model.vocab_size)
    one = SamplingParams(max_tokens=1)
    for i in range(0, 48, 8):
        engine.generate(prompts[i:i + 8], [one] * 8, mode="hypic")
    print("| prompts per call | tokens | cold segments / all | prefill (ms) |")
    print("|---|---|---|---|")
    at = 48
    for n in (1, 1, 2, 2, 4, 8):
        batch = prompts[at:at + n]
        at += n
        out: list = []
        ms = timed(lambda b=batch: out.extend(engine.generate(b, [one] * len(b), mode="hypic")))
        misses = sum(o.metrics.segment_misses for o in out)
        total = misses + sum(o.metrics.segment_hits for o in out)
        print(f"| {n} | {sum(len(s) for p in batch for s in p)} | {misses} / {total} | {ms:.1f} |", flush=True)
    docs = [s for p in prompts[100:] for s in p[1:-1]]
    for k in (1, 1, 4, 16):
        batch, docs = docs[:k], docs[k:]
        ms = timed(lambda b=batch: engine.prewarm(b))
        print(f"cold prefill alone, {k} documents, {sum(map(len, batch))} tokens: {ms:.1f} ms", flush=True)
    batch = prompts[at:at + 2]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.generate(batch, [one] * 2, mode="hypic")
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))


def cold_alone(engine: Engine, tok: Tokenizer) -> None:
    import cProfile
    import pstats
    trace = generate_trace(1, num_requests=200, pool_size=2048, rate_qps=1.0)
    docs = iter({tuple(s): s for p in encode_trace(trace, tok, engine.model.vocab_size) for s in p[1:-1]}.values())
    # warm-up, unmeasured: compiles the kernels and, with cold graphs (HYPIC_COLD_GRAPHS=1), captures
    # the shapes (slots × padded length) that the measured calls replay
    for k in (1, 2, 3, 4, 8) * 8:
        engine.prewarm([next(docs) for _ in range(k)])
    for k in (1, 1, 1, 1, 4, 4, 16, 16):
        batch = [next(docs) for _ in range(k)]
        ms = timed(lambda b=batch: engine.prewarm(b))
        print(f"cold prefill alone, {k} documents, {sum(map(len, batch))} tokens: {ms:.1f} ms", flush=True)
    for mode, runner in engine._graphs.items():
        print(f"cold graphs ({mode}): {runner.counts}, {len(runner.shapes)} shapes, "
              f"{sum(s.graph is not None for s in runner.shapes.values())} captured, refused {runner.refused}")
    batch = [next(docs) for _ in range(4)]
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    engine.prewarm(batch)
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof).sort_stats("cumtime").print_stats(40)
    batch = [next(docs) for _ in range(4)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as tprof:
        engine.prewarm(batch)
        torch.cuda.synchronize()
    print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def warm_profile(engine: Engine, tok: Tokenizer) -> None:
    from hypic.engine.combine import CombineContext
    for owner, names in ((engine, ("_plan", "_scatter")), (engine.store, ("lookup",)),
                         (CombineContext, ("linear", "attend", "save_conv", "conv_tails", "__init__"))):
        for name in names:
            label(owner, name)
    trace = generate_trace(0, num_requests=120, pool_size=256, rate_qps=1.0)
    prompts = encode_trace(trace, tok, engine.model.vocab_size)
    one = SamplingParams(max_tokens=1)
    for i in range(0, 48, 8):  # warm-up: kernels
        engine.generate(prompts[i:i + 8], [one] * 8, mode="hypic")
    docs = [s for p in prompts[48:96] for s in p[1:-1]]
    for i in range(0, len(docs), 16):  # every measured document cached
        engine.prewarm(docs[i:i + 16])
    # in-process A/B of the combine pass's GPU paths, read at each call: neither, the GDN layers in one
    # kernel (HYPIC_FUSED_COMBINE), and that plus attention by runs (HYPIC_COMBINE_FLASH)
    arms = {"general": ("0", "0", "tf32x3"), "fused": ("1", "0", "tf32x3"), "fused + flash (defaults)": ("1", "1", "tf32x3"),
            "+ bf16x3 dots": ("1", "1", "bf16x3")}
    print(f"| warm prompts per call | tokens | prefill (ms): {' / '.join(arms)} | per 1k tokens (ms) | first tokens as general's first call (each arm's two calls) |")
    print("|---|---|---|---|---|")
    at = 48
    for n in (1, 1, 2, 4, 8, 8, 16):
        batch = prompts[at:at + n]
        at += n
        tokens = sum(len(s) for p in batch for s in p)
        ms, firsts = {}, {}
        for arm in [*arms, *arms]:  # the better of two calls each
            os.environ["HYPIC_FUSED_COMBINE"], os.environ["HYPIC_COMBINE_FLASH"], os.environ["HYPIC_COMBINE_PRECISION"] = \
                arms[arm]
            out: list = []
            t = timed(lambda b=batch, o=out: o.extend(engine.generate(b, [one] * len(b), mode="hypic")))
            ms[arm] = min(ms.get(arm, t), t)
            firsts.setdefault(arm, []).append([o.token_ids[0] for o in out])
        # first tokens agreeing with the general path's first call, per arm and call (a random-weight
        # model's top logits are near ties, so bf16 reassociation can flip a few; the general path's
        # own second call shows the floor)
        ref = firsts["general"][0]
        same = " ".join(f"{sum(x == y for x, y in zip(f, ref, strict=True))}/{len(ref)}" for a in arms for f in firsts[a])
        print(f"| {n} | {tokens} | {' / '.join(f'{ms[a]:.1f}' for a in arms)} | "
              f"{' / '.join(f'{1e3 * ms[a] / tokens:.1f}' for a in arms)} | {same} |", flush=True)
    for name in ("HYPIC_FUSED_COMBINE", "HYPIC_COMBINE_FLASH", "HYPIC_COMBINE_PRECISION"):
        os.environ.pop(name)  # the defaults
    batch = prompts[at:at + 8]
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.generate(batch, [one] * 8, mode="hypic")
        torch.cuda.synchronize()
    print(f"profiled call of 8 (defaults): {1e3 * (time.perf_counter() - t0):.1f} ms wall (profiler on)")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))


def main() -> None:
    if "--warm-profile" in sys.argv:
        engine = Engine(random_model(SHAPES["qwen3.5-9b"], device="cuda", dtype=torch.bfloat16))
        warm_profile(engine, Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json")))
        return
    if "--cold-alone" in sys.argv:
        engine = Engine(random_model(SHAPES["qwen3.5-9b"], device="cuda", dtype=torch.bfloat16))
        cold_alone(engine, Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json")))
        return
    if "--pressure" in sys.argv:
        engine = Engine(random_model(SHAPES["qwen3.5-9b"], device="cuda", dtype=torch.bfloat16),
                        cache_device_bytes=60 << 30)
        pressure(engine, Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json")))
        return
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
    sampled = SamplingParams(max_tokens=64, temperature=1.0, top_p=0.95, seed=0)  # a draw per row, each step
    # what an OpenAI client often adds: penalties and log-probabilities (and vLLM's repetition penalty)
    featured = SamplingParams(max_tokens=64, temperature=1.0, top_p=0.95, seed=0, presence_penalty=0.5,
                              frequency_penalty=0.5, repetition_penalty=1.1, logprobs=5)
    arms = [("greedy", SamplingParams(max_tokens=64), None), ("T=1 top_p=0.95", sampled, None),
            ("T=1 top_p=0.95 + penalties + logprobs 5", featured, None)]
    if "--legacy-draw" in sys.argv:
        arms.append(("T=1 top_p=0.95, the per-row host draw before", sampled, _legacy_draw))
    for n in (1, 16, 64):
        for label, sp, draw in arms:
            real = engine_module.sample
            engine_module.sample = draw or real
            try:
                runs = engine.start(prompts[:n], [sp] * n, mode="full")
                engine.step(runs)
                ms = min(timed(lambda r=runs: engine.step(r)) for _ in range(5))
            finally:
                engine_module.sample = real
            print(f"decode step, {n} running, {label}: {ms:.1f} ms", flush=True)
            if n < 64 or draw is not None:
                engine.forget(runs)
    runs = engine.start(prompts[:64], [sampled] * 64, mode="full")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.step(runs)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10))


def _legacy_draw(logits, params, generators, *rest):
    """The draw sample() made before (scripts/sampling_cost.py): each row on the host; no logprobs."""
    sys.path.insert(0, str(Path(__file__).parent))
    from sampling_cost import legacy_sample

    return legacy_sample(logits, params, generators), [None] * len(params)


if __name__ == "__main__":
    main()
