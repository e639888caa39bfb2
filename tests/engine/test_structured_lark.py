"""Grammars in Lark's notation (``hypic.engine.structured.lark``): the matcher accepts what
independent references accept — Python's ``re.fullmatch`` for random grammars without recursion
(one random tree written as Lark, terminals, flags and ``%ignore`` included, and as a Python
expression), ``json.loads`` for Lark's JSON example, Python's parser for a left-recursive
calculator — every draw of the bundled model is derived from the grammar, and bad grammars are
refused by name and place."""

from __future__ import annotations

import ast
import json
import random
import re

import pytest

from hypic import LLM, SamplingParams
from hypic.engine.structured import compile_grammar, compile_schema
from hypic.engine.structured.lark import looks_like_lark
from hypic.engine.structured.matcher import accepts
from tests.engine.test_structured_grammar import _walk, assert_draws_derived

ALPHABET = 'aBé"\\-]^\n x.É'
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n"}
_CLASS_ESCAPES = {"]": "\\]", "\\": "\\\\", "^": "\\^", "-": "\\-", "\n": "\\n", "/": "\\/"}


class _Grammar:
    """A random grammar built twice: Lark text, and the Python expression it means."""

    def __init__(self, rng: random.Random, ignore: bool) -> None:
        self.rng, self.ignore = rng, ignore
        self.terminals: list[tuple[str, str]] = []  # (Lark definition, Python expression)

    def lexeme(self, lark: str, python: str, in_rule: bool) -> tuple[str, str]:
        # a lexeme a rule uses may follow ignored spaces; inside a terminal it may not
        return lark, (f"(?: *{python})" if in_rule and self.ignore else python)

    def tree(self, depth: int, in_rule: bool, repeated: bool = False) -> tuple[str, str]:
        """``repeated``: under a repetition, which repeats nothing more (a repetition of repetitions,
        ignored spaces in between, splits a text so many ways that the test's walks take seconds)."""
        rng = self.rng
        kinds = ["lit", "lit", "class", "range", "seq", "alt", "rep", "opt", "terminal"] if depth < 3 else \
            ["lit", "class", "range"]
        if repeated:
            kinds = [k for k in kinds if k not in ("rep", "opt")]
        kind = rng.choice(kinds if in_rule else [k for k in kinds if k != "terminal"])
        if kind == "lit":
            s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 3)))
            folded = rng.random() < 0.3
            lark = '"' + "".join(_ESCAPES.get(c, c) for c in s) + '"' + ("i" if folded else "")
            return self.lexeme(lark, f"(?{'i' if folded else ''}:{re.escape(s)})", in_rule)
        if kind == "class":
            chars = rng.sample(ALPHABET, rng.randint(1, 4))
            hat = "^" if rng.random() < 0.3 else ""
            body = "".join(_CLASS_ESCAPES.get(c, c) for c in chars)
            flags = rng.choice(["", "", "i", "s"])
            dot = rng.random() < 0.3  # '.': Python's, every character but \n (all of them under s)
            lark_body, py_body = (f"[{hat}{body}]", f"[{hat}{''.join(re.escape(c) for c in chars)}]")
            if dot:
                lark_body, py_body = f"(?:{lark_body}|.)", f"(?:{py_body}|.)"
            if not repeated and rng.random() < 0.4:
                q = rng.choice(["+", "*", "{1,2}"])
                lark_body, py_body = lark_body + q, py_body + q
            py = f"(?{flags}:{py_body})" if flags else py_body
            return self.lexeme(f"/{lark_body}/{flags}", py, in_rule)
        if kind == "range":
            lo = rng.choice("aAé-")
            hi = chr(ord(lo) + rng.randint(0, 3))
            return self.lexeme(f'"{lo}".."{hi}"', f"[{re.escape(lo)}-{re.escape(hi)}]", in_rule)
        if kind == "terminal":  # a named terminal: its insides read no ignored text
            name = f"T{len(self.terminals)}"
            lark, py = self.tree(depth + 1, in_rule=False, repeated=repeated)
            self.terminals.append((f"{name}: {lark}", py))
            return self.lexeme(name, f"(?:{py})", in_rule)
        parts = [self.tree(depth + 1, in_rule, repeated or kind in ("rep", "opt")) for _ in range(rng.randint(1, 3))]
        if kind == "seq":
            return " ".join(g for g, _ in parts), "".join(p for _, p in parts)
        if kind == "alt":
            py = "(?:" + "|".join(p for _, p in parts) + ")"
            if depth == 0:  # the rule's own alternatives, which may go on on the next line after |
                return rng.choice([" | ", "\n    | "]).join(g for g, _ in parts), py
            return "(" + " | ".join(g for g, _ in parts) + ")", py
        g, p = parts[0]
        if kind == "opt":
            return f"[{g}]", f"(?:{p})?"
        lark_q, py_q = rng.choice([("*", "*"), ("+", "+"), ("?", "?"), ("~ 2", "{2}"), ("~ 1..3", "{1,3}"),
                                   ("{0,2}", "{0,2}"), ("{2,}", "{2,}")])
        return f"({g}){lark_q}", f"(?:{p}){py_q}"


def _random_lark(seed: int) -> tuple[str, str]:
    rng = random.Random(seed)
    g = _Grammar(rng, ignore=rng.random() < 0.5)
    rules = [g.tree(0, in_rule=True) for _ in range(rng.randint(1, 3))]
    order = rng.sample(range(len(rules)), len(rules))
    prefix = rng.choice(["", "?", "!"])
    text = f"{prefix}start: " + " ".join(f"r{i}" for i in order) + "  // the start\n"
    text += "".join(f"r{i}.{rng.randint(1, 3)}: {lark} -> alias{i}\n" if rng.random() < 0.3 else f"r{i}: {lark}\n"
                    for i, (lark, _) in enumerate(rules))
    text += "".join(f"{t}\n" for t, _ in g.terminals)
    if g.ignore:
        text += '%ignore " "\n'
    pattern = "".join(rules[i][1] for i in order) + (" *" if g.ignore else "")
    return text, pattern


@pytest.mark.parametrize("seed", range(60))
def test_random_lark_grammars_accept_what_re_fullmatch_accepts(seed: int) -> None:
    text, pattern = _random_lark(seed)
    assert looks_like_lark(text)
    node = compile_grammar(text)
    rng = random.Random(seed)
    candidates = ["".join(rng.choice(ALPHABET + " ") for _ in range(rng.randint(0, 8))) for _ in range(150)]
    for _ in range(20):  # texts the grammar derives, as far as the walk finds them
        walked = _walk(node, rng)
        if walked is not None:
            candidates.append(walked.decode())
            candidates.append(" " + walked.decode().replace("a", " a", 1))
    for t in candidates:
        assert accepts(node, t.encode()) == (re.fullmatch(pattern, t) is not None), (text, pattern, t)


JSON_LARK = r"""
?start: value
?value: object
      | array
      | string
      | SIGNED_NUMBER      -> number
      | "true"             -> true
      | "false"            -> false
      | "null"             -> null

array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING

%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""


def test_larks_json_example_reads_what_json_loads_reads() -> None:
    """Over texts of ``[]{}",:1a``, spaces and newlines, where Lark's numbers and strings are JSON's
    (no '+', no leading zeros, no tabs), so the two must agree text by text."""
    node = compile_grammar(JSON_LARK)
    rng = random.Random(3)
    texts = [json.dumps(v, indent=rng.choice([None, 2])) for v in
             ({"a": [1, -2.5, 3e10, True, None], "b": {"c": 'd"\\é'}}, [], {}, "x", 0, [[[]]], "日本")]
    texts += ["".join(rng.choice('[]{}",:1a \n') for _ in range(rng.randint(1, 9))) for _ in range(4000)]

    def json_ok(t: str) -> bool:
        try:
            json.loads(t)
            return True
        except ValueError:
            return False

    agreed = 0
    for t in texts:
        assert accepts(node, t.encode()) == json_ok(t), t
        agreed += json_ok(t)
    assert agreed > 60  # the sample holds JSON texts, not only refusals


CALC_LARK = r"""
?start: sum
?sum: product
    | sum "+" product   -> add
    | sum "-" product   -> sub
?product: atom
    | product "*" atom  -> mul
    | product "/" atom  -> div
?atom: NUMBER           -> number
     | "-" atom         -> neg
     | NAME             -> var
     | "(" sum ")"

%import common.CNAME -> NAME
%import common.NUMBER
%import common.WS_INLINE
%ignore WS_INLINE
"""


def _python_calc(s: str) -> bool:
    try:
        tree = ast.parse(s.strip(" "), mode="eval")
    except SyntaxError:
        return False
    ok = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load, ast.Add, ast.Sub, ast.Mult,
          ast.Div, ast.USub)
    return all(isinstance(n, ok) and (not isinstance(n, ast.Constant) or type(n.value) in (int, float))
               for n in ast.walk(tree))  # (not '...', Python's Ellipsis)


def test_larks_left_recursive_calculator_reads_what_pythons_parser_reads() -> None:
    node = compile_grammar(CALC_LARK)
    rng = random.Random(11)
    texts = ["1+2*3", " a * (b - 3.5) / 2 ", "1+", "(1", "x y", "-(-x)", "1e5*.5", "2.5.3", "1a", "a1", "1 .5"]
    texts += ["".join(rng.choice("1.e+-*/()ab ") for _ in range(rng.randint(1, 9))) for _ in range(4000)]
    for t in texts:
        assert accepts(node, t.encode()) == _python_calc(t), t


def test_ignored_text_stands_between_lexemes_never_inside_a_terminal() -> None:
    node = compile_grammar('start: WORD ("," WORD)*\nWORD: /[a-z]+/ "!"?\n%ignore " " | "\\t"')
    for t, ok in (("ab,cd", True), (" ab , cd! ", True), ("\tab\t,cd", True), ("a b", False), ("ab !", False),
                  ("ab,,cd", False), ("ab!,cd!", True)):
        assert accepts(node, t.encode()) == ok, t
    # without %ignore, a space is text like any other
    assert not accepts(compile_grammar('start: "a" "b"'), b"a b")


def test_llguidances_json_item_reads_what_the_schema_reads() -> None:
    """``%json {schema}`` in a rule: the value a JSON schema's constraint accepts, here between
    literals and after ignored spaces; checked text by text against the schema's own constraint."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}, "n": {"type": "integer"}},
              "required": ["city"], "additionalProperties": False}
    node = compile_grammar('start: "call" %json ' + json.dumps(schema, indent=2) + ' ";"\n%ignore " "')
    alone = compile_schema(schema)
    values = ['{"city": "Oslo"}', '{"city": "Oslo", "n": 3}', '{"city":"Rome","n":-1}', '{"city": "Paris"}',
              '{"n": 3}', '{"city": "Oslo", "x": 1}', '{"city": 5}', "[]", '{"city": "Oslo"', "3"]
    for v in values:
        assert accepts(node, f"call {v};".encode()) == accepts(node, f"call{v} ;".encode()) == \
            accepts(alone, v.encode()), v
    assert sum(accepts(alone, v.encode()) for v in values) == 3


@pytest.mark.parametrize("grammar, needle", [
    ('value: "a"', r"no start rule \(start: …"),
    ('start: "a" x', "rule 'x' is used but never defined"),
    ('start: T\nT: "a" rule\nrule: "b"', "terminal T uses rule 'rule'"),
    ('start: "a"\n%ignore item\nitem: "b"', "%ignore uses rule 'item'"),
    ('start: "a"\nstart: "b"', r"'start' defined twice \(line 2, column 1\)"),
    ('start: pair{"a", "b"}', r"pair\{…\}: templates are not read"),
    ('_sep{x}: x\nstart: "a"', "templates are not read"),
    ('start: "a"\n%declare X', "%declare is not read"),
    ('start: "a"\n%import .other.X', "only Lark's common terminals are read"),
    ('start: "a"\n%import common.NOPE', r"common has no 'NOPE' \(it has DIGIT, "),
    ('start: /ab', "a regex ends at its line: expected /"),
    ('start: /a(?=b)/', r"/a\(\?=b\)/: look-arounds and named groups are not supported \(at 2\) "
                        r"\(line 1, column 8\)"),
    ('start: /a/x', "regex flag 'x' is not read"),
    ('start: /^a(?=b)$/', r"look-arounds and named groups are not supported \(at 3\)"),  # where it is written
    ('start: /(?i)^a(?=b)/', r"look-arounds and named groups are not supported \(at 7\)"),
    ('start: /(?x)a b/', "inline flag 'x' is not read"),
    ('start: "a\\q"', r"unknown escape \\q \(line 1, column 10\)"),
    ('start: "ab".."z"', "a range's ends are single characters"),
    ('start: "z".."a"', "is backwards"),
    ('start: ("a"', r"expected \) to close the group"),
    ('start: ["a"', "expected ] to close the optional part"),
    ('start: "a" ~ 3..1', r"expected 0 ≤ n ≤ m ≤ 4096"),
    ('start: "a" @', "unexpected '@'"),
    ('start: a\na: b "x" | "y"\nb: "z"? a', "rule 'a' reaches itself before reading anything"),
    ('start: "a"\nb ::= "x"', "name ::= … is GBNF"),
    ('start: "a"\n%frob X', "unknown directive %frob"),
    ('start: %json {"type": "object",}', r"%json: its schema is not JSON \(Expecting property name"),
    ('start: %json {"type": "array", "uniqueItems": true}', "%json: .*uniqueItems is supported .* a finite set"),
    ('start: T\nT: %json {"type": "string"}', "terminal T holds %json"),
])
def test_bad_lark_grammars_are_refused_by_name_and_place(grammar: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(grammar=grammar)


def test_which_notation_a_grammar_is_read_in() -> None:
    assert looks_like_lark('// a comment\n?start: "a"')
    assert looks_like_lark("%import common.WS\nstart: WS")
    assert not looks_like_lark('# a comment\nroot ::= "a"')
    assert not looks_like_lark('root::= "a"\nx: "b"')
    # a regex's anchors say nothing more: a lexeme is matched whole
    anchored, bare = compile_grammar('start: /^[0-9]{2}-a+$/ "."'), compile_grammar('start: /[0-9]{2}-a+/ "."')
    for t in ("12-a.", "12-aaa.", "1-a.", "12-a", "^12-a$."):
        assert accepts(anchored, t.encode()) == accepts(bare, t.encode()) == (re.fullmatch(r"\d\d-a+\.", t) is not None)
    # Python's inline flags at a pattern's start are its flags
    inline, after = compile_grammar('start: /(?is)a.b/'), compile_grammar('start: /a.b/is')
    for t in ("a\nb", "A-B", "aXb", "ab", "(?is)a-b"):
        assert accepts(inline, t.encode()) == accepts(after, t.encode()) == \
            (re.fullmatch("(?is)a.b", t) is not None), t
    # the same language either way
    lark, gbnf = compile_grammar('start: "a"i ("-" "0".."9")+'), compile_grammar('root ::= [aA] ("-" [0-9])+')
    for t in ("a-1", "A-1-2", "a", "b-1", "a-"):
        assert accepts(lark, t.encode()) == accepts(gbnf, t.encode()), t


def _python_literal(t: str) -> bool:
    """Lark's JSON as Python reads it: its numbers are Python's (``17.``, ``+1``), not JSON's."""
    names = {"true": "True", "false": "False", "null": "None"}
    ast.literal_eval(re.sub(r"\b(true|false|null)\b", lambda m: names[m[0]], t).strip())
    return True


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")


def test_every_draw_of_the_bundled_model_is_derived_from_a_lark_grammar(llm: LLM) -> None:
    for grammar, check in ((CALC_LARK, _python_calc), (JSON_LARK, _python_literal),
                           ('start: "Mira lives in " CITY "."\nCITY: "A".."Z" /[a-z]{2,12}/',
                            lambda t: re.fullmatch(r"Mira lives in [A-Z][a-z]{2,12}\.", t) is not None)):
        assert_draws_derived(llm, grammar, check)
