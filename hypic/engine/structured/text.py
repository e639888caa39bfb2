"""Plain-text structured output: the whole answer matched by a regular expression, or one of a list
of choices (vLLM's ``regex`` and ``choice`` constraints).

Where a JSON schema's string reads its characters between quotes and through JSON escapes, a ``Text``
node reads the answer's raw UTF-8 — every byte is text, spaces included — and feeds each decoded
character to the expression's automaton (``hypic.engine.structured.regex``, the same subset a
schema's ``pattern`` takes). The expression must match the whole answer (vLLM's meaning; ``^`` and
``$`` may be written or not, around the whole or any top-level branch). A ``choice`` is matched as its
literal strings, byte by byte.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from hypic.engine.structured.frames import END, POP, Outcome
from hypic.engine.structured.regex import Regex, Window, anchored_end, compile_regex
from hypic.engine.structured.schema import Lit
from hypic.engine.structured.strings import utf8_byte

ANY_LENGTH = Window.between(0, None)  # an answer has no length bound here (max_tokens has)


@dataclass(eq=False, frozen=True)
class Text:
    """The whole answer: matched by ``pattern``, or exactly one of ``words`` (a choice: its strings
    as sorted UTF-8, read by binary search — an automaton of 1 000 labels would be tens of
    thousands of states)."""

    pattern: Regex | None = None
    words: Lit | None = None

    def may_be_empty(self) -> bool:
        return b"" in self.words.values if self.words is not None else self.pattern.accepts(self.pattern.start)


@lru_cache(maxsize=64)
def compile_text(regex: str | None = None, choice: tuple[str, ...] | None = None) -> Text:
    """The node for ``regex`` or ``choice`` (exactly one given); ValueError naming which and why."""
    if (regex is None) == (choice is None):
        raise ValueError("regex, choice: give exactly one")
    if choice is not None:
        return Text(words=Lit(frozenset(c.encode() for c in choice)))
    # matched whole, so an anchor at either end of any top-level branch says nothing more: dropped
    # (the pattern parser takes anchors only at a pattern's ends)
    body = "|".join(_unanchored(branch) for branch in _top_level_branches(regex))
    wrapped = f"^(?:{body})$"
    try:
        return Text(compile_regex(wrapped))
    except ValueError as e:  # told of the expression as given (the parser saw it wrapped: positions 3 on)
        why = str(e)
        for seen in (wrapped, wrapped[1:-1]):
            why = why.removeprefix(f"pattern {seen!r}: ")
        why = re.sub(r" \(at (\d+)\)$", lambda m: f" (at {max(0, int(m[1]) - 3)})", why)
        raise ValueError(f"regex: {regex!r}: {why}") from None


def _top_level_branches(pattern: str) -> list[str]:
    """``pattern`` cut at its ``|`` outside groups, classes and escapes; ValueError when its
    parentheses do not pair (the wrapping ``^(?:…)$`` would pair a stray one: ``a)(?:b``)."""
    branches, depth, start, i, in_class = [], 0, 0, 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "^":
                i += 1
            if pattern[i + 1:i + 2] == "]":  # a ']' first in a class is itself
                i += 1
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"regex: {pattern!r}: unbalanced parenthesis (at {i})")
        elif c == "|" and depth == 0:
            branches.append(pattern[start:i])
            start = i + 1
        i += 1
    if depth:
        raise ValueError(f"regex: {pattern!r}: missing ) (unbalanced parenthesis)")
    return [*branches, pattern[start:]]


def _unanchored(branch: str) -> str:
    branch = branch.removeprefix("^")
    return branch[:-1] if anchored_end(branch) else branch


def initial(node: Text) -> tuple | bytes:
    return b"" if node.words is not None else ("in", node.pattern.start, 0, 0, 0, 0)


def _word(words: Lit, prefix: bytes, b: int) -> list[Outcome]:
    """A choice reads byte ``b`` (or END); the local is the answer's bytes so far."""
    done = [Outcome(POP, None, False)] if prefix in words.values else []  # the byte is what follows
    if b == END:
        return done
    grown = prefix + bytes([b])
    return ([Outcome(grown, None, True)] if grown in words.values or words.continues(grown) else []) + done


def text(node: Text, local: tuple, b: int) -> list[Outcome]:
    """A ``Text`` frame reads byte ``b`` (or END). Locals: ("in", states, need, value, low, high):
    the automaton's states and, inside a multi-byte character, the continuation bytes still due, the
    bits read so far and the next byte's range. A byte is let through only if some character it may
    begin or continue keeps the answer matchable."""
    if node.words is not None:
        return _word(node.words, local, b)
    rx = node.pattern
    _, states, need, value, low, high = local

    def char(c: int) -> list[Outcome]:
        nxt = rx.step(states, c)
        return [Outcome(("in", nxt, 0, 0, 0, 0), None, True)] if nxt and rx.finishes(nxt, ANY_LENGTH) else []

    # where the expression is matched, the text may end: the byte (END at the answer's end, or what
    # follows the text inside a structural tag's format) is handed to what comes next
    done = [Outcome(POP, None, False)] if not need and rx.accepts(states) else []
    if b == END:
        return done
    got = utf8_byte(need, value, low, high, b)
    if got is None:
        return done
    if isinstance(got, int):
        return char(got) + done
    need, value, low, high, lo, hi = got
    if not rx.can_step(states, lo, hi, ANY_LENGTH):
        return done
    return [Outcome(("in", states, need, value, low, high), None, True)] + done
