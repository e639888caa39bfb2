"""vLLM's ``grammar`` constraint (GBNF): the matcher accepts exactly what independent references
accept — Python's ``re.fullmatch`` for random grammars without recursion (the same random tree
written as GBNF and as a Python expression), hand-written recognisers for recursive ones (nested
brackets, arithmetic read by Python's own parser, JSON by ``json.loads``) — it never dead-ends a
walk, every draw of the bundled model is derived from the grammar, and bad grammars are refused by
name and place."""

from __future__ import annotations

import ast
import itertools
import json
import random
import re

import pytest

from hypic import LLM, SamplingParams
from hypic import StructuredOutputsParams as S
from hypic.engine.structured import compile_grammar
from hypic.engine.structured.frames import END
from hypic.engine.structured.matcher import accepting, accepts, advance, advance_bytes, start

ALPHABET = 'ab"\\é日-]^\n x.'
_GBNF_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n"}
_CLASS_ESCAPES = {"]": "\\]", "\\": "\\\\", "^": "\\^", "-": "\\-", "\n": "\\n"}


def _random_tree(rng: random.Random, depth: int) -> tuple[str, str]:
    """One random expression, as (GBNF, Python regex) that mean the same."""
    kind = rng.choice(["lit", "lit", "class", "dot", "seq", "alt", "rep"] if depth < 3 else ["lit", "class"])
    if kind == "lit":
        s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 3)))
        return '"' + "".join(_GBNF_ESCAPES.get(c, c) for c in s) + '"', "(?:" + re.escape(s) + ")"
    if kind == "class":
        chars = rng.sample(ALPHABET, rng.randint(1, 4))
        negated = rng.random() < 0.3
        gb, py = [], []
        for c in chars:
            if rng.random() < 0.3 and ord(c) < 0x7E:
                hi = chr(ord(c) + 2)
                gb.append(_CLASS_ESCAPES.get(c, c) + "-" + _CLASS_ESCAPES.get(hi, hi))
                py.append(re.escape(c) + "-" + re.escape(hi))
            else:
                gb.append(_CLASS_ESCAPES.get(c, c))
                py.append(re.escape(c))
        hat = "^" if negated else ""
        return f"[{hat}{''.join(gb)}]", f"[{hat}{''.join(py)}]"
    if kind == "dot":
        return ".", r"[\s\S]"
    parts = [_random_tree(rng, depth + 1) for _ in range(rng.randint(1, 3))]
    if kind == "seq":
        return " ".join(g for g, _ in parts), "".join(p for _, p in parts)
    if kind == "alt":
        return "(" + " | ".join(g for g, _ in parts) + ")", "(?:" + "|".join(p for _, p in parts) + ")"
    g, p = parts[0]
    q = rng.choice(["*", "+", "?", "{2}", "{1,3}", "{0,}", "{2,}"])
    return f"({g}){q}", f"(?:{p}){q}"


def _random_grammar(seed: int) -> tuple[str, str]:
    """A grammar of a few rules, some referring to others defined after them (never recursive)."""
    rng = random.Random(seed)
    rules, regexes = [], []
    for _ in range(rng.randint(1, 3)):
        g, p = _random_tree(rng, 0)
        rules.append(g)
        regexes.append(p)
    # root uses every rule, in a random order: root ::= r0 r2 r1 …, r_i ::= …
    order = rng.sample(range(len(rules)), len(rules))
    text = "root ::= " + " ".join(f"r{i}" for i in order) + "  # the start\n"
    text += "".join(f"r{i} ::= {g}\n" for i, g in enumerate(rules))
    return text, "".join(regexes[i] for i in order)


def _walk(node, rng: random.Random, steps: int = 60, stop: float = 0.15) -> bytes | None:
    """A random walk of allowed bytes (each state checked to be no dead end); the text if it could
    end, else None."""
    state, out = start(node), bytearray()
    for _ in range(steps):
        nxt = [b for b in range(256) if advance(state, b) is not None]
        ends = advance(state, END) is not None
        assert nxt or ends, f"dead end after {bytes(out)!r}"
        if ends and (not nxt or rng.random() < stop):
            return bytes(out)
        b = rng.choice(nxt)
        out.append(b)
        state = advance(state, b)
    return bytes(out) if accepting(state) else None


@pytest.mark.parametrize("seed", range(40))
def test_random_regular_grammars_accept_what_re_fullmatch_accepts(seed: int) -> None:
    text, pattern = _random_grammar(seed)
    node = compile_grammar(text)
    rng = random.Random(seed)
    candidates = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8))) for _ in range(150)]
    for _ in range(30):  # texts the grammar derives, as far as the walk finds them
        walked = _walk(node, rng)
        if walked is not None:
            candidates.append(walked.decode())
    for t in candidates:
        assert accepts(node, t.encode()) == (re.fullmatch(pattern, t) is not None), (text, pattern, t)


def test_a_rule_whose_alternatives_start_with_itself_reads_as_the_repetition_it_means() -> None:
    """``expr ::= expr "+" term | expr "-" term | term``: Lark's and yacc's way to write a chain,
    which a top-down matcher would unfold without end; checked against the repetition, text by text."""
    left = compile_grammar('root ::= expr\nexpr ::= expr "+" term | term | expr "-" term\n'
                           'term ::= [0-9] | "(" expr ")"')
    for n in range(7):
        for t in map("".join, itertools.product("1+-()", repeat=n)):
            assert accepts(left, t.encode()) == _chain(t), t


def _chain(s: str) -> bool:
    """A ± chain of one-digit numbers and bracketed chains, read by Python's parser (no unary signs)."""
    try:
        tree = ast.parse(s, mode="eval")
    except SyntaxError:
        return False
    ok = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub)
    return all(isinstance(n, ok) for n in ast.walk(tree)) and "11" not in s


def _brackets_ok(s: str) -> bool:
    stack = []
    for c in s:
        if c in "([":
            stack.append(c)
        elif c not in ")]" or not stack or stack.pop() != {")": "(", "]": "["}[c]:
            return False
    return not stack


def test_nested_brackets_match_a_stack_on_every_text_up_to_length_eight() -> None:
    node = compile_grammar('root ::= ("(" root ")" | "[" root "]")*')
    for n in range(9):
        for t in map("".join, itertools.product("()[]x", repeat=n)):
            if n <= 6 or t.count("x") == 0:  # every text to 6, bracket-only ones to 8
                assert accepts(node, t.encode()) == _brackets_ok(t), t


ARITHMETIC = r"""
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")" | "-" factor
number ::= "0"+ | [1-9] [0-9]*   # Python reads 00 and not 01
"""


def _python_arithmetic(s: str) -> bool:
    """Python's parser as the reference: an expression of integers, + - * / and unary minus only."""
    try:
        tree = ast.parse(s, mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub)
    return all(isinstance(n, allowed) for n in ast.walk(tree)) and "_" not in s and " " not in s


def test_arithmetic_matches_pythons_own_parser() -> None:
    node = compile_grammar(ARITHMETIC)
    rng = random.Random(1)
    texts = ["1+2*(3-4)/-5", "(((7)))", "0", "01", "1+", "-(-1)", "1(2)", "(1)(2)", "1**2", "1//2", "+1", "--1"]
    texts += ["".join(rng.choice("0123+-*/()") for _ in range(rng.randint(1, 9))) for _ in range(3000)]
    texts += [_walk(node, rng).decode() for _ in range(40)]
    for t in texts:
        assert accepts(node, t.encode()) == _python_arithmetic(t), t


JSON_GBNF = r"""
root    ::= value
value   ::= object | array | string | number | "true" | "false" | "null"
object  ::= "{" ws ( member ( "," ws member )* )? "}"
member  ::= string ":" ws value ws
array   ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
string  ::= "\"" ( [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""
number  ::= "-"? ( "0" | [1-9] [0-9]{0,15} ) ( "." [0-9]{1,15} )? ( [eE] [-+]? [0-9]{1,3} )?
ws      ::= " "?
"""


def test_a_json_grammar_derives_what_json_loads_reads() -> None:
    node = compile_grammar(JSON_GBNF)
    values = [{"a": [1, -2.5, 3e10, True, None], "b": {"c": "d\n\u00e9\"\\"}}, [], {}, "x", 0, -0.0, [[[]]], "日本"]
    for v in values:
        assert accepts(node, json.dumps(v, ensure_ascii=False).encode()), v
        assert accepts(node, json.dumps(v, ensure_ascii=True, separators=(",", ":")).encode()), v
    for bad in ('{"a" 1}', "[1,]", "01", '"\x01"', "tru", "{,}", '{"a":1,}', "1.", ".5"):
        assert not accepts(node, bad.encode()), bad
    rng = random.Random(7)
    walked = [w for w in (_walk(node, rng, steps=80, stop=0.3) for _ in range(60)) if w is not None]
    assert len(walked) >= 20
    for w in walked:
        json.loads(w)  # every text the grammar derives is JSON


@pytest.mark.parametrize("grammar, needle", [
    ('root ::= expr\nexpr ::= expr "+" "1" | expr "-" "1"', "rule 'expr' derives no text: each of its"),
    ('root ::= a\na ::= b? "x" | "y"\nb ::= "z"? a', "rule 'a' reaches itself before reading anything"),
    ('root ::= a\na ::= "z"? a "x" | "y"', "rule 'a' reaches itself"),  # after an item that may read nothing
    ('root ::= "a" x', "rule 'x' is used but never defined"),
    ('root ::= "a"\nb: "x"', r"b: … is a Lark rule \(a grammar is read as Lark when its first rule is written so\); "
                              r"in GBNF: name ::= … \(line 2, column 1\)"),
    ('a ::= "x"', "no root rule"),
    ('root ::= "a"\nroot ::= "b"', r"rule 'root' defined twice \(line 2, column 1\)"),
    ('root ::= "a" root', "no finite value satisfies it"),
    ('root ::= "a\\q"', r"unknown escape \\q \(line 1, column 12\)"),  # at the backslash
    ('root ::= "a', r"expected \""),
    ('root ::= [a-', "expected ]"),
    ('root ::= ("a"', r"expected \) to close the group"),
    ('root ::= [z-a]', "is backwards"),
    ('root ::= "a"{3,1}', r"expected 0 ≤ m ≤ n"),
    ('root ::= "a"{99999}', r"expected 0 ≤ m ≤ n ≤ 4096"),
    ('root ::= [^\\x00-\\U0010FFFF]', "matches no character"),
    ('root ::= "\\uD800"', "no character UTF-8 can write"),
    ('root ::= "a" @', "unexpected '@'"),
    ("root ::= " + "(" * 70 + '"a"' + ")" * 70, "groups nested deeper than 64"),
    ("root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1} "b"\n' for i in range(40)) + 'r40 ::= "c"',
     "its least value nests 41 levels deep"),  # each rule's Seq waits under the next
])
def test_bad_grammars_are_refused_by_name_and_place(grammar: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(grammar=grammar)


def test_a_bad_structural_tag_is_refused_and_a_grammar_is_one_constraint() -> None:
    with pytest.raises(ValueError, match="structural_tag.triggers: expected a non-empty list"):
        SamplingParams(structured_outputs=S(structural_tag='{"structures": []}'))
    with pytest.raises(ValueError, match="grammar: one constraint at a time"):
        SamplingParams(regex="a", grammar='root ::= "a"')
    with pytest.raises(ValueError, match="grammar: expected a string"):
        SamplingParams(grammar=5)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")  # a CPU test wherever it runs (on a GPU LLM() is bf16)


PROMPT = "Profile of Mira. Mira lives in Quorvane.<<PIC_SEP>>Where does Mira live?"


def assert_draws_derived(llm: LLM, grammar: str, check) -> None:  # check: Callable[[str], bool]
    """Three sampled draws under ``grammar``: each derived from it and passing ``check`` (the
    reference), or, cut by max_tokens, the start of a derivation."""
    node = compile_grammar(grammar)
    for seed in range(3):
        got = llm.generate(PROMPT, SamplingParams(max_tokens=30, temperature=1.0, seed=seed, grammar=grammar))[0]
        if got.finish_reason == "stop":
            assert accepts(node, got.text.encode()) and check(got.text), (grammar, got.text)
        else:
            assert advance_bytes(start(node), got.text.encode()) is not None, got.text


def test_every_draw_of_the_bundled_model_is_derived_from_the_grammar(llm: LLM) -> None:
    prompt = PROMPT
    for grammar, check in ((ARITHMETIC, _python_arithmetic), (JSON_GBNF, lambda t: json.loads(t) is not None),
                           ('root ::= "Mira lives in " [A-Z] [a-z]{2,12} "."',
                            lambda t: re.fullmatch(r"Mira lives in [A-Z][a-z]{2,12}\.", t) is not None)):
        assert_draws_derived(llm, grammar, check)
    vllms = llm.generate(prompt, SamplingParams(max_tokens=20, structured_outputs=S(grammar=ARITHMETIC)))[0]
    own = llm.generate(prompt, SamplingParams(max_tokens=20, grammar=ARITHMETIC))[0]
    assert vllms.text == own.text


def test_the_tries_allowed_tokens_equal_a_pass_over_every_token_in_a_grammar() -> None:
    """The walk and its shortcut at a grammar's character loops (the loop's plain tokens taken from
    a list) against trying every token's bytes from the state, at states met along random draws."""
    from tokenizers import Tokenizer

    from hypic.engine.structured import JsonConstraint, TokenVocab, token_bytes
    from hypic.engine.structured.matcher import char_loop
    from hypic.llm import bundled_model_path

    vocab = TokenVocab(token_bytes(Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))))
    rng = random.Random(5)
    loops = 0
    for grammar in ('root ::= ("- " [^\\n]+ "\\n"){1,3} [a-z ]{2,9} "." [0-9]{1,4}', JSON_GBNF,
                    # a bounded repetition's longer runs read on by what follows (found by a review: refused)
                    'root ::= [a-z ]{0,3} [a-z]*', 'root ::= "x" [a-z ]{0,5} ( "y" | [^a]* )',
                    'root ::= [a-z]{2} [a-z]+',
                    # Lark's notation: a regex's loop is a class's loop too; ignored spaces before each word
                    'start: ("- " /[^\\n]+/ "\\n"){1,3} WORD\n%import common.WORD',
                    'start: WORD ("," WORD)*\n%import common (WORD, WS)\n%ignore WS'):
        c = JsonConstraint(vocab, compile_grammar(grammar), set())
        for _ in range(60):
            state = c.state
            loops += char_loop(state) is not None
            want = sorted(i for i, data in vocab.pieces.items() if data and advance_bytes(state, data) is not None)
            assert c.allowed().tolist() == want
            if not want:
                break
            closing = [i for i in want if any(b in b'\n."]}' for b in vocab.pieces[i])]
            assert c.accept(rng.choice(closing if closing and rng.random() < 0.3 else want))
    assert loops > 10  # (unbounded repetitions: the bounded ones are walked whole)
