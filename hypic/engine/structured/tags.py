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
``begin`` (else that structure could never be reached; xgrammar's rule too). The same frame is
xgrammar's ``triggered_tags`` and ``any_text`` in a format tree (``formats.py``): a structure's body is
any format then one of its ends, free text may exclude strings (an enclosing tag's end among them)
and may stop at any byte, handing it to what follows the frame.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache

from hypic.engine.structured.frames import END, POP, Outcome
from hypic.engine.structured.grammar import Seq, Word
from hypic.engine.structured.schema import Alt, AnyValue, Node, Num, Ref, check_depth, compile_schema, json_text
from hypic.engine.structured.strings import utf8_step

MAX_TAG_BYTES = 4096  # a begin or end longer than this is refused (they are markers, not text)
# Free text is read against every prefix of every trigger (a set built at compile time: Σ len² / 2
# bytes), so triggers are held to what markers need: a request of 1 024 triggers of 4 KiB would
# have cost gigabytes.
MAX_TRIGGERS = 32
MAX_TRIGGER_BYTES = 128
MAX_STRUCTURES = 256  # a byte of a begin is matched against each (tools, not a vocabulary)

# A token named by a format (xgrammar's token-level formats: a special token such as Kimi's
# <|tool_call_begin|>) is read as a *mark*: bytes no text holds — 0xFF and 0xFE are never in UTF-8 —
# around its text (named by text) or its id (named by id). The vocabulary spells each special and
# added token both ways besides its text (``vocab.token_marks``), so a mark is written by that one
# token and by no text, and plain text, JSON strings and patterns never reach one.
NAME_MARK, ID_MARK = 0xFF, 0xFE
MARK_BYTES = (NAME_MARK, ID_MARK)


def token_mark(token: object, where: str) -> bytes:
    """A named token's mark: its text (a string) or its id (an integer) between the mark's bytes."""
    if isinstance(token, str) and token:
        return bytes([NAME_MARK]) + token.encode("utf-8", "surrogatepass") + bytes([NAME_MARK])
    if isinstance(token, int) and not isinstance(token, bool) and 0 <= token < 2**31:
        return bytes([ID_MARK]) + str(token).encode() + bytes([ID_MARK])
    raise ValueError(f"{where}: expected a token's text or its id (a non-negative integer), got {token!r}")


def shown(data: bytes) -> str:
    """A begin, end, trigger or exclude as a refusal quotes it: a mark as the token it names."""
    if data[:1] and data[0] in MARK_BYTES:
        body = data[1:-1].decode(errors="replace")
        return f"token {body!r}" if data[0] == NAME_MARK else f"token id {body}"
    return repr(data.decode(errors="replace"))


@dataclass(eq=False, frozen=True)
class Structure:
    begin: bytes
    body: object  # a matcher node: the value (its content) and then the end, pushed when the begin is whole


@dataclass(eq=False, frozen=True)
class Tagged:
    """Free text with tagged structures (module doc). ``prefixes``: every proper prefix of a
    trigger or an exclude, the empty one included — what free text may be in the middle of. With no
    triggers it is xgrammar's ``any_text``: free text that holds none of ``excludes``. Free text may
    end anywhere: the frame hands any byte to what follows it (the answer's end at the top, an
    enclosing tag's end inside one — whose ends are among ``excludes``, so it stops at the first)."""

    triggers: tuple[bytes, ...]
    structures: tuple[Structure, ...]
    prefixes: frozenset[bytes]
    at_least_one: bool = False  # the answer begins with a structure (xgrammar's triggered_tags)
    stop_after_first: bool = False  # the answer ends with its first structure's end
    excludes: tuple[bytes, ...] = ()  # what free text may not hold
    max_chars: int | None = None  # xgrammar's any_text budget: free text of at most this many characters
    tokens: bool = False  # token-level (any_tokens, token_triggered_tags): special tokens' marks are free text too

    def children(self) -> list:
        return [s.body for s in self.structures]

    def may_be_empty(self) -> bool:
        return not self.at_least_one

    def least(self, depth: dict[int, float]) -> float:
        """Free text may be empty; with ``at_least_one`` a structure's body nests above the frame."""
        if not self.at_least_one:
            return 1
        return 1 + min(depth[id(s.body)] for s in self.structures)


def free_text(triggers: tuple[bytes, ...], structures: tuple[Structure, ...], excludes: tuple[bytes, ...] = (),
              at_least_one: bool = False, stop_after_first: bool = False, max_chars: int | None = None,
              tokens: bool = False) -> Tagged:
    excludes = tuple(e for e in excludes if e)
    prefixes = frozenset({b"", *(t[:i] for t in triggers + excludes for i in range(len(t)))})  # b"": nothing pending
    return Tagged(triggers, structures, prefixes, at_least_one, stop_after_first, excludes, max_chars, tokens)


def compile_tags(spec: object) -> Tagged:
    """The node for a structural tag — its JSON text, or the object (``type`` ``structural_tag``
    optional) — with ``structures`` (each ``begin``, ``schema``, ``end``) and ``triggers``;
    ValueError naming what is wrong."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"structural_tag: not JSON: {e}") from None
        except RecursionError:
            raise ValueError("structural_tag: nested too deep to read") from None
    if not isinstance(spec, dict):
        raise ValueError(f"structural_tag: expected an object, got {type(spec).__name__}")
    # keys keep their order: a qwen_xml parameter list is written in its properties' declared order
    text = json_text(spec, "structural_tag", sort_keys=False)
    try:
        return _compile(text)
    except RecursionError:  # a schema's $ref chain or a grammar's rules inside, past Python's stack
        raise ValueError("structural_tag: nested too deep to compile") from None


@lru_cache(maxsize=64)
def _compile(text: str) -> object:
    spec = json.loads(text)
    if spec.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"structural_tag.type: expected 'structural_tag', got {spec['type']!r}")
    if "format" in spec:
        if set(spec) - {"type", "format"}:
            raise ValueError("structural_tag: format goes alone (beside type), not with structures or triggers")
        from hypic.engine.structured.formats import compile_format  # formats build on this frame: imported late
        return compile_format(spec["format"], "structural_tag.format")
    unknown = sorted(set(spec) - {"type", "structures", "triggers"})
    if unknown:
        raise ValueError(f"structural_tag: unknown field {unknown[0]!r} (hypic reads type, structures and triggers, "
                         "or format)")
    triggers = _triggers(spec.get("triggers"), "structural_tag.triggers")
    items = []
    for where, s in _entries(spec.get("structures"), "structural_tag.structures", {"begin", "end"}, {"schema"}):
        try:
            value = json_value(s.get("schema", True))  # no schema: any JSON value (vLLM's)
        except ValueError as e:
            raise ValueError(f"{where}.schema: {str(e).removeprefix('json_schema: ')}") from None
        items.append((where, s["begin"], value, (s["end"],)))
    node = triggered(triggers, items)
    check_depth(node, "structural_tag", "a structure whose value cannot end")
    return node


def json_value(schema: object) -> Node:
    """A schema's node as a structure's whole value: its own number (if it may be one) hands back
    what cannot go on with it — the end may begin with a digit, '.' or 'e'."""
    return _handing_back(compile_schema(schema))


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


def triggered(triggers: tuple[bytes, ...], items: list[tuple[str, str | bytes, object, tuple[str | bytes, ...]]],
              excludes: tuple[bytes, ...] = (), at_least_one: bool = False, stop_after_first: bool = False,
              where: str = "structural_tag", tokens: bool = False) -> Tagged:
    """The frame from checked triggers and (where, begin, content node, ends) items, each begin
    checked and named; a structure's body is its content, then one of its ends. Free text stops
    before an excluded string, so a trigger holding one (not at its end) could never be written:
    refused, named ``where``. A begin or end given as bytes is made already (a token's mark)."""
    for e in excludes:
        inside = next((t for t in triggers if e in t[:-1]), None)
        if inside is not None:
            raise ValueError(f"{where}.excludes: {shown(e)} lies inside the trigger {shown(inside)}, "
                             "which could then never be written")
    out = []
    for where, begin, content, ends in items:
        data = marker(begin, f"{where}.begin")
        if not any(data.startswith(t) for t in triggers):
            raise ValueError(f"{where}.begin: {shown(data)} starts with no trigger, so it could never be written")
        out.append(Structure(data, then_end(content, ends, f"{where}.end")))
    return free_text(triggers, tuple(out), excludes, at_least_one, stop_after_first, tokens=tokens)


def marker(text: object, where: str) -> bytes:
    """A begin or an end as bytes, held to a marker's size (bytes: a token's mark, made already)."""
    if isinstance(text, bytes):
        return text
    if not isinstance(text, str):
        raise ValueError(f"{where}: expected a string, got {type(text).__name__}")
    data = text.encode()
    if len(data) > MAX_TAG_BYTES:
        raise ValueError(f"{where}: more than {MAX_TAG_BYTES} bytes (a begin or end is a marker)")
    return data


def then_end(content: object, ends: tuple[str | bytes, ...], where: str) -> object:
    """``content`` followed by one of ``ends`` (an empty end: what follows comes at once)."""
    closes = [Word(d) if d else Seq(()) for d in dict.fromkeys(marker(e, where) for e in ends)]
    if all(isinstance(c, Seq) for c in closes):  # only an empty end
        return content
    return Seq((content, closes[0] if len(closes) == 1 else Alt(tuple(closes))))


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
    if node.at_least_one:
        return ("begin", b"")
    return ("free", b"") if node.max_chars is None else ("free", b"", 0)  # with a budget: the characters so far


def tagged(node: Tagged, local: tuple, b: int) -> list[Outcome]:
    """A ``Tagged`` frame reads byte ``b`` (or END). Locals: ("free", pending) — pending, the
    longest suffix of the text that a trigger or an exclude begins; ("part", pending, need, low,
    high) — inside a UTF-8 character, ``need`` continuation bytes due, the next in [low, high] (free
    text is well-formed UTF-8, as a JSON string is: a stray byte would read back as U+FFFD, and a
    budget counts characters); with ``max_chars`` each ends with the characters so far; ("mark", pending,
    opener) — inside a token's mark, in token-level free text (read whole, as a character); ("begin", got) — the begin's
    bytes so far; ("done",) — the first structure ended with ``stop_after_first``. A structure's body
    (its value, then its end) is pushed above the frame; the frame is back in free text (or done)
    when it is read. In free text or done, the byte may also be what follows the frame."""
    kind = local[0]
    if kind == "begin":
        return [] if b == END else list(dict.fromkeys(_begun(node, local[1] + bytes([b]))))
    leave = [Outcome(POP, None, False)]  # the text may end here: the byte belongs to what follows
    if kind == "done":
        return leave
    if kind == "free":  # a character's first byte: ASCII, or a lead announcing its continuation bytes
        if b == END:
            return leave
        if node.tokens and b in MARK_BYTES:  # a token's mark opens: read whole, as one character is
            return [Outcome(("mark", _pending(node, local[1] + bytes([b])), b), None, True)] + leave
        utf8 = utf8_step(0, 0, 0, b)
        if utf8 is None:  # no character starts so: not free text's byte
            return leave
    elif kind == "mark":  # inside a token's mark: its text or id, up to the byte that opened it
        if b == END or (b in MARK_BYTES and b != local[2]):
            return []
        if b != local[2]:
            return [Outcome(("mark", _pending(node, local[1] + bytes([b])), local[2]), None, True)]
        utf8, leave = (0, 0, 0), []  # whole: read on as a character's last byte
    else:  # "part": inside a character, only its next continuation byte; the text cannot end here
        utf8 = None if b == END else utf8_step(*local[2:5], b)
        if utf8 is None:
            return []
        leave = []
    budget = ()
    if node.max_chars is not None:  # a character counts at its first byte
        chars = local[-1] + (kind == "free")
        if chars > node.max_chars:
            return leave
        budget = (chars,)
    text = local[1] + bytes([b])
    begun = [o for t in node.triggers if text.endswith(t) for o in _begun(node, t)]
    if begun:
        return list(dict.fromkeys(begun)) + leave
    if any(text.endswith(e) for e in node.excludes):
        return leave
    text = _pending(node, text)
    state = ("part", text, *utf8, *budget) if utf8[0] else ("free", text, *budget)
    return [Outcome(state, None, True)] + leave


def _pending(node: Tagged, text: bytes) -> bytes:
    """The longest suffix of ``text`` that a trigger or an exclude begins."""
    prefixes = node.prefixes
    while text not in prefixes:
        text = text[1:]
    return text


def _begun(node: Tagged, got: bytes) -> list[Outcome]:
    """With ``got`` of a begin written (its last byte being read): a whole begin opens its
    structure's body; a part of one waits for more."""
    out = []
    after = ("done",) if node.stop_after_first else ("free", b"")
    for s in node.structures:
        if s.begin == got:
            out.append(Outcome(after, s.body, True))
        elif s.begin.startswith(got):
            out.append(Outcome(("begin", got), None, True))
    return out


def tag_loop(node: Tagged, local: tuple) -> tuple[tuple[tuple[int, int], ...], int | None] | None:
    """In free text with nothing of a trigger pending, the characters that keep it so: every one
    but the triggers' and excludes' first (ASCII) characters — a token of only those is let through
    whatever it says, if it holds no more characters than the budget leaves (None: no budget). None
    elsewhere, or when a mark begins with a non-ASCII byte (then every token is walked)."""
    if local[:2] != ("free", b""):
        return None
    # (a token's mark begins with a byte no text holds: it never stops a plain token)
    firsts = sorted({t[0] for t in node.triggers + node.excludes if t[0] not in MARK_BYTES})
    if firsts and firsts[-1] >= 0x80:
        return None
    ranges, lo = [], 0
    for c in firsts:
        if c > lo:
            ranges.append((lo, c - 1))
        lo = c + 1
    ranges.append((lo, 0x10FFFF))
    return tuple(ranges), None if node.max_chars is None else node.max_chars - local[2]
