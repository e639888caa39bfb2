"""xgrammar's token-level structural-tag formats (``token``, a tag's token begin or end,
``token_triggered_tags``, ``any_tokens``): a special token is read as its mark, so it is written by
that one token and by no text. The matcher against a regular expression over the same answers
with each token a character of its own, the vocabulary's masks against trying every token's every
spelling, the refusals by name."""

import random
import re

import pytest
from tokenizers import Tokenizer

from hypic import SamplingParams
from hypic.engine.structured import JsonConstraint, TokenVocab, token_bytes, token_marks
from hypic.engine.structured.formats import compile_format, named_tokens
from hypic.engine.structured.matcher import accepting, advance_bytes, start
from hypic.engine.structured.tags import token_mark
from hypic.llm import bundled_model_path

SPECIAL = ("<|S|>", "<|E|>", "<|b|>", "<|a|>", "<|e|>", "<|x|>")


def token(t: str | int) -> dict:
    return {"type": "token", "token": t}


ARGS = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
        "additionalProperties": False}
CALL = {"type": "tag", "begin": token("<|b|>"), "end": token("<|e|>"), "content": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "f:"}, {"type": "regex", "pattern": "[0-9]{1,2}"}, token("<|a|>"),
    {"type": "json_schema", "json_schema": ARGS}]}}
SECTION = {"type": "token_triggered_tags", "trigger_tokens": ["<|S|>"], "exclude_tokens": ["<|x|>"],
           "tags": [{"type": "tag", "begin": token("<|S|>"), "end": token("<|E|>"),
                     "content": {"type": "plus", "content": CALL}}]}
# the same answers as a regular expression, each special token one private-use character
CHAR = {t: chr(0xE000 + k) for k, t in enumerate(SPECIAL)}
FREE = f"(?:[^{CHAR['<|S|>']}{CHAR['<|x|>']}])"
ONE_CALL = f"{CHAR['<|b|>']}f:[0-9]{{1,2}}{CHAR['<|a|>']}\\{{\"n\":[0-9]\\}}{CHAR['<|e|>']}"
SECTION_RE = re.compile(f"(?:{FREE}|{CHAR['<|S|>']}(?:{ONE_CALL})+{CHAR['<|E|>']})*", re.DOTALL)


def as_bytes(pieces: list[str]) -> bytes:
    return b"".join(token_mark(p, "t") if p in CHAR else p.encode() for p in pieces)


def as_text(pieces: list[str]) -> str:
    return "".join(CHAR.get(p, p) for p in pieces)


def random_answer(rng: random.Random) -> list[str]:
    """Pieces (text, or a special token by name) near the format's shape, often off it by one."""
    out: list[str] = []
    for _ in range(rng.randint(0, 3)):
        out.append(rng.choice(["Hi. ", "<|S|>", "x", "<|b|>", "<|x|>", "<|E|>"]) if rng.random() < 0.3 else "ok ")
        if rng.random() < 0.5:
            out += ["<|S|>"]
            for _ in range(rng.randint(0, 2)):
                out += ["<|b|>", "f:", rng.choice(["1", "12", "123", ""]), rng.choice(["<|a|>", "<|e|>"]),
                        '{"n":' + rng.choice("07x") + "}", rng.choice(["<|e|>", "<|a|>", ""])]
            out += [rng.choice(["<|E|>", "<|E|>", "<|e|>", ""])]
    return out


def test_token_formats_accept_what_a_regex_over_token_characters_accepts() -> None:
    """400 random answers near the shape (a call section opened by its token, calls between their
    tokens, arguments held to a schema, an excluded token in the free text, markers misplaced): the
    matcher accepts a whole answer exactly when the regular expression does, and reads a prefix
    exactly when the answer extends to an accepted one of that shape (checked on the accepted)."""
    root = compile_format(SECTION, "f")
    agree = accepted = 0
    rng = random.Random(5)
    for _ in range(400):
        pieces = random_answer(rng)
        state = advance_bytes(start(root), as_bytes(pieces))
        mine = state is not None and accepting(state)
        want = SECTION_RE.fullmatch(as_text(pieces)) is not None
        assert mine == want, pieces
        agree += 1
        accepted += want
    assert agree == 400 and 40 < accepted < 360  # both outcomes met often


def test_a_token_is_never_spelled_by_text_nor_text_by_a_token() -> None:
    root = compile_format(SECTION, "f")
    assert advance_bytes(start(root), b"<|S|>") is not None  # its text is free text: no call opened
    opened = advance_bytes(start(root), token_mark("<|S|>", "t"))
    assert advance_bytes(opened, b"<|b|>") is None  # after the trigger, only the call's own token
    assert advance_bytes(opened, token_mark("<|b|>", "t")) is not None
    assert advance_bytes(start(compile_format({"type": "any_text"}, "f")), token_mark("<|x|>", "t")) is None
    free = compile_format({"type": "any_tokens", "exclude_tokens": ["<|x|>"]}, "f")  # token-level free text
    assert advance_bytes(start(free), token_mark("<|a|>", "t") + b"hi") is not None
    assert advance_bytes(start(free), token_mark("<|x|>", "t")) is None
    by_id = compile_format({"type": "sequence", "elements": [token(7), token("<|a|>")]}, "f")
    assert advance_bytes(start(by_id), token_mark(7, "t") + token_mark("<|a|>", "t")) is not None
    # an enclosing tag's token end stops any_tokens inside it (xgrammar's automatic end detection)
    inner = compile_format({"type": "tag", "begin": "<", "content": {"type": "any_tokens"}, "end": token("<|e|>")}, "f")
    closed = advance_bytes(start(inner), b"<text" + token_mark("<|a|>", "t") + token_mark("<|e|>", "t"))
    assert closed is not None and accepting(closed)
    assert advance_bytes(closed, b"more") is None


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))
    tok.add_special_tokens(list(SPECIAL))
    return tok


@pytest.fixture(scope="module")
def vocab(tokenizer: Tokenizer) -> TokenVocab:
    return TokenVocab(token_bytes(tokenizer), token_marks(tokenizer, {tokenizer.token_to_id("<|end|>")}))


def test_masks_equal_a_pass_over_every_token_s_every_spelling(vocab: TokenVocab, tokenizer: Tokenizer) -> None:
    """Random walks through the section format, leaning towards its next piece: at every step the
    allowed set is exactly the tokens one of whose spellings (its text, or its marks by text and by
    id) the matcher reads — so after the trigger token only the call's token is allowed, inside the
    arguments no special token is, and no byte token of 0xFE / 0xFF (which could spell a mark) ever is."""
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL}
    raw = token_bytes(tokenizer)
    stray = [i for i, d in raw.items() if 0xFF in d or 0xFE in d]
    assert stray  # the byte-level vocabulary has them: the rule below is tested
    spellings = {i: [d] for i, d in vocab.pieces.items() if d}
    for i, marks in vocab.marks.items():
        spellings.setdefault(i, []).extend(marks)
    root = compile_format(SECTION, "f")
    rng = random.Random(3)
    checked = 0
    after_trigger = []
    for _ in range(4):
        c = JsonConstraint(vocab, root, set())
        for _ in range(24):
            want = sorted(i for i, spelled in spellings.items()
                          if any(advance_bytes(c.state, d) is not None for d in spelled))
            got = c.allowed().tolist()
            assert got == want
            assert not set(got) & set(stray)
            checked += 1
            nxt = [ids["<|S|>"], ids["<|b|>"], ids["<|a|>"], ids["<|e|>"], ids["<|E|>"]]
            lean = [i for i in got if i in nxt or re.fullmatch(rb'[f:0-9{}"n]+', vocab.pieces.get(i, b"-"))]
            pick = rng.choice(lean if lean and rng.random() < 0.85 else got)
            assert c.accept(pick)
            if pick == ids["<|S|>"]:  # allowed in free text only: it opens the section
                after_trigger.append(c.allowed().tolist())
    assert checked == 96
    assert after_trigger and all(a == [ids["<|b|>"]] for a in after_trigger)


def test_a_token_named_by_text_or_id_is_checked_against_the_tokenizer(vocab: TokenVocab, tokenizer: Tokenizer) -> None:
    """Names are read off the tag (not off schemas inside it); the vocabulary refuses a name that is
    no special or added token of its tokenizer, and the end of sequence, by name."""
    spec = {"type": "structural_tag", "format": {**SECTION, "tags": [{**SECTION["tags"][0], "content": {
        "type": "json_schema", "json_schema": {"const": {"type": "token", "token": "<|not-a-name|>"}}}}]}}
    assert sorted(map(str, named_tokens(spec))) == ["<|E|>", "<|S|>", "<|S|>", "<|x|>"]
    vocab.check_tokens(named_tokens(spec))
    vocab.check_tokens(["<|a|>", tokenizer.token_to_id("<|a|>")])
    for bad in ("<|nope|>", "hello", "<|end|>", 10 ** 6):
        with pytest.raises(ValueError, match=f"structural_tag: token {re.escape(repr(bad))} is not a special or added"):
            vocab.check_tokens([bad])
    c = JsonConstraint(vocab, compile_format(token(tokenizer.token_to_id("<|a|>")), "f"), set())
    assert c.allowed().tolist() == [tokenizer.token_to_id("<|a|>")]  # named by id: that token alone
    assert c.accept(tokenizer.token_to_id("<|a|>")) and accepting(c.state)


def test_the_engine_refuses_a_token_its_tokenizer_lacks() -> None:
    from hypic import LLM

    llm = LLM(device="cpu")
    with pytest.raises(ValueError, match="token '<|nope|>' is not a special or added token"):
        llm.generate("Hi", SamplingParams(max_tokens=4, structural_tag={"format": token("<|nope|>")}))
    with pytest.raises(ValueError, match=r"structural_tag.format.type: 'exclude_token' is not served"):
        SamplingParams(structural_tag={"format": {"type": "exclude_token"}})
