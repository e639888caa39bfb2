"""Where `naive`'s loss comes from, head by head: `hypic_w8` with the transition dropped (the
states summed, as `naive` sums them) in one class of GDN heads only, the others composed exactly.

The classes are scripts/decay_profile.py's: heads that forget within the query, heads that forget
earlier documents, heads that keep the whole prompt. Everything else stays `hypic_w8`'s (seam,
conv warm-up), so each row isolates what the missing ``T`` costs in those heads; "all" drops it in
every head (`naive` keeps no seam or warm-up either, so it is its own row).

    python scripts/naive_by_head.py [--model DIR] [--n 16] [--difficulty 1.0] [--profile-n 4]

Why: issue 5 asks `naive` to lose ≥ 30 points; the bundled model loses 16.5. If the heads that
forget earlier documents carry most of that loss, a model with more such heads would lose more.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decay_profile import FAST, LONG, MIDDLE, profile  # noqa: E402


@contextlib.contextmanager
def naive_in(heads: dict[int, torch.Tensor]):
    """Within: the combine pass's prefix states use the naive sum in ``heads[layer]`` (a bool per head)."""
    from hypic.engine import combine

    linear, scan = combine.CombineContext.linear, combine.CombineContext._scan

    def linear_at(self, layer, *args, **kwargs):
        self._probe_layer = layer
        return linear(self, layer, *args, **kwargs)

    def mixed(self, family, chain, cu, runs):
        exact = scan(self, family, chain, cu, runs)
        mask = heads.get(self._probe_layer)
        if mask is None or not mask.any():
            return exact
        assembly = self.assembly  # the same scan as `naive` runs it: its assembly without T
        self.assembly = dataclasses.replace(assembly, use_transition=False)
        try:
            summed = scan(self, family, chain, cu, runs)
        finally:
            self.assembly = assembly
        return torch.where(mask.to(exact.device)[None, :, None, None], summed, exact)

    combine.CombineContext.linear, combine.CombineContext._scan = linear_at, mixed
    try:
        yield
    finally:
        combine.CombineContext.linear, combine.CombineContext._scan = linear, scan


def main() -> None:
    from hypic.eval.quality import evaluate
    from hypic.llm import bundled_model_path
    from hypic.models.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--difficulty", type=float, default=1.0)
    ap.add_argument("--profile-n", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="e.g. bfloat16 on a GPU (default: the model's)")
    ap.add_argument("--batch", type=int, default=8, help="prompts per engine call")
    args = ap.parse_args()
    # the GPU's fused GDN pass walks the chains itself: off (for every row alike), so that each
    # layer's prefix states pass through ``naive_in``
    os.environ["HYPIC_FUSED_COMBINE"] = "0"
    means, lengths = profile(args.model, args.profile_n, args.difficulty)
    kind = {}
    for (layer, head), g in means.items():
        half = math.log(0.5) / g if g < 0 else math.inf
        kind[layer, head] = FAST if half < lengths["query"] else LONG if half > lengths["prompt"] else MIDDLE
    layers = sorted({layer for layer, _ in kind})
    heads_per = 1 + max(h for _, h in kind)

    def masks(which: set[str]) -> dict[int, torch.Tensor]:
        return {layer: torch.tensor([kind[layer, h] in which for h in range(heads_per)]) for layer in layers}

    loaded = load_model(args.model or str(bundled_model_path()), device=args.device, dtype=args.dtype)
    base = evaluate(loaded, n=args.n, difficulty=args.difficulty, labels=["full", "naive", "hypic_w8"],
                    batch=args.batch)
    full = base["full"].average
    rows = [("full", full, 0), ("naive", base["naive"].average, len(kind)), ("hypic_w8", base["hypic_w8"].average, 0)]
    families = {k: r.family_scores for k, r in base.items()}
    for name, which in (("T dropped: " + FAST, {FAST}), ("T dropped: " + MIDDLE, {MIDDLE}),
                        ("T dropped: " + LONG, {LONG}), ("T dropped: every head", {FAST, MIDDLE, LONG})):
        with naive_in(masks(which)):
            r = evaluate(loaded, n=args.n, difficulty=args.difficulty, labels=["hypic_w8"],
                         batch=args.batch)["hypic_w8"]
        rows.append((name, r.average, sum(k in which for k in kind.values())))
        families[name] = r.family_scores
        print(f"{name}: {r.average:.1f}", flush=True)
    print(f"\n{args.n} examples per family, difficulty {args.difficulty}; head classes from {args.profile_n} "
          f"examples per family (median prompt {lengths['prompt']:.0f}, query {lengths['query']:.0f} tokens)\n")
    fams = list(next(iter(families.values())))
    print("| row | heads | " + " | ".join(fams) + " | average | Δ vs full |")
    print("|---|---|" + "---|" * (len(fams) + 2))
    for name, avg, count in rows:
        print(f"| {name} | {count} | " + " | ".join(f"{families[name][f]:.1f}" for f in fams)
              + f" | {avg:.1f} | {avg - full:+.1f} |")


if __name__ == "__main__":
    main()
