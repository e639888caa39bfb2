"""Structural tags (``SamplingParams.structural_tag``, vLLM's ``structural_tag``): free text in which
a trigger opens a tagged structure — the rest of its begin, a JSON value its schema accepts, its end.
The matcher against an independent reading of the rule (a scan for triggers, then ``json.loads`` of
the value), the vocabulary's masks against trying every token, draws through the bundled model,
refusals by name."""

import json
import random
import re

import pytest
from tokenizers import Tokenizer

from hypic import LLM, SamplingParams
from hypic import StructuredOutputsParams as S
from hypic.engine.structured import JsonConstraint, TokenVocab, compile_tags, token_bytes
from hypic.engine.structured.matcher import accepting, accepts, advance_bytes, finished, free_text_loop, start
from hypic.llm import bundled_model_path

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"], "additionalProperties": False}
CALLS = {"type": "structural_tag", "triggers": ["<function="],
         "structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
                        {"begin": "<function=get_time>", "schema": {"type": "integer"}, "end": "</function>"}]}


def _reference(spec: dict, text: str) -> bool:
    """The rule read directly: scan for the earliest trigger; from there one structure's begin, the
    shortest JSON text that parses as a value its schema accepts and its end follows (as hypic
    writes JSON: at most one space between tokens, none around the value), its end; repeat; the
    rest is free text."""
    structures = spec["structures"]
    at = 0
    while True:
        hits = [i for i in (text.find(t, at) for t in spec["triggers"]) if i >= 0]
        if not hits:
            return True
        start_ = min(hits)
        ok = False
        for s in structures:
            if not text.startswith(s["begin"], start_):
                continue
            body = start_ + len(s["begin"])
            for stop in range(body + 1, len(text) + 1):
                if not text.startswith(s["end"], stop):
                    continue
                try:
                    value = json.loads(text[body:stop])
                except json.JSONDecodeError:
                    continue
                if _valid(value, s.get("schema", {})) and _spaced_as_hypic_writes(text[body:stop]):
                    at, ok = stop + len(s["end"]), True
                    break
            if ok:
                break
        if not ok:
            return False


def _spaced_as_hypic_writes(value_text: str) -> bool:
    """No whitespace but single spaces between tokens outside strings, none at either end."""
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', value_text)
    return outside == outside.strip() and "  " not in outside and not re.search(r"[\t\n\r]", outside)


def _valid(value: object, schema: dict) -> bool:
    if schema.get("type") == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if schema.get("type") == "boolean":
        return isinstance(value, bool)
    if schema.get("type") == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if "anyOf" in schema:
        return any(_valid(value, s) for s in schema["anyOf"])
    if schema.get("type") == "string":
        return isinstance(value, str)
    if not schema:
        return True
    if not isinstance(value, dict) or not set(schema["required"]) <= set(value) or set(value) - set(
            schema["properties"]):
        return False
    return isinstance(value["city"], str) and all(isinstance(v, int) for k, v in value.items() if k == "days")


TEXTS = ["", "Sure.", "a < b, <func", "<function", "x<function=get_weather>{\"city\":\"Paris\"}</function> done",
         '<function=get_weather>{"city":"Paris","days":3}</function><function=get_time>12</function>',
         '<function=get_time>-7</function>tail <function=get_time>0</function>',
         '<function=get_weather>{"city": "Paris"}</function>', '<function=get_weather>{"city":  "P"}</function>',
         '<function=get_weather> {"city":"P"}</function>', '<function=get_time>5 </function>',
         "<function=other>{}</function>", '<function=get_weather>{"city":"Paris"}',
         '<function=get_weather>{"town":"X"}</function>', "<function=get_time>1.5</function>",
         "<function=get_time>12</function", "<<function=get_time>1</function>"]


@pytest.mark.parametrize("text", TEXTS)
def test_the_matcher_reads_tags_as_the_rule_says(text: str) -> None:
    node = compile_tags(CALLS)
    assert accepts(node, text.encode()) == _reference(CALLS, text), text


def test_random_texts_against_the_rule() -> None:
    """Random mixes of prose, trigger pieces, begins, values and ends: the matcher's verdict is the
    direct reading's, and every prefix of an accepted text stays readable."""
    node = compile_tags(CALLS)
    pieces = ["hi ", "<", "<function=", "<function=get_time>", "<function=get_weather>", "</function>", "</func",
              "12", "-3", '{"city":"Rome"}', '{"city":"A","days":2}', "{", "}", '"', "x", " "]
    rng = random.Random(3)
    for _ in range(1500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 7)))
        want = _reference(CALLS, text)
        assert accepts(node, text.encode()) == want, text
        if want:
            assert all(advance_bytes(start(node), text.encode()[:k]) is not None for k in range(len(text)))


def test_triggers_that_are_whole_begins_or_overlap() -> None:
    """A trigger that is a whole begin opens its value at once; a trigger inside another's prefix
    (``ab`` in ``aab``) is still found; an empty end returns to free text at the value's end; a
    number's end is read back by the structure (its last digit ends it only at the next byte)."""
    spec = {"triggers": ["@n", "ab"], "structures": [{"begin": "@n", "schema": {"type": "integer"}, "end": ""},
                                                     {"begin": "abc:", "schema": {"type": "boolean"}, "end": ";"}]}
    node = compile_tags(spec)
    for text, want in (("@n12 ok", True), ("@n ok", False), ("@nx", False), ("xaabc:true;", True), ("aab", False),
                       ("abc:true", False), ("abc:true;abc:false;", True), ("@n1@n2", True), ("aaa", True)):
        assert accepts(node, text.encode()) == want, text
        assert _reference(spec, text) == want, text


def test_a_number_may_end_where_its_end_begins_with_what_could_go_on_with_it() -> None:
    """An end that begins with a digit, ``.`` or ``e`` follows a number directly: ``42.`` is the number
    42 and the end "." (the number's reader hands such a byte back where the number is whole);
    inside JSON nothing changes (``[1.]`` is still refused)."""
    spec = {"triggers": ["Total: "], "structures": [{"begin": "Total: ", "schema": {"type": "number"}, "end": "."},
                                                   {"begin": "Total: n", "schema": {"type": "integer"}, "end": "0!"},
                                                   {"begin": "Total: a", "schema": {"anyOf": [{"type": "integer"},
                                                                                             {"type": "string"}]},
                                                    "end": "1"},
                                                   {"begin": "Total: v", "end": "e"}]}  # any value
    node = compile_tags(spec)
    for text in ("Total: 42. Done", "Total: 42.0. Done", "Total: 1e5.", "Total: n70!", "Total: n0!", "Total: 42.",
                 "Total: 4.", "Total: 42..", "Total: n1!", "Total: .5.", "Total: a71", "Total: a\"x\"1",
                 "Total: a7", "Total: v2e", "Total: v2e5e", "Total: v[2]e", "Total: ve"):
        assert accepts(node, text.encode()) == _reference(spec, text), text
    from hypic.engine.structured import compile_schema
    assert not accepts(compile_schema({"type": "array"}), b"[1.]") and accepts(compile_schema(True), b"[1.5,2e3]")


def test_a_trigger_that_ends_another_fires_with_it() -> None:
    spec = {"triggers": ["<f>", "f>"], "structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "."},
                                                      {"begin": "f>!", "schema": {"type": "boolean"}, "end": "."}]}
    node = compile_tags(spec)
    assert accepts(node, b"a<f>1. f>!true.") and accepts(node, b"<f>!true.") and not accepts(node, b"<f>")


def test_the_end_of_the_answer_only_in_free_text() -> None:
    node = compile_tags(CALLS)
    for text, free in (("hello", True), ("<function=get", False), ('<function=get_weather>{"city":"P"}', False),
                       ("<function=get_time>1</function>", True), ("<functio", True)):
        assert accepting(advance_bytes(start(node), text.encode())) == free, text


@pytest.mark.parametrize(("spec", "needle"), [
    ("{not json", "structural_tag: not JSON"),
    ({"structures": CALLS["structures"]}, r"structural_tag.triggers: expected a non-empty list"),
    ({"triggers": [""], "structures": CALLS["structures"]}, "structural_tag.triggers"),
    ({"triggers": ["<f"], "structures": []}, "structural_tag.structures: expected a non-empty list"),
    ({"triggers": ["<tool>"], "structures": CALLS["structures"]},
     r"structural_tag.structures\[0\].begin: '<function=get_weather>' starts with no trigger"),
    ({"triggers": ["<"], "structures": [{"begin": "<a>", "schema": {"type": "bogus"}, "end": "</a>"}]},
     r"structural_tag.structures\[0\].schema: "),
    ({"triggers": ["<"], "structures": [{"begin": "<a>", "schema": {}}]}, r"structures\[0\]: expected an object with"),
    ({"type": "structural_tag", "format": {"type": "sequence", "elements": []}},
     "structural_tag.format.elements: expected a non-empty list of formats"),
    ({"format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
        {"begin": "<f>", "content": {"type": "exclude_token"}, "end": ""}]}},
     r"structural_tag.format.tags\[0\].content.type: 'exclude_token' is not served \(one token by what"),
    ({"format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
        {"begin": "<f>", "content": {"type": "json_schema"}, "end": ""}]}},
     r"structural_tag.format.tags\[0\].content.json_schema: required for json_schema"),
    ({"format": None}, "structural_tag.format: expected an object"),
    ({"triggers": ["<\ud800"], "structures": [{"begin": "<\ud800", "end": ""}]}, "lone surrogate"),
    ({"triggers": ["<"], "structures": [{"begin": f"<{i}", "end": ""} for i in range(257)]},
     "structural_tag.structures: at most 256"),
    ({"format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
        {"begin": "<f>", "content": {"type": "json_schema", "json_schema": {}}, "end": ""}], "at_least_one": 1}},
     "structural_tag.format.at_least_one: expected a boolean"),
    ({"format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
        {"begin": "<g>", "content": {"type": "json_schema", "json_schema": {}}, "end": ""}]}},
     r"structural_tag.format.tags\[0\].begin: '<g>' starts with no trigger"),
    ({"format": {"type": "triggered_tags", "triggers": ["<f"], "tags": []}, "triggers": ["<f"]},
     "format goes alone"),
    ({"type": "json", "triggers": ["<"], "structures": CALLS["structures"]}, "structural_tag.type"),
    ({"triggers": ["<call>", "all"], "structures": [{"begin": "<call>", "end": "</call>"}]},
     "'all' lies inside '<call>'"),
    ({"triggers": ["<call>", "call"], "structures": [{"begin": "<call>", "end": "</call>"}]},  # not its end
     "'call' lies inside '<call>'"),
    ({"triggers": [f"<{i}>" for i in range(33)], "structures": [{"begin": "<1>", "end": ""}]}, "at most 32"),
    ({"triggers": ["<" * 129], "structures": [{"begin": "<" * 129, "end": ""}]}, "each at most 128 bytes"),
    ({"triggers": ["<"], "structures": [{"begin": "<", "end": "", "schema": {"enum": [b"x"]}}]}, "not JSON"),
    ({"triggers": ["<"], "structures": {"<"}}, "not JSON"),
])
def test_bad_tags_are_refused_by_name(spec: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(structural_tag=spec)


def _format(spec: dict, **flags: bool) -> dict:
    """The same tags in xgrammar's newer form: format triggered_tags, contents json_schema."""
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": spec["triggers"], "tags": [
        {"begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]}, "end": s["end"]}
        for s in spec["structures"]], **flags}}


def test_xgrammars_triggered_tags_read_as_the_older_form_and_its_two_flags() -> None:
    """``format: {"type": "triggered_tags", ...}`` accepts what the older form accepts (fixed and random
    texts); ``at_least_one`` makes the answer begin with a structure, ``stop_after_first`` end with its
    first structure's end (then nothing may follow: the output is finished)."""
    plain, newer = compile_tags(CALLS), compile_tags(_format(CALLS))
    rng = random.Random(4)
    pieces = ["hi ", "<function=", "<function=get_time>", "</function>", "12", '{"city":"Rome"}', "<"]
    for text in TEXTS + ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 6))) for _ in range(500)]:
        assert accepts(newer, text.encode()) == accepts(plain, text.encode()), text
    first = compile_tags(_format(CALLS, at_least_one=True))
    for text, want in (("", False), ("hi", False), ("<function=get_time>1</function>", True),
                       ("<function=get_time>1</function> then <function=get_time>2</function>", True),
                       ("hi <function=get_time>1</function>", False)):
        assert accepts(first, text.encode()) == want, text
    once = compile_tags(_format(CALLS, stop_after_first=True))
    for text, want in (("", True), ("hi", True), ("hi <function=get_time>1</function>", True),
                       ("<function=get_time>1</function>x", False),
                       ("<function=get_time>1</function><function=get_time>2</function>", False)):
        assert accepts(once, text.encode()) == want, text
    assert finished(advance_bytes(start(once), b"x <function=get_time>1</function>"))
    assert not finished(advance_bytes(start(plain), b"x <function=get_time>1</function>"))


def test_a_structure_without_a_schema_takes_any_json_value() -> None:
    node = compile_tags({"triggers": ["<v>"], "structures": [{"begin": "<v>", "end": "</v>"}]})
    for value in ('1', '"s"', '{"a":[true,null]}', '[]'):
        assert accepts(node, f"x<v>{value}</v>y".encode()), value
    assert not accepts(node, b"<v></v>")


def test_tags_are_one_constraint_and_vllms_object_carries_them() -> None:
    sp = SamplingParams(structured_outputs=S(structural_tag=json.dumps(CALLS)))
    assert sp.constraint_kinds == ["structural_tag"] and sp.structured_outputs is None
    assert sp.constraint() is compile_tags(CALLS)  # compiled once per tag set
    with pytest.raises(ValueError, match="structural_tag: one constraint at a time"):
        SamplingParams(regex="a", structural_tag=CALLS)
    with pytest.raises(ValueError, match="structural_tag: expected its JSON text or an object"):
        SamplingParams(structural_tag=5)


@pytest.fixture(scope="module")
def vocab() -> TokenVocab:
    tokenizer = Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))
    return TokenVocab(token_bytes(tokenizer))


def test_allowed_tokens_equal_a_pass_over_every_token(vocab: TokenVocab) -> None:
    """At states along random walks — free text (where the loop shortcut takes every token without
    a trigger's first character from a list), mid-trigger, mid-begin, inside the value, mid-end —
    the trie walk's allowed set is exactly the tokens whose bytes the matcher reads."""
    spec = {"triggers": ["<f", "er"], "structures": [  # "er": inside many tokens, most then refused ("ers")
        {"begin": "<f=w>", "schema": WEATHER, "end": "</f>"},
        {"begin": "er!", "schema": {"type": "integer", "minimum": 0, "maximum": 99}, "end": "."}]}
    checked, shortcuts = walk_masks(vocab, compile_tags(spec), rb"<|f|=|w|>|er|!|\{|\"|[0-9]|\.", 5, lean=0.8)
    assert checked == 180 and shortcuts > 5


def walk_masks(vocab: TokenVocab, node: object, marked: bytes, seed: int, lean: float) -> tuple[int, int]:
    """Six random walks of 30 tokens from ``node``'s start, each step's allowed set checked against
    trying every token; the walk leans (``lean``) towards tokens matching ``marked`` (a structure's
    next bytes), else any allowed one. The masks checked, and how many took the free-text shortcut."""
    rng = random.Random(seed)
    checked = shortcuts = 0
    for _ in range(6):
        c = JsonConstraint(vocab, node, set())
        for _ in range(30):
            shortcuts += free_text_loop(c.state) is not None
            want = sorted(i for i, data in vocab.pieces.items() if data and advance_bytes(c.state, data) is not None)
            got = c.allowed().tolist()
            assert got == want
            checked += 1
            if not got:
                break
            leaning = [i for i in got if re.search(marked, vocab.pieces[i])]
            assert c.accept(rng.choice(leaning if leaning and rng.random() < lean else got))
    return checked, shortcuts


def test_draws_through_the_bundled_model_follow_the_tags() -> None:
    """The bundled model answers ``Answer: <place>``; with "Answer" as a trigger opening
    ``Answer:"<a JSON string>".``, every sampled answer writes it only in that shape (its string
    cut short only where max_tokens ends the answer), while unconstrained answers do not."""
    llm = LLM(device="cpu")
    spec = {"triggers": ["Answer"], "structures": [{"begin": "Answer:", "schema": {"type": "string"}, "end": "."}]}
    prompt = "Profile of Mira. Mira lives in Quorvane and works as a potter.<<PIC_SEP>>Where does Mira live?"
    shaped = re.compile(r':("(?:[^"\\]|\\.)*")\.')
    named = 0
    for seed in range(6):
        text = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=seed,
                                                   structural_tag=spec))[0].text
        named += "Answer" in text
        at = 0
        while (i := text.find("Answer", at)) >= 0:  # in free text (inside a string it is no trigger)
            m = shaped.match(text, i + len("Answer"))
            if m is None:  # cut short by max_tokens: a prefix of the shape, running to the end
                assert re.fullmatch(r'(:("(?:[^"\\]|\\.)*)?)?', text[i + len("Answer"):]), (seed, text)
                break
            assert isinstance(json.loads(m[1]), str)
            at = m.end()
    assert named >= 3
    free = [llm.generate(prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=s))[0].text for s in range(6)]
    assert any("Answer" in t and not shaped.search(t) for t in free)  # unconstrained: another shape
    with pytest.raises(ValueError, match="structural_tag"):
        llm.generate(prompt, SamplingParams(structural_tag={"triggers": ["x"], "structures": []}))


def test_free_text_s_token_list_is_found_by_a_bytes_search_from_the_first_mask_on(vocab: TokenVocab) -> None:
    """The class of free text's loop (every character but the triggers' first ones) leaves out a few
    ASCII characters: its token list is read off the tokens' bytes, the same list the characters'
    own test gives; and a tag's first state, before any byte, takes that list already (it used to
    walk the whole vocabulary, and the first state after it built the list in the serving loop)."""
    from hypic.engine.structured.vocab import _all_within, _ascii_left_out

    node = compile_tags(CALLS)
    loop = free_text_loop(start(node))
    assert loop is not None and _ascii_left_out(loop[0]) == b"<"
    assert _ascii_left_out(((0, 0x10FFFF),)) == b"" and _ascii_left_out(((0x41, 0x10FFFF),)) == bytes(range(0x41))
    assert _ascii_left_out(((0, 0x3B), (0x3D, 0x2000))) is None  # not up to the last character
    assert _ascii_left_out(((0, 0xE8), (0xEA, 0x10FFFF))) is None  # "é" left out: not ASCII
    inside = vocab._inside(loop[0])
    by_chars = sorted(i for i in vocab.plain.ids.tolist() if _all_within(vocab.pieces[i].decode(), loop[0]))
    assert sorted(inside.tokens.ids.tolist()) == by_chars and len(by_chars) < len(vocab.plain.ids)
    lengths = [len(vocab.pieces[i].decode()) for i in inside.tokens.ids.tolist()]
    assert lengths == sorted(lengths)  # still by length: upto_length's cut is right
    assert sorted(inside.tokens.upto_length(2).tolist()) == sorted(i for i, n in zip(
        inside.tokens.ids.tolist(), lengths, strict=True) if n <= 2)
