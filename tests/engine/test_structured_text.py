"""Plain-text structured output (``SamplingParams.regex`` / ``choice``, vLLM's constraints): the
matcher accepts exactly the texts Python's ``re.fullmatch`` accepts — the independent reference —
byte by byte, multi-byte characters and spaces included; every draw through the bundled model ends
in a text the expression matches (or the start of one, when max_tokens cuts it); bad input is
refused by name."""

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypic import LLM, SamplingParams
from hypic.engine.structured import compile_text
from hypic.engine.structured.matcher import accepting, accepts, advance_bytes, finished, start

PATTERNS = [r"(yes|no), because .{1,10}", r"\d{3}-\d{4}", r"a*", r"[A-Z][a-z]+ (lives|works) in [^.]+\.",
            r"(é|ü|日本)+ ok", r"x?y{2,3}z*", r"\w+@\w+\.(com|org)", r"^\s*-?\d+(\.\d+)?$", r"[^a]", r"(ab|a)(bc|c)",
            r"^a$|^b$", r"ab|^c|d$", r"a\\$", r"a\$", r"[|]x|\|y", "éa+é日本é"]
ALPHABET = "abcdyxzn, .-é日本ü0123456789@ABcom\t\n|$\\"


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_matcher_accepts_what_re_fullmatch_accepts(pattern: str) -> None:
    node = compile_text(regex=pattern)
    rng = random.Random(pattern)
    texts = ["", "yes, because x", "123-4567", "日本日本 ok", "Mira lives in Quorvane.", "a@b.com", " -1.5", "b",
             "abc", "a", "c", "d", "a\\", "a$", "|x", "|y", "éaaé日本é",
             *("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 12))) for _ in range(300))]
    for t in texts:  # \w and \d are ASCII, as in JSON Schema's (ECMA-262's) patterns
        want = re.fullmatch(pattern, t, flags=re.ASCII) is not None
        assert accepts(node, t.encode()) == want, (pattern, t)
        # every prefix of a matching text stays alive (the matcher never dead-ends a match early)
        if want:
            assert all(advance_bytes(start(node), t.encode()[:k]) is not None for k in range(len(t.encode())))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=8), min_size=1, max_size=5), st.text(max_size=10))
def test_a_choice_accepts_its_strings_and_nothing_else(options: list[str], other: str) -> None:
    node = compile_text(choice=tuple(options))
    for o in options:
        assert accepts(node, o.encode()), o
    assert accepts(node, other.encode()) == (other in options)


def test_a_thousand_choices_compile_and_a_prefix_choice_may_end_or_go_on() -> None:
    labels = tuple(f"label {i} of the set" for i in range(1000))
    node = compile_text(choice=labels)
    assert accepts(node, b"label 999 of the set") and not accepts(node, b"label 1000 of the set")
    state = advance_bytes(start(compile_text(choice=("a", "ab"))), b"a")
    assert accepting(state) and not finished(state) and accepting(advance_bytes(state, b"b"))


def test_the_last_byte_of_the_only_match_finishes_the_output() -> None:
    state = advance_bytes(start(compile_text(choice=("positive", "negative"))), b"positive")
    assert accepting(state) and finished(state)
    state = advance_bytes(start(compile_text(regex="a+")), b"aa")
    assert accepting(state) and not finished(state)  # more a's may follow: EOS allowed, not forced


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")  # a CPU test wherever it runs (on a GPU LLM() is bf16)


def test_every_draw_of_the_bundled_model_matches(llm: LLM) -> None:
    prompt = "Profile of Mira. Mira lives in Quorvane.<<PIC_SEP>>Where does Mira live?"
    choices = ["positive", "negative", "neutral (maybe?)", "né"]
    for seed in range(4):
        got = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=seed, choice=choices))[0]
        assert got.text in choices and got.finish_reason == "stop", got.text
    for pattern in (r"[A-Z][a-z]+ (lives|works) in [^.]+\.", r"\d{3}-\d{4}", r"(é|ü|日本)+ ok"):
        for seed in range(3):
            sp = SamplingParams(max_tokens=40, temperature=1.0, seed=seed, regex=pattern, logprobs=1)
            got = llm.generate(prompt, sp)[0]
            if got.finish_reason == "stop":
                assert re.fullmatch(pattern, got.text), (pattern, got.text)
            else:  # cut by max_tokens: the start of a match
                assert advance_bytes(start(compile_text(regex=pattern)), got.text.encode()) is not None
    greedy = llm.generate(prompt, SamplingParams(max_tokens=20, regex=r"Mira lives in \w+\."))[0]
    assert re.fullmatch(r"Mira lives in \w+\.", greedy.text) and greedy.finish_reason == "stop"


@pytest.mark.parametrize("kwargs, needle", [
    (dict(regex="(?=a)"), r"regex: '\(\?=a\)': look-arounds"),
    (dict(regex="a{3,1}"), r"regex: 'a\{3,1\}': a repetition must be ordered"),
    (dict(regex=r"[^\s\S]"), "matches no text"),
    (dict(regex=r"x[^\s\S]|y[^\s\S]"), "matches no text"),
    (dict(regex=5), "regex: expected a string"),
    (dict(regex="a)(?:b"), r"regex: 'a\)\(\?:b': unbalanced parenthesis \(at 1\)"),  # the wrapping paired it
    (dict(regex="(a"), "missing \\)"),
    (dict(regex=r"(?:\uD83C[\uDF00-\uDFFF])+"), "matches no text \\(UTF-16 surrogates"),
    (dict(choice=[]), "choice: expected a non-empty list"),
    (dict(choice="yes"), "choice: expected a non-empty list"),
    (dict(choice=["a", 1]), "choice: expected a non-empty list"),
    (dict(regex="a", choice=["a"]), "choice: one constraint at a time"),
    (dict(json_schema=True, regex="a"), "regex: one constraint at a time"),
    (dict(regex="a", min_tokens=2), "min_tokens: not with regex"),
    (dict(choice=["a"], allowed_token_ids=[5]), "allowed_token_ids: not with choice"),
])
def test_bad_constraints_are_refused_by_name(kwargs, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_vllms_structured_outputs_params_read_into_the_same_constraints(llm: LLM) -> None:
    """Code written against vLLM's ``SamplingParams(structured_outputs=StructuredOutputsParams(...))``:
    each kind becomes hypic's own field (the same answers), a clone keeps it, and what vLLM would not
    take either (none, two) or cannot read (a structural tag without triggers) is refused by name."""
    from hypic import StructuredOutputsParams as S

    prompt = "Profile of Mira. Mira lives in Quorvane.<<PIC_SEP>>Where does Mira live?"
    for vllms, own in ((S(choice=["north", "south"]), dict(choice=["north", "south"])),
                       (S(regex=r"\d{2}"), dict(regex=r"\d{2}")),
                       (S(json='{"type": "integer"}'), dict(json_schema={"type": "integer"})),
                       (S(json_object=True), dict(json_schema={"type": "object"}))):
        sp = SamplingParams(max_tokens=10, structured_outputs=vllms)
        assert sp.structured_outputs is None and sp.clone(max_tokens=9).constraint_kinds == sp.constraint_kinds
        assert llm.generate(prompt, sp)[0].text == llm.generate(prompt, SamplingParams(max_tokens=10, **own))[0].text
    for kwargs, needle in ((dict(structured_outputs=S()), "exactly one of"),
                           (dict(structured_outputs=S(regex="a", choice=["a"])), "exactly one of"),
                           (dict(structured_outputs=S(structural_tag="{}")), "structural_tag.triggers: expected"),
                           (dict(structured_outputs=S(regex="a"), choice=["a"]), "structured_outputs: not with choice"),
                           (dict(structured_outputs={"choice": ["a"]}), "expected a StructuredOutputsParams")):
        with pytest.raises(ValueError, match=needle):
            SamplingParams(**kwargs)
