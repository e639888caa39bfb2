"""The fictional world behind every task: entities, the relations between them, and their wording.

A world is sampled per example (or per trace), so facts are random and only the documents tell
them. Each relation carries its own sentence templates (a little variety, so the model learns
to read rather than match one string), question templates, the canonical phrase used in summary
answers, and, for relations whose value is another entity, the noun phrase ("the mentor of X")
that multi-hop questions chain through.
"""

import random
from dataclasses import dataclass

from hypic.eval import vocab


@dataclass(frozen=True)
class Relation:
    name: str
    subject: str  # "person" | "org"
    values: str  # a key of VALUES, or "person" / "org" when the value is another entity
    facts: tuple[str, ...]  # sentence templates: {s} subject phrase, {v} value phrase
    questions: tuple[str, ...]  # question templates: {s} subject phrase
    summary: str  # canonical phrase in summary answers: {v} value phrase
    topic: str = ""  # report section heading (organisation relations)
    link: str = ""  # noun phrase for the value entity, e.g. "the mentor of {s}" (entity-valued relations)


VALUES: dict[str, tuple[str, ...]] = {
    "city": tuple(vocab.CITIES),
    "region": tuple(vocab.REGIONS),
    "job": tuple(vocab.JOBS),
    "instrument": tuple(vocab.INSTRUMENTS),
    "pet": tuple(vocab.PETS),
    "colour": tuple(vocab.COLOURS),
    "food": vocab.FOODS,
    "product": vocab.PRODUCTS,
    "budget": vocab.BUDGET_MOVES,
    "staff": tuple(vocab.STAFF_SIZES),
    "risk": tuple(vocab.RISKS),
    "advice": vocab.ADVICE,
}

_R = Relation
RELATIONS: dict[str, Relation] = {r.name: r for r in (
    _R("home", "person", "city", ("{s} lives in {v}.", "{s} has a home in {v}.", "The home of {s} is in {v}."),
       ("Where does {s} live?", "In which city does {s} live?"), "lives in {v}"),
    _R("birthplace", "person", "city", ("{s} was born in {v}.", "The birthplace of {s} is {v}."),
       ("Where was {s} born?", "In which city was {s} born?"), "born in {v}"),
    _R("job", "person", "job", ("{s} works as {v}.", "{s} earns a living as {v}.", "By trade, {s} is {v}."),
       ("What is the job of {s}?", "What does {s} do for a living?"), "works as {v}"),
    _R("employer", "person", "org", ("{s} works for {v}.", "{s} is employed by {v}.", "{s} has a job at {v}."),
       ("Which organisation employs {s}?", "Who does {s} work for?"), "works for {v}", link="the employer of {s}"),
    _R("instrument", "person", "instrument", ("{s} plays {v}.", "{s} practises {v} every evening."),
       ("Which instrument does {s} play?", "What instrument does {s} play?"), "plays {v}"),
    _R("pet", "person", "pet", ("{s} keeps {v} as a pet.", "The pet of {s} is {v}.", "{s} owns {v}."),
       ("What pet does {s} keep?", "Which animal does {s} keep as a pet?"), "keeps {v}"),
    _R("colour", "person", "colour",
       ("The favourite colour of {s} is {v}.", "{s} likes the colour {v} best.", "{s} loves the colour {v}."),
       ("What is the favourite colour of {s}?", "Which colour does {s} like best?"), "favourite colour {v}"),
    _R("food", "person", "food", ("{s} likes to eat {v}.", "The favourite dish of {s} is {v}.", "{s} often cooks {v}."),
       ("What food does {s} like best?", "What is the favourite dish of {s}?"), "likes {v}"),
    _R("mentor", "person", "person",
       ("{s} was trained by {v}.", "The mentor of {s} is {v}.", "{s} learned the trade from {v}."),
       ("Who is the mentor of {s}?", "Who trained {s}?"), "trained by {v}", link="the mentor of {s}"),
    _R("hq", "org", "city", ("{s} is based in {v}.", "The main office of {s} is in {v}.",
                              "{s} has its headquarters in {v}."),
       ("Where is {s} based?", "In which city is {s} based?"), "based in {v}", topic="location"),
    _R("founder", "org", "person", ("{s} was founded by {v}.", "{v} founded {s}."),
       ("Who founded {s}?", "Who is the founder of {s}?"), "founded by {v}", topic="history",
       link="the founder of {s}"),
    _R("leader", "org", "person", ("{s} is led by {v}.", "{v} is the leader of {s}."),
       ("Who leads {s}?", "Who is the leader of {s}?"), "led by {v}", topic="leadership",
       link="the leader of {s}"),
    _R("product", "org", "product", ("{s} makes {v}.", "{s} is known for its {v}."),
       ("What does {s} make?", "Which goods does {s} make?"), "makes {v}", topic="products"),
    _R("partner", "org", "org", ("{s} works closely with {v}.", "{s} has a partnership with {v}."),
       ("Which organisation works with {s}?", "Who is the partner of {s}?"), "partners with {v}",
       topic="partners", link="the partner of {s}"),
    _R("budget", "org", "budget", ("The budget of {s} {v} this year.", "This year the budget of {s} {v}."),
       ("What happened to the budget of {s}?",), "budget {v}", topic="finances"),
    _R("staff", "org", "staff", ("{s} employs {v} workers.", "{s} has {v} workers on its payroll."),
       ("How many workers does {s} employ?",), "employs {v} workers", topic="staff"),
    _R("risk", "org", "risk", ("The main risk for {s} is {v}.", "{s} is most threatened by {v}."),
       ("What is the main risk for {s}?",), "main risk {v}", topic="risks"),
    _R("advice", "org", "advice", ("The report advises {s} to {v}.", "The auditors say {s} should {v}."),
       ("What is {s} advised to do?",), "should {v}", topic="advice"),
    _R("region", "org", "region", ("{s} serves the {v} region.", "Most customers of {s} live in the {v} region."),
       ("Which region does {s} serve?",), "serves {v}", topic="customers"),
)}
PERSON_RELATIONS = tuple(r for r in RELATIONS.values() if r.subject == "person")
ORG_RELATIONS = tuple(r for r in RELATIONS.values() if r.subject == "org")
LINK_RELATIONS = tuple(r for r in RELATIONS.values() if r.link)


@dataclass
class Entity:
    name: str
    kind: str  # "person" | "org"
    facts: dict[str, str]  # relation name -> value (another entity's name for links)

    @property
    def phrase(self) -> str:
        """How sentences name it: organisations take an article ("the Brassline Guild")."""
        return f"the {self.name}" if self.kind == "org" else self.name


@dataclass
class World:
    people: list[Entity]
    orgs: list[Entity]

    def get(self, name: str) -> Entity:
        return next(e for e in self.people + self.orgs if e.name == name)


INDEFINITE = ("job", "pet")  # value kinds the documents give an indefinite article ("a weaver")


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def value_phrase(rel: Relation, value: str) -> str:
    """The value as it reads inside a sentence; the bare value is always a contiguous part of it."""
    if rel.values == "org" or rel.values == "instrument":
        return f"the {value}"
    if rel.values in INDEFINITE:
        return article(value)
    return value


def answer_phrase(rel: Relation, value: str) -> str:
    """A QA reference answer: the value, keeping the indefinite article the documents give it ("a
    weaver", "an owl"). Scoring drops articles (SQuAD's normalisation), so this changes no score; it
    lets a model answer by copying the span the document holds. A model trained on bare values
    learned to read the article ("an" → the one pet that starts with a vowel) but never the noun
    after "a" (docs/training.md, session 5)."""
    return article(value) if rel.values in INDEFINITE else value


def sentence(template: str, s: str, v: str = "") -> str:
    text = template.format(s=s, v=v)
    return text[0].upper() + text[1:]


def _names(rng: random.Random, n: int, firsts: list[str], lasts: list[str]) -> list[str]:
    """n distinct two-word names; while they fit, no two share a word, so a name is never half-confusable."""
    if n <= min(len(firsts), len(lasts)):
        return [f"{a} {b}" for a, b in zip(rng.sample(firsts, n), rng.sample(lasts, n), strict=True)]
    if n > len(firsts) * len(lasts):
        raise ValueError(f"a world holds at most {len(firsts) * len(lasts)} such names, asked for {n}")
    picks = rng.sample(range(len(firsts) * len(lasts)), n)
    return [f"{firsts[i // len(lasts)]} {lasts[i % len(lasts)]}" for i in picks]


def sample_world(rng: random.Random, n_people: int, n_orgs: int) -> World:
    """Random entities with every relation filled; links point at other entities of this world."""
    people = [Entity(n, "person", {}) for n in _names(rng, n_people, vocab.FIRST_NAMES, vocab.LAST_NAMES)]
    orgs = [Entity(n, "org", {}) for n in _names(rng, n_orgs, vocab.ORG_STEMS, vocab.ORG_KINDS)]
    pools = {"person": people, "org": orgs}
    for e in people + orgs:
        for rel in PERSON_RELATIONS if e.kind == "person" else ORG_RELATIONS:
            if rel.values in pools:
                others = [o.name for o in pools[rel.values] if o is not e]
                if others:  # a world too small for this link simply leaves it out
                    e.facts[rel.name] = rng.choice(others)
            else:
                e.facts[rel.name] = rng.choice(VALUES[rel.values])
    return World(people, orgs)
