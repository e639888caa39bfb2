"""A pre-test: the task suite with distractors that share the question's subject, scored by the
bundled model (not trained on them) under ``full``, ``naive`` and ``hypic_w8``.

The published datasets' distractors are about the question's subject: HotpotQA's are retrieved
for the question, TriviaQA's evidence pages are all about its topic, MultiNews' articles all
cover one event. Ours profile other entities, and scripts/naive_by_head.py placed `naive`'s loss
where documents overwrite each other along shared keys (the report summary). This swaps three
families' builders for shared-subject ones, leaving the report summary as it is:

- single_hop: the evidence profile, then news briefs that each state another fact of the target
  (never the asked one) and a line about it, among other people;
- multi_hop: the two hops' profiles, then briefs that state other facts of the start and of the
  bridge entity (never either hop's fact);
- multi_doc_summary: every brief, carrier or not, also has a line about the target (no fact).

    python scripts/shared_subject_suite.py [--model DIR] [--n 16] [--device cpu] [--dtype D] [--batch 8]

If `naive` loses far more here with `full` still high, a model fine-tuned on these families is
the way to the issue's −30; if not, that route is closed too.
"""

from __future__ import annotations

import argparse
import json
import random

from hypic.eval import tasks
from hypic.eval.docs import fact, news, org_filler, person_filler, profile
from hypic.eval.vocab import CITIES
from hypic.eval.world import LINK_RELATIONS, RELATIONS, Entity, sample_world, sentence


def _about(rng: random.Random, e: Entity) -> str:
    return person_filler(rng, e.phrase) if e.kind == "person" else org_filler(rng, e.phrase)


def _brief(rng: random.Random, k: tasks.Knobs, subjects: list[tuple[Entity, list[str]]],
           cast: list[Entity], avoid: frozenset[str]) -> str:
    """A news brief stating one allowed fact of each subject and a line about it, among `cast`."""
    fixed = []
    for e, allowed in subjects:
        if allowed:
            fixed.append(fact(rng, e, RELATIONS[rng.choice(allowed)]))
        fixed.append(_about(rng, e))
    return news(rng, rng.choice(CITIES), rng.randint(*k.doc_tokens), fixed, rng.sample(cast, min(3, len(cast))),
                avoid)


def single_hop(rng: random.Random, k: tasks.Knobs) -> tasks.Example:
    n = rng.randint(*k.num_docs)
    kind = "person" if rng.random() < 0.7 else "org"
    world = sample_world(rng, 12, 4)
    target = world.people[0] if kind == "person" else world.orgs[0]
    rel = RELATIONS[rng.choice(list(target.facts))]
    answer_value = target.facts[rel.name]
    evidence = profile(rng, target, rng.randint(*k.doc_tokens), required=[rel.name])
    allowed = [r for r, v in target.facts.items() if r != rel.name and v != answer_value]
    cast = [p for p in world.people if p is not target]
    briefs = [_brief(rng, k, [(target, allowed)], cast, frozenset({answer_value})) for _ in range(n - 1)]
    docs, support = tasks._place(rng, [evidence.text, *briefs], 1)
    question = sentence(rng.choice(rel.questions), target.phrase)
    answer = tasks.answer_phrase(rel, answer_value)
    return tasks.Example([tasks.HEAD_QA, *docs, tasks._query(question)], answer, "single_hop", "em_f1", support,
                         {"relation": rel.name, "subject": target.name})


def multi_hop(rng: random.Random, k: tasks.Knobs) -> tasks.Example:
    n = rng.randint(*k.num_docs)
    world = sample_world(rng, 12, 6)
    first = rng.choice(LINK_RELATIONS)
    start = rng.choice(world.people if first.subject == "person" else world.orgs)
    bridge = world.get(start.facts[first.name])
    second = RELATIONS[rng.choice([r for r, v in bridge.facts.items() if v != start.name])]
    answer = bridge.facts[second.name]
    t = k.doc_tokens
    docs = [profile(rng, start, rng.randint(*t), required=[first.name], avoid=frozenset({answer})).text,
            profile(rng, bridge, rng.randint(*t), required=[second.name], avoid=frozenset({start.name})).text]
    start_ok = [r for r, v in start.facts.items() if r != first.name and v not in (answer, bridge.name)]
    bridge_ok = [r for r, v in bridge.facts.items() if r != second.name and v not in (answer, start.name)]
    cast = [p for p in world.people if p is not start and p is not bridge]
    for _ in range(n - 2):
        subjects = [(start, start_ok), (bridge, bridge_ok)]
        rng.shuffle(subjects)
        docs.append(_brief(rng, k, subjects[:rng.randint(1, 2)], cast, frozenset({answer, bridge.name, start.name})))
    docs, support = tasks._place(rng, docs, 2)
    question = sentence(rng.choice(second.questions), first.link.format(s=start.phrase))
    return tasks.Example([tasks.HEAD_QA, *docs, tasks._query(question)], tasks.answer_phrase(second, answer),
                         "multi_hop", "em_f1", support,
                         {"relation": f"{first.name}>{second.name}", "subject": start.name, "bridge": bridge.name})


def multi_doc_summary(rng: random.Random, k: tasks.Knobs) -> tasks.Example:
    n = rng.randint(*k.num_docs)
    world = sample_world(rng, min(48, n + 8), 6)
    target, crowd = world.people[0], world.people[1:]
    rels = rng.sample([r for r in RELATIONS.values() if r.subject == "person" and r.values != "person"],
                      rng.randint(2, min(5, n)))
    carriers = sorted(rng.sample(range(n), len(rels)))
    docs = []
    for i in range(n):
        fixed = [fact(rng, target, rels[carriers.index(i)])] if i in carriers else []
        fixed.append(_about(rng, target))
        docs.append(news(rng, rng.choice(CITIES), rng.randint(*k.doc_tokens), fixed, rng.sample(crowd, rng.randint(2, 4)),
                         frozenset({target.name})))
    answer = "; ".join(r.summary.format(v=tasks.value_phrase(r, target.facts[r.name])) for r in rels)
    question = f"What do the documents say about {target.phrase}? List the facts in order."
    return tasks.Example([tasks.HEAD_SUMMARY, *docs, tasks._query(question)], answer, "multi_doc_summary", "rougeL",
                         tuple(1 + i for i in carriers), {"subject": target.name})


SHARED = {"single_hop": single_hop, "multi_hop": multi_hop, "multi_doc_summary": multi_doc_summary}


def use_shared() -> None:
    """Swap the builders in place: the quality runner and `tasks.generate` read the same dict."""
    for name, build in SHARED.items():
        tasks.FAMILIES[name] = tasks.FAMILIES[name]._replace(build=build)


def main() -> None:
    from hypic.eval.quality import evaluate
    from hypic.llm import bundled_model_path
    from hypic.models.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--difficulty", type=float, default=1.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--labels", default="full,naive,hypic_w8")
    ap.add_argument("--standard", action="store_true", help="the suite as it is, for the side-by-side")
    ap.add_argument("--show", type=int, default=0, help="print this many examples per family and stop")
    args = ap.parse_args()
    if not args.standard:
        use_shared()
    if args.show:
        for fam in tasks.FAMILIES:
            for ex in tasks.generate(fam, args.show, 1234, difficulty=args.difficulty):
                print(f"== {fam}\n" + "\n".join(ex.segments) + f"\n-> {ex.answer}\n")
        return
    loaded = load_model(args.model or str(bundled_model_path()), device=args.device, dtype=args.dtype)
    res = evaluate(loaded, n=args.n, difficulty=args.difficulty, labels=args.labels.split(","), batch=args.batch)
    fams = list(tasks.FAMILIES)
    full = res["full"].average
    print("| mode | " + " | ".join(fams) + " | average | Δ vs full | EM single/multi |")
    print("|---|" + "---|" * (len(fams) + 3))
    for label, r in res.items():
        cells = " | ".join(f"{r.family_scores[f]:.1f}" for f in fams)
        em = f"{r.family_em['single_hop']:.1f}/{r.family_em['multi_hop']:.1f}"
        print(f"| {label} | {cells} | {r.average:.1f} | {r.average - full:+.1f} | {em} |")
    print(json.dumps({k: {"families": v.family_scores, "docs": v.docs_scores} for k, v in res.items()}))


if __name__ == "__main__":
    main()
