"""Decode steps as CUDA graphs against eager steps, in serving, inside one warmed process: each
rate's block of the trace is replayed once per arm — eager, graphs with a memory pool per capture
(the default), graphs sharing one pool (``step_graph.SHARED_POOL``) — the first arm rotating from
rate to rate, so the machine, Triton's caches and the segment store are the same for all. The
A/B behind docs/benchmarks.md's "trace again with decode steps as CUDA graphs"; the 9B shape,
random weights, `hypic` mode. Each block is run once unmeasured before its arms, so every arm
finds the block's documents cached.

    python3 scripts/graph_ab.py [--rates 4,8,32] [--requests 48] [--warm 48] [--pool 256]
    python3 scripts/graph_ab.py --shape tiny --device cpu --rates 1,2 --requests 4 --warm 4 --pool 32
"""

from __future__ import annotations

import argparse

import torch
from tokenizers import Tokenizer

from hypic.bench.shapes import SHAPES
from hypic.bench.trace import QUANTILE, Probe, TraceLoad, make_trace, replay
from hypic.bench.trace_targets import EngineTarget
from hypic.engine.engine import Engine
from hypic.llm import bundled_model_path
from hypic.models import step_graph
from hypic.models.random_init import random_model

# eager steps; graphs, each capture in a pool of its own (the default); graphs sharing one pool
ARMS = ["off", "own pools", "shared pool"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="4,8,32")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--warm", type=int, default=48)
    ap.add_argument("--pool", type=int, default=256)
    ap.add_argument("--shape", default="qwen3.5-9b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (no graphs there)")
    args = ap.parse_args()
    rates = sorted(float(r) for r in args.rates.split(","))
    load = TraceLoad(requests=args.requests, warm=args.warm, pool=args.pool)
    trace = make_trace(load, rates)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    engine = Engine(random_model(SHAPES[args.shape], device=args.device, dtype=dtype))
    tokenizer = Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))
    target = EngineTarget(engine, trace, tokenizer, max_running=load.max_running, max_queue=load.requests + 1)
    target.begin("hypic")
    target.warm(list(range(load.warm)))
    target.note()
    print("| decode steps | rate (QPS) | TTFT p50 (ms) | p90 (ms) | prefill p50 (ms) | errors | decode |")
    print("|---|---|---|---|---|---|---|")
    try:
        for k, rate in enumerate(rates):
            block = list(range(load.warm + k * load.requests, load.warm + (k + 1) * load.requests))
            # The block's documents cached before any arm runs it: otherwise the first arm alone
            # prefills them cold (session 16's first A/B: its prefill p50 was 1.7x the others').
            target.warm(block)
            target.note()
            first = trace.requests[block[0]].arrival_s
            arrivals = [(trace.requests[i].arrival_s - first) / rate for i in block]
            for arm in ARMS[k % len(ARMS):] + ARMS[:k % len(ARMS)]:  # each rate starts with another arm
                graphs = arm != "off"
                engine.decode_graphs = graphs  # batches made from now on (a block starts with none)
                step_graph.SHARED_POOL = arm == "shared pool"
                step_graph._refused.discard(engine.model)  # one arm's failed capture must not turn off the next
                probe = Probe("hypic", rate)
                for res in replay(target, block, arrivals, load.max_tokens):
                    if isinstance(res, str):
                        probe.errors.append(res)
                    else:
                        probe.ttft.append(res.ttft_s)
                        probe.engine_ttft.append(res.prefill_s)
                prefill = Probe("hypic", rate, ttft=probe.engine_ttft)
                print(f"| {arm} | {rate:g} | {1e3 * probe.quantile(0.5):.1f} | "
                      f"{1e3 * probe.quantile(QUANTILE):.1f} | {1e3 * prefill.quantile(0.5):.1f} | "
                      f"{len(probe.errors)} | {target.note()} |", flush=True)
    finally:
        target.close()
        engine.close()


if __name__ == "__main__":
    main()
