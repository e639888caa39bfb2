"""Does `naive` lose more where the documents share their subject? Single-hop questions asked over
the report-summary family's prompts — every part about one organisation — against the single-hop
family's own prompts, whose documents profile different entities.

scripts/naive_by_head.py found `naive`'s loss in the long-memory heads' erasure and on the report
summary, whose parts overwrite each other's writes along shared keys. If that reading holds, a
question over such documents should lose more under `naive` than the same kind of question over
documents about different entities, with the answer the same one-fact lookup.

    python scripts/shared_subject_qa.py [--model DIR] [--n 64] [--difficulty 1.0] [--device cpu]

The report's prompts keep their documents; only the last segment changes: a question about one
finding (the relation's own question wording, as single-hop asks it), answered by its value.
Scores: exact match and F1 (SQuAD's) per mode, and Δ vs `full` on the same prompts.
"""

from __future__ import annotations

import argparse
import random
import statistics

from hypic import LLM, SamplingParams
from hypic.eval import tasks
from hypic.eval.metrics import best_score
from hypic.eval.world import ORG_RELATIONS, sentence

MODES = ("full", "naive", "hypic")  # the LLM's seam is 8 (hypic_w8); naive takes no seam


def report_questions(n: int, difficulty: float, seed: int) -> list[tuple[list[str], str]]:
    """(segments, answer) per report prompt: its parts, then a question about one finding it states."""
    rng = random.Random(seed)
    out = []
    for ex in tasks.generate("report_summary", n, seed=seed, difficulty=difficulty):
        stated = [(r, v) for r in ORG_RELATIONS for v in [_value_in(ex, r)] if v]
        if not stated:
            continue
        rel, value = rng.choice(stated)
        org_phrase = _phrase(ex)
        question = sentence(rng.choice(rel.questions), org_phrase)
        out.append(([*ex.segments[:-1], tasks._query(question)], value))  # articles drop out in scoring
    return out


def _phrase(ex: tasks.Example) -> str:
    """The organisation as the report names it ("the Tidewell Trust"), read off its question."""
    q = ex.segments[-1]
    return q.split("Summarise the report on ", 1)[1].split(", one finding per part.")[0]


def _value_in(ex: tasks.Example, rel) -> str | None:
    """The relation's value as the documents phrase it, if the reference summary states it (the
    report's finding)."""
    head, _, tail = rel.summary.partition("{v}")
    for item in ex.references[0].split("; "):
        if item.startswith(head) and item.endswith(tail):
            return item[len(head):len(item) - len(tail) if tail else None]
    return None


def single_hop(n: int, difficulty: float, seed: int) -> list[tuple[list[str], str]]:
    return [(ex.segments, ex.references[0]) for ex in tasks.generate("single_hop", n, seed=seed, difficulty=difficulty)]


def run(llm: LLM, prompts: list[tuple[list[str], str]]) -> dict[str, tuple[float, float]]:
    scores = {}
    for mode in MODES:
        outs = llm.generate([p for p, _ in prompts], SamplingParams(max_tokens=8), mode=mode)
        s = [best_score("em_f1", o.outputs[0].text.strip(), [a]) for o, (_, a) in zip(outs, prompts, strict=True)]
        scores[mode] = (100 * statistics.mean(x["em"] for x in s), 100 * statistics.mean(x["f1"] for x in s))
    return scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--difficulty", type=float, default=1.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device)
    sets = {"single-hop prompts (documents about different entities)": single_hop(args.n, args.difficulty, args.seed),
            "report prompts (every part about one organisation)": report_questions(args.n, args.difficulty, args.seed)}
    print("| prompts | n | " + " | ".join(f"{m} EM / F1" for m in MODES) + " | naive Δ F1 vs full |")
    print("|---|---|" + "---|" * (len(MODES) + 1))
    for name, prompts in sets.items():
        s = run(llm, prompts)
        print(f"| {name} | {len(prompts)} | " + " | ".join(f"{s[m][0]:.1f} / {s[m][1]:.1f}" for m in MODES)
              + f" | {s['naive'][1] - s['full'][1]:+.1f} |", flush=True)


if __name__ == "__main__":
    main()
