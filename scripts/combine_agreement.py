"""Do the combine pass's GPU paths give the general path's logits? Fully cached trace prompts on the
9B shape (random weights), first-token logits through the general path, the fused GDN combine
(``HYPIC_FUSED_COMBINE``), that plus attention by runs (``HYPIC_COMBINE_FLASH``), and that with the
bodies' dots in bf16x3 (``HYPIC_COMBINE_PRECISION``), in fp32 and in bf16. In fp32 the paths must agree to rounding: a gap there is a bug. In bf16 each path rounds
differently, and a random model's top logits are near ties, so some argmaxes flip: the bf16 gap
between paths should be of the size of bf16 rounding itself, which the fp32 vs bf16 gap of the
general path shows.

    python3 scripts/combine_agreement.py [--prompts 8]
"""

from __future__ import annotations

import argparse
import os

import torch
from tokenizers import Tokenizer

from hypic.bench.shapes import SHAPES
from hypic.bench.trace_targets import encode_trace
from hypic.engine.engine import Engine
from hypic.eval.trace import generate_trace
from hypic.llm import bundled_model_path
from hypic.models.random_init import random_model

ARMS = {"general": ("0", "0", "tf32x3"), "fused": ("1", "0", "tf32x3"), "fused + flash": ("1", "1", "tf32x3"),
        "fused + flash, bf16x3 dots": ("1", "1", "bf16x3")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))
    trace = generate_trace(0, num_requests=48 + args.prompts, pool_size=256, rate_qps=1.0)
    prompts = encode_trace(trace, tok, SHAPES["qwen3.5-9b"]["vocab_size"])[48:]
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine = Engine(random_model(SHAPES["qwen3.5-9b"], device="cuda", dtype=dtype, seed=0))
        engine.prewarm([s for p in prompts for s in p[1:-1]])
        for arm, (fused, flash, precision) in ARMS.items():
            os.environ["HYPIC_FUSED_COMBINE"], os.environ["HYPIC_COMBINE_FLASH"] = fused, flash
            os.environ["HYPIC_COMBINE_PRECISION"] = precision
            logits[(dtype, arm)] = engine.prefill_logits(prompts, mode="hypic")[0].double().cpu()
        del engine
        torch.cuda.empty_cache()
    ref = logits[(torch.float32, "general")]
    print("| model dtype | path | max rel. gap to fp32 general (per prompt, worst) | argmax as fp32 general |")
    print("|---|---|---|---|")
    for (dtype, arm), x in logits.items():
        gap = ((x - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        same = (x.argmax(-1) == ref.argmax(-1)).sum().item()
        print(f"| {str(dtype)[6:]} | {arm} | {gap:.2e} | {same}/{len(prompts)} |")


if __name__ == "__main__":
    main()
