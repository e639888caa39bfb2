"""Documents: fact sentences padded with filler to a target length.

Each document is cached and tokenized on its own, so each names its subject in full in a title
and in every fact (no pronouns reaching across documents). Length is counted with
`approx_tokens` (words and punctuation marks), which tracks the trained BPE closely because the
closed vocabulary makes nearly every word one token. Filler sentences carry no facts and use no
value words, so they change length without changing answers.
"""

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hypic.eval import vocab
from hypic.eval.world import RELATIONS, Entity, Relation, sentence, value_phrase

_WORDS = re.compile(r"\w+|[^\w\s]")


def approx_tokens(text: str) -> int:
    """Words plus punctuation marks: the token count of the trained tokenizer, give or take a few percent."""
    return len(_WORDS.findall(text))


def fact(rng: random.Random, entity: Entity, rel: Relation) -> str:
    return sentence(rng.choice(rel.facts), entity.phrase, value_phrase(rel, entity.facts[rel.name]))


def person_filler(rng: random.Random, subject: str) -> str:
    form = rng.randrange(3)
    if form == 0:
        body = f"{rng.choice(vocab.FILLER_ACTS)} {rng.choice(vocab.FILLER_OBJECTS)} {rng.choice(vocab.FILLER_TIMES)}"
    elif form == 1:
        body = f"{rng.choice(vocab.FILLER_HABITS)} {rng.choice(vocab.FILLER_TOPICS)}"
    else:
        body = f"{rng.choice(vocab.FILLER_GOES)} to {rng.choice(vocab.FILLER_PLACES)} {rng.choice(vocab.FILLER_TIMES)}"
    return sentence(f"{{s}} {body}.", subject)


def org_filler(rng: random.Random, subject: str) -> str:
    act, obj = rng.choice(vocab.ORG_FILLER_ACTS), rng.choice(vocab.ORG_FILLER_OBJECTS)
    return sentence(f"{{s}} {act} {obj} {rng.choice(vocab.FILLER_TIMES)}.", subject)


def scene_filler(rng: random.Random) -> str:
    return sentence(f"{rng.choice(vocab.SCENES)} {rng.choice(vocab.FILLER_TIMES)}.", "")


def fit(rng: random.Random, title: str, fixed: Sequence[str], optional: Sequence[str],
        filler: Callable[[], str], target: int) -> str:
    """Title, then `fixed` sentences mixed with optional facts and filler, up to `target` tokens.

    Fixed sentences are always kept (a document may overshoot a tiny target rather than lose its
    evidence); the rest is added while it fits, so the result lands within one sentence of the target.
    """
    body = list(fixed)
    used = approx_tokens(title) + sum(approx_tokens(s) for s in body)
    spare = list(optional)
    rng.shuffle(spare)
    misses = 0
    while misses < 4:  # a few short fillers may still fit after a long one did not
        s = spare.pop() if spare and rng.random() < 0.5 else filler()
        n = approx_tokens(s)
        if used + n <= target:
            body.append(s)
            used += n
        else:
            misses += 1
    rng.shuffle(body)
    return " ".join([title, *body])


@dataclass(frozen=True)
class Doc:
    text: str
    stated: tuple[str, ...]  # names of the relations whose facts the text states


def profile(rng: random.Random, entity: Entity, target: int, required: Sequence[str] = (),
            avoid: frozenset[str] = frozenset()) -> Doc:
    """A document about one entity: its required facts, some of its other facts, filler.

    `avoid` holds value strings that must not appear (e.g. the answer, in the first hop's document).
    """
    rels = [RELATIONS[r] for r in entity.facts]
    fixed = [fact(rng, entity, RELATIONS[r]) for r in required]
    others = [r for r in rels if r.name not in required and entity.facts[r.name] not in avoid]
    opt_text = {fact(rng, entity, r): r.name for r in others}
    if entity.kind == "person":
        title = sentence("Profile of {s}.", entity.phrase)
        text = fit(rng, title, fixed, list(opt_text), lambda: person_filler(rng, entity.phrase), target)
    else:
        title = sentence("Notes on {s}.", entity.phrase)
        text = fit(rng, title, fixed, list(opt_text), lambda: org_filler(rng, entity.phrase), target)
    stated = tuple(required) + tuple(name for s, name in opt_text.items() if s in text)
    return Doc(text, stated)


def news(rng: random.Random, city: str, target: int, fixed: Sequence[str],
         cast: Sequence[Entity], avoid: frozenset[str]) -> str:
    """A news brief from a town: `fixed` sentences plus facts and filler about a cast of other people."""
    optional = [fact(rng, p, RELATIONS[r]) for p in cast for r in p.facts if p.facts[r] not in avoid]

    def filler() -> str:
        return person_filler(rng, rng.choice(cast).phrase) if rng.random() < 0.6 else scene_filler(rng)

    return fit(rng, f"News from {city}.", fixed, optional, filler, target)


def report_section(rng: random.Random, org: Entity, part: int, parts: int, rel: Relation | None,
                   target: int) -> str:
    """One part of a long report on an organisation: at most one finding, the rest filler."""
    title = sentence(f"Report on {{s}}, part {part} of {parts}: {rel.topic if rel else 'background'}.", org.phrase)
    fixed = [fact(rng, org, rel)] if rel else []
    return fit(rng, title, fixed, (), lambda: org_filler(rng, org.phrase), target)
