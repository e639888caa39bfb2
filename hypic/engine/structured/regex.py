"""A regular expression as a character NFA: what a JSON Schema ``pattern`` (and a ``format``) asks
of a string, read one character at a time by the structured-output matcher.

The subset is what generation can enforce: literals and escapes (``\\d \\w \\s`` and their negations,
``\\.`` …), classes ``[a-z_]`` / ``[^…]``, ``.``, groups ``( )`` / ``(?: )``, alternation, the
quantifiers ``* + ? {n} {n,} {n,m}`` (lazy forms mean the same language), and ``^`` / ``$`` at the
pattern's ends. Back-references and look-arounds are refused by name. As in JSON Schema (ECMA-262's
``search``), a pattern not anchored by ``^`` / ``$`` may have any text before / after it.

Thompson's construction: states with character-class edges and ε edges; a matcher state is the
frozenset of NFA states reached, its ε-closure taken, so it hashes and steps are memoized.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

MAX_CODE = 0x10FFFF
MAX_REPEAT = 64  # {n,m} copies the repeated part: bounded, so a pattern cannot blow up the automaton ...
MAX_STATES = 20_000  # ... nor can nested repetitions, which multiply: (a{64}){64} is 8 200 states
MAX_GROUP_DEPTH = 64  # groups in groups: the parser and the automaton's builder recurse once per level
Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code-point ranges

ANY: Ranges = ((0, MAX_CODE),)
DIGIT: Ranges = ((ord("0"), ord("9")),)
WORD: Ranges = ((ord("0"), ord("9")), (ord("A"), ord("Z")), (ord("_"), ord("_")), (ord("a"), ord("z")))
SPACE: Ranges = ((9, 13), (32, 32), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
                 (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))  # ECMA-262's \s


def normal(ranges: list[tuple[int, int]]) -> Ranges:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((a, b) for a, b in out)


def negate(ranges: Ranges) -> Ranges:
    out, at = [], 0
    for lo, hi in ranges:
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= MAX_CODE:
        out.append((at, MAX_CODE))
    return tuple(out)


def without_surrogates(ranges: Ranges) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        out += [(a, b) for a, b in ((lo, min(hi, 0xD7FF)), (max(lo, 0xE000), hi)) if a <= b]
    return tuple(out)


def _has(ranges: Ranges, c: int) -> bool:
    return any(lo <= c <= hi for lo, hi in ranges)


class LengthsTooCostly(Exception):
    """``Regex.lengths`` passed its budget."""


@dataclass(frozen=True)
class Window:
    """How many more characters a string may take: ``bits`` the lengths allowed, as a mask over
    ``Regex.lengths(cap)``'s bits (bit ``cap``: ``cap`` or more)."""

    cap: int
    bits: int

    @staticmethod
    def between(low: int, high: int | None, cap: int | None = None) -> Window:
        """Lengths in [low, high] (high None: no maximum); ``cap`` past every bound that matters
        (default: high + 1, or low without a maximum), kept equal for one string so masks are shared."""
        cap = (low if high is None else high + 1) if cap is None else cap
        top = cap if high is None else min(high, cap)
        bits = ((1 << (top + 1)) - 1) & ~((1 << low) - 1) if low <= top else 0
        return Window(cap, bits)


_EVICTING = threading.Lock()  # a pattern's ``lengths`` memo: the oldest cap out and the new one in, at once
MEMO_SETS = 65536  # a pattern's memoized steps, and its loops, at most (then started again)
# caps whose ``lengths`` a pattern keeps: one compiled pattern serves every schema that names it (a
# ``format``, a common ``pattern``), each maxLength a cap of its own — kept without a bound, 200 of
# them held 4.7 MB on the email format
LENGTH_CAPS = 16


@dataclass
class Regex:
    """The automaton: ``edges[s]`` the (class, target) pairs of state s, ``eps[s]`` its ε targets."""

    pattern: str
    edges: list[list[tuple[Ranges, int]]] = field(default_factory=list)
    eps: list[list[int]] = field(default_factory=list)
    start: frozenset[int] = frozenset()
    accept: int = 0
    _lengths: dict[int, list[int]] = field(default_factory=dict)  # ``lengths`` per cap
    _steps: dict[tuple[frozenset[int], int], frozenset[int]] = field(default_factory=dict)
    _loops: dict[frozenset[int], tuple[Ranges, int]] = field(default_factory=dict)  # ``loop`` per state set

    def new(self) -> int:
        if len(self.edges) >= MAX_STATES:
            raise ValueError(f"pattern {self.pattern!r}: its automaton needs more than {MAX_STATES} states "
                             "(nested repetitions multiply)")
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def closure(self, states: set[int]) -> frozenset[int]:
        todo, seen = list(states), set(states)
        while todo:
            for t in self.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        # only states that read a character, and the accept state, say anything about what may
        # follow: the others (a group's or a repetition's junctions) are left out, so a set is
        # equal to every set that behaves alike — ``.*``'s start is its loop, and masks are shared
        return frozenset(s for s in seen if self.edges[s] or s == self.accept)

    def step(self, states: frozenset[int], c: int) -> frozenset[int]:
        """The states after character ``c`` (empty: the text can no longer match)."""
        key = (states, c)
        got = self._steps.get(key)
        if got is None:
            got = self.closure({t for s in states for r, t in self.edges[s] if _has(r, c)})
            if len(self._steps) > MEMO_SETS:
                self._steps.clear()
            self._steps[key] = got
        return got

    def can_step(self, states: frozenset[int], lo: int, hi: int, window: Window) -> bool:
        """Whether some character in [lo, hi] (one still being decoded) keeps the text matchable
        with a number of characters after it that ``window`` allows (``Window``)."""
        masks = self.lengths(window.cap)
        return any(a <= hi and lo <= b and masks[t] & window.bits
                   for s in states for r, t in self.edges[s] for a, b in r)

    def finishes(self, states: frozenset[int], window: Window) -> bool:
        """Whether the text can be completed into a match with a number of characters ``window`` allows."""
        masks = self.lengths(window.cap)
        return any(masks[s] & window.bits for s in states)

    def accepts(self, states: frozenset[int]) -> bool:
        return self.accept in states

    def loop(self, states: frozenset[int]) -> tuple[Ranges, int]:
        """The characters that leave ``states`` as they are — a loop's, such as ``.*``'s or a URL
        path's — and the fewest characters that then still complete a match: a text inside the loop
        may take any run of those characters, within its length bounds (``TokenVocab``'s shortcut).
        Worked out once per state set."""
        got = self._loops.get(states)
        if got is None:
            edges = [r for s in states for r, _ in self.edges[s]]
            cuts = sorted({lo for r in edges for lo, _ in r} | {hi + 1 for r in edges for _, hi in r})
            kept = [(a, b - 1) for a, b in zip(cuts, cuts[1:], strict=False) if self.step(states, a) == states]
            if len(self._loops) > MEMO_SETS:
                self._loops.clear()
            got = self._loops[states] = (normal(kept), self._fewest(states))
        return got

    def _fewest(self, states: frozenset[int]) -> int:
        """The fewest characters from ``states`` to a match (a breadth-first search: ε moves are free)."""
        level, seen, n = set(states), set(states), 0
        while level:
            if self.accept in level:
                return n
            level = {t for s in level for _, t in self.edges[s]}
            level = set(self.closure(level)) - seen
            seen |= level
            n += 1
        return MAX_CODE  # no match from here (a state the matcher never keeps)

    def lengths(self, cap: int, budget: int | None = None) -> list[int]:
        """Per state, a bit mask of the numbers of characters that complete a match from it: bit n
        for n < ``cap``, bit ``cap`` for ``cap`` or more (saturating, so loops end). Exact for any
        window of lengths inside [0, cap) and for "at least n" windows: what a minLength and a
        maxLength ask together (``Window``). A fixed point from the accept state backwards; a loop
        takes about ``cap`` rounds of ``cap``-bit masks, so the cost grows with ``cap`` squared:
        past ``budget`` bits of mask updates, ``LengthsTooCostly``."""
        got = self._lengths.get(cap)
        if got is not None:
            return got
        if budget is not None and cap > budget // 64:  # its masks alone would be too large to build
            raise LengthsTooCostly(cap)
        work = 0
        top = 1 << cap
        full = (top << 1) - 1
        back: list[list[tuple[int, bool]]] = [[] for _ in self.eps]  # (predecessor, over a character)
        for s in range(len(self.eps)):
            for t in self.eps[s]:
                back[t].append((s, False))
            for _, t in self.edges[s]:
                back[t].append((s, True))
        masks = [0] * len(self.eps)
        masks[self.accept] = 1
        todo = [self.accept]
        while todo:
            t = todo.pop()
            m = masks[t]
            shifted = ((m << 1) | (m & top)) & full
            for s, char in back[t]:
                grown = masks[s] | (shifted if char else m)
                if grown != masks[s]:
                    masks[s] = grown
                    todo.append(s)
                    work += cap
                    if budget is not None and work > budget:
                        raise LengthsTooCostly(cap)
        with _EVICTING:  # masks are made on requests' threads and the serving loop's (TokenVocab)
            if len(self._lengths) >= LENGTH_CAPS:  # a hot pattern (a format) meets many maxLengths: the oldest out
                self._lengths.pop(next(iter(self._lengths)), None)
            self._lengths[cap] = masks
        return masks


Node = tuple  # ("char", Ranges) | ("cat", [Node]) | ("alt", [Node]) | ("rep", Node, low, high | None)


def anchored_end(pattern: str) -> bool:
    r"""Whether ``pattern`` ends with the ``$`` anchor: a ``$`` after an even number of backslashes
    (``a\\$`` is a backslash, then the anchor; ``a\$`` a literal dollar)."""
    if not pattern.endswith("$"):
        return False
    body = pattern[:-1]
    return (len(body) - len(body.rstrip("\\"))) % 2 == 0


def compile_regex(pattern: str) -> Regex:
    """ValueError naming what is not supported or not well formed."""
    tree = _Parser(pattern).parse()
    rx = Regex(pattern)
    begin, end = _build(rx, tree)
    rx.accept = end
    rx.start = rx.closure({begin})
    if not rx.finishes(rx.start, Window.between(0, None)):
        surrogates = re.search(r"\\u[dD][89a-fA-F]", pattern)
        raise ValueError(f"pattern {pattern!r}: matches no text" + (
            " (UTF-16 surrogates, \\uD800–\\uDFFF, are no characters UTF-8 can write: write an astral "
            "character as itself)" if surrogates else ""))
    return rx


def parse_tree(pattern: str) -> Node:
    """``pattern`` as a tree, matched whole (no anchors, no text around it): a Lark grammar's
    ``/regex/`` lexeme, compiled to grammar frames rather than an automaton. ValueError as
    ``compile_regex``'s."""
    return _Parser(pattern).whole()


def _build(rx: Regex, node: Node) -> tuple[int, int]:
    """Thompson's construction of one tree node: its (entry, exit) states."""
    kind = node[0]
    if kind == "char":
        a, b = rx.new(), rx.new()
        # UTF-16 surrogates (D800–DFFF, a JS pattern's way to spell astral characters) are no
        # character UTF-8 can write: taken out, so a pattern that needs one matches nothing and is
        # refused, rather than compiled into a state no byte leaves
        ranges = without_surrogates(node[1])
        if ranges:  # an empty class ([^\s\S]) matches no character: no edge, so no path through it
            rx.edges[a].append((ranges, b))
        return a, b
    if kind == "cat":
        a = rx.new()
        end = a
        for child in node[1]:
            x, y = _build(rx, child)
            rx.eps[end].append(x)
            end = y
        return a, end
    if kind == "alt":
        a, b = rx.new(), rx.new()
        for child in node[1]:
            x, y = _build(rx, child)
            rx.eps[a].append(x)
            rx.eps[y].append(b)
        return a, b
    _, child, low, high = node  # "rep": low copies, then (high - low) optional ones, or a loop
    a = rx.new()
    end = a
    for _ in range(low):
        x, y = _build(rx, child)
        rx.eps[end].append(x)
        end = y
    if high is None:
        x, y = _build(rx, child)
        b = rx.new()
        rx.eps[end] += [x, b]
        rx.eps[y] += [x, b]
        return a, b
    b = rx.new()
    for _ in range(high - low):
        x, y = _build(rx, child)
        rx.eps[end] += [x, b]
        end = y
    rx.eps[end].append(b)
    return a, b


DOT: Ranges = negate(((10, 10), (13, 13), (0x2028, 0x2029)))


class _Parser:
    """Recursive descent over the pattern into a tree (``Node``)."""

    def __init__(self, pattern: str) -> None:
        self.s, self.i, self.depth = pattern, 0, 0

    def fail(self, why: str) -> ValueError:
        return ValueError(f"pattern {self.s!r}: {why} (at {self.i})")

    def peek(self, k: int = 0) -> str:
        return self.s[self.i + k] if self.i + k < len(self.s) else ""

    def parse(self) -> Node:
        head = self.s.startswith("^")
        tail = anchored_end(self.s)
        body = self.s[int(head):len(self.s) - int(tail)]
        self.s, self.i = body, 0
        tree = self.whole()
        if (head or tail) and tree[0] == "alt":  # ECMA's ^a|b$ anchors one side each: not what it looks like
            raise self.fail("an anchor beside a top-level '|' is ambiguous; write ^(…|…)$")
        anywhere = ("rep", ("char", ANY), 0, None)
        return ("cat", [*([] if head else [anywhere]), tree, *([] if tail else [anywhere])])

    def whole(self) -> Node:
        """The rest of the pattern as one tree (a stray ')' ends nothing)."""
        tree = self.alternation()
        if self.i < len(self.s):
            raise self.fail("an unmatched ')'")
        return tree

    def alternation(self) -> Node:
        options = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self) -> Node:
        items = []
        while self.peek() and self.peek() not in "|)":
            items.append(self.quantified())
        return ("cat", items)

    def quantified(self) -> Node:
        node = self.atom()
        while self.peek() and self.peek() in "*+?{":
            c = self.peek()
            if c == "{":
                low, high = self.braces()
            else:
                self.i += 1
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            node = ("rep", node, low, high)
            if self.peek() == "?":  # lazy: the same language
                self.i += 1
        return node

    def braces(self) -> tuple[int, int | None]:
        close = self.s.find("}", self.i)
        low, comma, high = (self.s[self.i + 1:close] if close > 0 else "").partition(",")
        if not low.isdigit() or (high and not high.isdigit()):
            raise self.fail("a quantifier {n}, {n,} or {n,m} expected")
        self.i = close + 1
        lo, hi = int(low), (int(high) if high else None if comma else int(low))
        if (hi is not None and hi < lo) or max(lo, hi or 0) > MAX_REPEAT:
            raise self.fail(f"a repetition must be ordered and at most {MAX_REPEAT}")
        return lo, hi

    def atom(self) -> Node:
        c = self.peek()
        if c == "(":
            self.i += 1
            if self.s.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.fail("look-arounds and named groups are not supported")
            self.depth += 1
            if self.depth > MAX_GROUP_DEPTH:
                raise self.fail(f"groups nested deeper than {MAX_GROUP_DEPTH}")
            node = self.alternation()
            self.depth -= 1
            if self.peek() != ")":
                raise self.fail("a ')' expected")
            self.i += 1
            return node
        if c == "[":
            return ("char", self.klass())
        if c == ".":
            self.i += 1
            return ("char", DOT)
        if c == "\\":
            return ("char", self.escape())
        if c in ("*", "+", "?", "{"):
            raise self.fail("nothing to repeat")
        if c in ("^", "$"):
            raise self.fail(f"{c!r} only at the pattern's ends is supported")
        self.i += 1
        return ("char", ((ord(c), ord(c)),))

    def escape(self) -> Ranges:
        self.i += 1
        c = self.peek()
        if not c:
            raise self.fail("a dangling backslash")
        self.i += 1
        named = {"d": DIGIT, "w": WORD, "s": SPACE}
        if c.lower() in named:
            return named[c.lower()] if c.islower() else negate(named[c.lower()])
        simple = {"n": 10, "r": 13, "t": 9, "f": 12, "v": 11, "0": 0}
        if c in simple:
            return ((simple[c], simple[c]),)
        if c == "u":
            digits = self.s[self.i:self.i + 4]
            if len(digits) != 4 or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail("\\u needs four hex digits")
            self.i += 4
            return ((int(digits, 16),) * 2,)
        if c.isalnum():
            raise self.fail(f"the escape \\{c} (a back-reference, a boundary or unknown) is not supported")
        return ((ord(c), ord(c)),)

    def single(self) -> Ranges:
        """One class item: a character or an escape."""
        if self.peek() == "\\":
            return self.escape()
        c = self.peek()
        self.i += 1
        return ((ord(c), ord(c)),)

    def klass(self) -> Ranges:
        self.i += 1
        negated = self.peek() == "^"
        self.i += negated
        ranges: list[tuple[int, int]] = []
        first = True
        while self.peek() and (self.peek() != "]" or first):
            first = False
            item = self.single()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                upper = self.single()
                if len(item) != 1 or item[0][0] != item[0][1] or len(upper) != 1 or upper[0][0] != upper[0][1]:
                    raise self.fail("a class range needs single characters at both ends")
                if upper[0][0] < item[0][0]:
                    raise self.fail("a class range out of order")
                ranges.append((item[0][0], upper[0][0]))
            else:
                ranges.extend(item)
        if self.peek() != "]":
            raise self.fail("a ']' expected")
        self.i += 1
        out = normal(ranges)
        return negate(out) if negated else out
