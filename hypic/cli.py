"""Command line: ``hypic demo`` (the main job) and, as they land, serve / generate / eval / bench.

Until the engine exists the demo is the algebra's self-check: for every linear-attention family it
splits a random span in two, composes the halves' cached summaries and prints how far the result
is from running the whole span, next to the naive sum that drops ``T``.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from hypic.ops import recurrence as R
from hypic.ops.family import FAMILIES
from hypic.ops.linear import linear_attention


def _inputs(family: str, length: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    fam = FAMILIES[family]
    H, K, V = 4, 32, 32
    x = {"q": torch.randn(length, H, K, generator=gen, dtype=torch.float64),
         "k": F.normalize(torch.randn(length, H, K, generator=gen, dtype=torch.float64), dim=-1),
         "v": torch.randn(length, H, V, generator=gen, dtype=torch.float64)}
    if fam.gate != "none":
        shape = (length, H) if fam.gate == "head" else (length, H, K)
        x["g"] = -0.1 * torch.rand(*shape, generator=gen, dtype=torch.float64)
    if fam.beta:
        x["beta"] = torch.rand(length, H, generator=gen, dtype=torch.float64)
    if fam.lowrank:
        kappa = F.normalize(torch.randn(length, H, K, generator=gen, dtype=torch.float64), dim=-1)
        x["a"], x["b"] = -kappa, kappa * torch.rand(length, H, 1, generator=gen, dtype=torch.float64)
    return x


def demo(args: argparse.Namespace) -> int:
    gen = torch.Generator().manual_seed(args.seed)
    n = args.length
    print(f"hypic algebra self-check: two spans of {n} tokens, 4 heads, K = V = 32")
    print(f"{'family':<10}{'compose fp64':>14}{'compose fp32':>14}{'chunk kernel':>14}{'naive S1+S2':>14}")
    worst = 0.0
    for family in FAMILIES:
        x = _inputs(family, 2 * n, gen)
        gates = {k: t for k, t in x.items() if k in ("g", "beta", "a", "b")}
        s0 = torch.randn(4, 32, 32, generator=gen, dtype=torch.float64)
        ref = R.run(family, x["q"], x["k"], x["v"], initial_state=s0, **gates).final_state
        row = []
        for dtype in (torch.float64, torch.float32):
            halves = [R.summarize(family, x["k"][s].to(dtype), x["v"][s].to(dtype),
                                  **{k: t[s].to(dtype) for k, t in gates.items()})
                      for s in (slice(0, n), slice(n, 2 * n))]
            out = R.apply(family, R.compose(family, *halves), s0.to(dtype))
            row.append(((out.double() - ref).norm() / ref.norm()).item())
        x32 = {k: t.float() for k, t in x.items()}
        chunk = linear_attention(family, x32["q"], x32["k"], x32["v"], initial_state=s0.float()[None],
                                 **{k: x32[k] for k in gates}).final_state[0]
        row.append(((chunk.double() - ref).norm() / ref.norm()).item())
        halves = [R.summarize(family, x["k"][s], x["v"][s], **{k: t[s] for k, t in gates.items()})
                  for s in (slice(0, n), slice(n, 2 * n))]
        whole = R.summarize(family, x["k"], x["v"], **gates).state
        naive = ((halves[0].state + halves[1].state - whole).norm() / whole.norm()).item()
        worst = max(worst, row[1], row[2])
        print(f"{family:<10}" + "".join(f"{e:>14.1e}" for e in (*row, naive)))
    print("relative error of the final state vs the fp64 token loop; naive = summing states without T")
    return 0 if worst < 1e-4 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hypic", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="the main job: a short end-to-end run on the bundled model")
    p_demo.add_argument("--length", type=int, default=300)
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.set_defaults(func=demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
