"""A JSON Schema compiled into the value nodes the structured-output matcher walks.

Structured output (OpenAI's ``response_format``, vLLM's guided JSON) constrains decoding so the
text generated *is* a JSON value the schema accepts. The subset here is what generation can
enforce byte by byte: ``type`` (one or a list), ``properties`` / ``required`` /
``additionalProperties``, ``items`` / ``prefixItems`` / ``minItems`` / ``maxItems``, ``minLength`` / ``maxLength``,
``pattern`` (``hypic.engine.structured.regex``'s subset), ``format`` (``FORMATS``: date, time,
date-time, uuid, ipv4, email — as patterns), ``enum``, ``const``, ``anyOf`` / ``oneOf``, a
one-element ``allOf``, and local ``$ref`` into ``$defs`` / ``definitions`` (pydantic's models).
``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum`` (``bounds``; a bounded
number is written without an exponent). Annotations (``title``, ``description``, ``default`` …) are
ignored. Any other keyword (``multipleOf``, ``uniqueItems`` …) or format is refused by name rather
than silently not enforced: an output the caller's validator then rejects is worse than a 400.

Choices of the generator, not of JSON Schema: an object with declared ``properties`` gets only
those keys (each at most once, ``required`` ones before ``}``; an undeclared key would be allowed
by default ``additionalProperties``, never needed); ``oneOf`` is generated as ``anyOf`` (a value
matching two options is not excluded); enum and const values are written in compact JSON.

Nodes compare by identity (``eq=False``): the matcher's states hold them and are hashed every step,
and the same schema text compiles to the same nodes (``compile_schema`` is cached), so requests
with one schema share the vocabulary's memo of allowed tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache

from hypic.engine.structured.bounds import Bounds, feasible
from hypic.engine.structured.regex import Regex, compile_regex

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                         "deprecated", "readOnly", "writeOnly", "$defs", "definitions"})
KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
                      "minLength", "maxLength", "pattern", "format", "enum", "const", "anyOf", "oneOf", "allOf",
                      "$ref", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "prefixItems"})
# the formats enforced, as patterns (RFC 3339 dates and times, RFC 4122 UUIDs, dotted IPv4, a plain e-mail shape)
_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d{1,9})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
_DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
FORMATS = {
    "date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}[Tt]{_TIME}$",
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "ipv4": rf"^{_OCTET}(\.{_OCTET}){{3}}$",
    "email": r"^[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(\.[A-Za-z0-9-]{1,63})*\.[A-Za-z]{2,24}$",
}
MAX_DIGITS = 16  # per part of a number (the matcher's bound)
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")


@dataclass(eq=False, frozen=True)
class AnyValue:
    """Any JSON value; its type is chosen by its first byte."""


@dataclass(eq=False, frozen=True)
class Obj:
    props: dict[bytes, Node]  # escaped key bytes (as between the quotes) → the value's node; empty: free keys
    required: frozenset[bytes]
    extra: Node | None  # the values of free keys (used when ``props`` is empty); None: no key at all


@dataclass(eq=False, frozen=True)
class Arr:
    items: Node | None  # the items after ``prefix``; None: none (``items: false``)
    min_items: int
    max_items: int | None  # with ``items`` None, at most len(prefix)
    prefix: tuple[Node, ...] = ()  # ``prefixItems``: item i's own schema (tuples)


@dataclass(eq=False, frozen=True)
class Str:
    min_len: int  # in characters (an escape is one)
    max_len: int | None
    pattern: Regex | None = None  # ``pattern`` or ``format``: read character by character


@dataclass(eq=False, frozen=True)
class Num:
    integer: bool
    bounds: Bounds | None = None  # minimum / maximum (exclusive or not): written without an exponent


@dataclass(eq=False, frozen=True)
class Lit:
    """One of a few exact texts: enum and const values, true / false / null."""

    values: frozenset[bytes]


@dataclass(eq=False, frozen=True)
class Alt:
    options: tuple[Node, ...]


@dataclass(eq=False)
class Ref:
    """A ``$ref``; its target is set once every definition is compiled (definitions may recurse)."""

    name: str
    target: Node | None = None


Node = AnyValue | Obj | Arr | Str | Num | Lit | Alt | Ref

ANY = AnyValue()
ANY_OBJ = Obj({}, frozenset(), ANY)
ANY_ARR = Arr(ANY, 0, None)
ANY_STR = Str(0, None)
NUMBER = Num(False)
BOOL = Lit(frozenset({b"true", b"false"}))
NULL = Lit(frozenset({b"null"}))


def compact(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def compile_schema(schema: object) -> Node:
    """The node tree of a JSON Schema (a dict, or True for any value); ValueError naming what is
    wrong or unsupported. Cached by the schema's text: equal schemas give the same nodes."""
    try:
        text = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"json_schema: not JSON ({e})") from None
    return _compile_text(text)


@lru_cache(maxsize=64)
def _compile_text(text: str) -> Node:
    schema = json.loads(text)
    if schema is True:
        return ANY
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema: expected an object (or true), got {text[:80]}")
    refs: dict[str, Ref] = {}
    node = _node(schema, "json_schema", refs)
    while pending := [r for r in refs.values() if r.target is None]:  # definitions may name more
        for ref in pending:
            section, _, key = ref.name.removeprefix("#/").partition("/")
            defs = schema.get(section)
            if not isinstance(defs, dict) or key not in defs:
                raise ValueError(f"json_schema: $ref {ref.name!r} names no definition in this schema")
            ref.target = _node(defs[key], f"json_schema.{section}.{key}", refs)
    return node


def _node(schema: object, where: str, refs: dict[str, Ref]) -> Node:
    if schema is True:
        return ANY
    if schema is False:
        raise ValueError(f"{where}: the schema false accepts no value")
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: expected a schema object, got {json.dumps(schema)[:80]}")
    unknown = sorted(set(schema) - KEYWORDS - ANNOTATIONS)
    if unknown:
        raise ValueError(f"{where}: JSON Schema keyword {unknown[0]!r} is not supported in structured output "
                         f"(supported: {', '.join(sorted(KEYWORDS))})")
    keys = set(schema) - ANNOTATIONS
    if "$ref" in schema:
        _alone(schema, "$ref", where)
        name = schema["$ref"]
        if not isinstance(name, str) or not name.startswith(("#/$defs/", "#/definitions/")):
            raise ValueError(f"{where}: $ref {name!r}: only local references into $defs or definitions are supported")
        return refs.setdefault(name, Ref(name))
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list) or not values:
            raise ValueError(f"{where}: enum must be a non-empty list")
        kinds = schema.get("type")
        if kinds is not None:  # both given: the values of those types only
            kinds = kinds if isinstance(kinds, list) else [kinds]
            values = [v for v in values if any(_is(v, k) for k in kinds)]
            if not values:
                raise ValueError(f"{where}: no enum value is of type {schema['type']}")
        return Lit(frozenset(compact(v) for v in values))
    for word in ("anyOf", "oneOf", "allOf"):
        if word in schema:
            _alone(schema, word, where)
            options = schema[word]
            if not isinstance(options, list) or not options:
                raise ValueError(f"{where}: {word} must be a non-empty list of schemas")
            if word == "allOf" and len(options) != 1:
                raise ValueError(f"{where}: allOf with more than one schema is not supported in structured output")
            nodes = tuple(_node(o, f"{where}.{word}[{i}]", refs) for i, o in enumerate(options))
            return nodes[0] if len(nodes) == 1 else Alt(nodes)
    kind = schema.get("type")
    if kind is None:
        kind = "object" if {"properties", "required", "additionalProperties"} & keys else \
            "array" if {"items", "prefixItems", "minItems", "maxItems"} & keys else \
            "string" if {"minLength", "maxLength", "pattern", "format"} & keys else \
            "number" if {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & keys else None
        if kind is None:
            return ANY
    if isinstance(kind, list):
        if not kind or any(k not in TYPES for k in kind):
            raise ValueError(f"{where}: type must be one of {list(TYPES)} or a non-empty list of them")
        return Alt(tuple(_typed(schema, k, where, refs) for k in dict.fromkeys(kind))) if len(kind) > 1 \
            else _typed(schema, kind[0], where, refs)
    if kind not in TYPES:
        raise ValueError(f"{where}: type must be one of {list(TYPES)}, got {kind!r}")
    return _typed(schema, kind, where, refs)


_PYTHON_TYPES = {"object": dict, "array": list, "string": str, "null": type(None), "integer": int,
                 "number": (int, float)}


def _is(value: object, kind: object) -> bool:
    """Whether a JSON value is of a JSON Schema type (an integer is a number too; so is 1.0 an integer)."""
    if isinstance(value, bool):
        return kind == "boolean"
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    python = _PYTHON_TYPES.get(kind) if isinstance(kind, str) else None
    return python is not None and isinstance(value, python)


def _alone(schema: dict, word: str, where: str) -> None:
    others = sorted(set(schema) - ANNOTATIONS - {word})
    if others:
        raise ValueError(f"{where}: {word} beside {others[0]!r} is not supported in structured output")


def _count(schema: dict, name: str, where: str) -> int | None:
    value = schema.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    return value


def _bounds(schema: dict, integer: bool, where: str) -> Bounds | None:
    """minimum / maximum and their exclusive forms (a number each; draft 4's boolean forms too)."""
    def number(name: str) -> Decimal | None:
        value = schema.get(name)
        if value is None or isinstance(value, bool):
            return None
        if not isinstance(value, (int, float)) or value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{where}: {name} must be a finite number, got {value!r}")
        return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)

    low, high = number("minimum"), number("maximum")
    low_open, high_open = schema.get("exclusiveMinimum") is True, schema.get("exclusiveMaximum") is True  # draft 4
    low_open, high_open = low_open and low is not None, high_open and high is not None
    floor, ceiling = number("exclusiveMinimum"), number("exclusiveMaximum")  # draft 6 on: bounds of their own
    if floor is not None and (low is None or floor >= low):
        low, low_open = floor, True
    if ceiling is not None and (high is None or ceiling <= high):
        high, high_open = ceiling, True
    if low is None and high is None:
        return None
    bounds = Bounds(low, high, low_open, high_open)
    if not feasible("", integer, bounds, MAX_DIGITS - 1):
        raise ValueError(f"{where}: no {'integer' if integer else 'number'} of at most {MAX_DIGITS} digits "
                         "lies within its minimum and maximum")
    return bounds


def _pattern(schema: dict, where: str) -> Regex | None:
    """A string's ``pattern`` or ``format`` as a compiled regex (both at once: refused)."""
    pattern, fmt = schema.get("pattern"), schema.get("format")
    if pattern is not None and fmt is not None:
        raise ValueError(f"{where}: pattern beside format is not supported in structured output")
    if fmt is not None:
        if fmt not in FORMATS:
            raise ValueError(f"{where}: format {fmt!r} is not supported in structured output "
                             f"(supported: {', '.join(sorted(FORMATS))})")
        pattern = FORMATS[fmt]
    if pattern is None:
        return None
    if not isinstance(pattern, str):
        raise ValueError(f"{where}: pattern must be a string")
    try:
        return _regex(pattern)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


@lru_cache(maxsize=256)
def _regex(pattern: str) -> Regex:
    return compile_regex(pattern)


def _typed(schema: dict, kind: str, where: str, refs: dict[str, Ref]) -> Node:
    if kind == "object":
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise ValueError(f"{where}: properties must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or any(not isinstance(r, str) for r in required):
            raise ValueError(f"{where}: required must be a list of property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise ValueError(f"{where}: required property {missing[0]!r} is not among the properties")
        extra = schema.get("additionalProperties", True)
        nodes = {compact(k)[1:-1]: _node(v, f"{where}.properties.{k}", refs) for k, v in props.items()}
        free = None if props or extra is False else _node(extra, f"{where}.additionalProperties", refs)
        return Obj(nodes, frozenset(compact(r)[1:-1] for r in required), free)
    if kind == "array":
        items = schema.get("items", True)
        if isinstance(items, list):
            raise ValueError(f"{where}: items as a list (draft 4's tuples) is not supported in structured output; "
                             "use prefixItems")
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise ValueError(f"{where}: prefixItems must be a list of schemas")
        low, high = _count(schema, "minItems", where) or 0, _count(schema, "maxItems", where)
        if items is False:
            high = len(prefix) if high is None else min(high, len(prefix))
        if high is not None and high < low:
            raise ValueError(f"{where}: maxItems {high} is below minItems {low}")
        return Arr(None if items is False else _node(items, f"{where}.items", refs), low, high,
                   tuple(_node(p, f"{where}.prefixItems[{i}]", refs) for i, p in enumerate(prefix)))
    if kind == "string":
        low, high = _count(schema, "minLength", where) or 0, _count(schema, "maxLength", where)
        if high is not None and high < low:
            raise ValueError(f"{where}: maxLength {high} is below minLength {low}")
        return Str(low, high, _pattern(schema, where))
    if kind in ("integer", "number"):
        return Num(kind == "integer", _bounds(schema, kind == "integer", where))
    return BOOL if kind == "boolean" else NULL
