"""What a half-precision host tier costs in answer quality: the bundled model's task suite under
``hypic`` (w = 8) with every cache entry's summaries rounded once through bf16 or fp16 — as if
every document had been demoted to the host tier and promoted back (``SegmentStore(host_dtype=…)``),
the worst case — against the same run in fp32.

    python scripts/host_precision.py [--n 100] [--seed 1234]

Prints a table (per family score, average, first-token KL and top-1 agreement with ``full``) and
the worst change of any first-token log-probability. CPU is fine: the bundled model is small.
"""

from __future__ import annotations

import argparse
import time

import torch

from hypic.cache import store as store_module
from hypic.cache.layout import convert_into, header_of, retyped
from hypic.eval import quality
from hypic.eval.quality import evaluate
from hypic.llm import bundled_model_path
from hypic.models.loader import load_model

STATE: dict[str, torch.dtype | None] = {"dtype": None}  # the dtype the label being run rounds through


def rounding_insert():
    """``SegmentStore.insert`` that first rounds the entry's summaries through ``STATE["dtype"]``."""
    plain = store_module.SegmentStore.insert

    def insert(self, entry):
        dtype = STATE["dtype"]
        if dtype is not None:
            header = header_of(entry)
            narrow = retyped(header, torch.float32, dtype)
            half = convert_into(entry, narrow, torch.empty(narrow.nbytes, dtype=torch.uint8))
            entry = convert_into(half, header, torch.empty(header.nbytes, dtype=torch.uint8))
        return plain(self, entry)
    return insert


def prebuild(engine, prompts, mode, cold) -> None:
    """Every prompt's documents cached (rounded) before the prompt runs: a request would otherwise
    use the entries its own cold prefill just built, before any demotion."""
    engine.prefill_logits(prompts, mode=mode)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100, help="examples per task family")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    loaded = load_model(str(bundled_model_path()), device="cpu")
    runs = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
    for name in runs:  # the same (mode, seam, cold) under three labels: one `full` reference for all
        quality.LABELS[f"hypic_w8_{name}"] = quality.LABELS["hypic_w8"]
    order = list(runs)
    quality.build_entries = prebuild
    store_module.SegmentStore.insert = rounding_insert()
    t0 = time.perf_counter()

    def next_label(done: dict) -> None:  # the next label rounds through its dtype
        print(f"{order[len(done) - 1]}: done after {time.perf_counter() - t0:.0f} s", flush=True)
        if len(done) < len(order):
            STATE["dtype"] = runs[order[len(done)]]

    STATE["dtype"] = runs[order[0]]
    results = evaluate(loaded, n=args.n, seed=args.seed, labels=[f"hypic_w8_{n}" for n in order], on_label=next_label)
    rows = {name: results[f"hypic_w8_{name}"] for name in order}
    families = list(rows["float32"].family_scores)
    print(f"\nhypic (w = 8), {args.n} examples per family, seed {args.seed}; summaries rounded through each dtype\n")
    print("| summaries | " + " | ".join(families) + " | average | KL(full ‖ ·) | top-1 vs full (%) |")
    print("|---" * (len(families) + 4) + "|")
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r.family_scores[f]:.1f}" for f in families)
              + f" | {r.average:.2f} | {r.kl:.2e} | {r.top1:.1f} |")


if __name__ == "__main__":
    main()
