"""xgrammar's structural-tag formats (``{"type": "structural_tag", "format": {...}}``): the matcher
against an independent reading of each format over Python strings (``re`` for regexes, ``json.loads``
for JSON, substring scans for free text and triggers), the vocabulary's masks against trying every
token, draws through the bundled model, refusals that name the field."""

import json
import random
import re

import pytest

from hypic import LLM, SamplingParams
from hypic.engine.structured import TokenVocab, compile_tags
from hypic.engine.structured.matcher import accepts, advance_bytes, finished, start
from tests.engine.test_structured_tags import vocab, walk_masks  # noqa: F401 — the bundled vocabulary, module-scoped


def _compiled(fmt: dict) -> object:
    return compile_tags({"type": "structural_tag", "format": fmt})


def _ends(fmt: dict, text: str, i: int, stops: tuple[str, ...] = ()) -> set[int]:
    """Where a chunk ``fmt`` reads from position ``i`` of ``text`` may end (the format read directly);
    ``stops``: the enclosing tag's ends, which unbounded text stops at."""
    kind = fmt["type"]
    if kind == "const_string":
        return {i + len(fmt["value"])} if text.startswith(fmt["value"], i) else set()
    if kind == "regex":
        return {j for j in range(i, len(text) + 1) if re.fullmatch(fmt["pattern"], text[i:j])}
    if kind == "json_schema" and fmt.get("style") == "qwen_xml":
        rx = re.compile(_qwen_xml_pattern(fmt["json_schema"]), re.DOTALL)
        return {j for j in range(i, len(text) + 1) if rx.fullmatch(text, i, j)}
    if kind == "json_schema":
        return {j for j in range(i + 1, len(text) + 1) if _json(text[i:j], fmt["json_schema"])}
    if kind == "any_text":
        marks = [*fmt.get("excludes", []), *(s for s in stops if s)]
        first = min((text.find(m, i) + len(m) for m in marks if text.find(m, i) >= 0), default=len(text) + 1)
        return set(range(i, first))  # up to (not through) the first excluded string's last character
    if kind == "sequence":
        at, last = {i}, len(fmt["elements"]) - 1
        for k, e in enumerate(fmt["elements"]):
            at = {j for p in at for j in _ends(e, text, p, stops if k == last else ())}
        return at
    if kind == "or":
        return {j for e in fmt["elements"] for j in _ends(e, text, i, stops)}
    if kind in ("optional", "star", "plus", "repeat"):
        low, high = {"optional": (0, 1), "star": (0, -1), "plus": (1, -1)}.get(kind, (fmt.get("min"), fmt.get("max")))
        out, at, n = set(), {i}, 0
        while at and (high == -1 or n <= high) and n <= len(text) + 1:
            if n >= low:
                out |= at
            at = {j for p in at for j in _ends(fmt["content"], text, p, stops)}
            n += 1
        return out
    if kind == "tag":
        ends = fmt["end"] if isinstance(fmt["end"], list) else [fmt["end"]]
        if not text.startswith(fmt["begin"], i):
            return set()
        return {q + len(e) for q in _ends(fmt["content"], text, i + len(fmt["begin"]), tuple(ends)) for e in ends
                if text.startswith(e, q)}
    if kind == "triggered_tags":
        return _triggered(fmt, text, i, stops, fmt.get("at_least_one", False))
    if kind == "dispatch":  # as the docs say it: free text where a pattern, once written, is followed by its format
        return _ends({"type": "triggered_tags", "triggers": [p for p, _ in fmt["rules"]],
                      "tags": [{"begin": p, "content": f, "end": ""} for p, f in fmt["rules"]],
                      "excludes": fmt.get("excludes", []), "stop_after_first": not fmt.get("loop", True)},
                     text, i, stops)
    if kind == "tags_with_separator":
        one = {"type": "or", "elements": [{**t, "type": "tag"} for t in fmt["tags"]]}
        then = {"type": "sequence", "elements": [{"type": "const_string", "value": fmt["separator"]}, one]}
        more = one if fmt.get("stop_after_first") else {"type": "sequence", "elements": [one, {"type": "star",
                                                                                             "content": then}]}
        return _ends(more if fmt.get("at_least_one") else {"type": "optional", "content": more}, text, i)
    raise AssertionError(kind)


def _triggered(fmt: dict, text: str, i: int, stops: tuple[str, ...], tag_first: bool) -> set[int]:
    """Free text from ``i`` until the first trigger or excluded string ends; a trigger there opens a
    tag that begins at the trigger; after the tag, free text again (or the end, stop_after_first)."""
    out: set[int] = set()
    if tag_first:
        starts = [(i, t) for t in fmt["tags"] if text.startswith(t["begin"], i)]
    else:
        marks = [*fmt["triggers"], *fmt.get("excludes", []), *(s for s in stops if s)]
        hits = [(text.find(m, i) + len(m), m in fmt["triggers"], m) for m in marks if text.find(m, i) >= 0]
        if not hits:
            return set(range(i, len(text) + 1))
        end = min(h[0] for h in hits)
        out |= set(range(i, end))  # free text may stop anywhere before the mark is whole
        trigger = next((m for e, is_trigger, m in hits if e == end and is_trigger), None)
        if trigger is None:  # an excluded string: free text cannot hold it
            return out
        at = end - len(trigger)
        starts = [(at, t) for t in fmt["tags"] if t["begin"].startswith(trigger) and text.startswith(t["begin"], at)]
    for at, t in starts:
        for q in _ends({**t, "type": "tag"}, text, at):
            out |= {q} if fmt.get("stop_after_first") else _triggered(fmt, text, q, stops, False)
    return out


def _qwen_xml_pattern(schema: dict) -> str:
    """The qwen_xml parameter list as one Python regex: each property in declared order (optional
    unless required) as ``<parameter=KEY>``, a newline or not, its value, a newline or not,
    ``</parameter>``, a newline or not; a string's value raw text without ``</parameter>`` (an enum:
    one of its strings), an integer's JSON."""
    out = ""
    for key, sub in schema["properties"].items():
        if "enum" in sub:
            value = "|".join(map(re.escape, sub["enum"]))
        elif sub["type"] == "string":
            value = "(?:(?!</parameter>).)*"
        else:
            value = "-?(?:0|[1-9][0-9]*)"
        one = f"<parameter={re.escape(key)}>\n?(?:{value})\n?</parameter>\n?"
        out += one if key in schema.get("required", []) else f"(?:{one})?"
    return out


def _json(value_text: str, schema: dict) -> bool:
    """A JSON text as hypic writes it (no space at either end, single spaces between tokens) that the
    (small) schema accepts."""
    try:
        value = json.loads(value_text)
    except json.JSONDecodeError:
        return False
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', value_text)
    if outside != outside.strip() or "  " in outside or re.search(r"[\t\n\r]", outside):
        return False
    if schema.get("type") == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if schema.get("type") == "object":
        props = schema["properties"].items()
        return isinstance(value, dict) and set(value) == set(schema["required"]) and all(
            value[k] == p["const"] if "const" in p else isinstance(value[k], int) for k, p in props)
    raise AssertionError(schema)


def accepted(fmt: dict, text: str) -> bool:
    return len(text) in _ends(fmt, text, 0)


THINK = {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}
CALL = {"type": "object", "properties": {"name": {"const": "f"}, "n": {"type": "integer"}}, "required": ["name", "n"]}
CALLS = {"type": "triggered_tags", "triggers": ["<tool"], "tags": [
    {"begin": "<tool>", "content": {"type": "json_schema", "json_schema": CALL}, "end": ["</tool>", "</t>"]},
    {"begin": "<tool_n>", "content": {"type": "regex", "pattern": "[0-9]+"}, "end": "</tool_n>"}]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                                          "days": {"type": "integer"}}, "required": ["city"]}
QWEN_CALLS = {"type": "triggered_tags", "triggers": ["<tool_call>\n<function="], "excludes": ["<think>"], "tags": [
    {"begin": "<tool_call>\n<function=get_weather>\n", "end": "\n</function>\n</tool_call>",
     "content": {"type": "json_schema", "json_schema": WEATHER, "style": "qwen_xml"}}]}
FORMATS = {
    "think then calls": ({"type": "sequence", "elements": [THINK, CALLS]},
                         ["<think>", "</think>", "</thi", "<tool>", "<tool_n>", "</tool_n>", "</tool>", "</t>", "<to",
                          '{"name":"f","n":3}', '{"name":"g","n":3}', "12", "x", " ", "<"], ("<think>", "")),
    "calls inside a tag": ({"type": "tag", "begin": "<r>", "content": {**CALLS, "excludes": ["!!"]}, "end": "</r>"},
                           ["<r>", "</r>", "<tool>", "<tool_n>", "</tool_n>", "</tool>", "7", "!", "a", "<", "</"],
                           ("<r>", "</r>")),
    "answer shapes": ({"type": "sequence", "elements": [
        {"type": "optional", "content": {"type": "const_string", "value": "A: "}},
        {"type": "or", "elements": [{"type": "regex", "pattern": "[a-z]+( [a-z]+)*"},
                                    {"type": "grammar", "grammar": 'root ::= [0-9]+ ("." [0-9]+)?'},
                                    {"type": "json_schema", "json_schema": {"type": "integer"}}]},
        {"type": "repeat", "min": 1, "max": 2, "content": {"type": "const_string", "value": "."}}]},
        ["A: ", "A:", "ab", " ", "cd", "1", "2.5", ".", "-3", "x"], ("", ".")),
    "tags with a separator": ({"type": "tags_with_separator", "separator": ", ", "tags": [
        {"begin": "<a>", "content": {"type": "any_text"}, "end": "</a>"},
        {"begin": "<b>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}}, "end": "</b>"}]},
        ["<a>", "</a>", "<b>", "</b>", ", ", ",", "hi", "4", " "], ("", "")),
    "qwen tool calls": (QWEN_CALLS, ["Sure. ", "<tool_call>\n<function=", "get_weather>\n", "<parameter=city>",
                                     "<parameter=unit>", "<parameter=days>", "\n", "Paris", "c", "f", "12", "x",
                                     "</parameter>", "</parameter>\n", "\n</function>\n</tool_call>", "<", "</"],
                        ("", "")),
    "dispatch in a tag": ({"type": "tag", "begin": "<r>", "end": "</r>", "content": {"type": "dispatch", "rules": [
        ["<n>", {"type": "json_schema", "json_schema": {"type": "integer"}}],
        ["@", {"type": "regex", "pattern": "[a-z]+!"}]], "excludes": ["##"]}},
        ["<n>", "@", "12", "ab!", "ab", "#", "x", " ", "</r>", "<", "!"], ("<r>", "</r>")),
    "dispatch once": ({"type": "dispatch", "loop": False, "rules": [["<n>", {"type": "const_string", "value": "7."}]]},
                      ["<n>", "7.", "7", "x", "<"], ("", "")),
    "one call first": ({**CALLS, "at_least_one": True, "stop_after_first": True},
                       ["5", "12", "5", "12", "<tool>", "</tool_n>", "x", '{"name":"f","n":1}', "</t>"],
                       ("<tool_n>", "</tool_n>")),
}
# the grammar above, as the regex the direct reading uses
GRAMMARS = {'root ::= [0-9]+ ("." [0-9]+)?': r"[0-9]+(\.[0-9]+)?"}


def _as_read(fmt: object) -> object:
    """The format with each grammar replaced by its regex (the direct reading has no GBNF parser)."""
    if isinstance(fmt, dict):
        if fmt.get("type") == "grammar":
            return {"type": "regex", "pattern": GRAMMARS[fmt["grammar"]]}
        return {k: _as_read(v) for k, v in fmt.items()}
    return [_as_read(v) for v in fmt] if isinstance(fmt, list) else fmt


@pytest.mark.parametrize("name", FORMATS)
def test_random_texts_against_a_direct_reading(name: str) -> None:
    """Random texts from pieces of each format (most between its usual opening and close): the
    matcher accepts exactly what the direct reading does, and every prefix of an accepted text stays
    readable."""
    fmt, pieces, (lead, tail) = FORMATS[name]
    node, reading = _compiled(fmt), _as_read(fmt)
    rng = random.Random(name)
    hits = 0
    for _ in range(700):
        text = lead * (rng.random() < 0.7) + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6))) + \
            tail * (rng.random() < 0.7)
        want = accepted(reading, text)
        assert accepts(node, text.encode()) == want, (name, text)
        if want:
            hits += 1
            assert all(advance_bytes(start(node), text.encode()[:k]) is not None for k in range(len(text))), text
    assert hits >= 20, hits  # the pieces do write accepted texts


@pytest.mark.parametrize(("fmt", "texts"), [
    ({"type": "const_string", "value": "ok"}, {"ok": True, "o": False, "oks": False, "": False}),
    ({"type": "any_text", "excludes": ["<|x|>", "zz"]}, {"": True, "free text": True, "a <|x| b": True,
                                                         "a <|x|> b": False, "zz": False, "z z": True}),
    ({"type": "plus", "content": {"type": "regex", "pattern": "[ab]"}}, {"": False, "a": True, "abba": True,
                                                                         "abc": False}),
    ({"type": "repeat", "min": 2, "max": 3, "content": {"type": "const_string", "value": "x"}},
     {"x": False, "xx": True, "xxx": True, "xxxx": False}),
    ({"type": "tag", "begin": "[", "content": {"type": "star", "content": {"type": "const_string", "value": "1"}},
      "end": ["]", ")"]}, {"[]": True, "[11)": True, "[1": False, "[1]]": False}),
    (THINK, {"<think></think>": True, "<think>a</thin b</think>": True, "<think>a</think>b</think>": False}),
    ({"type": "json_schema", "style": "qwen_xml", "json_schema": {
        "type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "array"}},
        "required": ["path"]}},
     {"<parameter=path>/tmp/a b</parameter>": True, "<parameter=path>\n<x> & y\n</parameter>\n": True,
      "<parameter=path>a</parameter><parameter=lines>[1,2]</parameter>": True,
      "<parameter=path>a</parameter><parameter=lines>1</parameter>": False,
      "<parameter=lines>[]</parameter><parameter=path>a</parameter>": False,  # declared order
      " <parameter=path>a</parameter>": False, "<parameter=path>a</parameter></parameter>": False}),
    ({"type": "json_schema", "style": "qwen_xml", "json_schema": {  # maxLength in characters, as the parser
        "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"]}},  # strips a newline each side
     {"<parameter=s>abc</parameter>": True, "<parameter=s>\nabc\n</parameter>": True,
      "<parameter=s>\nab\n\n</parameter>": True, "<parameter=s>é☃😀</parameter>": True,
      "<parameter=s>abcd</parameter>": False, "<parameter=s>\nabc\n\n</parameter>": False,
      "<parameter=s>é☃😀x</parameter>": False}),
    ({"type": "json_schema", "style": "qwen_xml", "json_schema": {"type": "object"}},
     {"": True, "<parameter=any_1>x</parameter>\n<parameter=b>[]</parameter>": True, "<parameter=1a>x</parameter>":
      False}),
])
def test_each_format_reads_its_chunk(fmt: dict, texts: dict[str, bool]) -> None:
    node = _compiled(fmt)
    for text, want in texts.items():
        assert accepts(node, text.encode()) == want, (fmt["type"], text)
        if fmt["type"] != "json_schema":  # (the direct reading knows strings, enums and integers only)
            assert accepted(fmt, text) == want, (fmt["type"], text)  # the direct reading agrees


def test_an_answer_ends_where_its_format_does() -> None:
    """A format with nothing more to read finishes the output (the sampler stops there); free text
    at the top, or a repetition with room left, does not."""
    for fmt, text, done in (({"type": "const_string", "value": "ok"}, b"ok", True),
                            ({"type": "sequence", "elements": [THINK, {"type": "const_string", "value": "."}]},
                             b"<think>x</think>.", True),
                            (THINK, b"<think>x</think>", True),
                            ({"type": "sequence", "elements": [THINK, {"type": "any_text"}]}, b"<think></think>",
                             False),
                            ({"type": "plus", "content": {"type": "const_string", "value": "a"}}, b"aa", False)):
        state = advance_bytes(start(_compiled(fmt)), text)
        assert state is not None and finished(state) == done, (fmt, text)


@pytest.mark.parametrize(("fmt", "needle"), [
    ({"type": "sequence", "elements": []}, r"structural_tag.format.elements: expected a non-empty list"),
    ({"type": "or", "elements": [{"type": "const_string", "value": 1}]},
     r"structural_tag.format.elements\[0\].value: expected a string"),
    ({"type": "exclude_token", "exclude_tokens": []}, r"format.type: 'exclude_token' is not served \(one token by"),
    ({"type": "token_tag_dispatch", "pairs": []}, r"format.type: 'token_tag_dispatch' is not served"),
    ({"type": "token", "token": 1.5}, r"structural_tag.format.token: expected a token's text or its id"),
    ({"type": "token", "token": -1}, r"structural_tag.format.token: expected a token's text or its id"),
    ({"type": "any_tokens", "exclude_tokens": "<|x|>"}, r"format.exclude_tokens: expected a list of tokens"),
    ({"type": "token_triggered_tags", "trigger_tokens": [], "tags": []},
     r"format.trigger_tokens: expected a non-empty"),
    ({"type": "token_triggered_tags", "trigger_tokens": ["<|a|>"], "tags": [{"begin": "<|a|>", "content":
      {"type": "any_text"}, "end": "x"}]}, r"format.tags\[0\].begin: expected a token \(a token trigger opens it\)"),
    ({"type": "token_triggered_tags", "trigger_tokens": ["<|a|>"], "tags": [{"begin": {"token": "<|b|>"}, "content":
      {"type": "any_text"}, "end": "x"}]}, r"format.tags\[0\].begin: token '<\|b\|>' starts with no trigger"),
    ({"type": "dispatch", "rules": []}, r"structural_tag.format.rules: expected a non-empty list"),
    ({"type": "dispatch", "rules": [["", {"type": "any_text"}]]}, r"format.rules\[0\]: expected \[pattern, format\]"),
    ({"type": "dispatch", "rules": [["<a>", {"type": "bogus"}]]}, r"format.rules\[0\]\[1\].type: expected one of"),
    ({"type": "dispatch", "rules": [["<a>", {"type": "any_text"}]], "loop": 1}, r"format.loop: expected a boolean"),
    ({"type": "bogus"}, r"structural_tag.format.type: expected one of \['any_text', 'any_tokens', 'const_string'"),
    ({"type": "const_string"}, r"structural_tag.format.value: required for const_string"),
    ({"type": "const_string", "value": "a", "extra": 1}, r"structural_tag.format: unknown field 'extra'"),
    ({"type": "json_schema", "json_schema": {"type": "object"}, "style": "glm_xml"},
     r"structural_tag.format.style: 'glm_xml' is not served \(json or qwen_xml\)"),
    ({"type": "json_schema", "json_schema": {"type": "array"}, "style": "qwen_xml"},
     r"structural_tag.format.json_schema: the qwen_xml style writes an object's properties; got type 'array'"),
    ({"type": "json_schema", "json_schema": {"properties": {"a": {}}, "required": ["b"]}, "style": "qwen_xml"},
     r"structural_tag.format.json_schema.required: 'b' is not among the properties"),
    ({"type": "json_schema", "json_schema": {"properties": {"a": {"type": "nope"}}}, "style": "qwen_xml"},
     r"structural_tag.format.json_schema.properties.a: "),
    ({"type": "json_schema", "json_schema": {"type": "object"}, "any_order": True}, r"any_order: not served"),
    ({"type": "json_schema", "json_schema": {"type": "nope"}}, r"structural_tag.format.json_schema: "),
    ({"type": "regex", "pattern": "a("}, r"structural_tag.format.pattern: 'a\(': "),
    ({"type": "grammar", "grammar": "root ::= x"}, r"structural_tag.format.grammar: rule 'x' is used but never"),
    ({"type": "any_text", "max_tokens": 5}, r"structural_tag.format.max_tokens: not served \(max_chars is"),
    ({"type": "repeat", "min": 3, "max": 2, "content": {"type": "any_text"}}, r"max 2 is below min 3"),
    ({"type": "repeat", "min": -1, "max": 2, "content": {"type": "any_text"}}, r"min: expected a non-negative"),
    ({"type": "repeat", "min": 0, "max": 5000, "content": {"type": "any_text"}}, r"a bound above 4096"),
    ({"type": "tag", "begin": {"token": 1.5}, "content": {"type": "any_text"}, "end": "x"},
     r"structural_tag.format.begin.token: expected a token's text or its id"),
    ({"type": "tag", "begin": {"type": "const_string", "value": "x"}, "content": {"type": "any_text"}, "end": "x"},
     r"structural_tag.format.begin: expected a string or a token format"),
    ({"type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": []},
     r"structural_tag.format.end: expected a string, a non-empty list of strings or a token format"),
    ({"type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": "x" * 200},
     r"structural_tag.format.content.excludes: at most 32 strings .* each at most 128 bytes"),
    ({"type": "triggered_tags", "triggers": ["<f"], "tags": [{"begin": "<f>", "content": {"type": "any_text"},
                                                              "end": "</f>"}], "excludes": ["<"]},
     r"structural_tag.format.excludes: '<' lies inside the trigger '<f'"),
    ({"type": "triggered_tags", "triggers": ["<f"], "tags": [{"type": "token", "begin": "<f>",
                                                              "content": {"type": "any_text"}, "end": "</f>"}]},
     r"structural_tag.format.tags\[0\].type: expected 'tag'"),
    ({"type": "tags_with_separator", "separator": ",", "tags": [{"begin": "<f>", "content": {"type": "any_text"},
                                                                  "end": "</f>"}], "stop_after_first": "yes"},
     r"structural_tag.format.stop_after_first: expected a boolean"),
    ({"type": "sequence", "elements": [{"type": "optional", "content": {"type": "any_text"}}] * 100},
     r"structural_tag.format: more than \d+ formats that may be empty"),
])
def test_bad_formats_are_refused_by_name(fmt: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(structural_tag={"type": "structural_tag", "format": fmt})


def test_deep_or_many_formats_are_refused() -> None:
    fmt: dict = {"type": "const_string", "value": "x"}
    for _ in range(40):
        fmt = {"type": "sequence", "elements": [fmt]}
    with pytest.raises(ValueError, match="formats nested more than 32 deep"):
        _compiled(fmt)
    with pytest.raises(ValueError, match="more than 2048 format objects"):
        _compiled({"type": "or", "elements": [{"type": "const_string", "value": str(i)} for i in range(2100)]})


def test_allowed_tokens_equal_a_pass_over_every_token(vocab: TokenVocab) -> None:  # noqa: F811
    """Along random walks through a think tag, free text with calls, a regex and a JSON value, the
    trie walk's allowed set (with the free-text shortcut where it applies) is exactly the tokens
    whose bytes the matcher reads."""
    fmt = {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<think>", "content": {"type": "any_text", "excludes": ["er"]}, "end": "</think>"},
        {**CALLS, "triggers": ["<tool", "an"], "tags": [*CALLS["tags"], {"begin": "and", "content": {
            "type": "regex", "pattern": "[a-z]{1,3}"}, "end": ";"}]}]}
    checked, shortcuts = walk_masks(vocab, _compiled(fmt), rb"<|/|t|h|k|>|an|d|;|\{|\"|[0-9]", 6, lean=0.85)
    assert checked >= 120 and shortcuts > 5


def test_qwen_xml_masks_equal_a_pass_over_every_token(vocab: TokenVocab) -> None:  # noqa: F811
    """The same along walks through Qwen-style calls in free text: raw string values (free text
    that stops at ``</parameter>``), an enum's strings, an integer, the newlines between."""
    checked, _ = walk_masks(vocab, _compiled(QWEN_CALLS), rb"<|/|t|p|=|>|\n|c|[0-9]", 7, lean=0.9)
    assert checked >= 120


def test_draws_through_the_bundled_model_follow_the_format() -> None:
    """The bundled model answers ``Answer: <place>``; held to ``Answer: `` then one capitalised word
    or ``unknown``, then ``.``, every sampled answer has that shape (or is cut short by max_tokens),
    while unconstrained answers do not all have it."""
    llm = LLM(device="cpu")
    fmt = {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "or", "elements": [{"type": "regex", "pattern": "[A-Z][a-z]+"},
                                    {"type": "const_string", "value": "unknown"}]},
        {"type": "const_string", "value": "."}]}
    prompt = "Profile of Mira. Mira lives in Quorvane and works as a potter.<<PIC_SEP>>Where does Mira live?"
    shape = re.compile(r"Answer: (?:[A-Z][a-z]+|unknown)\.")
    whole = 0
    for seed in range(4):
        text = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=seed, structural_tag={
            "type": "structural_tag", "format": fmt}))[0].text
        if shape.fullmatch(text):
            whole += 1
        else:  # cut short: a prefix of the shape
            assert accepts(_compiled({"type": "sequence", "elements": [*fmt["elements"][:2]]}), text.encode()) or \
                advance_bytes(start(_compiled(fmt)), text.encode()) is not None, (seed, text)
    assert whole >= 2
    free = [llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=s))[0].text for s in range(4)]
    assert not all(shape.fullmatch(t) for t in free)


@pytest.mark.gpu
def test_on_a_gpu_answers_follow_their_formats() -> None:
    """On CUDA, batched with a free request: each answer is accepted whole by its format, or is a
    prefix of an accepted text when max_tokens cut it."""
    import torch

    gpu = LLM(device="cuda", dtype=torch.float32)
    prompt = "Profile of Mira. Mira lives in Quorvane and works as a potter.<<PIC_SEP>>Where does Mira live?"
    answer = {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "or", "elements": [{"type": "regex", "pattern": "[A-Z][a-z]+"},
                                    {"type": "const_string", "value": "unknown"}]},
        {"type": "const_string", "value": "."}]}
    think = {"type": "sequence", "elements": [{**THINK, "content": {"type": "any_text", "excludes": ["<think>"]}},
                                              QWEN_CALLS]}
    formats = [answer, think, {"type": "tags_with_separator", "separator": ",", "at_least_one": True, "tags": [
        {"begin": "<n>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}}, "end": "</n>"}]}]
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=k, structural_tag={
        "type": "structural_tag", "format": f}) for k, f in enumerate(formats)] + [SamplingParams(max_tokens=8)]
    outs = gpu.generate([prompt] * len(params), params)
    for out, fmt in zip(outs, formats, strict=False):
        node = _compiled(fmt)
        if out.finish_reason == "stop":
            assert accepts(node, out.text.encode()), out.text
        else:
            assert advance_bytes(start(node), out.text.encode()) is not None, out.text
    assert outs[0].text.startswith("Answer: ") and outs[1].text.startswith("<think>") and outs[-1].token_ids


def test_repetitions_of_what_may_be_empty_stay_small() -> None:
    """A repetition whose item may read nothing needs no empty iterations to reach its count (its low
    bound is met by them), and a byte enters one iteration: ``(a?){130}`` then ``b`` reads ``b``; nested
    bounded repetitions keep only undominated alternatives (not every split of the a's so far)."""
    opt_a = {"type": "optional", "content": {"type": "const_string", "value": "a"}}
    node = _compiled({"type": "sequence", "elements": [{"type": "repeat", "min": 130, "max": 130, "content": opt_a},
                                                       {"type": "const_string", "value": "b"}]})
    for text, want in ((b"b", True), (b"a" * 130 + b"b", True), (b"a" * 131 + b"b", False)):
        assert accepts(node, text) == want, text
    chunks = [{"type": "grammar", "grammar": 'root ::= "a"?'}] * 80  # 80 chunks that may be empty, then b
    assert accepts(_compiled({"type": "sequence", "elements": [*chunks, {"type": "const_string", "value": "b"}]}), b"b")
    from hypic.engine.structured import compile_grammar
    for nested in (compile_grammar('root ::= (("a"{0,20}){0,20}){0,20}'), _compiled(
            {"type": "repeat", "min": 0, "max": 20, "content": {"type": "repeat", "min": 0, "max": 20, "content": {
                "type": "repeat", "min": 0, "max": 20, "content": {"type": "const_string", "value": "a"}}}})):
        state = start(nested)
        for n in range(1, 60):
            state = advance_bytes(state, b"a")
            assert state is not None and len(state.alts) <= 64, (n, len(state.alts))
        assert accepts(nested, b"a" * 8000) and not accepts(nested, b"a" * 8001)


def test_qwen_xml_reads_strings_as_pydantic_writes_them() -> None:
    """An Enum field (a $ref to a string enum), an Optional[str] (anyOf string, null) and a pattern
    (found anywhere, as JSON Schema reads it) are raw text; an object with no properties and
    ``additionalProperties: false`` takes no parameter."""
    schema = {"type": "object", "$defs": {"Unit": {"enum": ["c", "f"], "type": "string"}}, "required": ["u"],
              "properties": {"u": {"$ref": "#/$defs/Unit"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                             "code": {"type": "string", "pattern": "^[0-9]+"}}}
    node = _compiled({"type": "json_schema", "style": "qwen_xml", "json_schema": schema})
    for text, want in (("<parameter=u>c</parameter>", True), ('<parameter=u>"c"</parameter>', False),
                       ("<parameter=u>f</parameter><parameter=note>any text</parameter>", True),
                       ("<parameter=u>f</parameter><parameter=code>12ab</parameter>", True),
                       ("<parameter=u>f</parameter><parameter=code>ab12</parameter>", False)):
        assert accepts(node, text.encode()) == want, text
    none = _compiled({"type": "json_schema", "style": "qwen_xml", "json_schema": {"additionalProperties": False}})
    assert accepts(none, b"") and not accepts(none, b"<parameter=a>x</parameter>")
    # a union naming itself through $defs (was a RecursionError: a 500) is JSON
    looped = {"properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"],
              "$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "integer"}]}}}
    node = _compiled({"type": "json_schema", "style": "qwen_xml", "json_schema": looped})
    assert accepts(node, b"<parameter=a>7</parameter>") and not accepts(node, b"<parameter=a>x</parameter>")


@pytest.mark.parametrize(("spec", "needle"), [
    ({"type": []}, r"structural_tag.format.type: expected a string naming the format"),
    ({"type": "json_schema", "style": "qwen_xml", "json_schema": {"properties": {"a": {}}, "required": [{}]}},
     r"structural_tag.format.json_schema: properties must be an object and required a list of names"),
    ({"type": "json_schema", "style": "qwen_xml", "json_schema": {"properties": {"a": {"type": "string",
                                                                                        "pattern": 5}}}},
     r"json_schema.properties.a.pattern: expected a string"),
    ({"type": "json_schema", "style": "qwen_xml", "json_schema": {"properties": {"a": {"enum": "abc"}}}},
     r"json_schema.properties.a: enum must be a non-empty list"),
    ({"type": "json_schema", "style": "qwen_xml", "json_schema": {"required": ["a"]}},
     r"json_schema.required: 'a' is not among the properties"),
    ({"type": "or", "elements": [{"type": "triggered_tags", "triggers": [f"<{i:03d}" + "x" * 120 for i in range(32)],
                                  "tags": [{"begin": f"<{i:03d}" + "x" * 120, "content": {"type": "any_text"},
                                            "end": "."} for i in range(32)]}] * 20},
     r"structural_tag.format.elements\[\d+\]: the triggers and excludes .* more than 1024 KiB of prefixes"),
])
def test_malformed_or_costly_formats_are_value_errors(spec: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        _compiled(spec)
    with pytest.raises(ValueError, match="structural_tag: nested too deep to read"):
        compile_tags("[" * 100_000)


def test_any_text_holds_its_character_budget(vocab: TokenVocab) -> None:  # noqa: F811
    """``max_chars`` counts characters, not bytes; inside a tag the end must come once the budget is
    spent; masks along walks (the free-text shortcut taking tokens that fit the budget left) equal
    trying every token."""
    think = {"type": "tag", "begin": "<think>", "end": "</think>", "content": {"type": "any_text", "max_chars": 5}}
    node = _compiled(think)
    for text, want in (("<think>abcde</think>", True), ("<think>abcdef</think>", False), ("<think></think>", True),
                       ("<think>éé☃😀x</think>", True), ("<think>éé☃😀xy</think>", False)):
        assert accepts(node, text.encode()) == want, text
    assert accepts(_compiled({"type": "any_text", "max_chars": 0}), b"")
    assert not accepts(_compiled({"type": "any_text", "max_chars": 0}), b"a")
    checked, shortcuts = walk_masks(vocab, _compiled({**think, "content": {"type": "any_text", "max_chars": 40}}),
                                    rb"<|/|t|h|>", 8, lean=0.3)
    assert checked >= 30 and shortcuts > 5
    with pytest.raises(ValueError, match=r"structural_tag.format.content.max_chars: expected a non-negative"):
        _compiled({**think, "content": {"type": "any_text", "max_chars": -1}})


def test_free_text_is_well_formed_utf8() -> None:
    """Free text holds characters, as xgrammar's ``any_text`` does: a character may be split across
    tokens, but a stray continuation byte, an overlong or surrogate form, a lead past U+10FFFF or a
    character cut by the end is no text (it would read back as U+FFFD, and a budget count it wrong);
    read against Python's own UTF-8 decoder over every short byte string."""
    loose = _compiled({"type": "any_text"})
    tagged = _compiled({"type": "tag", "begin": "<t>", "end": "</t>", "content": {"type": "any_text", "max_chars": 3}})
    for text in ("é☃😀", "a\u07ff\u0800\uffff\U00010000\U0010ffff", "<t>é\u2603</t>"):
        assert accepts(loose, text.encode())
    for raw in (b"\x80", b"a\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                b"\xf5\x80\x80\x80", b"\xff", b"\xe2\x98", b"\xf0\x9f\x98"):
        assert not accepts(loose, raw), raw
        assert not accepts(tagged, b"<t>" + raw + b"</t>"), raw
    rng = random.Random(0)
    pool = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5]
    for _ in range(3000):
        raw = bytes(rng.choice(pool) for _ in range(rng.randint(1, 5)))
        try:
            raw.decode("utf-8")
            valid = True
        except UnicodeDecodeError:
            valid = False
        assert accepts(loose, raw) == valid, raw
        within = valid and len(raw.decode()) <= 3 and b"</t>" not in raw
        assert accepts(tagged, b"<t>" + raw + b"</t>") == within, raw
