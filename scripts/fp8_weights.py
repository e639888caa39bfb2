"""Weights in bf16 against weights held in 8 bits (``quantization="fp8"``), side by side on one GPU:
weight memory, TTFT across the ladder and decode steps. (How far 8 bits move the outputs is not
read here: a random-weight network turns any small change into a different answer — 0.1% on its
input embeddings moved the 35B-A3B shape's logits by 72% — so scripts/fp8_layers.py measures each
layer alone, and the trained bundled model's quality runner the answers.)

    python scripts/fp8_weights.py --arms qwen3.5-35b-a3b:bf16,qwen3.5-35b-a3b:fp8,qwen3-next-80b-a3b:fp8

An arm ``shape:fp8-torch`` quantizes the activations with PyTorch's elementwise ops instead of the
Triton pass (HYPIC_FP8_TRITON=0), for an A/B in one run.

Each arm builds its random-weight model (hypic.models.random_init), measures, and frees it before
the next; the table prints last (and to --out). An arm whose weights do not fit is reported as such.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

from hypic.bench.shapes import SHAPES
from hypic.bench.ttft import RagShape, rag_prompts, run
from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams
from hypic.models.random_init import random_model


def decode_ms(engine: Engine, vocab: int, batch: int, steps: int = 128) -> float:
    """Median ms per decode step of ``batch`` sequences (short prompts, EOS ignored)."""
    prompts = rag_prompts(RagShape(docs=1, doc_tokens=256, head_tokens=64, query_tokens=16), vocab, batch, seed=3)
    params = [SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.0)] * batch
    engine.generate(prompts, params, mode="full")  # warm-up: graphs, kernels
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, mode="full")
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    ttft = statistics.median(o.metrics.ttft_s for o in outs)
    return 1000 * (total - ttft) / (steps - 1)


def measure(shape: str, quant: str | None, args: argparse.Namespace) -> dict:
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    try:
        loaded = random_model(SHAPES[shape], device=device, dtype=torch.bfloat16, quantization=quant)
    except torch.OutOfMemoryError:
        return {"arm": f"{shape}:{quant or 'bf16'}", "error": "weights do not fit"}
    row = {"arm": f"{shape}:{quant or 'bf16'}", "load_s": time.perf_counter() - t0,
           "weights_gib": sum(p.numel() * p.element_size() for p in loaded.model.parameters()) / 2**30,
           "allocated_gib": (torch.cuda.memory_allocated() - before) / 2**30}
    print(f"{row['arm']}: {row['weights_gib']:.1f} GiB of weights, built in {row['load_s']:.0f} s", file=sys.stderr)
    vocab = loaded.model.vocab_size
    engine = Engine(loaded, seam=8, cache_host_bytes=0)
    res = run(engine, RagShape(docs=args.docs, doc_tokens=args.doc_tokens), reps=args.reps)
    row.update({k: res[k] for k in ("full", "hypic_cold", "hypic_warm")})
    for b in (1, 16):
        row[f"decode_ms_b{b}"] = decode_ms(engine, vocab, b)
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(row), file=sys.stderr, flush=True)
    del engine, loaded
    gc.collect()
    torch.cuda.empty_cache()
    return row


def table(rows: list[dict]) -> str:
    lines = ["| arm | weights (GiB) | full (ms) | hypic cold (ms) | hypic warm (ms) "
             "| decode step b=1 / b=16 (ms) | peak (GiB) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['arm']} | {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['arm']} | {r['weights_gib']:.1f} | {1000 * r['full']:.1f} | "
                     f"{1000 * r['hypic_cold']:.1f} | {1000 * r['hypic_warm']:.1f} | "
                     f"{r['decode_ms_b1']:.2f} / {r['decode_ms_b16']:.2f} | {r['peak_gib']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="qwen3.5-35b-a3b:bf16,qwen3.5-35b-a3b:fp8-torch,qwen3.5-35b-a3b:fp8,"
                                     "qwen3-next-80b-a3b:fp8")
    p.add_argument("--docs", type=int, default=32)
    p.add_argument("--doc-tokens", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    rows = []
    for arm in args.arms.split(","):
        shape, _, quant = arm.partition(":")
        # fp8-torch: the activations quantized by PyTorch's elementwise ops, not the Triton pass (an A/B)
        os.environ["HYPIC_FP8_TRITON"] = "0" if quant == "fp8-torch" else "1"
        row = measure(shape, None if quant in ("", "bf16") else "fp8", args)
        row["arm"] = arm
        rows.append(row)
    text = table(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
