"""Which bytes may come next in a JSON text a schema accepts: the structured-output matcher.

A state is a tuple of alternatives (a byte may begin a value of more than one option of an
``anyOf``; a digit after ``1`` may continue the number or an enum's ``12``); each alternative is a
stack of frames — (node, local, parent, depth), innermost first — and the run of whitespace bytes
just read. States are plain tuples, so they hash, and the vocabulary memoizes the tokens allowed
in each (``hypic.engine.structured.vocab``).

A frame's handler reads one byte and answers with outcomes (local, child, consumed): ``local`` its
own next local state, or ``POP`` when its value is complete; ``child`` a node to push above it;
``consumed`` False when the byte belongs to what comes next (a number ends at the byte after its
last digit; a union hands its first byte to each option), so it is read again there. ``END`` is
the byte after the text: only a finished value reads it.

Bounds keep an unlucky model from looping inside the grammar (a small model, asked for JSON, will
write newlines for as long as it may): between tokens at most one space, no newline (compact JSON,
as outlines generates it; ``MAX_WS``), ``MAX_DIGITS`` digits per part of a number (two in an exponent), ``MAX_DEPTH``
nested values. Strings must be well-formed UTF-8 byte by byte; control characters must be escaped,
as JSON requires.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from hypic.engine.structured.containers import array_frame, obj_frame
from hypic.engine.structured.frames import DIGITS, END, POP, UNBOUNDED, WS, Outcome
from hypic.engine.structured.grammar import GRAMMAR_NODES, Chars, Rep, Seq, grammar_frame
from hypic.engine.structured.grammar import initial as grammar_initial
from hypic.engine.structured.numbers import initial as initial_number
from hypic.engine.structured.numbers import number
from hypic.engine.structured.regex import normal
from hypic.engine.structured.schema import (
    ANY_ARR,
    ANY_OBJ,
    ANY_STR,
    BOOL,
    MAX_DEPTH,
    NULL,
    NUMBER,
    Alt,
    AnyValue,
    Arr,
    Lit,
    Node,
    Num,
    Obj,
    Ref,
    Str,
    free_key,
    needs,
    unique_items,
)
from hypic.engine.structured.strings import string
from hypic.engine.structured.tags import Tagged, tag_loop, tagged
from hypic.engine.structured.tags import initial as tags_initial
from hypic.engine.structured.text import Text, initial, text

MAX_WS = 1
MAX_HOPS = 512  # bytes read again without being consumed, per byte: a schema that only refers to itself ends
# (a structural tag's format checks its chains of empty chunks against it: formats.py); each hop a
# frame of recursion, well inside Python's limit of 1 000


class Root:
    """The frame under the value: whitespace before it, then only END."""

    def __init__(self, node: Node) -> None:
        self.node = node


Stack = tuple  # (node, local, parent Stack | None, depth)


class State(NamedTuple):
    alts: tuple[tuple[Stack, int], ...]  # (stack, whitespace run)


def start(node: Node) -> State:
    return State((((_root(node), "before", None, 0), 0),))


@lru_cache(maxsize=64)
def _root(node: Node) -> Root:
    """One root per node: states of requests with one schema are equal, and share the memo. As many
    as the memo keeps constraints (``vocab.MEMO_ROOTS``): a root holds its compiled constraint (a
    pattern's automaton and its step memo, up to ≈ 17 MB at a 150 000-token vocabulary)."""
    return Root(node)


def advance(state: State, byte: int) -> State | None:
    """The state after ``byte`` (0–255, or END), or None when no alternative can read it."""
    out: dict[tuple[Stack, int], None] = {}
    for stack, ws in state.alts:
        run = ws + 1 if byte in WS and _between_tokens(stack) else 0
        if run > MAX_WS:
            continue
        for s in _feed(stack, byte, MAX_HOPS):
            out[(s, run)] = None
    if len(out) > PRUNE_AT:
        return State(_undominated(list(out)))
    return State(tuple(out)) if out else None


PRUNE_AT = 16  # alternatives past which the dominated ones are dropped (nested counts multiply them)


def _undominated(alts: list[tuple[Stack, int]]) -> tuple[tuple[Stack, int], ...]:
    """The alternatives less those another makes redundant: equal but for the counts of repetitions
    whose item may read nothing (``Rep.empty_item``), each count at least the other's — a lower count
    accepts all a higher one does (empty iterations make up the difference, and more remain). Without
    this, ``(("a"{0,20}){0,20}){0,20}`` holds every split of the a's so far: thousands of alternatives."""
    groups: dict[tuple, list[tuple[tuple[int, ...], tuple[Stack, int]]]] = {}
    for alt in alts:
        shape, counts, frame = [], [], alt[0]
        while frame is not None:
            node, local, parent, depth = frame
            if isinstance(node, Rep) and node.empty_item:
                counts.append(local)
                shape.append((id(node), None, depth))
            else:
                shape.append((id(node), local, depth))
            frame = parent
        groups.setdefault((tuple(shape), alt[1]), []).append((tuple(counts), alt))
    kept = []
    for members in groups.values():
        members.sort(key=lambda m: sum(m[0]))
        front: list[tuple[int, ...]] = []
        for counts, alt in members:
            if not any(all(a <= b for a, b in zip(f, counts, strict=True)) for f in front):
                front.append(counts)
                kept.append(alt)
    return tuple(kept)


def _only_top(state: State) -> tuple[object, object] | None:
    """The top frame's (node, local) of the only alternative; None when there are several."""
    return (state.alts[0][0][0], state.alts[0][0][1]) if len(state.alts) == 1 else None


def free_string_room(state: State) -> int | None:
    """How many more characters a string with no pattern may take here — inside it, between
    characters, the only alternative — (``UNBOUNDED`` without a maxLength); None when the state is
    no such string. There any plain text that many characters long or shorter is let through."""
    top = _only_top(state)
    if top is None:
        return None
    node, local = top
    if isinstance(node, Arr) and local[0] == "string":  # a unique array's string, read by the array
        node, local = unique_items(node), local[3]
    elif isinstance(node, Obj) and local[0] == "name" and local[2] is not None:  # a distinct free key, likewise
        node, local = free_key(node), local[2]
    if not isinstance(node, Str) or node.pattern is not None or local[0] != "in" or local[2] != 0:
        return None
    return UNBOUNDED if node.max_len is None else node.max_len - local[1]


def string_loop(state: State) -> tuple[tuple[tuple[int, int], ...], int] | None:
    """Inside a patterned string, between characters, the only alternative, at a loop of its
    pattern: the characters that keep its automaton where it is, and how many of them a token may
    hold (``UNBOUNDED`` without a maxLength; with one, what leaves room for the fewest characters
    that then complete a match) — or None. Any plain text of those characters, that long or
    shorter, is let through and leaves the pattern where it was."""
    top = _only_top(state)
    if top is None:
        return None
    node, local = top
    if not isinstance(node, Str) or node.pattern is None or local[0] != "in" or local[3] != 0:
        return None
    chars, fewest = node.pattern.loop(local[2])
    if not chars:
        return None
    return chars, UNBOUNDED if node.max_len is None else node.max_len - local[1] - fewest


def char_loop(state: State) -> tuple[tuple[tuple[int, int], ...], int] | None:
    """A grammar's unbounded character repetition (``[^\n]*``, ``[a-z]{2,}``) at the top of the only
    alternative: its characters, and ``UNBOUNDED`` — any plain run of them is let through, whatever
    else may follow — or None."""
    top = _only_top(state)
    if top is None:
        return None
    node, local = top
    if isinstance(node, Seq) and local < len(node.items):  # the repetition is its next item, not yet opened
        node, local = node.items[local], 0
    node = _named(node)
    if not isinstance(node, Rep) or node.high is not None:
        # a bounded repetition (``[a-z]{0,5}``) bounds only itself: a longer run of its characters may
        # still be read by what follows it, so those tokens must be walked — the shortcut (which takes
        # the short ones and walks none of the class's) would refuse them
        return None
    item = _named(node.item)
    # its item a class, or a choice with classes among its options (a JSON string's characters; a
    # Lark terminal's LETTER: UCASE_LETTER | LCASE_LETTER, each option a named class)
    classes = [item] if isinstance(item, Chars) else [o for o in map(_named, item.options) if isinstance(o, Chars)] \
        if isinstance(item, Alt) else []
    if not classes:
        return None
    return normal([r for c in classes for r in c.code_points()]), UNBOUNDED


def _named(node: object) -> object:
    """What a rule reference (or a chain of them) stands for; any other node itself."""
    while isinstance(node, Ref):
        node = node.target
    return node


def free_text_loop(state: State) -> tuple[tuple[tuple[int, int], ...], int] | None:
    """Structural tags' free text with no trigger begun, the only alternative: the characters that
    keep it so (``tags.tag_loop``) and how many a token may hold (``UNBOUNDED`` without a budget); else None."""
    top = _only_top(state)
    if top is not None and isinstance(top[0], Root) and top[1] == "before" and isinstance(top[0].node, Tagged):
        top = (top[0].node, tags_initial(top[0].node))  # a tag's first byte: its free text's, as it starts
    if top is None or not isinstance(top[0], Tagged):
        return None
    loop = tag_loop(*top)
    return None if loop is None else (loop[0], UNBOUNDED if loop[1] is None else loop[1])


def _between_tokens(stack: Stack) -> bool:
    """Whether the next byte falls between tokens, not inside a string, a declared key or a literal
    (whose spaces are text)."""
    node, local = stack[0], stack[1]
    if isinstance(node, (Text, Tagged, *GRAMMAR_NODES)):  # its spaces are text
        return False
    if isinstance(node, Str):
        return local == ("open",)
    if isinstance(node, Obj):
        return local[0] not in ("key", "name")
    if isinstance(node, Arr):
        return local[0] not in ("item", "string")  # inside a unique array's value (a string's spaces are text)
    return not isinstance(node, Lit) or local == b""


def advance_bytes(state: State, data: bytes) -> State | None:
    for b in data:
        state = advance(state, b)
        if state is None:
            return None
    return state


def accepts(node: Node, text: bytes) -> bool:
    """Whether ``text`` is a whole value ``node`` accepts, as generated (compact, no exponent where bounded)."""
    state = advance_bytes(start(node), text)
    return state is not None and accepting(state)


def accepting(state: State) -> bool:
    """The text so far is a whole value the schema accepts."""
    return advance(state, END) is not None


def finished(state: State) -> bool:
    """A whole value to which no byte can be added: generation is over."""
    return accepting(state) and not any(advance(state, b) is not None for b in range(256))


def _feed(stack: Stack, byte: int, hops: int, fed: set | None = None) -> list[Stack]:
    """The stacks after ``byte``; ``fed``: the stacks this byte was already handed to, unconsumed
    (a union whose options refer to one definition reaches it many ways: once is enough, or the
    ways multiply with every hop). Recursive, at most ``hops`` deep (a loop with its own stack
    measured 1.1–1.5× slower a byte)."""
    node, local, parent, depth = stack
    found: list[Stack] = []
    fed = set() if fed is None else fed
    for local2, child, consumed in _handle(node, local, byte, depth):
        if local2 is POP:
            if parent is None:
                continue
            s = parent
        else:
            s = (node, local2, parent, depth)
        if child is not None:
            if s[3] + needs(child) > MAX_DEPTH:  # a value that could not be finished within the nesting allowed
                continue
            s = (child, _initial(child), s, s[3] + 1)
        if consumed:
            found.append(s)
            continue
        # a repetition of an item that may read nothing takes the byte at its first count only
        # (grammar.settle_repeats): the counts empty iterations reach accept no more
        key = (s[0], s[2]) if type(s[0]) is Rep and s[0].empty_item else s
        if hops > 0 and key not in fed:
            fed.add(key)
            found += _feed(s, byte, hops - 1, fed)
    return found


def _initial(node: Node | Text | Tagged) -> object:
    if isinstance(node, Text):
        return initial(node)
    if isinstance(node, Tagged):
        return tags_initial(node)
    if isinstance(node, GRAMMAR_NODES):
        return grammar_initial(node)
    if isinstance(node, (Lit,)):
        return b""
    if isinstance(node, Num):
        return initial_number(node)
    return ("open",)


def _handle(node: object, local: object, b: int, depth: int) -> list[Outcome]:
    """``depth``: the frame's own — an object or array lets a key or item begin only if its value
    can be finished within ``MAX_DEPTH`` (else the key's bytes would lead nowhere)."""
    if isinstance(node, Root):
        if local == "before":
            if isinstance(node.node, (Text, Tagged, *GRAMMAR_NODES)):  # plain text: each byte its own; may be empty
                return [Outcome("after", node.node, False)]
            if b in WS:
                return [Outcome("before", None, True)]
            return [] if b == END else [Outcome("after", node.node, False)]
        return [Outcome("end", None, True)] if local == "after" and b == END else []
    if isinstance(node, AnyValue):
        child = (ANY_OBJ if b == ord("{") else ANY_ARR if b == ord("[") else ANY_STR if b == ord('"')
                 else (node.number or NUMBER) if b == ord("-") or b in DIGITS else BOOL if b in (ord("t"), ord("f"))
                 else NULL if b == ord("n") else None)
        return [] if child is None else [Outcome(POP, child, False)]
    if isinstance(node, Alt):
        return [Outcome(POP, o, False) for o in node.options]
    if isinstance(node, Ref):
        return [Outcome(POP, node.target, False)]
    if isinstance(node, Obj):
        return obj_frame(node, local, b, depth)
    if isinstance(node, Arr):
        return array_frame(node, local, b, depth)
    if isinstance(node, Str):
        return string(node, local, b)
    if isinstance(node, Text):
        return text(node, local, b)
    if isinstance(node, Tagged):
        return tagged(node, local, b)
    if isinstance(node, GRAMMAR_NODES):
        return grammar_frame(node, local, b)
    if isinstance(node, Num):
        return number(node, local, b)
    return _literal(node, local, b)


def _literal(node: Lit, prefix: bytes, b: int) -> list[Outcome]:
    if b == END:
        return []
    grown = prefix + bytes([b])
    out = [Outcome(POP, None, True)] if grown in node.values else []
    if node.continues(grown):
        out.append(Outcome(grown, None, True))
    return out
