"""Where a warm hypic request, or one decode step, spends host work: aten ops per hypic source line
(hypic.bench.host_ops).

The model has the Qwen3.5-9B layer pattern (32 layers, every 4th full attention) at tiny width; the
prompt is the TTFT benchmark's (head, N documents, query) with every document cached, in a new order.
``--decode N`` counts one decode step of N running requests instead; ``--cold K`` the request with
its first K documents new (prefilled cold in the same forward, as under cache pressure).

``--requests R``: a call of R warm requests (the same documents, each prompt in its own order).

    python scripts/host_ops.py [--docs 32] [--top 25] [--decode N | --cold K | --requests R]
"""

from __future__ import annotations

import argparse

import torch

from hypic.bench.host_ops import count_ops
from hypic.bench.shapes import SHAPES
from hypic.bench.ttft import RagShape, rag_prompts
from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams
from hypic.models.random_init import random_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--doc-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--decode", type=int, default=0, help="count one decode step of this many requests")
    ap.add_argument("--cold", type=int, default=0, help="this many of the request's documents are new")
    ap.add_argument("--requests", type=int, default=1, help="warm requests in the call")
    args = ap.parse_args()
    layers = 32
    loaded = random_model(dict(SHAPES["tiny"], num_hidden_layers=layers), device="cpu", dtype=torch.float32)
    engine = Engine(loaded, seam=8)
    prompts = rag_prompts(RagShape(args.docs, args.doc_tokens, 64, 16), loaded.model.vocab_size, 1 + args.requests)
    one = [SamplingParams(max_tokens=1)]
    engine.generate([prompts[0]], one, mode="hypic")  # every document cached
    if args.decode:
        runs = engine.start([prompts[1]] * args.decode, [SamplingParams(max_tokens=8)] * args.decode, mode="hypic")
        engine.step(runs)  # the first step grows nothing new: count a later one
        with torch.no_grad():
            counter = count_ops(lambda: engine.step(runs))
        what = f"decode step, {args.decode} running"
    elif args.requests > 1:
        with torch.no_grad():
            counter = count_ops(lambda: engine.generate(prompts[1:], one * args.requests, mode="hypic"))
        what = f"call of {args.requests} warm requests of {args.docs} documents"
    else:
        fresh = [[(t + 1) % loaded.model.vocab_size for t in d] for d in prompts[1][1:1 + args.cold]]  # never seen
        prompt = [prompts[1][0], *fresh, *prompts[1][1 + args.cold:]]
        with torch.no_grad():
            counter = count_ops(lambda: engine.generate([prompt], one, mode="hypic"))
        what = f"request of {args.docs} documents, {args.cold} of them cold"
    total, gpu = sum(counter.sites.values()), counter.gpu_relevant()
    print(f"{what}: {total} aten ops, {sum(gpu.values())} outside CPU-only "
          f"kernels ({sum(gpu.values()) / layers:.0f} per layer)")
    print("\nby source line (CPU-only kernels left out):")
    for site, n in gpu.most_common(args.top):
        print(f"{n:6d}  {site}")


if __name__ == "__main__":
    main()
