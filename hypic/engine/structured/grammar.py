"""vLLM's ``grammar`` constraint: the whole answer derived from a context-free grammar, written in
GBNF (llama.cpp's and xgrammar's EBNF — what vLLM's ``structured_outputs.grammar`` takes).

    root   ::= answer ("; " answer)*       # the start rule is root
    answer ::= "yes" | "no" | [0-9]+ | "(" answer ")"

Rules are ``name ::= alternatives``; an alternative is a sequence of string literals (``"…"``, with
``\\n \\t \\r \\\\ \\" \\xHH \\uHHHH \\UHHHHHHHH``), character classes (``[a-z_]``, ``[^"\\n]``), ``.``
(any character), rule names and parenthesised groups, each optionally repeated by ``*``, ``+``,
``?`` or ``{m}`` / ``{m,}`` / ``{m,n}``; ``#`` starts a comment. A grammar whose first rule is
written Lark's way (``start: …``) is read by ``lark.py`` into the same rule expressions.

The grammar compiles to frames the structured-output matcher already runs (``matcher.py``): a
rule reference is a ``Ref``, a choice an ``Alt`` — both replaced by what they lead to, as in a JSON
schema — and four more here: ``Seq`` (its items one after another; the last replaces it, so a
right-recursive rule does not deepen the stack), ``Rep`` (an item between ``low`` and ``high``
times), ``Word`` (a literal's bytes) and ``Chars`` (one UTF-8 character of a class). Every byte is
text: no whitespace is skipped. The matcher's state holds every parse still possible, so an
ambiguous grammar works. A rule whose alternatives start with the rule itself (``expr ::= expr "+"
term | term``) is read as the repetition it means (``expr ::= term ("+" term)*``); any other
left recursion (a rule that reaches itself before reading a byte: through another rule, or after
an item that may read nothing) is refused, since it would unfold without end. Like a JSON
value, a derivation nests at most ``MAX_DEPTH`` frames, and the matcher opens none it could not
finish within them (``needs``): a grammar whose least derivation is deeper, or infinite, is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from hypic.engine.structured.frames import END, POP, Outcome
from hypic.engine.structured.regex import negate, normal, without_surrogates
from hypic.engine.structured.schema import Alt, Ref, check_depth, reachable
from hypic.engine.structured.strings import utf8_byte

MAX_GRAMMAR = 65536  # characters of grammar text
MAX_REPEAT = 4096  # a {m,n} bound: each count is a state of its own


@dataclass(eq=False, frozen=True)
class Seq:
    items: tuple

    def children(self) -> list:
        return list(self.items)

    def least(self, depth: dict[int, float]) -> float:
        """The frames its least derivation nests: each item but the last above it, the last in its place."""
        if not self.items:
            return 1
        return max([1 + depth[id(i)] for i in self.items[:-1]] + [depth[id(self.items[-1])]])


@dataclass(eq=False, frozen=True)
class Rep:
    item: object
    low: int
    high: int | None
    # set by ``settle_repeats`` when the item may read nothing: then ``low`` is 0 (empty iterations
    # fill any count) and a byte enters at most one iteration (``matcher._feed``), since a count
    # reached by empty iterations accepts no more than the count before it
    empty_item: bool = False

    def children(self) -> list:
        return [self.item]

    def least(self, depth: dict[int, float]) -> float:
        return 1 + depth[id(self.item)] if self.low else 1


@dataclass(eq=False, frozen=True)
class Word:
    data: bytes  # never empty (an empty literal is an empty Seq)

    def children(self) -> list:
        return []

    def least(self, depth: dict[int, float]) -> float:
        return 1


@dataclass(eq=False, frozen=True)
class Chars:
    """One character: in one of ``ranges`` (inclusive code points), or in none when ``negated``."""

    ranges: tuple[tuple[int, int], ...]
    negated: bool

    def has(self, c: int) -> bool:
        return any(lo <= c <= hi for lo, hi in self.ranges) != self.negated

    def meets(self, lo: int, hi: int) -> bool:
        """Whether some character in [lo, hi] is in the class."""
        if not self.negated:
            return any(a <= hi and lo <= b for a, b in self.ranges)
        c = lo  # the first in [lo, hi] that no range covers
        for a, b in sorted(self.ranges):
            if a <= c <= b:
                c = b + 1
        return c <= hi

    def code_points(self) -> tuple[tuple[int, int], ...]:
        """The class as sorted ranges of the code points UTF-8 can write (negation applied, no surrogates)."""
        ranges = normal(list(self.ranges))
        return without_surrogates(negate(ranges) if self.negated else ranges)

    def children(self) -> list:
        return []

    def least(self, depth: dict[int, float]) -> float:
        return 1


GRAMMAR_NODES = (Seq, Rep, Word, Chars)
ANY_CHAR = Chars(((0, 0x10FFFF),), False)


def initial(node: Seq | Rep | Word | Chars) -> object:
    return (0, 0, 0, 0) if isinstance(node, Chars) else 0


def grammar_frame(node: Seq | Rep | Word | Chars, local: object, b: int) -> list[Outcome]:
    """A grammar frame reads byte ``b`` (or END)."""
    if isinstance(node, Seq):
        i, n = local, len(node.items)
        if i == n:
            return [Outcome(POP, None, False)]
        return [Outcome(POP if i == n - 1 else i + 1, node.items[i], False)]
    if isinstance(node, Rep):
        n, out = local, []
        if node.high is None or n < node.high:
            last = node.high is not None and n + 1 == node.high
            # unbounded: counts past ``low`` are one state, so an item that reads nothing loops once
            nxt = POP if last else min(n + 1, node.low) if node.high is None else n + 1
            out.append(Outcome(nxt, node.item, False))
        if n >= node.low:
            out.append(Outcome(POP, None, False))
        return out
    if b == END:
        return []
    if isinstance(node, Word):
        if b != node.data[local]:
            return []
        return [Outcome(POP if local + 1 == len(node.data) else local + 1, None, True)]
    got = utf8_byte(*local, b)
    if got is None:
        return []
    if isinstance(got, int):
        return [Outcome(POP, None, True)] if node.has(got) else []
    need, value, low, high, lo, hi = got
    return [Outcome((need, value, low, high), None, True)] if node.meets(lo, hi) else []


@lru_cache(maxsize=64)
def compile_grammar(text: str) -> Seq:
    """The start rule of a grammar as matcher frames: GBNF (``root``) or Lark (``start``;
    ``lark.py``), told apart by how its first rule is written. ValueError naming what is wrong,
    where (line and column) or which rule. Cached by text."""
    if not isinstance(text, str):
        raise ValueError(f"grammar: expected GBNF or Lark text, got {type(text).__name__}")
    if len(text) > MAX_GRAMMAR:
        raise ValueError(f"grammar: {len(text)} characters, more than {MAX_GRAMMAR}")
    from hypic.engine.structured.lark import looks_like_lark, read_lark  # lark.py builds on this module

    if looks_like_lark(text):
        rules, start = read_lark(text)
    else:
        rules, start = _Parser(text).rules(), "root"
        if "root" not in rules:
            raise ValueError("grammar: no root rule (root ::= …: where the answer starts)")
    return compile_rules(rules, start)


def compile_rules(rules: dict[str, tuple], start: str) -> Seq:
    """Rule expressions (``_Parser``'s tuples) from rule ``start`` on, as matcher frames."""
    rules = {name: _unfold_left_recursion(name, expr) for name, expr in rules.items()}
    refs: dict[str, Ref] = {}

    def node(expr: object) -> object:
        kind = expr[0]
        if kind == "ref":
            name = expr[1]
            if name not in rules:
                raise ValueError(f"grammar: rule {name!r} is used but never defined")
            if name not in refs:
                refs[name] = Ref(name)
                refs[name].target = node(rules[name])
            return refs[name]
        if kind == "alt":
            options = tuple(node(o) for o in expr[1])
            return options[0] if len(options) == 1 else Alt(options)
        if kind == "seq":
            items = tuple(node(i) for i in expr[1])
            return items[0] if len(items) == 1 else Seq(items)
        if kind == "rep":
            return Rep(node(expr[1]), expr[2], expr[3])
        if kind == "word":
            return Word(expr[1]) if expr[1] else Seq(())
        return expr[1]  # chars, or a node compiled already (Lark's %json: a schema's value)

    try:  # each walk recurses once per rule a rule uses: a chain of hundreds outruns Python's stack
        root = Seq((node(("ref", start)),))  # a grammar frame at the root: the matcher reads it as text
        _check_left_recursion(root)
        settle_repeats(root)
        check_depth(root, "grammar", "a rule that only refers to itself with no way out")
    except RecursionError:
        raise ValueError("grammar: rules nested too deep to compile (a chain of hundreds of rules, each "
                         "using the next)") from None
    return root


def _unfold_left_recursion(name: str, expr: tuple) -> tuple:
    """A rule whose alternatives start with the rule itself, ``a ::= a x | a y | b | c``, rewritten
    as the same language read from the left, ``a ::= (b | c) (x | y)*``: the matcher expands rules
    top-down and would unfold ``a`` without end, yet grammars (Lark's above all: its LALR parser
    wants them) often write lists and operator chains this way. Only the rule's own top-level
    alternatives are looked at; left recursion through another rule is refused later."""
    if expr[0] != "alt":
        return expr
    loops, bases = [], []
    for option in expr[1]:
        items = option[1] if option[0] == "seq" else [option]
        if items and items[0] == ("ref", name):
            loops.append(("seq", list(items[1:])))
        else:
            bases.append(option)
    if not loops:
        return expr
    if not bases:
        raise ValueError(f"grammar: rule {name!r} derives no text: each of its alternatives starts with "
                         f"{name!r} itself")
    return ("seq", [("alt", bases), ("rep", ("alt", loops), 0, None)])


def _nullable(nodes: list) -> set[int]:
    """The ids of the nodes that can derive the empty text (a fixed point: rules may recurse); a
    frame of another module says so by ``may_be_empty()`` (free text, a regex's text)."""
    empty: set[int] = set()
    changed = True
    while changed:
        changed = False
        for n in nodes:
            if id(n) in empty:
                continue
            if isinstance(n, Seq):
                ok = all(id(i) in empty for i in n.items)
            elif isinstance(n, Rep):
                ok = n.low == 0 or id(n.item) in empty
            elif isinstance(n, Alt):
                ok = any(id(o) in empty for o in n.options)
            elif isinstance(n, Ref):
                ok = id(n.target) in empty
            else:
                ok = hasattr(n, "may_be_empty") and n.may_be_empty()
            if ok:
                empty.add(id(n))
                changed = True
    return empty


def settle_repeats(root: object) -> set[int]:
    """Marks every repetition whose item may read nothing (``Rep.empty_item``, ``low`` 0) — else a
    byte would cross one empty iteration per count, ``(a?){1000}`` a thousand hops a byte — and
    returns the ids of the nodes that may read nothing. Idempotent (a cached tree settles once)."""
    nodes = reachable(root)
    empty = _nullable(nodes)
    for n in nodes:
        if isinstance(n, Rep) and id(n.item) in empty and not n.empty_item:
            object.__setattr__(n, "low", 0)  # frozen for hashing by identity; settled before any match
            object.__setattr__(n, "empty_item", True)
    return empty


def _check_left_recursion(root: Seq) -> None:
    """ValueError naming a rule that reaches itself before any byte is read."""
    nodes = reachable(root)
    empty = _nullable(nodes)

    def first(n: object) -> list:
        """What ``n`` may start by reading, before any byte."""
        if isinstance(n, Seq):
            out = []
            for i in n.items:
                out.append(i)
                if id(i) not in empty:
                    break
            return out
        if isinstance(n, Rep):
            return [] if n.high == 0 else [n.item]
        if isinstance(n, Alt):
            return list(n.options)
        return [n.target] if isinstance(n, Ref) else []

    for ref in (n for n in nodes if isinstance(n, Ref)):
        todo, seen = first(ref.target), set()
        while todo:
            n = todo.pop()
            if n is ref:
                raise ValueError(f"grammar: rule {ref.name!r} reaches itself before reading anything other than as "
                                 "the first item of its own alternatives (expr ::= expr \"+\" term | term is "
                                 "read as expr ::= term (\"+\" term)*), which hypic does not parse; write it "
                                 "with repetition")
            if id(n) not in seen:
                seen.add(id(n))
                todo += first(n)


class GrammarText:
    """A grammar's text and a place in it, as both notations' readers walk it: errors naming the
    place, blanks and comments skipped, escapes read."""

    WHERE = "grammar"  # what an error begins with

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def fail(self, why: str, at: int | None = None) -> ValueError:
        at = self.at if at is None else at
        line = self.text.count("\n", 0, at) + 1
        col = at - (self.text.rfind("\n", 0, at) + 1) + 1
        return ValueError(f"{self.WHERE}: {why} (line {line}, column {col})")

    def comment_here(self) -> bool:
        return self.text[self.at] == "#"

    def skip(self, newlines: bool = True) -> None:
        while self.at < len(self.text):
            c = self.text[self.at]
            if self.comment_here():
                end = self.text.find("\n", self.at)
                self.at = len(self.text) if end < 0 else end
            elif c in " \t\r" or (newlines and c == "\n"):
                self.at += 1
            else:
                break

    def escape(self) -> int:
        """The character an escape writes, read from just past its backslash."""
        if self.at >= len(self.text):
            raise self.fail("unterminated escape")
        e = self.text[self.at]
        self.at += 1
        simple = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "0": 0, "\\": 92, '"': 34, "'": 39, "/": 47,
                  "[": 91, "]": 93, "-": 45, "^": 94}
        if e in simple:
            return simple[e]
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        digits = self.text[self.at:self.at + (width or 0)]
        if width is None or not re.fullmatch(r"[0-9A-Fa-f]+", digits or "-") or len(digits) != width:
            self.at -= 2
            raise self.fail(f"unknown escape \\{e}")
        self.at += width
        value = int(digits, 16)
        if value > 0x10FFFF or 0xD800 <= value <= 0xDFFF:
            raise self.fail(f"\\{e}{digits} is no character UTF-8 can write")
        return value


class _Parser(GrammarText):
    """GBNF text → {rule name: expression}; an expression is a tuple: ("alt", [seq…]), ("seq",
    [item…]), ("rep", item, low, high), ("ref", name), ("word", bytes), ("chars", Chars)."""

    NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
    RULE_START = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*)[ \t]*::=")

    def rules(self) -> dict[str, tuple]:
        rules: dict[str, tuple] = {}
        self.skip()
        while self.at < len(self.text):
            m = self.RULE_START.match(self.text, self.at)
            if m is None:
                raise self.fail("expected a rule: name ::= …")
            name = m[1]
            if name in rules:
                raise self.fail(f"rule {name!r} defined twice")
            self.at = m.end()
            rules[name] = self.alternatives()
            self.skip()
        return rules

    def _rule_starts_here(self) -> bool:
        return self.RULE_START.match(self.text, self.at) is not None

    def alternatives(self, depth: int = 0) -> tuple:
        if depth > 64:
            raise self.fail("groups nested deeper than 64")
        options = [self.sequence(depth)]
        while self.at < len(self.text) and self.text[self.at] == "|":
            self.at += 1
            options.append(self.sequence(depth))
        return ("alt", options)

    def sequence(self, depth: int) -> tuple:
        items = []
        while True:
            self.skip()
            if self.at >= len(self.text) or self.text[self.at] in "|)" or self._rule_starts_here():
                return ("seq", items)
            item = self.term(depth)
            self.skip(newlines=False)
            items.append(self.repeat(item))

    def term(self, depth: int) -> tuple:
        c = self.text[self.at]
        if c == '"':
            return ("word", self.literal())
        if c == "[":
            return ("chars", self.char_class())
        if c == ".":
            self.at += 1
            return ("chars", ANY_CHAR)
        if c == "(":
            self.at += 1
            inner = self.alternatives(depth + 1)
            self.skip()
            if self.at >= len(self.text) or self.text[self.at] != ")":
                raise self.fail("expected ) to close the group")
            self.at += 1
            return inner
        m = self.NAME.match(self.text, self.at)
        if m is None:
            raise self.fail(f"unexpected {c!r}")
        if re.compile(r"[ \t]*:(?!:)").match(self.text, m.end()):
            raise self.fail(f"{m[0]}: … is a Lark rule (a grammar is read as Lark when its first rule is "
                            "written so); in GBNF: name ::= …")
        self.at = m.end()
        return ("ref", m[0])

    def repeat(self, item: tuple) -> tuple:
        while self.at < len(self.text) and self.text[self.at] in "*+?{":
            c = self.text[self.at]
            self.at += 1
            if c == "{":
                m = re.compile(r"\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?}").match(self.text, self.at)
                if m is None:
                    raise self.fail("expected {m}, {m,} or {m,n}")
                low = int(m[1])
                high = low if m[2] is None else int(m[3]) if m[3] else None
                if (high is not None and high < low) or max(low, high or 0) > MAX_REPEAT:
                    raise self.fail(f"repetition {{{m[0][:-1].strip()}}}: expected 0 ≤ m ≤ n ≤ {MAX_REPEAT}")
                self.at = m.end()
            else:
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            item = ("rep", item, low, high)
            self.skip(newlines=False)
        return item

    def char(self, closing: str) -> int:
        """One character of a literal or class, escapes read."""
        if self.at >= len(self.text):
            raise self.fail(f"unterminated: expected {closing}")
        c = self.text[self.at]
        self.at += 1
        if c != "\\":
            if c == "\n" and closing == '"':
                raise self.fail('a literal ends at its line: expected "')
            return ord(c)
        return self.escape()

    def literal(self) -> bytes:
        self.at += 1
        out = []
        while self.at >= len(self.text) or self.text[self.at] != '"':
            out.append(chr(self.char('"')))
        self.at += 1
        return "".join(out).encode()

    def char_class(self) -> Chars:
        start = self.at
        self.at += 1
        negated = self.text.startswith("^", self.at)
        self.at += negated
        ranges = []
        while self.at >= len(self.text) or self.text[self.at] != "]":
            lo = self.char("]")
            hi = lo
            if self.text.startswith("-", self.at) and not self.text.startswith("-]", self.at):
                self.at += 1
                hi = self.char("]")
                if hi < lo:
                    raise self.fail(f"range {chr(lo)!r}-{chr(hi)!r} is backwards")
            ranges.append((lo, hi))
        self.at += 1
        chars = Chars(tuple(ranges), negated)
        if not chars.meets(0, 0x10FFFF) or not (chars.meets(0, 0xD7FF) or chars.meets(0xE000, 0x10FFFF)):
            self.at = start
            raise self.fail("this class matches no character")
        return chars
