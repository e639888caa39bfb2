"""Host time of a warm call's combine pass, by method, on the CPU: 8 warm requests of 20 cached
256-token documents on a 32-layer tiny-width model (the 9B layer pattern), every method of the
combine context and the engine's planning wrapped in a timer, and the call's segment keys timed
alone. The methods' times include their torch ops (CPU compute at tiny width); the layout and key
rows are pure host work, as on a GPU host.

    python scripts/combine_host_time.py [--requests 8]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from hypic.bench.shapes import SHAPES
from hypic.bench.ttft import RagShape, rag_prompts
from hypic.cache.keys import segment_key
from hypic.engine.combine import CombineContext
from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams
from hypic.models.random_init import random_model

METHODS = ("__init__", "attend", "linear", "conv_tails", "save_conv", "_packed_keys", "_key_layout", "_bias")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()
    spent, calls = collections.Counter(), collections.Counter()

    def timed(owner, name: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[f"{owner.__name__}.{name}"] += time.perf_counter() - t
                calls[f"{owner.__name__}.{name}"] += 1
        setattr(owner, name, wrapper)

    for name in METHODS:
        if hasattr(CombineContext, name):  # an older checkout may name its layout step differently
            timed(CombineContext, name)
    timed(Engine, "_plan")
    loaded = random_model(dict(SHAPES["tiny"], num_hidden_layers=32), device="cpu", dtype=torch.float32)
    engine = Engine(loaded, seam=8)
    prompts = rag_prompts(RagShape(20, 256, 24, 16), loaded.model.vocab_size, 1 + args.requests)
    one = [SamplingParams(max_tokens=1)]
    engine.generate([prompts[0]], one, mode="hypic")  # every document cached
    engine.generate(prompts[1:], one * args.requests, mode="hypic")  # warm-up
    spent.clear()
    calls.clear()
    t = time.perf_counter()
    engine.generate(prompts[1:], one * args.requests, mode="hypic")
    total = time.perf_counter() - t
    segments = [s for p in prompts[1:] for s in p]
    t = time.perf_counter()
    for _ in range(10):
        for s in segments:
            segment_key(s, model_fingerprint=engine.fingerprint, seam=8, dtype="float32")
    keys = (time.perf_counter() - t) / 10
    print(f"call of {args.requests} warm requests: {1e3 * total:.1f} ms")
    print("| step | host ms (with its CPU ops) | calls |")
    print("|---|---|---|")
    for name, s in spent.most_common():
        print(f"| {name} | {1e3 * s:.2f} | {calls[name]} |")
    print(f"| segment_key × {len(segments)} (the call's keys, alone) | {1e3 * keys:.2f} | {len(segments)} |")


if __name__ == "__main__":
    main()
