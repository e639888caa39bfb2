"""Grammars in Lark's notation — the other syntax vLLM's ``structured_outputs.grammar`` takes (its
guidance backend reads it, its xgrammar one converts it) — read into the rule expressions GBNF's
reader makes, then compiled by ``grammar.compile_rules`` onto the same frames.

    start: pair ("," pair)*
    pair: KEY "=" value
    ?value: SIGNED_NUMBER | ESCAPED_STRING | "none"i
    KEY: /[a-z_]+/
    %import common (SIGNED_NUMBER, ESCAPED_STRING, WS)
    %ignore WS

Read: rules (``name: …``, lower case) and terminals (``NAME: …``, upper case), each on its line or
continued on lines that start with ``|``; the ``?`` / ``!`` prefixes, ``.priority`` and ``-> alias``
shape Lark's tree, not the language, so they are read and dropped. Items: ``"literal"`` (``"…"i``
case-insensitive), ``"a".."z"``, ``/regex/flags`` (Python's syntax, the subset the ``regex``
constraint takes, with flags ``i``, ``s`` — after it, or as ``(?is)`` at its start; ``m`` and ``u``
change nothing here; ``^`` / ``$`` at its ends are read as nothing, a lexeme being matched whole),
names, ``( … )``, ``[ … ]`` (optional), ``? * +``, ``~ n`` / ``~ n..m``; ``//`` and ``#``
comments; and llguidance's extensions ``{n}`` / ``{n,m}`` and ``%json {schema}`` (a JSON value
the schema accepts, written as a schema's answer is). ``%import common.NAME [-> ALIAS]`` /
``%import common (A, B)`` take Lark's common terminals, written here (``COMMON``); ``%ignore`` what
may stand between lexemes. Refused by name: other imports, ``%declare`` / ``%override`` /
``%extend``, templates (``name{x}``), regex flags ``x`` and ``l``. The start rule is ``start``.

hypic matches characters, not tokens: a terminal is a regular language inlined where it is used, and
a text is accepted when some split of it into lexemes derives it (Lark's Earley parser with its
dynamic lexer; a standard lexer's longest match can refuse some of those texts). ``%ignore``: every
lexeme a rule uses (a literal, a regex, a terminal) may be preceded by any run of the ignored
terminals, and so may the end of the text — where a lexer would skip them.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from hypic.engine.structured.grammar import MAX_REPEAT, Chars, GrammarText
from hypic.engine.structured.regex import ANY, DOT, anchored_end, negate, normal, parse_tree
from hypic.engine.structured.tags import json_value

NAME = re.compile(r"_*[A-Za-z][A-Za-z0-9_]*")
DEFINITION = re.compile(r"([?!]*)(_*[A-Za-z][A-Za-z0-9_]*)(?:\.(-?\d+))?[ \t]*(\{[^}\n]*\}[ \t]*)?:(?!:)")
GBNF_RULE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*[ \t]*::=")
DIRECTIVE = re.compile(r"%[a-z]*")
IGNORE, START = "%ignore", "%start"  # rules of the reader's own: no name written in a grammar has '%'

# Lark's common terminals (the names and languages of its ``common.lark``), in this notation
COMMON = r"""
DIGIT: "0".."9"
HEXDIGIT: "a".."f" | "A".."F" | DIGIT
INT: DIGIT+
SIGNED_INT: ["+" | "-"] INT
DECIMAL: INT "." INT? | "." INT
_EXP: ("e" | "E") SIGNED_INT
FLOAT: INT _EXP | DECIMAL _EXP?
SIGNED_FLOAT: ["+" | "-"] FLOAT
NUMBER: FLOAT | INT
SIGNED_NUMBER: ["+" | "-"] NUMBER
_STRING_INNER: /.*/
_STRING_ESC_INNER: /([^\\\n]|\\.)*/
ESCAPED_STRING: "\"" /([^"\\\n]|\\.)*/ "\""
LCASE_LETTER: "a".."z"
UCASE_LETTER: "A".."Z"
LETTER: UCASE_LETTER | LCASE_LETTER
WORD: LETTER+
CNAME: ("_" | LETTER) ("_" | LETTER | DIGIT)*
WS_INLINE: (" " | /\t/)+
WS: /[ \t\f\r\n]/+
CR: /\r/
LF: /\n/
NEWLINE: (CR? LF)+
SH_COMMENT: /#[^\n]*/
CPP_COMMENT: /\/\/[^\n]*/
C_COMMENT: "/*" /([^*]|\*+[^*\/])*/ /\*+/ "/"
SQL_COMMENT: /--[^\n]*/
"""


def looks_like_lark(text: str) -> bool:
    """Whether the grammar's first statement is written Lark's way (``name: …`` or a ``%``
    directive) rather than GBNF's (``name ::= …``)."""
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith(("#", "//")):
            continue
        return GBNF_RULE.match(s) is None and (DIRECTIVE.match(s) is not None or DEFINITION.match(s) is not None)
    return False


def is_terminal(name: str) -> bool:
    return name.lstrip("_")[:1].isupper() or name.startswith("common.")


def read_lark(text: str) -> tuple[dict[str, tuple], str]:
    """The grammar's rules as GBNF's reader writes them, and the one to start from; ValueError
    naming what is wrong and where."""
    reader = _Reader(text)
    reader.statements()
    if "start" not in reader.defs:
        raise ValueError("grammar: Lark: no start rule (start: …: where the answer starts)")
    defs = {**_common(), **reader.defs}
    ignore = ("ref", IGNORE) if reader.ignored else None
    rules = {name: _lexemes(expr, name, None if is_terminal(name) else ignore) for name, expr in defs.items()}
    if ignore is None:
        return rules, "start"
    ignored = [_lexemes(e, IGNORE, None) for e in reader.ignored]
    rules[IGNORE] = _any_run(ignored, rules)
    rules[START] = ("seq", [("ref", "start"), ignore])  # and at the end of the text
    return rules, START


def _lexemes(expr: tuple, owner: str, ignore: tuple | None) -> tuple:
    """``expr`` with its lexemes unwrapped — inside a rule (``ignore`` given) each preceded by the
    ignored run — and a rule used inside a terminal (or ``%ignore``) refused."""
    kind = expr[0]
    lexical = owner == IGNORE or is_terminal(owner)  # a terminal's insides, or what %ignore skips
    where = "%ignore" if owner == IGNORE else f"terminal {owner}"
    if kind == "lex":
        return expr[1] if ignore is None else ("seq", [ignore, expr[1]])
    if kind == "json":  # a value read as a rule reads it: ignored text may stand before it, not inside
        if lexical:
            raise ValueError(f"grammar: Lark: {where} holds %json: a JSON value is a rule's item")
        return ("node", expr[1]) if ignore is None else ("seq", [ignore, ("node", expr[1])])
    if kind == "ref":
        name = expr[1]
        if lexical and not is_terminal(name):
            raise ValueError(f"grammar: Lark: {where} uses rule {name!r}: a terminal is made of "
                             "literals, regexes and other terminals")
        return ("seq", [ignore, expr]) if ignore is not None and is_terminal(name) else expr
    if kind in ("alt", "seq"):
        return (kind, [_lexemes(e, owner, ignore) for e in expr[1]])
    if kind == "rep":
        return ("rep", _lexemes(expr[1], owner, ignore), expr[2], expr[3])
    return expr


def _any_run(ignored: list[tuple], rules: dict[str, tuple]) -> tuple:
    """Any run of the ignored terminals. One that is itself a run (``WS: /[ \\t]/+``) is repeated
    from zero rather than nested in a second repetition: the same text, split one way only."""
    if len(ignored) == 1:
        body = ignored[0]
        for _ in range(64):  # through names and one-item groups (a bound: a terminal may name itself)
            if body[0] == "ref" and body[1] in rules:
                body = rules[body[1]]
            elif body[0] in ("alt", "seq") and len(body[1]) == 1:
                body = body[1][0]
            else:
                break
        if body[0] == "rep" and body[2] == 1 and body[3] is None:
            return ("rep", body[1], 0, None)
    return ("rep", ("alt", ignored), 0, None)


@lru_cache(maxsize=1)
def _common() -> dict[str, tuple]:
    """``COMMON``'s terminals as ``common.NAME``, so a grammar's own names never collide with them."""
    reader = _Reader(COMMON)
    reader.statements()

    def renamed(expr: tuple) -> tuple:
        if expr[0] == "ref":
            return ("ref", "common." + expr[1])
        if expr[0] in ("alt", "seq"):
            return (expr[0], [renamed(e) for e in expr[1]])
        if expr[0] == "rep":
            return ("rep", renamed(expr[1]), expr[2], expr[3])
        if expr[0] == "lex":
            return ("lex", renamed(expr[1]))
        return expr

    return {"common." + name: renamed(expr) for name, expr in reader.defs.items()}


def common_names() -> list[str]:
    return [name.removeprefix("common.") for name in _common()]


def fold_case(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """A class read case-insensitively, as Python's ``re.IGNORECASE`` reads it: a class covering most
    characters is folded through its complement (``[^a]``: neither ``a`` nor ``A``)."""
    if sum(hi - lo + 1 for lo, hi in ranges) > 0x88000:
        return negate(_fold(negate(ranges)))
    return _fold(ranges)


def _fold(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    extra = []
    for lo, hi in ranges:
        for a, b, shift in ((65, 90, 32), (97, 122, -32)):  # ASCII letters as ranges
            if max(lo, a) <= min(hi, b):
                extra.append((max(lo, a) + shift, min(hi, b) + shift))
        if hi > 127 and hi - max(lo, 128) < 4096:  # other letters one by one, where few
            for c in range(max(lo, 128), hi + 1):
                for other in {chr(c).lower(), chr(c).upper()}:
                    if len(other) == 1 and other != chr(c):
                        extra.append((ord(other), ord(other)))
    return normal([*ranges, *extra])


class _Reader(GrammarText):
    """Lark text → ``defs`` (name → expression, GBNF's reader's tuples, a lexeme wrapped as
    ``("lex", …)`` until ``_lexemes`` knows whether ignored text may precede it) and ``ignored``."""

    WHERE = "grammar: Lark"

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.defs: dict[str, tuple] = {}
        self.ignored: list[tuple] = []

    def peek(self) -> str:
        return self.text[self.at] if self.at < len(self.text) else ""

    def comment_here(self) -> bool:
        return self.text[self.at] == "#" or self.text.startswith("//", self.at)

    def statements(self) -> None:
        self.skip(newlines=True)
        while self.at < len(self.text):
            if self.peek() == "%":
                self.directive()
            else:
                self.definition()
            self.skip(newlines=False)
            if self.peek() not in ("", "\n"):
                raise self.fail(f"unexpected {self.peek()!r}")
            self.skip(newlines=True)

    def definition(self) -> None:
        m = DEFINITION.match(self.text, self.at)
        if m is None:
            found = NAME.match(self.text, self.at)
            if found and re.compile(r"[ \t]*::=").match(self.text, found.end()):
                raise self.fail("name ::= … is GBNF: a grammar is read as Lark when its first rule is "
                                "written name: …, so every rule must be")
            raise self.fail("expected a rule (name: …), a terminal (NAME: …) or a directive (%import, %ignore)")
        name = m[2]
        if m[4]:
            raise self.fail(f"{name}{m[4].strip()}: templates are not read; write each use out")
        if name in self.defs:
            raise self.fail(f"{name!r} defined twice")
        self.at = m.end()
        self.defs[name] = self.expansions(0)

    def directive(self) -> None:
        start = self.at
        word = DIRECTIVE.match(self.text, self.at)[0]
        self.at += len(word)
        if word == "%ignore":
            self.skip(newlines=False)
            self.ignored.append(self.expansions(0))
        elif word == "%import":
            self.imports()
        elif word in ("%declare", "%override", "%extend"):
            raise self.fail(f"{word} is not read (it serves Lark's own lexer and imported grammars)", start)
        else:
            raise self.fail(f"unknown directive {word}", start)

    def imports(self) -> None:
        self.skip(newlines=False)
        m = re.compile(r"common\b[ \t]*").match(self.text, self.at)
        if m is None:
            raise self.fail("only Lark's common terminals are read: %import common.NAME or %import common (A, B)")
        self.at = m.end()
        if self.peek() == ".":
            self.at += 1
            name = self.name()
            self.skip(newlines=False)
            alias = name
            if self.text.startswith("->", self.at):
                self.at += 2
                self.skip(newlines=False)
                alias = self.name()
            self.bring(name, alias)
        elif self.peek() == "(":
            self.at += 1
            while True:
                self.skip(newlines=True)
                self.bring(self.name(), None)
                self.skip(newlines=True)
                if self.peek() == ")":
                    self.at += 1
                    return
                if self.peek() != ",":
                    raise self.fail("expected , or ) in the list of names")
                self.at += 1
        else:
            raise self.fail("expected common.NAME or common (A, B)")

    def name(self) -> str:
        m = NAME.match(self.text, self.at)
        if m is None:
            raise self.fail("expected a name")
        self.at = m.end()
        return m[0]

    def bring(self, name: str, alias: str | None) -> None:
        if name not in common_names():
            raise self.fail(f"common has no {name!r} (it has {', '.join(common_names())})", self.at - len(name))
        alias = alias or name
        if alias in self.defs:
            raise self.fail(f"{alias!r} defined twice")
        self.defs[alias] = ("ref", "common." + name)

    def expansions(self, depth: int) -> tuple:
        if depth > 64:
            raise self.fail("groups nested deeper than 64")
        options = [self.alias(depth)]
        while True:
            mark = self.at
            self.skip(newlines=True)  # an alternative may go on on the next line, after |
            if self.peek() != "|":
                self.at = mark
                return ("alt", options)
            self.at += 1
            options.append(self.alias(depth))

    def alias(self, depth: int) -> tuple:
        seq = self.sequence(depth)
        if self.text.startswith("->", self.at):  # names the tree node: nothing to match
            self.at += 2
            self.skip(newlines=False)
            self.name()
            self.skip(newlines=depth > 0)
        return seq

    def sequence(self, depth: int) -> tuple:
        items = []
        while True:
            self.skip(newlines=depth > 0)  # at the top a line ends the definition (or | goes on)
            c = self.peek()
            if c in ("", "\n", "|", ")", "]") or self.text.startswith("->", self.at):
                return ("seq", items)
            items.append(self.repeat(self.atom(depth), depth))

    def atom(self, depth: int) -> tuple:
        c, start = self.peek(), self.at
        if c in "\"'":
            text = self.string()
            folded = self.peek() == "i" and not NAME.match(self.text, self.at + 1)
            self.at += folded
            mark = self.at
            self.skip(newlines=False)
            if self.text.startswith("..", self.at):
                self.at += 2
                self.skip(newlines=False)
                if self.peek() not in "\"'" or not self.peek():
                    raise self.fail('expected a string after .. ("a".."z")')
                upper = self.string()
                if len(text) != 1 or len(upper) != 1:
                    raise self.fail("a range's ends are single characters", start)
                if ord(upper) < ord(text):
                    raise self.fail(f"range {text!r}..{upper!r} is backwards", start)
                return ("lex", ("chars", Chars(((ord(text), ord(upper)),), False)))
            self.at = mark
            return ("lex", _literal(text, folded))
        if c == "/":
            return ("lex", self.regex())
        if c in "([":
            self.at += 1
            inner = self.expansions(depth + 1)
            self.skip(newlines=True)
            close = ")" if c == "(" else "]"
            if self.peek() != close:
                raise self.fail(f"expected {close} to close the {'group' if c == '(' else 'optional part'}")
            self.at += 1
            return inner if c == "(" else ("rep", inner, 0, 1)
        m = NAME.match(self.text, self.at)
        if m is not None:
            self.at = m.end()
            if self.peek() == "{" and not re.compile(r"\{\s*\d").match(self.text, self.at):
                raise self.fail(f"{m[0]}{{…}}: templates are not read; write each use out", start)
            return ("ref", m[0])
        if self.text.startswith("%json", self.at):
            return ("json", self.json_schema())
        if c == "%":
            raise self.fail(f"{DIRECTIVE.match(self.text, self.at)[0]!r} is not read inside a rule")
        raise self.fail(f"unexpected {c!r}")

    def json_schema(self) -> object:
        """llguidance's ``%json {schema}``: a JSON value the schema accepts, written compactly as a
        schema's answer is (``schema.py``), where the item stands."""
        start = self.at
        self.at += len("%json")
        self.skip(newlines=True)
        try:
            schema, end = json.JSONDecoder().raw_decode(self.text, self.at)
        except json.JSONDecodeError as e:
            raise self.fail(f"%json: its schema is not JSON ({e.msg})", e.pos) from None
        try:
            node = json_value(schema)
        except ValueError as e:
            raise self.fail(f"%json: {str(e).removeprefix('json_schema: ')}", start) from None
        self.at = end
        return node

    def repeat(self, item: tuple, depth: int) -> tuple:
        while True:
            mark = self.at
            self.skip(newlines=depth > 0)
            c = self.peek()
            if c and c in "*+?":
                self.at += 1
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "~":
                self.at += 1
                self.skip(newlines=False)
                m = re.compile(r"(\d+)(?:[ \t]*\.\.[ \t]*(\d+))?").match(self.text, self.at)
                if m is None:
                    raise self.fail("expected ~ n or ~ n..m")
                low, high = int(m[1]), int(m[2] or m[1])
                self.bounds(low, high, m[0])
                self.at = m.end()
            elif c == "{" and re.compile(r"\{\s*\d").match(self.text, self.at):
                m = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?}").match(self.text, self.at)
                if m is None:
                    raise self.fail("expected {n}, {n,} or {n,m}")
                low = int(m[1])
                high = low if m[2] is None else int(m[3]) if m[3] else None
                self.bounds(low, high, m[0])
                self.at = m.end()
            else:
                self.at = mark
                return item
            item = ("rep", item, low, high)

    def bounds(self, low: int, high: int | None, written: str) -> None:
        if (high is not None and high < low) or max(low, high or 0) > MAX_REPEAT:
            raise self.fail(f"repetition {written}: expected 0 ≤ n ≤ m ≤ {MAX_REPEAT}")

    def string(self) -> str:
        quote, start = self.peek(), self.at
        self.at += 1
        out = []
        while True:
            if self.at >= len(self.text) or self.text[self.at] == "\n":
                raise self.fail(f"a string ends at its line: expected {quote}", start)
            c = self.text[self.at]
            self.at += 1
            if c == quote:
                return "".join(out)
            out.append(chr(self.escape()) if c == "\\" else c)

    def regex(self) -> tuple:
        start = self.at
        self.at += 1
        while True:  # to the first / not escaped: the pattern's own \/ reads as a slash
            c = self.peek()
            if c in ("", "\n") or c == "\\" and self.text[self.at + 1:self.at + 2] in ("", "\n"):
                raise self.fail("a regex ends at its line: expected /", start)
            self.at += 2 if c == "\\" else 1
            if c == "/":
                break
        pattern = self.text[start + 1:self.at - 1]
        flags = re.compile(r"[imslux]*").match(self.text, self.at)[0]
        self.at += len(flags)
        bad = sorted(set(flags) - set("imsu"))
        if bad:
            raise self.fail(f"regex flag {bad[0]!r} is not read (i, s, m and u are)", self.at - len(flags))
        inline = re.match(r"\(\?([a-zA-Z]+)\)", pattern)  # Python's flags for the whole pattern: (?i)select
        if inline:
            bad = sorted(set(inline[1]) - set("imsu"))
            if bad:
                raise self.fail(f"/{pattern}/: inline flag {bad[0]!r} is not read (i, s, m and u are)", start)
            flags += inline[1]
        body = pattern[inline.end() if inline else 0:].removeprefix("^")  # a lexeme is matched whole: anchors
        body = body[:-1] if anchored_end(body) else body  # at its ends say nothing more
        try:
            tree = parse_tree(body)
        except ValueError as e:
            why = str(e).removeprefix(f"pattern {body!r}: ")
            shift = len(pattern) - len(body) - int(anchored_end(pattern))  # placed in the pattern as written
            why = re.sub(r" \(at (\d+)\)$", lambda m: f" (at {int(m[1]) + shift})", why)
            raise self.fail(f"/{pattern}/: {why}", start) from None
        return _from_regex(tree, "i" in flags, "s" in flags)


def _literal(text: str, folded: bool) -> tuple:
    if not folded:
        return ("word", text.encode())
    items, run = [], ""
    for c in text:
        if c.lower() == c.upper():  # no case: bytes as they are
            run += c
            continue
        if run:
            items.append(("word", run.encode()))
            run = ""
        items.append(("chars", Chars(fold_case(((ord(c), ord(c)),)), False)))
    if run:
        items.append(("word", run.encode()))
    return ("seq", items)


NOT_NEWLINE = negate(((10, 10),))


def _from_regex(tree: tuple, folded: bool, dotall: bool) -> tuple:
    """A regex tree (``regex.parse_tree``) as grammar expressions: it runs as grammar frames, so a
    character loop in it gets the vocabulary's shortcut like a GBNF class's."""
    kind = tree[0]
    if kind == "char":
        ranges = tree[1]
        if ranges == DOT:  # the parser reads '.' as ECMA's; Python's misses only \n, or nothing under s
            ranges = ANY if dotall else NOT_NEWLINE
        return ("chars", Chars(fold_case(ranges) if folded else ranges, False))
    if kind == "cat":
        return ("seq", [_from_regex(t, folded, dotall) for t in tree[1]])
    if kind == "alt":
        return ("alt", [_from_regex(t, folded, dotall) for t in tree[1]])
    return ("rep", _from_regex(tree[1], folded, dotall), tree[2], tree[3])
