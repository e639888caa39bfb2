"""Structural tags: free text in which a trigger opens a tagged structure (vLLM's and xgrammar's
``structural_tag``, the constraint an agent's function calls need with ``tool_choice: auto``).

The answer is free text until it writes one of the ``triggers``; from there it must write the rest
of the ``begin`` of a structure that starts with that trigger, then a JSON value that structure's
schema accepts (compact, as every hypic JSON output), then its ``end``, and is free text again::

    {"type": "structural_tag",
     "structures": [{"begin": "<function=get_weather>", "schema": {...}, "end": "</function>"}],
     "triggers": ["<function="]}

lets the model answer in prose, or call ``get_weather`` with arguments its schema accepts, as often
as it likes. Free text is read byte by byte against the triggers (the longest suffix of the text
that begins one); it may end anywhere but inside a structure. A trigger must begin every structure's
``begin`` (else that structure could never be reached; xgrammar's rule too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from hypic.engine.structured.frames import END, POP, Outcome
from hypic.engine.structured.schema import Node, compile_schema

MAX_TAG_BYTES = 4096  # a begin or end longer than this is refused (they are markers, not text)
# Free text is read against every prefix of every trigger (a set built at compile time: Σ len² / 2
# bytes), so triggers are held to what markers need: a request of 1 024 triggers of 4 KiB would
# have cost gigabytes.
MAX_TRIGGERS = 32
MAX_TRIGGER_BYTES = 128


@dataclass(frozen=True)
class Structure:
    begin: bytes
    schema: Node
    end: bytes


@dataclass(eq=False, frozen=True)
class Tagged:
    """Free text with tagged structures (module doc). ``prefixes``: every proper prefix of a
    trigger, the empty one included — what free text may be in the middle of."""

    triggers: tuple[bytes, ...]
    structures: tuple[Structure, ...]
    prefixes: frozenset[bytes]


def compile_tags(spec: object) -> Tagged:
    """The node for a structural tag — its JSON text, or the object (``type`` ``structural_tag``
    optional) — with ``structures`` (each ``begin``, ``schema``, ``end``) and ``triggers``;
    ValueError naming what is wrong."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"structural_tag: not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"structural_tag: expected an object, got {type(spec).__name__}")
    try:
        text = json.dumps(spec, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"structural_tag: not JSON ({e})") from None
    return _compile(text)


@lru_cache(maxsize=64)
def _compile(text: str) -> Tagged:
    spec = json.loads(text)
    unknown = sorted(set(spec) - {"type", "structures", "triggers"})
    if unknown:
        raise ValueError(f"structural_tag: unknown field {unknown[0]!r} (hypic reads type, structures, triggers; "
                         "xgrammar's newer 'format' form is not served)")
    if spec.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"structural_tag.type: expected 'structural_tag', got {spec['type']!r}")
    triggers = spec.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag.triggers: expected a non-empty list of non-empty strings")
    encoded = tuple(dict.fromkeys(t.encode() for t in triggers))
    if len(encoded) > MAX_TRIGGERS or max(map(len, encoded)) > MAX_TRIGGER_BYTES:
        raise ValueError(f"structural_tag.triggers: at most {MAX_TRIGGERS}, each at most {MAX_TRIGGER_BYTES} bytes "
                         "(they are markers)")
    for t in encoded:  # found first, the inner one would always open its structures, never the outer's
        inner = next((u for u in encoded if u != t and u in t[1:]), None)
        if inner is not None:
            raise ValueError(f"structural_tag.triggers: {inner.decode()!r} lies inside {t.decode()!r}, so "
                             f"{t.decode()!r} could never be written whole (its inner trigger opens first)")
    structures = spec.get("structures")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag.structures: expected a non-empty list of {begin, schema, end}")
    out = []
    for i, s in enumerate(structures):
        where = f"structural_tag.structures[{i}]"
        if not isinstance(s, dict) or not {"begin", "end"} <= set(s) or set(s) - {"begin", "schema", "end"}:
            got = sorted(s) if isinstance(s, dict) else type(s).__name__
            raise ValueError(f"{where}: expected an object with begin, end and (optionally) schema, got {got}")
        if not isinstance(s["begin"], str) or not isinstance(s["end"], str):
            raise ValueError(f"{where}: begin and end must be strings")
        begin, end = s["begin"].encode(), s["end"].encode()
        if not any(begin.startswith(t.encode()) for t in triggers):
            raise ValueError(f"{where}.begin: {s['begin']!r} starts with no trigger, so it could never be written")
        try:
            schema = compile_schema(s.get("schema", True))  # no schema: any JSON value (vLLM's default)
        except ValueError as e:
            raise ValueError(f"{where}.schema: {str(e).removeprefix('json_schema: ')}") from None
        out.append(Structure(begin, schema, end))
    for i, s in enumerate(out):
        if max(len(s.begin), len(s.end)) > MAX_TAG_BYTES:
            raise ValueError(f"structural_tag.structures[{i}]: a begin or end of more than {MAX_TAG_BYTES} bytes")
    return Tagged(encoded, tuple(out), frozenset(t[:i] for t in encoded for i in range(len(t))))


def initial(node: Tagged) -> tuple:
    return ("free", b"")


def tagged(node: Tagged, local: tuple, b: int) -> list[Outcome]:
    """A ``Tagged`` frame reads byte ``b`` (or END). Locals: ("free", pending) — pending, the
    longest suffix of the text that a trigger begins; ("begin", got) — the begin's bytes so far;
    ("end", i, got) — after structure i's value, its end's bytes so far."""
    kind = local[0]
    if kind == "free":
        if b == END:
            return [Outcome(POP, None, False)]
        text = local[1] + bytes([b])
        out = [o for t in node.triggers if text.endswith(t) for o in _begun(node, t)]
        if out:
            return list(dict.fromkeys(out))
        prefixes = node.prefixes
        while text not in prefixes:
            text = text[1:]
        return [Outcome(("free", text), None, True)]
    if kind == "begin":
        if b == END:
            return []
        return list(dict.fromkeys(_begun(node, local[1] + bytes([b]))))
    _, i, got = local
    end = node.structures[i].end
    if got == end:  # an empty end: free text at once
        return tagged(node, ("free", b""), b)
    if b == END:
        return []
    grown = got + bytes([b])
    if grown == end:
        return [Outcome(("free", b""), None, True)]
    return [Outcome(("end", i, grown), None, True)] if end.startswith(grown) else []


def _begun(node: Tagged, got: bytes) -> list[Outcome]:
    """With ``got`` of a begin written (its last byte being read): a whole begin opens its
    structure's value; a part of one waits for more."""
    out = []
    for i, s in enumerate(node.structures):
        if s.begin == got:
            out.append(Outcome(("end", i, b""), s.schema, True))
        elif s.begin.startswith(got):
            out.append(Outcome(("begin", got), None, True))
    return out


def tag_loop(node: Tagged, local: tuple) -> tuple[tuple[int, int], ...] | None:
    """In free text with nothing of a trigger pending, the characters that keep it so: every one
    but the triggers' first (ASCII) characters — a token of only those is let through whatever it
    says. None elsewhere, or when a trigger begins with a non-ASCII byte (then every token is walked)."""
    if local != ("free", b""):
        return None
    firsts = sorted({t[0] for t in node.triggers})
    if firsts[-1] >= 0x80:
        return None
    ranges, lo = [], 0
    for c in firsts:
        if c > lo:
            ranges.append((lo, c - 1))
        lo = c + 1
    ranges.append((lo, 0x10FFFF))
    return tuple(ranges)
