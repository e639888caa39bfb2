"""Random pydantic types — models nesting models, optional and defaulted fields, unions, enums,
literals, constrained strings and numbers, lists, tuples, sets, dicts with constrained keys, dates,
UUIDs, durations — turned into their JSON Schemas, compiled, and written by random draws under the
mask: every text pydantic's own validator must accept. pydantic is the independent reference; the
types are drawn from a seed, so a failure names a reproducible type."""

import datetime
import enum
import random
import uuid
from typing import Annotated, Literal

import pytest

from tests.engine.test_structured import _written, tokenizer, vocab  # noqa: F401 — module-scoped fixtures

pytest.importorskip("pydantic")  # the references here; the GPU machine's environment lacks it
from pydantic import BaseModel, Field, TypeAdapter, conint, constr, create_model  # noqa: E402


class Shade(enum.Enum):
    DARK = "dark"
    LIGHT = "light"


class Size(enum.IntEnum):
    S = 1
    M = 2
    L = 3


# (not Decimal: its schema is {"anyOf": [{"type": "number"}, {"type": "string"}]}, any string, which its
# validator then refuses unless it spells a number — the schema, not the draw, is loose there)
LEAVES = [
    int, float, bool, str, type(None), datetime.date, datetime.datetime, datetime.time, datetime.timedelta, uuid.UUID,
    Shade, Size, Literal["yes", "no"], Literal[1, 2, 3],
    conint(ge=0, le=100), conint(gt=-5, lt=5, multiple_of=2), Annotated[float, Field(ge=0, le=1)],
    constr(min_length=1, max_length=8), constr(pattern=r"^[a-z]{2,5}$"),
    Annotated[float, Field(multiple_of=0.25, ge=-2, le=2)],
]


def _type(rng: random.Random, depth: int, names: list[int]) -> object:
    """A random type; containers and models while ``depth`` lasts."""
    if depth == 0 or rng.random() < 0.35:
        return rng.choice(LEAVES)
    inner = _type(rng, depth - 1, names)
    kind = rng.randrange(11)
    if kind == 0:
        return list[inner]
    if kind == 1:
        return Annotated[list[inner], Field(min_length=1, max_length=3)]
    if kind == 2:
        return inner | None
    if kind == 3:
        return inner | _type(rng, depth - 1, names)
    if kind == 4:
        return tuple[inner, rng.choice(LEAVES)]
    if kind == 5:
        return rng.choice([set[str], set[Shade], set[int], frozenset[Size], set[bool], set[conint(ge=0, le=5)],
                           set[float], set[conint(gt=-10, multiple_of=3)]])
    if kind == 6:
        return dict[rng.choice([str, Shade, Literal["a", "b"], constr(pattern=r"^k[0-9]$")]), inner]
    if kind == 7:
        return Annotated[dict[str, inner], Field(min_length=rng.randint(0, 2), max_length=rng.choice([None, 3]))]
    return _model(rng, depth - 1, names)


def _model(rng: random.Random, depth: int, names: list[int]) -> type[BaseModel]:
    names.append(len(names))
    fields = {}
    for i in range(rng.randint(1, 4)):
        t = _type(rng, depth, names)
        if rng.random() < 0.3:
            fields[f"f{i}"] = (t | None, None)  # optional: a default, not required
        else:
            fields[f"f{i}"] = (t, ...)
    return create_model(f"M{names[-1]}", **fields)


@pytest.mark.parametrize("seed", range(40))
def test_random_pydantic_types_draws_validate(vocab, seed: int) -> None:  # noqa: F811 — the fixture
    rng = random.Random(seed)
    kind = _model(rng, 3, [])
    adapter = TypeAdapter(kind)
    schema = adapter.json_schema()
    for draw in range(2):
        text = _written(vocab, schema, random.Random(seed * 10 + draw), 1500, closer=200.0).decode()
        adapter.validate_json(text)
