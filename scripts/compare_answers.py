"""Greedy answers of the bundled model (or --model) side by side across modes, per example, with
the reference: where a mode loses points, and how (docs/quality.md, "where the remaining gaps come
from"). For the summary families it also counts reference facts recalled and answers that give the
same facts as the first mode in another order, and how many documents apart the facts it swaps
stand; for two-hop questions it says where each wrong
answer came from (the documents naming the bridge entity, the subject, another entity, or none),
and exact match split by which of the two evidence documents comes first: in context a model can
link the bridge while reading its document after the subject's, which hypic's standalone documents
cannot (docs/quality.md).

    python scripts/compare_answers.py [--family multi_doc_summary] [--n 12] [--difficulty 1] [--modes full,hypic]
"""

from __future__ import annotations

import argparse

import torch

from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams
from hypic.eval.metrics import score
from hypic.eval.quality import MAX_TOKENS
from hypic.eval.tasks import FAMILIES, generate
from hypic.eval.tokenizer import encode_example
from hypic.llm import bundled_model_path
from hypic.models.loader import load_model


def wrong_sources(examples: list, got: list[str]) -> dict[str, int]:
    """Where the wrong answers to two-hop questions come from. A document "names" an entity when its
    text contains the name; "bridge" means the answer stands in a document naming the bridge entity
    (the second hop read the right entity but the wrong fact, or the model stopped at hop one when
    the answer is the bridge itself), "subject" that it stands only in the subject's (the hop was
    skipped), "other" another document (the first hop found the wrong bridge), "none" nowhere."""
    counts = dict.fromkeys(("right", "bridge", "subject", "other", "none"), 0)
    for ex, answer in zip(examples, got, strict=True):
        if score("em_f1", answer, ex.answer)["em"] == 1.0:
            counts["right"] += 1
            continue
        value = answer.removeprefix("a ").removeprefix("an ").strip()
        holders = [d for d in ex.documents if value and value in d]
        if value == ex.meta["bridge"] or any(ex.meta["bridge"] in d for d in holders):
            counts["bridge"] += 1
        elif any(ex.meta["subject"] in d for d in holders):
            counts["subject"] += 1
        else:
            counts["other" if holders else "none"] += 1
    return counts


def em_by_order(examples: list, got: list[str]) -> dict[str, str]:
    """Exact match of two-hop answers, split by whether the subject's document (``support[0]``)
    comes before the bridge's (``support[1]``) or after it."""
    tally = {"subject first": [0, 0], "bridge first": [0, 0]}
    for ex, answer in zip(examples, got, strict=True):
        cell = tally["subject first" if ex.support[0] < ex.support[1] else "bridge first"]
        cell[0] += score("em_f1", answer, ex.answer)["em"] == 1.0
        cell[1] += 1
    return {k: f"{right}/{n}" for k, (right, n) in tally.items()}


def inverted_pairs(examples: list, got: list[str]) -> dict[int, int]:
    """Pairs of reference facts an answer gives in the wrong order, counted by how many documents
    apart their documents stand (``support`` holds each fact's document, in reference order). A
    standalone document knows its place only through the attention layers' positions; if that is
    where order slips, the swaps sit between neighbours."""
    distance: dict[int, int] = {}
    for ex, answer in zip(examples, got, strict=True):
        facts = ex.answer.split("; ")
        order = [facts.index(p) for p in answer.split("; ") if p in facts]
        for a, i in enumerate(order):
            for j in order[a + 1:]:
                if i > j:
                    d = ex.support[i] - ex.support[j]
                    distance[d] = distance.get(d, 0) + 1
    return dict(sorted(distance.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(bundled_model_path()))
    ap.add_argument("--family", default="multi_doc_summary", choices=list(FAMILIES))
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--difficulty", type=float, default=1.0)
    ap.add_argument("--modes", default="full,hypic")
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="prompts per engine call")
    args = ap.parse_args()
    loaded = load_model(args.model, device="cpu", dtype=torch.float32)
    tok, metric = loaded.tokenizer, FAMILIES[args.family].metric
    examples = generate(args.family, args.n, 1234, difficulty=args.difficulty)  # the quality runner's seed
    prompts = [encode_example(tok, ex).segments for ex in examples]
    modes = args.modes.split(",")
    answers: dict[str, list[str]] = {}
    params = SamplingParams(max_tokens=MAX_TOKENS[metric])
    for mode in modes:
        engine = Engine(loaded, seam=args.seam)
        # a few prompts per call: 200 long prompts at once hold every KV cache together (> 24 GB)
        outs = [o for i in range(0, len(prompts), args.batch)
                for o in engine.generate(prompts[i:i + args.batch], [params] * len(prompts[i:i + args.batch]),
                                         mode=mode)]
        answers[mode] = [tok.decode(o.token_ids, skip_special_tokens=True).strip() for o in outs]
    key = "f1" if metric == "em_f1" else "rougeL"
    recalled = dict.fromkeys(modes, 0)
    reordered = dict.fromkeys(modes, 0)
    facts_total = 0
    for i, ex in enumerate(examples):
        print(f"[{i}] {len(ex.documents)} documents · reference: {ex.answer}")
        facts = ex.answer.split("; ")
        facts_total += len(facts)
        first = answers[modes[0]][i].split("; ")
        for mode in modes:
            got = answers[mode][i]
            print(f"    {mode:10s} {score(metric, got, ex.answer)[key]:.2f}  {got}")
            recalled[mode] += sum(f in got for f in facts)
            parts = got.split("; ")
            reordered[mode] += parts != first and sorted(parts) == sorted(first)
    if args.family == "multi_hop":
        for mode in modes:
            print(f"{mode}: wrong answers by source: {wrong_sources(examples, answers[mode])}")
            print(f"{mode}: exact match by evidence order: {em_by_order(examples, answers[mode])}")
    if metric == "rougeL":
        for mode in modes:
            print(f"{mode}: {recalled[mode]} of {facts_total} reference facts recalled; "
                  f"{reordered[mode]} of {len(examples)} answers are {modes[0]}'s facts in another order")
            print(f"{mode}: fact pairs out of reference order, by documents apart: "
                  f"{inverted_pairs(examples, answers[mode])}")


if __name__ == "__main__":
    main()
