"""A JSON Schema compiled into the value nodes the structured-output matcher walks.

Structured output (OpenAI's ``response_format``, vLLM's guided JSON) constrains decoding so the
text generated *is* a JSON value the schema accepts. The subset here is what generation can
enforce byte by byte: ``type`` (one or a list), ``properties`` / ``required`` /
``additionalProperties`` / ``propertyNames`` / one pattern of ``patternProperties`` / ``minProperties`` /
``maxProperties`` (``Obj``), ``items`` / ``prefixItems`` / ``minItems`` / ``maxItems``, ``minLength`` / ``maxLength``,
``pattern`` (``hypic.engine.structured.regex``'s subset), ``format`` (``string_formats.FORMATS``: date, time,
date-time, uuid, ipv4, ipv6, ipvanyaddress, email, uri, duration, hostname — as patterns; binary, path, password —
any string), ``enum`` and ``const`` (with any keyword beside them:
the values it refuses are dropped), ``anyOf``, ``oneOf`` whose options no value can satisfy two
of (different types; objects told apart by a required property's constants: pydantic's
discriminated unions — it is generated as ``anyOf``, so overlapping options are refused), a
one-element ``allOf``, and local ``$ref`` into ``$defs`` / ``definitions`` (pydantic's models).
``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum`` and ``multipleOf`` (``bounds``; a
bounded number is written without an exponent). Annotations (``title``, ``description``, ``default`` …) are
ignored. ``uniqueItems`` holds where the items are a finite set of values (an enum, a const, a boolean:
``unique_items``), free strings, integers or unbounded numbers. Any
other keyword (``dependentRequired`` …) or format is refused by name rather than silently not enforced: an
output the caller's validator then rejects is worse than a 400. So
is a schema generation would dead-end in: no value at all (a pattern no string of the allowed
lengths matches, a ``$ref`` cycle with no way out), or none nested within ``MAX_DEPTH``.

Choices of the generator, not of JSON Schema: an object with declared ``properties`` gets only
those keys, in their declared order (each at most once, optional ones skippable, ``required`` ones
before ``}``: xgrammar's and vLLM's order — a schema that puts ``reasoning`` before ``answer`` is
answered so; an undeclared key would be allowed by default ``additionalProperties``, never
needed); enum and const values are written in compact JSON; a ``\\u`` escape never spells a
UTF-16 surrogate (a character past U+FFFF is written as UTF-8).

Nodes compare by identity (``eq=False``): the matcher's states hold them and are hashed every step,
and the same schema text compiles to the same nodes (``compile_schema`` is cached), so requests
with one schema share the vocabulary's memo of allowed tokens.
"""

from __future__ import annotations

import bisect
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from functools import cached_property, lru_cache
from typing import NamedTuple

from hypic.engine.request import check_utf8
from hypic.engine.structured.bounds import MAX_DIGITS, Bounds, feasible, integer_completions
from hypic.engine.structured.regex import LengthsTooCostly, Regex, Window, compile_regex
from hypic.engine.structured.string_formats import BYTES_BOUNDED, FORMATS

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                         "deprecated", "readOnly", "writeOnly", "$defs", "definitions",
                         "discriminator"})  # OpenAPI's, beside pydantic's oneOf: its options are disjoint anyway
KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
                      "propertyNames", "patternProperties", "minProperties", "maxProperties",
                      "minLength", "maxLength", "pattern", "format", "enum", "const", "anyOf", "oneOf", "allOf",
                      "$ref", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                      "prefixItems", "uniqueItems"})
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
# Bits of mask updates a pattern's length masks (``Regex.lengths``) may cost; a loop costs about
# cap² of them. maxLength 10⁹ with a pattern held the server's event loop for good; a bound past
# the budget is refused by name instead. ≈ 0.1 s at this budget on a 2-vCPU CPU (session 26).
LENGTH_WORK = 2 * 10**9


@dataclass(eq=False, frozen=True)
class AnyValue:
    """Any JSON value; its type is chosen by its first byte. ``number``: the node a number is read
    by (a structural tag's value hands back what follows it: ``numbers.number``)."""

    number: Num | None = None


@dataclass(eq=False, frozen=True)
class Obj:
    props: dict[bytes, Node]  # escaped key bytes (as between the quotes) → the value's node, in declared
    # order (the order keys are written in); empty: free keys
    required: frozenset[bytes]
    extra: Node | None  # the values of free keys (used when ``props`` is empty); None: no key at all
    keys: Node | None = None  # free keys' own schema (``propertyNames``, ``patternProperties``' pattern): a
    # string or an enum of strings; None: any string
    min_props: int = 0  # ``minProperties`` / ``maxProperties``: keys written (declared or free)
    max_props: int | None = None

    @property
    def counted(self) -> bool:
        """Whether the frame counts its keys (free keys are not counted otherwise, so that the states of
        every free-keyed object's values repeat and share the vocabulary's memo)."""
        return self.min_props > 0 or self.max_props is not None

    @property
    def distinct(self) -> bool:
        """Free keys written once each: where two or more are due, a key written twice would count twice
        here and once in the parsed object."""
        return not self.props and self.min_props >= 2

    @cached_property
    def order(self) -> dict[bytes, int]:
        """Each declared key's place."""
        return {k: i for i, k in enumerate(self.props)}


@dataclass(eq=False, frozen=True)
class Arr:
    items: Node | None  # the items after ``prefix``; None: none (``items: false``)
    min_items: int
    max_items: int | None  # with ``items`` None, at most len(prefix)
    prefix: tuple[Node, ...] = ()  # ``prefixItems``: item i's own schema (tuples)
    unique: bool = False  # ``uniqueItems`` (items read as ``unique_items`` says)


@dataclass(eq=False, frozen=True)
class Str:
    min_len: int  # in characters (an escape is one)
    max_len: int | None
    pattern: Regex | None = None  # ``pattern`` or ``format``: read character by character


@dataclass(eq=False, frozen=True)
class Num:
    integer: bool
    bounds: Bounds | None = None  # minimum / maximum (exclusive or not): written without an exponent
    # a structural tag's whole value: where the number so far is whole it may also end, the byte
    # handed back (its end may begin with a digit, '.' or 'e'); inside JSON never (its parents
    # refuse those bytes, and the extra alternative cost the matcher 1.2–1.5×)
    hand_back: bool = False


@dataclass(eq=False, frozen=True)
class Lit:
    """One of a few exact texts: enum and const values, true / false / null."""

    values: frozenset[bytes]

    @cached_property
    def ordered(self) -> tuple[bytes, ...]:
        return tuple(sorted(self.values))

    def continues(self, text: bytes) -> bool:
        """Whether ``text`` is a proper prefix of a value: the values it begins sort right after it
        (a binary search; scanning every value per byte made a 20 000-value enum's mask cost seconds,
        and a set of every prefix grew with a value's length squared: 2 GB for a 60 kB const)."""
        i = bisect.bisect_right(self.ordered, text)
        return i < len(self.ordered) and self.ordered[i].startswith(text)


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
    """A value's text as generated; NaN and the infinities are no JSON (ValueError)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def json_text(value: object, what: str, sort_keys: bool = True) -> str:
    """``value`` as canonical JSON text (sorted keys, unless their order means something: what the
    compilers cache by); ValueError named ``what`` when it is no JSON, holds a string no UTF-8 text
    holds, or nests too deep."""
    try:
        text = json.dumps(value, sort_keys=sort_keys, allow_nan=False)
        written = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: not JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{what}: nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
    check_utf8(written, what)  # every string writable as the output's UTF-8
    return text


def compile_schema(schema: object) -> Node:
    """The node tree of a JSON Schema (a dict, or True for any value); ValueError naming what is
    wrong or unsupported. Cached by the schema's text: equal schemas give the same nodes."""
    text = json_text(schema, "json_schema", sort_keys=False)  # properties keep their declared order
    try:  # compiling recurses through $refs: a chain of hundreds outruns Python's stack first
        return _compile_text(text)
    except RecursionError:
        raise ValueError("json_schema: nested too deep to compile (a chain of hundreds of $refs?)") from None


MAX_DEPTH = 32  # nested values the matcher lets a text hold (matcher.py: a runaway model cannot nest forever)
MAX_SCHEMA_DEPTH = 4 * MAX_DEPTH  # nested schemas (properties, items, anyOf …): past it, no value fits anyway


@dataclass
class _Compiling:
    """One schema being compiled: its root (where ``$ref`` points), the references met, and what
    reads through references, run once every one has its target: the enums beside other keywords
    (the node of those keywords, and what filters the values through it), then the checks."""

    root: dict
    refs: dict[str, Ref]
    literals: list[tuple[Node, Callable[[], None]]]
    checks: list[Callable[[], None]]


@lru_cache(maxsize=64)
def _compile_text(text: str) -> Node:
    schema = json.loads(text)
    if schema is True:
        return ANY
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema: expected an object (or true), got {text[:80]}")
    cx = _Compiling(schema, {}, [], [])
    node = _node(schema, "json_schema", cx, 0)
    while pending := [r for r in cx.refs.values() if r.target is None]:  # definitions may name more
        for ref in pending:
            section, _, key = ref.name.removeprefix("#/").partition("/")
            defs = schema.get(section)
            if not isinstance(defs, dict) or key not in defs:
                raise ValueError(f"json_schema: $ref {ref.name!r} names no definition in this schema")
            ref.target = _node(defs[key], f"json_schema.{section}.{key}", cx, 0)
    pending = list(cx.literals)
    while pending:  # an enum's filter once the keywords beside it reach no other enum still unfiltered
        ready = [p for p in pending if not _reaches_unset(p[0])]
        if not ready:
            raise ValueError("json_schema: an enum or const beside keywords that refer back to it is not supported")
        for p in ready:
            p[1]()
            pending.remove(p)
    for check in cx.checks:
        check()
    check_depth(node)
    _check_chains(node)
    return node


def _check_length_work(rx: Regex, low: int, high: int | None, what: str, where: str) -> None:
    """ValueError when the string's length bounds would cost its pattern's length masks more than
    ``LENGTH_WORK`` (measured in the fixed point itself: a pattern without loops is cheap at any
    bound); within it the masks are built here, once, and decoding reuses them."""
    try:
        rx.lengths(low if high is None else high + 1, budget=LENGTH_WORK)  # Window.between's cap
    except LengthsTooCostly:
        bound, value = ("maxLength", high) if high is not None else ("minLength", low)
        raise ValueError(f"{where}: {bound} {value} is too large to enforce with its {what} (the work grows with "
                         f"the bound squared where the {what} repeats)") from None


def _node(schema: object, where: str, cx: _Compiling, depth: int) -> Node:
    if depth > MAX_SCHEMA_DEPTH:  # named at the top: the path down is as long as the schema is deep
        raise ValueError(f"json_schema: nested deeper than {MAX_SCHEMA_DEPTH} levels")
    depth += 1
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
        return cx.refs.setdefault(name, Ref(name))
    if "enum" in schema or "const" in schema:
        return _literals(schema, where, cx, depth)
    for word in ("anyOf", "oneOf", "allOf"):
        if word in schema:
            _alone(schema, word, where)
            options = schema[word]
            if not isinstance(options, list) or not options:
                raise ValueError(f"{where}: {word} must be a non-empty list of schemas")
            if word == "allOf" and len(options) != 1:
                raise ValueError(f"{where}: allOf with more than one schema is not supported in structured output")
            nodes = tuple(_node(o, f"{where}.{word}[{i}]", cx, depth) for i, o in enumerate(options))
            if word == "oneOf" and len(nodes) > 1:
                cx.checks.append(lambda: _check_one_of(nodes, where))
            return nodes[0] if len(nodes) == 1 else Alt(nodes)
    kind = schema.get("type")
    if kind is None:
        kind = "object" if {"properties", "required", "additionalProperties", "propertyNames", "patternProperties",
                            "minProperties", "maxProperties"} & keys else \
            "array" if {"items", "prefixItems", "minItems", "maxItems"} & keys else \
            "string" if {"minLength", "maxLength", "pattern", "format"} & keys else \
            "number" if {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"} & keys else None
        if kind is None:
            return ANY
        node = _typed(schema, kind, where, cx, depth)  # generated as that type; validated as any other too
        UNTYPED.add(node)
        return node
    if isinstance(kind, list):
        if not kind or any(k not in TYPES for k in kind):
            raise ValueError(f"{where}: type must be one of {list(TYPES)} or a non-empty list of them")
        return Alt(tuple(_typed(schema, k, where, cx, depth) for k in dict.fromkeys(kind))) if len(kind) > 1 \
            else _typed(schema, kind[0], where, cx, depth)
    if kind not in TYPES:
        raise ValueError(f"{where}: type must be one of {list(TYPES)}, got {kind!r}")
    return _typed(schema, kind, where, cx, depth)


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


def _literals(schema: dict, where: str, cx: _Compiling, depth: int) -> Node:
    """``enum`` or ``const``: the values, less those the keywords beside them refuse (``type``
    read here; any other keyword compiled and each value's text run through it once every
    ``$ref`` is resolved, so none is silently dropped)."""
    word = "enum" if "enum" in schema else "const"
    values = schema["enum"] if word == "enum" else [schema["const"]]
    if not isinstance(values, list) or not values:
        raise ValueError(f"{where}: enum must be a non-empty list")
    try:
        texts = {compact(v): v for v in values}
    except ValueError:
        raise ValueError(f"{where}: {word} holds NaN or an infinity, which JSON cannot write") from None
    kinds = schema.get("type")
    if kinds is not None:  # both given: the values of those types only
        kinds = kinds if isinstance(kinds, list) else [kinds]
        texts = {t: v for t, v in texts.items() if any(_is(v, k) for k in kinds)}
        if not texts:
            raise ValueError(f"{where}: no {word} value is of type {schema['type']}")
    rest = {k: v for k, v in schema.items() if k not in ANNOTATIONS and k not in (word, "type")}
    if not rest:
        return Lit(frozenset(texts))
    if kinds is not None:
        rest["type"] = schema["type"]
    others = _node(rest, where, cx, depth)
    holder = Ref(f"{where}.{word}")  # its target set by the check: the values the other keywords accept

    def keep() -> None:
        from hypic.engine.structured.matcher import accepts  # the matcher imports this module
        kept = frozenset(t for t in texts if accepts(others, t))
        if not kept:
            raise ValueError(f"{where}: no {word} value satisfies the keywords beside it ({', '.join(sorted(rest))})")
        holder.target = Lit(kept)

    cx.literals.append((others, keep))
    return holder


# Nodes a validator reads more loosely than the matcher generates them — for ``oneOf``, which must
# know what *validates*: a schema without "type" generated as the type its keywords imply (any other
# type passes its validation), a string whose ``format`` the matcher enforces (validators take
# formats as annotations by default).
UNTYPED: weakref.WeakSet = weakref.WeakSet()
FORMATTED: weakref.WeakSet = weakref.WeakSet()


def _kinds(node: Node, seen: frozenset = frozenset()) -> frozenset[str] | None:
    """The JSON types a node's values can have (None: any); "integer" apart from other numbers."""
    if node in UNTYPED:
        return None
    if isinstance(node, Ref):
        return None if node in seen or node.target is None else _kinds(node.target, seen | {node})
    if isinstance(node, Alt):
        out: set[str] = set()
        for o in node.options:
            k = _kinds(o, seen)
            if k is None:
                return None
            out |= k
        return frozenset(out)
    if isinstance(node, Lit):
        return frozenset(_kind_of(json.loads(v)) for v in node.values)
    if isinstance(node, Num):
        return frozenset({"integer"} if node.integer else {"integer", "fraction"})
    kind = {Obj: "object", Arr: "array", Str: "string"}.get(type(node))
    return None if kind is None else frozenset({kind})


def _kind_of(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "integer" if isinstance(value, int) or value.is_integer() else "fraction"
    return {str: "string", dict: "object", list: "array"}.get(type(value), "null")


def _resolved(node: Node) -> Node:
    for _ in range(64):  # a chain of references (a cycle of them is refused by check_depth)
        if not isinstance(node, Ref) or node.target is None:
            return node
        node = node.target
    return node


def _disjoint(a: Node, b: Node, hops: int = 8) -> bool:
    """Whether no JSON value can satisfy both nodes' schemas, as far as can be shown cheaply:
    different types; literals apart (a string literal checked against a string's rules); objects
    whose required property's values are disjoint (pydantic's discriminated unions). False when unsure."""
    a, b = _resolved(a), _resolved(b)
    ka, kb = _kinds(a), _kinds(b)
    if ka is not None and kb is not None and not ka & kb:
        return True
    if hops == 0:
        return False
    if isinstance(a, Alt):
        return all(_disjoint(o, b, hops - 1) for o in a.options)
    if isinstance(b, Alt):
        return all(_disjoint(a, o, hops - 1) for o in b.options)
    if isinstance(b, Lit) and not isinstance(a, Lit):
        a, b = b, a
    if isinstance(a, Lit):
        values = [json.loads(v) for v in a.values]
        if isinstance(b, Lit):  # JSON equality: 1 and 1.0 are one value
            others = [json.loads(v) for v in b.values]
            return not any(_kind_of(x) == _kind_of(y) and x == y for x in values for y in others)
        if isinstance(b, Str) and b not in FORMATTED:  # strings as written: the matcher reads them as a validator does
            from hypic.engine.structured.matcher import accepts  # the matcher imports this module
            strings = [v for v in values if _kind_of(v) == "string"]
            if b in UNTYPED and len(strings) < len(values):  # b's validation lets every non-string through
                return False
            return all(not accepts(b, compact(v)) for v in strings)
        return False
    if a in UNTYPED or b in UNTYPED:  # a discriminator says nothing of values of other types
        return False
    if isinstance(a, Obj) and isinstance(b, Obj):
        return any(k in b.required and k in b.props and _disjoint(a.props[k], b.props[k], hops - 1)
                   for k in a.required if k in a.props)
    return False


def _scalar_literals(node: Node) -> list[tuple[str, object]] | None:
    """A literal node's values as (kind, value), hashable with JSON's equality (1 and 1.0 alike), or
    None when it is no literal or holds an object or array."""
    node = _resolved(node)
    if not isinstance(node, Lit) or node in UNTYPED:
        return None
    values = [json.loads(v) for v in node.values]
    return None if any(isinstance(v, (dict, list)) for v in values) else [(_kind_of(v), v) for v in values]


def _check_one_of(options: tuple[Node, ...], where: str) -> None:
    """``oneOf`` is generated as ``anyOf``, right only when no value satisfies two options. Scalar
    literals (a ``oneOf`` of documented consts: thousands) are told apart by one set, not pair by
    pair; every other option is checked against every option."""
    seen: dict[tuple[str, object], int] = {}
    literals, rest = [], []
    for i, node in enumerate(options):
        values = _scalar_literals(node)
        if values is None:
            rest.append(i)
            continue
        literals.append(i)
        for v in values:
            first = seen.setdefault(v, i)
            if first != i:
                _overlap(where, first, i)
    for k, i in enumerate(rest):
        for j in [*rest[k + 1:], *literals]:
            if not _disjoint(options[i], options[j]):
                _overlap(where, min(i, j), max(i, j))


def _overlap(where: str, i: int, j: int) -> None:
    raise ValueError(f"{where}: oneOf whose options {i} and {j} may both accept a value is not supported "
                     "in structured output (one value must satisfy exactly one); use anyOf, or options "
                     "of different types or with a required property of different const values")


NEEDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # node → the nesting its least value needs


class Values(NamedTuple):
    texts: tuple[bytes, ...]  # every text of the values, sorted
    value_of: dict[bytes, int]  # text → its value's number
    count: int  # distinct values


@lru_cache(maxsize=256)
def unique_items(arr: Arr) -> Values | Str | Num | None:
    """What a ``uniqueItems`` array's items are, as its frame reads them (its ``$ref`` chain crossed):
    a finite set of values (an enum, a const, a boolean: ``Values``, each item one of those not
    written yet); free strings (no maxLength, pattern or format: pydantic's ``set[str]`` — each can
    always grow by a character, so one equal to a value written is only refused at its closing quote);
    integers, bounded or not (``set[int]``, ``set[conint(ge=0, le=9)]``: refused where an equal one ends,
    and a prefix at once when every integer inside the bounds it can still become was written —
    ``0``, 16 digits, ``9`` under ``maximum: 9``: ``bounds.integer_completions``); numbers without bounds
    (``set[float]``: compared as exact decimals, ``1`` and ``1.0`` one value); else None: not served."""
    node = _through_refs(arr.items)
    if isinstance(node, Str):
        return node if node.pattern is None and node.max_len is None else None
    if isinstance(node, Num):
        return node if node.integer or node.bounds is None else None
    return literal_values(node) if isinstance(node, Lit) else None


@lru_cache(maxsize=256)
def literal_values(node: Lit) -> Values:
    """A literal's texts, each numbered by its value — JSON equality, not text: 1 and 1.0 are one
    value, and so are objects whose keys differ in order."""
    values: dict[object, int] = {}
    value_of = {text: values.setdefault(_same_value(json.loads(text, parse_float=Decimal)), len(values))
                for text in node.ordered}
    return Values(node.ordered, value_of, len(values))


def _same_value(value: object) -> object:
    """A key equal for JSON-equal values: numbers by value (bools kept apart), objects by key set."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (type(value).__name__, value)
    if isinstance(value, (int, Decimal)):
        return ("number", Decimal(value).normalize())
    if isinstance(value, list):
        return ("array", tuple(_same_value(v) for v in value))
    return ("object", tuple(sorted((k, _same_value(v)) for k, v in value.items())))


@lru_cache(maxsize=256)
def unique_count(arr: Arr) -> int | None:
    """How many distinct items a unique array can hold — a set of values' count, the integers within
    the bounds — or None where endless (free strings, unbounded integers and numbers)."""
    items = unique_items(arr)
    if isinstance(items, Values):
        return items.count
    if isinstance(items, Num) and items.integer and items.bounds is not None:
        return integer_completions("", items.bounds)
    return None


def _check_unique(arr: Arr, where: str) -> None:
    if unique_items(arr) is None:
        raise ValueError(f"{where}: uniqueItems is supported in structured output where items are a finite set of "
                         "values (an enum, a const, a boolean), strings without maxLength, pattern or format, "
                         "integers, or numbers without bounds, not for other items")
    count = unique_count(arr)
    if count is not None and arr.min_items > count:
        raise ValueError(f"{where}: minItems {arr.min_items} with uniqueItems, but its items have only "
                         f"{count} distinct values")


def needs(node: Node) -> int:
    """How deeply the least value of ``node`` nests (a string: 1; ``{"a": [1]}``: 3); the matcher
    opens no value it could not finish within ``MAX_DEPTH``."""
    return NEEDS.get(node, 1)


def check_depth(root: Node, what: str = "json_schema", endless: str = "a $ref cycle with no way out") -> None:
    """Every node's ``needs``, as a fixed point (references may recurse); a schema (or grammar:
    ``what``) whose least value is infinite (``endless``) or nests past ``MAX_DEPTH`` is refused,
    since generation would dead-end in it."""
    nodes = reachable(root)
    inf = float("inf")
    depth: dict[int, float] = {id(n): inf for n in nodes}
    changed = True
    while changed:
        changed = False
        for n in nodes:
            d = _least(n, depth)
            if d < depth[id(n)]:
                depth[id(n)], changed = d, True
    need = depth[id(root)]
    if need == inf:
        raise ValueError(f"{what}: no finite value satisfies it ({endless})")
    if need > MAX_DEPTH:
        raise ValueError(f"{what}: its least value nests {int(need)} levels deep; structured output "
                         f"allows {MAX_DEPTH}")
    for n in nodes:
        if depth[id(n)] != 1 and depth[id(n)] != inf:
            NEEDS[n] = int(depth[id(n)])


MAX_CHAIN = 48  # references and unions crossed before a value's first byte (the matcher's MAX_HOPS is 512)


def _check_chains(root: Node) -> None:
    """ValueError for a chain of ``$ref``s and unions longer than ``MAX_CHAIN``: the matcher hands a
    byte on at most MAX_HOPS times (a schema that only refers to itself must end), so a longer chain
    compiled into a value whose first byte could never be read (70 ``$ref``s: nothing but a space)."""
    memo: dict[int, int] = {}
    path: set[int] = set()

    def chain(n: Node) -> int:
        if id(n) in memo or id(n) in path:  # on the path: a cycle, whose ways the matcher reads once a byte
            return memo.get(id(n), 0)
        kids = n.options if isinstance(n, Alt) else [n.target] if isinstance(n, Ref) and n.target else None
        if kids is None:
            return 0
        path.add(id(n))
        memo[id(n)] = got = 1 + max(chain(k) for k in kids)
        path.discard(id(n))
        return got

    longest = max(chain(n) for n in reachable(root))
    if longest > MAX_CHAIN:
        raise ValueError(f"json_schema: a chain of {longest} $refs and unions leads to one value; structured "
                         f"output follows at most {MAX_CHAIN}")


def _reaches_unset(root: Node) -> bool:
    """Whether a reference without its target yet (an enum's, still to be filtered) is reachable."""
    return any(isinstance(n, Ref) and n.target is None for n in reachable(root))


def reachable(root: Node) -> list[Node]:
    """Every node reachable from ``root``, once each (references may recurse)."""
    nodes, todo, seen = [], [root], set()
    while todo:
        n = todo.pop()
        if id(n) not in seen:
            seen.add(id(n))
            nodes.append(n)
            todo += _children(n)
    return nodes


def _children(n: Node) -> list[Node]:
    if isinstance(n, Obj):
        return [*n.props.values(), *([] if n.extra is None else [n.extra]), *([] if n.keys is None else [n.keys])]
    if isinstance(n, Arr):
        return [*n.prefix, *([] if n.items is None else [n.items])]
    if isinstance(n, Alt):
        return list(n.options)
    if isinstance(n, Ref):
        return [] if n.target is None else [n.target]
    return n.children() if hasattr(n, "children") else []  # a grammar's frames (grammar.py)


def _least(n: Node, depth: dict[int, float]) -> float:
    if isinstance(n, Obj):
        due = [depth[id(n.props[k])] for k in n.required]
        if n.min_props > len(due):  # the shallowest optional or free values make up the count
            if n.props:
                others = sorted(depth[id(v)] for k, v in n.props.items() if k not in n.required)
            else:
                others = [] if n.extra is None else [depth[id(n.extra)]] * n.min_props
            due += others[:n.min_props - len(due)]
        return 1 + max(due, default=0)
    if isinstance(n, Arr):
        due = [n.prefix[i] if i < len(n.prefix) else n.items for i in range(min(n.min_items, len(n.prefix) + 1))]
        return 1 + max((depth[id(c)] for c in due if c is not None), default=0)
    if isinstance(n, Alt):
        return min(depth[id(o)] for o in n.options)
    if isinstance(n, Ref):
        return float("inf") if n.target is None else depth[id(n.target)]
    return n.least(depth) if hasattr(n, "least") else 1  # a grammar's frames (grammar.py)


def _free_keys(schema: dict, declared: bool, where: str, cx: _Compiling, depth: int) -> tuple[Node | None, Node | None]:
    """Free keys' own schema and their values' (None: any string; additionalProperties'), from
    ``propertyNames`` (pydantic's ``dict[SomeEnum, …]``, ``dict[Literal[…], …]``) or one pattern of
    ``patternProperties`` (``dict[constr(pattern=…), …]``). Only such keys are written, as only declared
    keys are beside ``properties``; a key that may match several patterns, or a declared key that must
    also meet them, is refused by name."""
    names, patterns = schema.get("propertyNames"), schema.get("patternProperties")
    if names is None and patterns is None:
        return None, None
    word = "propertyNames" if names is not None else "patternProperties"
    if declared:
        raise ValueError(f"{where}: {word} beside properties is not supported in structured output")
    if names is not None and patterns is not None:
        raise ValueError(f"{where}: propertyNames beside patternProperties is not supported in structured output")
    if patterns is not None:
        if not isinstance(patterns, dict) or len(patterns) != 1:
            raise ValueError(f"{where}: patternProperties with one pattern is supported in structured output, "
                             f"got {len(patterns) if isinstance(patterns, dict) else json.dumps(patterns)[:40]}")
        (pattern, sub), = patterns.items()
        keys = Str(0, None, _pattern({"pattern": pattern}, f"{where}.patternProperties"))
        if not keys.pattern.finishes(keys.pattern.start, Window.between(0, None)):
            raise ValueError(f"{where}: no string matches patternProperties' pattern")
        return keys, _node(sub, f"{where}.patternProperties.{pattern}", cx, depth)
    keys = _node(names, f"{where}.propertyNames", cx, depth)
    cx.checks.append(lambda: _check_names(keys, where))
    return (None if isinstance(keys, AnyValue) else keys), None


def _check_names(keys: Node, where: str) -> None:
    """``propertyNames`` must read strings only: a string's rules or an enum of strings."""
    named = _through_refs(keys)
    if not (isinstance(named, Str) or isinstance(named, Lit) and all(v[:1] == b'"' for v in named.values)):
        raise ValueError(f"{where}: propertyNames is supported in structured output as a string's rules or an "
                         "enum of strings")


@lru_cache(maxsize=256)
def free_key(obj: Obj) -> Str | Lit:
    """What an object's free keys are, its ``$ref`` chain crossed: a string's rules or a literal."""
    return ANY_STR if obj.keys is None else _through_refs(obj.keys)


@lru_cache(maxsize=256)
def key_count(obj: Obj) -> int | None:
    """How many distinct free keys an object can write — an enum's values — or None where endless."""
    keys = free_key(obj)
    return literal_values(keys).count if isinstance(keys, Lit) else None


def _through_refs(node: Node | None) -> Node | None:
    """The node at the end of ``node``'s chain of references."""
    for _ in range(MAX_CHAIN):
        if not isinstance(node, Ref):
            break
        node = node.target
    return node


def _check_counts(obj: Obj, where: str, cx: _Compiling) -> None:
    """minProperties / maxProperties that some object meets; where free keys are due twice or more,
    keys that can be told apart (``Obj.distinct``): any string, or an enum with enough values."""
    low, high = obj.min_props, obj.max_props
    if high is not None and high < low:
        raise ValueError(f"{where}: maxProperties {high} is below minProperties {low}")
    if obj.props:
        if low > len(obj.props):
            raise ValueError(f"{where}: minProperties {low}, but only {len(obj.props)} properties are declared")
        if high is not None and len(obj.required) > high:
            raise ValueError(f"{where}: maxProperties {high} is below its {len(obj.required)} required properties")
        return
    if low and obj.extra is None:
        raise ValueError(f"{where}: minProperties {low}, but additionalProperties is false and none is declared")

    def distinct_keys() -> None:
        keys, count = free_key(obj), key_count(obj)
        if count is not None:
            if low > count:
                raise ValueError(f"{where}: minProperties {low}, but its keys have only {count} values")
        elif keys.pattern is not None or keys.max_len is not None:
            raise ValueError(f"{where}: minProperties {low} with keys bounded by a pattern or maxLength is not "
                             "supported in structured output (keys written once each must be told apart)")
    if obj.distinct:
        cx.checks.append(distinct_keys)


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
    """minimum / maximum and their exclusive forms (a number each; draft 4's boolean forms too), and
    multipleOf (a positive number of at most MAX_DIGITS fraction digits, as every number written)."""
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
    step = number("multipleOf")
    if step is not None and step <= 0:
        raise ValueError(f"{where}: multipleOf must be greater than 0, got {schema['multipleOf']!r}")
    if step is not None and -step.normalize().as_tuple().exponent > MAX_DIGITS:
        raise ValueError(f"{where}: multipleOf {schema['multipleOf']!r} has more than {MAX_DIGITS} fraction digits, "
                         "which no number written here has")
    if low is None and high is None and step is None:
        return None
    bounds = Bounds(low, high, low_open, high_open, step)
    if not feasible("", integer, bounds, MAX_DIGITS - 1):
        on = " on a multiple of its multipleOf" if step is not None else ""
        raise ValueError(f"{where}: no {'integer' if integer else 'number'} of at most {MAX_DIGITS} digits "
                         f"lies within its minimum and maximum{on}")
    return bounds


def _pattern(schema: dict, where: str) -> Regex | None:
    """A string's ``pattern`` or ``format`` as a compiled regex (both at once: refused)."""
    pattern, fmt = schema.get("pattern"), schema.get("format")
    if pattern is not None and fmt is not None:
        raise ValueError(f"{where}: pattern beside format is not supported in structured output")
    if fmt is not None:
        if not isinstance(fmt, str):
            raise ValueError(f"{where}: format must be a string, got {type(fmt).__name__}")
        if fmt not in FORMATS:
            raise ValueError(f"{where}: format {fmt!r} is not supported in structured output "
                             f"(supported: {', '.join(sorted(FORMATS))})")
        pattern = FORMATS[fmt]
        if fmt == "binary" and "maxLength" in schema:
            pattern = BYTES_BOUNDED
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


def _typed(schema: dict, kind: str, where: str, cx: _Compiling, depth: int) -> Node:
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
        nodes = {compact(k)[1:-1]: _node(v, f"{where}.properties.{k}", cx, depth) for k, v in props.items()}
        keys, free = _free_keys(schema, bool(props), where, cx, depth)  # (free: patternProperties' values)
        if free is None and not props and extra is not False:
            free = _node(extra, f"{where}.additionalProperties", cx, depth)
        low, high = _count(schema, "minProperties", where) or 0, _count(schema, "maxProperties", where)
        node = Obj(nodes, frozenset(compact(r)[1:-1] for r in required), free, keys, low, high)
        if low or high is not None:
            _check_counts(node, where, cx)
        return node
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
        unique = schema.get("uniqueItems", False)
        if not isinstance(unique, bool):
            raise ValueError(f"{where}: uniqueItems must be a boolean, got {unique!r}")
        if unique and prefix:
            raise ValueError(f"{where}: uniqueItems beside prefixItems is not supported in structured output")
        node = Arr(None if items is False else _node(items, f"{where}.items", cx, depth), low, high,
                   tuple(_node(p, f"{where}.prefixItems[{i}]", cx, depth) for i, p in enumerate(prefix)),
                   unique and items is not False)
        if node.unique:
            cx.checks.append(lambda: _check_unique(node, where))
        return node
    if kind == "string":
        low, high = _count(schema, "minLength", where) or 0, _count(schema, "maxLength", where)
        if high is not None and high < low:
            raise ValueError(f"{where}: maxLength {high} is below minLength {low}")
        node = Str(low, high, _pattern(schema, where))
        if "format" in schema and node.pattern is not None:
            FORMATTED.add(node)
        if node.pattern is not None:
            what = "pattern" if "pattern" in schema else "format"
            _check_length_work(node.pattern, low, high, what, where)
            if not node.pattern.finishes(node.pattern.start, Window.between(low, high)):
                raise ValueError(f"{where}: no string of {low} to {'any' if high is None else high} characters "
                                 f"matches its {what}")
        return node
    if kind in ("integer", "number"):
        return Num(kind == "integer", _bounds(schema, kind == "integer", where))
    return BOOL if kind == "boolean" else NULL
