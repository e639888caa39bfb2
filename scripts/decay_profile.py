"""How far back each GDN head of a model remembers: its per-token decay on the quality runner's
prompts, as a half-life in tokens, beside the prompts' own lengths.

Why it matters for the mode ladder: ``naive`` drops each document's transition ``T`` — the decay the
later documents apply to it and the delta rule's erasure along their keys. A head that forgets a
document within the query (half-life of a few tokens) has lost every document by the query's end in
either composition; a head that keeps the whole prompt (half-life past its length) has ``T`` ≈ the
erasure alone; only heads in between see ``naive``'s missing decay in full.

    python scripts/decay_profile.py [--model DIR] [--n 4] [--difficulty 1.0]

The decay is ``exp(g)``, ``g = −exp(A_log)·softplus(a + dt_bias)`` per token and head; the half-life
is ``ln ½ / mean(g)`` over every prompt token of every example (the geometric mean of the decay).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F

FAST, MIDDLE, LONG = "forgets within the query", "forgets earlier documents", "keeps the whole prompt"


def profile(model_dir: str | None, n: int, difficulty: float) -> tuple[dict[tuple[int, int], float], dict[str, float]]:
    """Mean ``g`` per (layer, head) over ``n`` examples of every family under ``full``, and the
    prompts' median lengths (whole prompt, query)."""
    from hypic import LLM, SamplingParams
    from hypic.eval import tasks

    llm = LLM(model_dir, device="cpu")
    sums: dict[int, torch.Tensor] = {}
    count = 0

    def record(layer, args) -> None:
        _, _, _, a = layer._project(args[0])
        g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
        sums[layer.layer] = sums.get(layer.layer, 0) + g.sum(0)

    gdn = [m for m in llm.loaded.model.modules() if hasattr(m, "A_log") and hasattr(m, "_project")]
    if not gdn:
        raise SystemExit("the model has no GDN layers")
    hooks = [m.register_forward_pre_hook(record) for m in gdn]
    prompts, queries = [], []
    for family in tasks.FAMILIES:
        for ex in tasks.generate(family, n, seed=0, difficulty=difficulty):
            ids = llm.tokenize(ex.segments)
            prompts.append(sum(map(len, ids)))
            queries.append(len(ids[-1]))
            llm.generate([ex.segments], SamplingParams(max_tokens=1), mode="full")  # one prefill: its tokens
            count += prompts[-1]
    for h in hooks:
        h.remove()
    means = {(layer, head): float(total[head]) / count for layer, total in sums.items()
             for head in range(total.shape[0])}
    return means, {"prompt": statistics.median(prompts), "query": statistics.median(queries)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model folder (default: the bundled model)")
    ap.add_argument("--n", type=int, default=4, help="examples per task family")
    ap.add_argument("--difficulty", type=float, default=1.0)
    args = ap.parse_args()
    means, lengths = profile(args.model, args.n, args.difficulty)
    query, prompt = lengths["query"], lengths["prompt"]
    print(f"median prompt {prompt:.0f} tokens, median query {query:.0f} tokens\n")
    print("| layer | head | decay / token | half-life (tokens) | |")
    print("|---|---|---|---|---|")
    kinds: dict[str, int] = {}
    for (layer, head), g in sorted(means.items()):
        half = math.log(0.5) / g if g < 0 else math.inf
        kind = FAST if half < query else LONG if half > prompt else MIDDLE
        kinds[kind] = kinds.get(kind, 0) + 1
        print(f"| {layer} | {head} | {math.exp(g):.4f} | {half:,.1f} | {kind} |")
    print("\n" + "; ".join(f"{k}: {kinds.get(k, 0)} heads" for k in (FAST, MIDDLE, LONG)))


if __name__ == "__main__":
    main()
