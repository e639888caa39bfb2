"""What a `full` prompt of a length not met before costs when attention takes cuDNN (from
``attention.CUDNN_MIN_TOKENS`` tokens on), against lengths met before and against cuDNN left out,
in one process: cuDNN builds an execution graph per shape.

    python3 scripts/cudnn_shapes.py [--model DIR] [--shape qwen3.5-9b]
"""

from __future__ import annotations

import argparse
import random

import torch

from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams
from hypic.ops import attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--shape", default="qwen3.5-9b")
    ap.add_argument("--prime", default="8192,8192", help="lengths run first, unmeasured (kernels, cuDNN's set-up)")
    args = ap.parse_args()
    from hypic.bench.shapes import SHAPES
    from hypic.models.loader import load_model
    from hypic.models.random_init import random_model

    loaded = (load_model(args.model, device="cuda", dtype=torch.bfloat16) if args.model
              else random_model(SHAPES[args.shape], device="cuda", dtype=torch.bfloat16))
    engine = Engine(loaded, seam=8)
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1)

    def ttft(n: int) -> float:
        prompt = [[rng.randrange(10, 1000) for _ in range(n)]]
        return 1e3 * engine.generate([prompt], [one], mode="full")[0].metrics.ttft_s

    for n in args.prime.split(","):  # kernels compiled, cuDNN set up
        ttft(int(n))
    base = attention.CUDNN_MIN_TOKENS
    print("| cuDNN | tokens | TTFT (ms) |\n|---|---|---|")
    for use in (True, False, True):
        attention.CUDNN_MIN_TOKENS = base if use else 1 << 40
        for n in (8192, 8192 + rng.randrange(1, 2000), 8192, 8192 + rng.randrange(2000, 4000), 9000):
            print(f"| {'on' if use else 'off'} | {n} | {ttft(n):.1f} |", flush=True)


if __name__ == "__main__":
    main()
