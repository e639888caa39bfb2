"""The synthetic task suite: prompts as segments (head, documents, query) with reference answers.

Four families stand in for the published evaluation's datasets, over fictional worlds so nothing
is answerable from pretraining:

- `single_hop` (TriviaQA-like): one fact about one entity, among distractor profiles.
- `multi_hop` (HotpotQA-like): a bridge question, "Where does the mentor of X live?"; X's
  profile names the bridge entity, the bridge entity's own profile holds the answer.
- `multi_doc_summary` (MultiNews-like): facts about one person scattered over news briefs full of
  other people; the answer lists them in document order (ROUGE-L).
- `report_summary` (GovReport-like): one long report on an organisation, split into parts; the
  answer lists each part's finding in order (ROUGE-L).

Text is templated and answers are short and copied verbatim from the documents, so a tiny model
trained from scratch can learn the format. Every query ends with "Answer:"; the model should
generate the answer and then the end marker (`<|end|>` in the trained tokenizer). `difficulty`
is the curriculum knob: 0 gives the family's fewest documents (one or two) or one more, of
16–32 tokens; 1 the full 4–32 documents of 64–512 tokens; values between interpolate both
ranges; `num_docs` / `doc_tokens` override either.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from hypic.eval.docs import Doc, fact, news, profile, report_section
from hypic.eval.vocab import CITIES
from hypic.eval.world import (
    LINK_RELATIONS,
    ORG_RELATIONS,
    PERSON_RELATIONS,
    RELATIONS,
    Entity,
    Relation,
    answer_phrase,
    sample_world,
    sentence,
    value_phrase,
)

HEAD_QA = "You are a careful reader. Answer the question with a short answer copied from the documents."
HEAD_SUMMARY = "You are a careful reader. Summarise the documents as a short list of facts, in the order they appear."


@dataclass(frozen=True)
class Example:
    segments: list[str]  # head first, documents, query last
    answer: str  # the reference the model should generate after "Answer:"
    family: str
    metric: str  # "em_f1" | "rougeL"
    support: tuple[int, ...] = ()  # indices into segments of the documents holding the evidence, in hop order
    meta: dict[str, str] = field(default_factory=dict)
    # More (query, answer) pairs the same documents answer: training appends them after the main
    # answer for denser retrieval supervision; evaluation ignores them. Drawn after every other
    # field, so they leave the example itself unchanged.
    extra: tuple[tuple[str, str], ...] = ()
    # Two-hop (query, answer) pairs over the same documents: a link one profile states (the mentor
    # of A) leads to another profiled entity B, and the question asks a fact B's profile states.
    # Drawn after `extra`, so they leave it unchanged too.
    extra_multi: tuple[tuple[str, str], ...] = ()
    # Other answers the documents support as well as `answer`, scored like it (SQuAD's max over
    # references): the documents word a partnership as mutual ("X works closely with Y") though
    # each organisation's profile states its own partner, so "the partner of Y" reads X too.
    # Derived from the documents, no draw: the example is unchanged.
    alternatives: tuple[str, ...] = ()

    @property
    def references(self) -> tuple[str, ...]:
        return (self.answer, *self.alternatives)

    @property
    def head(self) -> str:
        return self.segments[0]

    @property
    def documents(self) -> list[str]:
        return self.segments[1:-1]

    @property
    def query(self) -> str:
        return self.segments[-1]


@dataclass(frozen=True)
class Knobs:
    num_docs: tuple[int, int]  # inclusive range of documents per prompt
    doc_tokens: tuple[int, int]  # inclusive range of target (approximate) tokens per document


def _query(question: str) -> str:
    return f"Question: {question}\nAnswer:"


EXTRA_QUESTIONS = 32


def _extra(rng: random.Random, profiles: list[tuple[Entity, Doc]],
           asked: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """Single-hop questions about facts the profiles state, other than the one `asked` (entity, relation)."""
    pairs = [(e, r) for e, d in profiles for r in d.stated if (e.name, r) != asked]
    rng.shuffle(pairs)
    return tuple((_query(sentence(rng.choice(RELATIONS[r].questions), e.phrase)),
                  answer_phrase(RELATIONS[r], e.facts[r])) for e, r in pairs[:EXTRA_QUESTIONS])


def _extra_multi(rng: random.Random, profiles: list[tuple[Entity, Doc]],
                 asked: tuple[str, str, str]) -> tuple[tuple[str, str], ...]:
    """Two-hop questions the profiles answer, other than the one `asked` (start, link, relation)."""
    by_name = {e.name: (e, d) for e, d in profiles}
    chains = []
    for a, doc_a in profiles:
        for link in (r for r in doc_a.stated if RELATIONS[r].link and a.facts[r] in by_name):
            b, doc_b = by_name[a.facts[link]]
            chains += [(a, link, b, r) for r in doc_b.stated
                       if b is not a and b.facts[r] != a.name and (a.name, link, r) != asked]
    rng.shuffle(chains)
    return tuple((_query(sentence(rng.choice(RELATIONS[r].questions), RELATIONS[link].link.format(s=a.phrase))),
                  answer_phrase(RELATIONS[r], b.facts[r])) for a, link, b, r in chains[:EXTRA_QUESTIONS])


def readings(e: Entity, rel: Relation, profiles: list[tuple[Entity, Doc]]) -> set[str]:
    """Every value of ``rel`` for ``e`` the prompt's documents support: its own value where a
    document states it, and for a partnership (worded as mutual) each organisation whose document
    names ``e`` as its partner."""
    found = {e.facts[rel.name] for o, d in profiles if o is e and rel.name in d.stated}
    if rel.name == "partner":
        found |= {o.name for o, d in profiles if o.facts.get("partner") == e.name and "partner" in d.stated}
    return found


def _alternatives(rel: Relation, values: set[str], answer: str, exclude: frozenset[str] = frozenset()
                  ) -> tuple[str, ...]:
    return tuple(sorted({answer_phrase(rel, v) for v in values - exclude} - {answer}))


def _place(rng: random.Random, docs: list[str], evidence: int) -> tuple[list[str], tuple[int, ...]]:
    """Shuffle documents; return them and the segment indices of the first `evidence` ones, in order."""
    order = list(range(len(docs)))
    rng.shuffle(order)
    placed = [""] * len(docs)
    for src, dst in enumerate(order):
        placed[dst] = docs[src]
    return placed, tuple(1 + order[i] for i in range(evidence))


def _single_hop(rng: random.Random, k: Knobs) -> Example:
    n = rng.randint(*k.num_docs)
    kind = "person" if rng.random() < 0.7 else "org"
    world = sample_world(rng, n + 2 if kind == "person" else 4, n + 2 if kind == "org" else 4)
    subjects = (world.people if kind == "person" else world.orgs)[:n]
    target = subjects[0]  # the world is shuffled already; _place decides where it lands
    rel = RELATIONS[rng.choice(list(target.facts))]
    profiles = [(target, profile(rng, target, rng.randint(*k.doc_tokens), required=[rel.name]))]
    profiles += [(e, profile(rng, e, rng.randint(*k.doc_tokens))) for e in subjects[1:]]
    docs, support = _place(rng, [d.text for _, d in profiles], 1)
    question = sentence(rng.choice(rel.questions), target.phrase)
    extra = _extra(rng, profiles, (target.name, rel.name))
    answer = answer_phrase(rel, target.facts[rel.name])
    return Example([HEAD_QA, *docs, _query(question)], answer, "single_hop", "em_f1", support,
                   {"relation": rel.name, "subject": target.name}, extra, _extra_multi(rng, profiles, ("", "", "")),
                   _alternatives(rel, readings(target, rel, profiles), answer))


def _multi_hop(rng: random.Random, k: Knobs) -> Example:
    n = rng.randint(*k.num_docs)
    # At most ten organisations keeps their names free of shared words (see world._names).
    world = sample_world(rng, n + 2, min(10, n // 2 + 3))
    first = rng.choice(LINK_RELATIONS)
    start = rng.choice(world.people if first.subject == "person" else world.orgs)
    bridge = world.get(start.facts[first.name])
    second = RELATIONS[rng.choice([r for r, v in bridge.facts.items() if v != start.name])]
    answer = bridge.facts[second.name]
    t = k.doc_tokens
    # Neither hop's document may give the other hop away: the answer stays out of the first,
    # the start entity out of the second.
    profiles = [(start, profile(rng, start, rng.randint(*t), required=[first.name], avoid=frozenset({answer}))),
                (bridge, profile(rng, bridge, rng.randint(*t), required=[second.name], avoid=frozenset({start.name})))]
    others = [e for e in world.people + world.orgs if e is not start and e is not bridge]
    profiles += [(e, profile(rng, e, rng.randint(*t))) for e in rng.sample(others, n - 2)]
    docs, support = _place(rng, [d.text for _, d in profiles], 2)
    question = sentence(rng.choice(second.questions), first.link.format(s=start.phrase))
    extra = _extra(rng, profiles, ("", ""))
    # every bridge the first hop reads (the stated one; for a partnership, also each organisation
    # naming the start as its partner), then every answer each bridge's documents give — never the
    # start itself, which no question here asks for
    bridges = [world.get(b) for b in readings(start, first, profiles)]
    values = set().union(*(readings(b, second, profiles) for b in bridges if second.name in b.facts))
    reference = answer_phrase(second, answer)
    return Example([HEAD_QA, *docs, _query(question)], reference, "multi_hop", "em_f1", support,
                   {"relation": f"{first.name}>{second.name}", "subject": start.name, "bridge": bridge.name},
                   extra, _extra_multi(rng, profiles, (start.name, first.name, second.name)),
                   _alternatives(second, values, reference, frozenset({start.name})))


def _multi_doc_summary(rng: random.Random, k: Knobs) -> Example:
    n = rng.randint(*k.num_docs)
    world = sample_world(rng, min(48, n + 8), 6)
    target, crowd = world.people[0], world.people[1:]
    rels = rng.sample([r for r in PERSON_RELATIONS if r.values != "person"], rng.randint(2, min(5, n)))
    carriers = sorted(rng.sample(range(n), len(rels)))
    docs = []
    for i in range(n):
        fixed = [fact(rng, target, rels[carriers.index(i)])] if i in carriers else []
        cast = rng.sample(crowd, rng.randint(2, 4))
        docs.append(news(rng, rng.choice(CITIES), rng.randint(*k.doc_tokens), fixed, cast,
                         frozenset({target.name})))
    answer = "; ".join(r.summary.format(v=value_phrase(r, target.facts[r.name])) for r in rels)
    question = f"What do the documents say about {target.phrase}? List the facts in order."
    return Example([HEAD_SUMMARY, *docs, _query(question)], answer, "multi_doc_summary", "rougeL",
                   tuple(1 + i for i in carriers), {"subject": target.name})


def _report_summary(rng: random.Random, k: Knobs) -> Example:
    n = rng.randint(*k.num_docs)
    org = sample_world(rng, 6, 4).orgs[0]
    rels = rng.sample(ORG_RELATIONS, min(n, len(ORG_RELATIONS)))
    carriers = sorted(rng.sample(range(n), len(rels)))  # parts beyond the findings are background
    docs = [report_section(rng, org, i + 1, n, rels[carriers.index(i)] if i in carriers else None,
                           rng.randint(*k.doc_tokens)) for i in range(n)]
    answer = "; ".join(r.summary.format(v=value_phrase(r, org.facts[r.name])) for r in rels)
    question = f"Summarise the report on {org.phrase}, one finding per part."
    return Example([HEAD_SUMMARY, *docs, _query(question)], answer, "report_summary", "rougeL",
                   tuple(1 + i for i in carriers), {"subject": org.name})


class Family(NamedTuple):
    build: Callable[[random.Random, Knobs], Example]
    metric: str
    min_docs: int  # the fewest documents the family's question can be built over


FAMILIES: dict[str, Family] = {
    "single_hop": Family(_single_hop, "em_f1", 1),
    "multi_hop": Family(_multi_hop, "em_f1", 2),
    "multi_doc_summary": Family(_multi_doc_summary, "rougeL", 2),
    "report_summary": Family(_report_summary, "rougeL", 2),
}


def knobs(family: str, difficulty: float = 1.0, num_docs: tuple[int, int] | None = None,
          doc_tokens: tuple[int, int] | None = None) -> Knobs:
    """Document count and length ranges for a family: interpolated from `difficulty`, or given."""
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; choose from {sorted(FAMILIES)}")
    if not 0.0 <= difficulty <= 1.0:
        raise ValueError(f"difficulty: expected a number in [0, 1], got {difficulty!r}")
    least = FAMILIES[family].min_docs

    def lerp(a: int, b: int) -> int:
        return round(a + (b - a) * difficulty)

    num_docs = num_docs or (lerp(least, 4), lerp(least + 1, 32))
    doc_tokens = doc_tokens or (lerp(16, 64), lerp(32, 512))
    if not least <= num_docs[0] <= num_docs[1]:
        raise ValueError(f"{family}: num_docs must be a range with {least} <= low <= high, got {num_docs}")
    if not 1 <= doc_tokens[0] <= doc_tokens[1]:
        raise ValueError(f"{family}: doc_tokens must be a range with 1 <= low <= high, got {doc_tokens}")
    if num_docs[1] > 46:  # the worlds give every document its own entity from 48 name parts
        raise ValueError(f"{family}: at most 46 documents per prompt, got {num_docs}")
    return Knobs(tuple(num_docs), tuple(doc_tokens))


def generate(family: str, n: int, seed: int, difficulty: float = 1.0, num_docs: tuple[int, int] | None = None,
             doc_tokens: tuple[int, int] | None = None) -> list[Example]:
    """`n` examples of one family. Example i depends only on (family, seed, i): a longer run extends a shorter one."""
    k = knobs(family, difficulty, num_docs, doc_tokens)
    build = FAMILIES[family].build
    return [build(random.Random(f"{family}/{seed}/{i}"), k) for i in range(n)]
