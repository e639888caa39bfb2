"""Objects whose keys are counted or constrained — ``minProperties`` / ``maxProperties``, ``propertyNames``,
``patternProperties`` (pydantic's ``dict[SomeEnum, …]``, ``dict[Literal[…], …]``,
``dict[constr(pattern=…), …]``, ``Field(min_length=…)`` on a dict) — against a direct reading of the
schema over Python's parsed JSON (each key's pairs kept, so that a repeated key shows), on random
texts, random draws under the mask, masks against every token, and pydantic's validators."""

import enum
import json
import random
import re
from typing import Annotated, Literal

import pytest

from hypic.engine.structured import compile_schema
from tests.engine.test_structured import (  # noqa: F401 — tokenizer, vocab: module-scoped fixtures
    _matches,
    _written,
    tokenizer,
    vocab,
    walk_masks_every_token,
    walk_never_stranded,
)

pytest.importorskip("pydantic")  # the references here; the GPU machine's environment lacks it
from pydantic import Field, TypeAdapter, constr  # noqa: E402

INT = {"type": "integer"}
SCHEMAS = {
    "dict min 2": {"type": "object", "additionalProperties": INT, "minProperties": 2},
    "dict max 2": {"type": "object", "additionalProperties": INT, "maxProperties": 2},
    "dict 1 to 3": {"type": "object", "additionalProperties": INT, "minProperties": 1, "maxProperties": 3},
    "enum keys": {"type": "object", "additionalProperties": INT, "propertyNames": {"enum": ["a", "b", "ab"]}},
    "enum keys, min 2": {"type": "object", "additionalProperties": INT, "propertyNames": {"enum": ["a", "b", "ab"]},
                         "minProperties": 2},
    "pattern keys": {"type": "object", "patternProperties": {"^[ab]+$": INT}},
    "pattern keys, max 1": {"type": "object", "patternProperties": {"^[ab]+$": INT}, "maxProperties": 1},
    "declared 2 of 3": {"type": "object", "properties": {"a": INT, "b": INT, "c": INT}, "required": ["c"],
                        "minProperties": 2, "maxProperties": 2},
    "declared at least 2": {"type": "object", "properties": {"a": INT, "b": INT, "c": INT}, "minProperties": 2},
}


def _pairs(text: str) -> list[tuple[str, object]] | None:
    """The object's (key, value) pairs in order, repeats kept; None when the text is no JSON object."""
    try:
        pairs = json.loads(text, object_pairs_hook=lambda p: p)
    except json.JSONDecodeError:
        return None
    return pairs if isinstance(pairs, list) else None


def _valid(schema: dict, text: str) -> bool:
    """The schema read directly over the parsed object (integers as values: all these schemas use)."""
    pairs = _pairs(text)
    if pairs is None:
        return False
    obj = dict(pairs)
    if not schema.get("minProperties", 0) <= len(obj) <= schema.get("maxProperties", 10**9):
        return False
    if any(not isinstance(v, int) or isinstance(v, bool) for v in obj.values()):
        return False
    props = schema.get("properties", {})
    if props and (any(k not in props for k in obj) or any(r not in obj for r in schema.get("required", []))):
        return False
    if "propertyNames" in schema and any(k not in schema["propertyNames"]["enum"] for k in obj):
        return False
    return all(re.search(p, k) for p in schema.get("patternProperties", {}) for k in obj)


def _as_generated(schema: dict, text: str) -> bool:
    """Whether the text has the form hypic writes: each key once, only declared keys (if any) and in
    their order."""
    keys = [k for k, _ in _pairs(text) or []]
    order = list(schema.get("properties", {}))
    if order and any(k not in order for k in keys):
        return False
    return len(set(keys)) == len(keys) and (not order or keys == sorted(keys, key=order.index))


@pytest.mark.parametrize("name", SCHEMAS)
def test_random_objects_are_read_as_the_schema_says(name: str) -> None:
    """Random compact objects of keys from a small pool: where each key is written once (and declared
    keys in order — the form generated), accepted exactly when the direct reading says; with a repeated
    key, accepted only if valid too (a counted object never takes one where it could count twice)."""
    schema, rng = SCHEMAS[name], random.Random(name)
    pool = ["a", "b", "c", "ab", "A", ""]
    seen = {True: 0, False: 0}
    for _ in range(1500):
        keys = [rng.choice(pool) for _ in range(rng.randint(0, 4))]
        text = "{" + ",".join(f'"{k}":{rng.choice(["1", "-2", "true"])}' for k in keys) + "}"
        got = _matches(schema, text)
        if _as_generated(schema, text):
            assert got == _valid(schema, text), text
            seen[got] += 1
        elif got:
            assert _valid(schema, text), text
    assert seen[True] > 10 and seen[False] > 10, seen
    if schema.get("minProperties", 0) >= 2 and "patternProperties" not in schema:  # keys told apart: written once
        assert not _matches(schema, '{"a":1,"a":2,"b":3}') and not _matches(schema, '{"a":1,"b":2,"a":3}')


@pytest.mark.parametrize("name", SCHEMAS)
def test_no_walk_is_ever_stranded(name: str) -> None:
    """300 random walks over the bytes these objects are made of, each byte drawn among those the
    matcher lets through: some byte, or the end, is always allowed (no comma where no key can
    follow, no key after which the count cannot be met), and every object a walk ends on is valid."""
    schema, rng = SCHEMAS[name], random.Random(1)
    node = compile_schema(schema)
    for _ in range(300):
        text = walk_never_stranded(node, '{}":,abcA1-', rng, 0.2, give_up_past=60)
        assert text is None or _valid(schema, text), (name, text)


@pytest.mark.parametrize("name", SCHEMAS)
def test_draws_under_the_mask_end_in_objects_the_schema_accepts(vocab, name: str) -> None:  # noqa: F811
    schema = SCHEMAS[name]
    for seed in range(6):
        text = _written(vocab, schema, random.Random(seed), 300, closer=60.0).decode()
        assert _valid(schema, text) and _as_generated(schema, text), text


def test_distinct_keys_masks_equal_every_token_and_draws_never_repeat_a_key(vocab) -> None:  # noqa: F811
    """Free string keys due twice or more are written once each: at every state the mask is exactly
    the tokens the matcher reads (the free-string shortcut inside a key read by the object itself)."""
    schema = {"type": "object", "additionalProperties": {"type": "boolean"}, "minProperties": 3}
    rng = random.Random(5)
    for _ in range(4):
        text = walk_masks_every_token(vocab, schema, rng)
        pairs = _pairs(text.decode())
        assert pairs is not None and len(pairs) >= 3 and len({k for k, _ in pairs}) == len(pairs), text


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"
    GREEN = "green"


TYPES = {
    "dict[Colour, int], at least 2": Annotated[dict[Colour, int], Field(min_length=2)],
    "dict[Literal, int], at most 1": Annotated[dict[Literal["x", "y"], int], Field(max_length=1)],
    "dict[pattern, int]": dict[constr(pattern=r"^[a-z]{2,4}$"), int],
    "dict[str, int], 2 to 3": Annotated[dict[str, int], Field(min_length=2, max_length=3)],
}


@pytest.mark.parametrize("name", TYPES)
def test_pydantic_dicts_schemas_compile_and_their_draws_validate(vocab, name: str) -> None:  # noqa: F811
    adapter = TypeAdapter(TYPES[name])
    schema = adapter.json_schema()
    for seed in range(6):
        text = _written(vocab, schema, random.Random(seed), 300, closer=400.0).decode()
        adapter.validate_json(text)
        assert _as_generated(schema, text), text


@pytest.mark.parametrize("schema, needle", [
    ({"type": "object", "minProperties": 3, "maxProperties": 2}, "maxProperties 2 is below minProperties 3"),
    ({"type": "object", "properties": {"a": INT}, "minProperties": 2}, "only 1 properties are declared"),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "required": ["a", "b"], "maxProperties": 1},
     "below its 2 required"),
    ({"type": "object", "additionalProperties": False, "minProperties": 1}, "additionalProperties is false"),
    ({"type": "object", "propertyNames": {"enum": ["a", "b"]}, "minProperties": 3}, "only 2 values"),
    ({"type": "object", "propertyNames": {"maxLength": 3}, "minProperties": 2}, "keys bounded by a pattern"),
    ({"type": "object", "patternProperties": {"^a": INT}, "minProperties": 2}, "keys bounded by a pattern"),
    ({"type": "object", "propertyNames": {"type": "integer"}}, "propertyNames is supported .* enum of strings"),
    ({"type": "object", "propertyNames": {"enum": ["a", 1]}}, "propertyNames is supported"),
    ({"type": "object", "patternProperties": {"^a": INT, "^b": INT}}, "with one pattern is supported in .*, got 2"),
    ({"type": "object", "properties": {"a": INT}, "patternProperties": {"^a": INT}}, "patternProperties beside prop"),
    ({"type": "object", "propertyNames": {"enum": ["a"]}, "patternProperties": {"^a": INT}},
     "propertyNames beside patternProperties"),
    ({"type": "object", "patternProperties": {"^a$": INT, }, "maxProperties": -1}, "maxProperties must be"),
])
def test_objects_no_generation_can_satisfy_or_serve_are_refused_by_name(schema: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        compile_schema(schema)
