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
``begin`` (else that structure could never be reached; xgrammar's rule too). xgrammar's newer form
``{"format": {"type": "triggered_tags", ...}}`` says the same with ``content: {"type": "json_schema"}``,
and two flags: ``at_least_one`` (the answer begins with a structure) and ``stop_after_first`` (it
ends with the first structure's end).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache

from hypic.engine.structured.frames import END, POP, Outcome
from hypic.engine.structured.schema import Alt, AnyValue, Node, Num, Ref, compile_schema, json_text

MAX_TAG_BYTES = 4096  # a begin or end longer than this is refused (they are markers, not text)
# Free text is read against every prefix of every trigger (a set built at compile time: Σ len² / 2
# bytes), so triggers are held to what markers need: a request of 1 024 triggers of 4 KiB would
# have cost gigabytes.
MAX_TRIGGERS = 32
MAX_TRIGGER_BYTES = 128
MAX_STRUCTURES = 256  # a byte of a begin is matched against each (tools, not a vocabulary)


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
    at_least_one: bool = False  # the answer begins with a structure (xgrammar's triggered_tags)
    stop_after_first: bool = False  # the answer ends with its first structure's end


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
    return _compile(json_text(spec, "structural_tag"))


@lru_cache(maxsize=64)
def _compile(text: str) -> Tagged:
    spec = json.loads(text)
    if spec.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"structural_tag.type: expected 'structural_tag', got {spec['type']!r}")
    if "format" in spec:
        return _triggered_tags(spec)
    unknown = sorted(set(spec) - {"type", "structures", "triggers"})
    if unknown:
        raise ValueError(f"structural_tag: unknown field {unknown[0]!r} (hypic reads type, structures and triggers, "
                         "or format)")
    triggers = _triggers(spec.get("triggers"), "structural_tag.triggers")
    items = []
    for where, s in _entries(spec.get("structures"), "structural_tag.structures", {"begin", "end"}, {"schema"}):
        items.append((where, s["begin"], s.get("schema", True), s["end"]))  # no schema: any JSON value (vLLM's)
    return _tagged(triggers, items, False, False)


def _triggered_tags(spec: dict) -> Tagged:
    """xgrammar's newer form: ``{"format": {"type": "triggered_tags", "triggers", "tags": [{"begin",
    "content": {"type": "json_schema", "json_schema"}, "end"}], "at_least_one", "stop_after_first"}}``
    — the one format the older form can say (other format types, and other contents, refused by name)."""
    fmt = spec["format"]
    if set(spec) - {"type", "format"}:
        raise ValueError("structural_tag: format goes alone (beside type), not with structures or triggers")
    if not isinstance(fmt, dict):
        raise ValueError(f"structural_tag.format: expected an object, got {type(fmt).__name__}")
    if fmt.get("type") != "triggered_tags":
        got = fmt.get("type")
        raise ValueError(f"structural_tag.format.type: {got!r} is not served (hypic serves triggered_tags, its "
                         "tags' content json_schema)")
    unknown = sorted(set(fmt) - {"type", "triggers", "tags", "at_least_one", "stop_after_first"})
    if unknown:
        raise ValueError(f"structural_tag.format: unknown field {unknown[0]!r}")
    flags = [fmt.get(name, False) for name in ("at_least_one", "stop_after_first")]
    for name, flag in zip(("at_least_one", "stop_after_first"), flags, strict=True):
        if not isinstance(flag, bool):
            raise ValueError(f"structural_tag.format.{name}: expected a boolean, got {flag!r}")
    triggers = _triggers(fmt.get("triggers"), "structural_tag.format.triggers")
    items = []
    for where, t in _entries(fmt.get("tags"), "structural_tag.format.tags", {"begin", "content", "end"}, {"type"}):
        if t.get("type", "tag") != "tag":
            raise ValueError(f"{where}.type: expected 'tag', got {t['type']!r}")
        content = t["content"]
        if not isinstance(content, dict):
            raise ValueError(f"{where}.content: expected an object, got {type(content).__name__}")
        if content.get("type") != "json_schema":
            raise ValueError(f"{where}.content.type: {content.get('type')!r} is not served (json_schema only)")
        if set(content) != {"type", "json_schema"}:
            extra = sorted(set(content) - {"type", "json_schema"})
            raise ValueError(f"{where}.content: " + (f"unknown field {extra[0]!r}" if extra else
                                                     "json_schema is missing"))
        items.append((where, t["begin"], content["json_schema"], t["end"]))
    return _tagged(triggers, items, *flags)


def _entries(entries: object, named: str, required: set[str], optional: set[str]) -> list[tuple[str, dict]]:
    """A non-empty list of objects with the ``required`` fields and maybe the ``optional`` ones,
    each with the name a refusal gives it."""
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{named}: expected a non-empty list of {{{', '.join(sorted(required))}}}")
    if len(entries) > MAX_STRUCTURES:
        raise ValueError(f"{named}: at most {MAX_STRUCTURES}, got {len(entries)}")
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not required <= set(e) or set(e) - required - optional:
            got = sorted(e) if isinstance(e, dict) else type(e).__name__
            maybe = f" (and optionally {', '.join(sorted(optional))})" if optional else ""
            raise ValueError(f"{named}[{i}]: expected an object with {', '.join(sorted(required))}{maybe}, got {got}")
    return [(f"{named}[{i}]", e) for i, e in enumerate(entries)]


def _triggers(triggers: object, named: str) -> tuple[bytes, ...]:
    """The triggers, checked: non-empty strings, held to markers' size, none inside another."""
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{named}: expected a non-empty list of non-empty strings")
    encoded = tuple(dict.fromkeys(t.encode() for t in triggers))
    if len(encoded) > MAX_TRIGGERS or max(map(len, encoded)) > MAX_TRIGGER_BYTES:
        raise ValueError(f"{named}: at most {MAX_TRIGGERS}, each at most {MAX_TRIGGER_BYTES} bytes (they are markers)")
    for t in encoded:  # found first, the inner one would always open its structures, never the outer's
        inner = next((u for u in encoded if u != t and u in t[1:-1]), None)  # (one ending it fires with it)
        if inner is not None:
            raise ValueError(f"{named}: {inner.decode()!r} lies inside {t.decode()!r}, so {t.decode()!r} could never "
                             "be written whole (its inner trigger opens first)")
    return encoded


def _tagged(encoded: tuple[bytes, ...], items: list[tuple[str, object, object, object]], at_least_one: bool,
            stop_after_first: bool) -> Tagged:
    """The node from the triggers and (where, begin, schema, end) items, each checked and named."""
    out = []
    for where, begin, schema, end in items:
        if not isinstance(begin, str) or not isinstance(end, str):
            raise ValueError(f"{where}: begin and end must be strings")
        if not any(begin.encode().startswith(t) for t in encoded):
            raise ValueError(f"{where}.begin: {begin!r} starts with no trigger, so it could never be written")
        if max(len(begin.encode()), len(end.encode())) > MAX_TAG_BYTES:
            raise ValueError(f"{where}: a begin or end of more than {MAX_TAG_BYTES} bytes")
        try:
            node = compile_schema(schema)
        except ValueError as e:
            field = "schema" if where.startswith("structural_tag.structures") else "content.json_schema"
            raise ValueError(f"{where}.{field}: {str(e).removeprefix('json_schema: ')}") from None
        out.append(Structure(begin.encode(), _handing_back(node), end.encode()))
    return Tagged(encoded, tuple(out), frozenset(t[:i] for t in encoded for i in range(len(t))), at_least_one,
                  stop_after_first)


def _handing_back(node: Node, depth: int = 0) -> Node:
    """The value's node with its own number (if it may be one) handing back what cannot go on with
    it — the end may begin with a digit, '.' or 'e' — copied: compiled schemas are shared."""
    if isinstance(node, Num):
        return dataclasses.replace(node, hand_back=True)
    if isinstance(node, AnyValue):
        return AnyValue(Num(False, hand_back=True))
    if isinstance(node, Alt):
        return Alt(tuple(_handing_back(o, depth + 1) for o in node.options))
    if isinstance(node, Ref) and node.target is not None and depth < 8:
        return _handing_back(node.target, depth + 1)
    return node


def initial(node: Tagged) -> tuple:
    return ("begin", b"") if node.at_least_one else ("free", b"")


def tagged(node: Tagged, local: tuple, b: int) -> list[Outcome]:
    """A ``Tagged`` frame reads byte ``b`` (or END). Locals: ("free", pending) — pending, the
    longest suffix of the text that a trigger begins; ("begin", got) — the begin's bytes so far;
    ("end", i, got) — after structure i's value, its end's bytes so far; ("done",) — the first
    structure ended with ``stop_after_first``: only the answer's end."""
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
    if kind == "done":
        return [Outcome(POP, None, False)] if b == END else []
    _, i, got = local
    end = node.structures[i].end
    after = ("done",) if node.stop_after_first else ("free", b"")
    if got == end:  # an empty end: what follows a structure at once
        return tagged(node, after, b)
    if b == END:
        return []
    grown = got + bytes([b])
    if grown == end:
        return [Outcome(after, None, True)]
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
