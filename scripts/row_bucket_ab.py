"""EXPERIMENT (with the commit that pads rows; reverted in the next): padding a CUDA matmul's rows to
a multiple of 64 (``HYPIC_ROW_BUCKET``) against not, in one process, alternating call by call: the
cold prefill of fresh documents alone (``Engine.prewarm``, 9B shape, random bf16 weights), after an
unmeasured warm-up.

    python3 scripts/row_bucket_ab.py [--calls 40] [--docs 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_costs import timed  # noqa: E402

from hypic.bench.shapes import SHAPES  # noqa: E402
from hypic.bench.trace_targets import encode_trace  # noqa: E402
from hypic.engine.engine import Engine  # noqa: E402
from hypic.eval.trace import generate_trace  # noqa: E402
from hypic.llm import bundled_model_path  # noqa: E402
from hypic.models.layers.fused import BucketedLinear, FusedLinears  # noqa: E402
from hypic.models.random_init import random_model  # noqa: E402


def set_bucket(model: torch.nn.Module, bucket: int) -> None:
    for m in model.modules():
        if isinstance(m, BucketedLinear):
            m.bucket = bucket
        for v in vars(m).values():
            if isinstance(v, FusedLinears):
                v.bucket = bucket


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=40, help="measured calls per arm")
    ap.add_argument("--docs", type=int, default=1, help="documents per call")
    args = ap.parse_args()
    engine = Engine(random_model(SHAPES["qwen3.5-9b"], device="cuda", dtype=torch.bfloat16))
    tok = Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))
    trace = generate_trace(1, num_requests=400, pool_size=2048, rate_qps=1.0)
    docs = iter({tuple(s): s for p in encode_trace(trace, tok, engine.model.vocab_size) for s in p[1:-1]}.values())
    for k in (1, 2, 3, 4, 8) * 8:  # warm-up, both arms: kernels compiled
        set_bucket(engine.model, 64 * (k % 2))
        engine.prewarm([next(docs) for _ in range(k)])
    times: dict[int, list[float]] = {0: [], 64: []}
    for i in range(2 * args.calls):
        bucket = 64 * (i % 2)
        set_bucket(engine.model, bucket)
        batch = [next(docs) for _ in range(args.docs)]
        times[bucket].append(timed(lambda b=batch: engine.prewarm(b)))
    print(f"| HYPIC_ROW_BUCKET | calls of {args.docs} document(s) | median (ms) | mean | min | max |")
    print("|---|---|---|---|---|---|")
    for bucket, t in times.items():
        print(f"| {bucket} | {len(t)} | {statistics.median(t):.1f} | {statistics.mean(t):.1f} | {min(t):.1f} | "
              f"{max(t):.1f} |")


if __name__ == "__main__":
    main()
