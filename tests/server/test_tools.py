"""Tool calling in chat through the ``openai`` client: forced calls (``required``, a named function)
are calls of a listed function whose arguments its schema accepts, whole and streamed; ``auto``
answers are searched for Hermes blocks; the tools and earlier calls reach the template; what
cannot be served is a 400 naming the field, and serving goes on."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from hypic import LLM, SamplingParams
from hypic.engine.structured import compile_tags
from hypic.server.chat import CHATML, ChatTemplate
from hypic.server.generation import one_call_each
from hypic.server.tools import OPENS, StreamedCalls, ToolCalling, call_style, call_tags, parse_calls, strict_calls
from tests.engine.test_structured_formats import accepts
from tests.server.conftest import MODEL, LiveServer, build_model, http_client, openai_client, serve_with_template

# a Qwen-like template: the tools listed in a system turn, an assistant's calls as Hermes blocks
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "days": {"type": "integer"}},
                   "required": ["city", "days"], "additionalProperties": False}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 12}},
                                     "required": ["query"]}}}
TOOLS = [WEATHER, LOOKUP]
ASK = [{"role": "user", "content": "What is the weather in Quorvane for two days?"}]


@pytest.fixture(scope="module")
def tool_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The shared test model, its chat template one that renders tools."""
    live = serve_with_template(model_dir, tmp_path_factory.mktemp("tools_model"), TOOLS_TEMPLATE,
                               max_completion_tokens=64)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(tool_server: LiveServer) -> OpenAI:
    return openai_client(tool_server)


@pytest.fixture(scope="module")
def http(tool_server: LiveServer) -> httpx.Client:
    return http_client(tool_server)


def _checked(call) -> dict:
    """A call of a listed function whose arguments its parameters accept (checked here by hand)."""
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("call_")
    if call.function.name == "get_weather":
        assert set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 10
        assert isinstance(args["days"], int) and not isinstance(args["days"], bool)
    else:
        assert call.function.name == "lookup" and set(args) == {"query"} and len(args["query"]) <= 12
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "lookup"}}])
def test_a_forced_call_is_a_listed_function_with_arguments_its_schema_accepts(client: OpenAI, choice) -> None:
    one = dict(parallel_tool_calls=False)  # one call (OpenAI's default, parallel calls: a list, below)
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=64,
                                         temperature=0, **one)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    args = _checked(c.message.tool_calls[0])
    if isinstance(choice, dict):
        assert c.message.tool_calls[0].function.name == "lookup"
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=64, temperature=0, stream=True, **one))
    calls = [call for ch in chunks if ch.choices for call in ch.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == c.message.tool_calls[0].function.name
    assert json.loads(calls[0].function.arguments) == args  # greedy: the same call streamed
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        ["tool_calls"]


# pydantic's shape for a model holding another: the nested one in $defs, named by $ref from the root
SAVE = {"type": "function", "function": {"name": "save", "parameters": {
    "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "title": "Address"}},
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "home": {"$ref": "#/$defs/Address"}},
    "required": ["name", "home"], "title": "Person"}}}
# another tool with a definition of the same name and another shape: each call keeps its own
MOVE = {"type": "function", "function": {"name": "move", "parameters": {
    "definitions": {"Address": {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"]}},
    "type": "object", "properties": {"to": {"$ref": "#/definitions/Address"}}, "required": ["to"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "save"}}])
def test_a_forced_call_s_arguments_may_refer_to_their_own_definitions(client: OpenAI, choice) -> None:
    """A $ref names the root of its document: inside the forced call's schema the parameters' root
    is not the root any more (a 400 blaming response_format, which the request did not have)."""
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[SAVE, MOVE], tool_choice=choice,
                                         max_tokens=64, temperature=0, parallel_tool_calls=False)
    call = out.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    if call.function.name == "save":
        assert set(args) == {"name", "home"} and set(args["home"]) == {"city"} and len(args["home"]["city"]) <= 8
    else:
        assert call.function.name == "move" and set(args) == {"to"} and isinstance(args["to"]["zip"], int)


def test_the_tools_and_earlier_calls_reach_the_template_and_the_conversation_goes_on(client: OpenAI) -> None:
    turn = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          max_tokens=64, temperature=0, parallel_tool_calls=False)
    call = turn.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None,
                      "tool_calls": [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}]
    nxt = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert nxt.choices[0].finish_reason in ("stop", "length", "tool_calls")
    segments = ChatTemplate(TOOLS_TEMPLATE).segments(
        [("user", [ASK[0]["content"]]), ("assistant", [""]), ("tool", ["Sunny, 21 C."])],
        {"tools": TOOLS}, [{}, {"tool_calls": history[1]["tool_calls"]}, {"tool_call_id": call.id}])
    texts = [s.text for s in segments]
    assert '"name": "get_weather"' in texts[0] and '"name": "lookup"' in texts[0]  # the tools, in the first segment
    assert f'<tool_call>{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}' in texts[1]
    assert texts[2].startswith("<|im_start|>tool\nSunny, 21 C.")


KIMI_TOKENS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>")
# Kimi's way (its chat template): an assistant's calls as a section of special tokens, each call's id
# written back into the prompt, and a tool's answer naming the id it answers
KIMI_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'tool' %}## Return of {{ m['tool_call_id'] }}\n{% endif %}{{ m['content'] or '' }}"
    "{% if m.get('tool_calls') %}<|tool_calls_section_begin|>{% for c in m['tool_calls'] %}<|tool_call_begin|>"
    "{{ c['id'] }}<|tool_call_argument_begin|>{{ c['function']['arguments'] }}<|tool_call_end|>{% endfor %}"
    "<|tool_calls_section_end|>{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_kimi_model_s_forced_calls_carry_kimi_ids_counting_the_conversation_s_calls(tmp_path) -> None:
    """A tokenizer with Kimi's call markers: a forced call's id is ``functions.NAME:IDX``, IDX the
    calls made so far in the conversation (the form Kimi's template writes back and the model was
    trained on), whole and streamed; the template writes it into the next turn's prompt."""
    from tests.server.conftest import build_model

    model = build_model(tmp_path / "kimi_tokens", special=KIMI_TOKENS)
    live = serve_with_template(model, tmp_path / "kimi", KIMI_TEMPLATE, max_completion_tokens=64)
    try:
        client = openai_client(live)
        first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                               max_tokens=64, temperature=0).choices[0].message.tool_calls[0]
        assert first.id == f"functions.{first.function.name}:0"
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [first.model_dump()]},
                   {"role": "tool", "tool_call_id": first.id, "content": "Sunny."}]
        named = {"type": "function", "function": {"name": "lookup"}}
        second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice=named,
                                                max_tokens=64, temperature=0).choices[0].message.tool_calls[0]
        assert second.id == "functions.lookup:1"
        chunks = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice=named,
                                                max_tokens=64, temperature=0, stream=True)
        assert [c.id for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []] == \
            ["functions.lookup:1"]
        segments = ChatTemplate(KIMI_TEMPLATE).segments(
            [("user", [ASK[0]["content"]]), ("assistant", [""]), ("tool", ["Sunny."])], {},
            [{}, {"tool_calls": history[1]["tool_calls"]}, {"tool_call_id": first.id}])
        texts = "".join(s.text for s in segments)  # what the template writes back: the id, twice
        assert f"<|tool_call_begin|>{first.id}<|tool_call_argument_begin|>" in texts
        assert f"## Return of {first.id}" in texts
    finally:
        live.stop()


def test_auto_answers_are_searched_for_hermes_blocks() -> None:
    names = ("get_weather", "lookup")
    calls, rest = parse_calls('Let me check.\n<tool_call>\n{"name": "lookup", "arguments": {"query": "mill"}}\n'
                              '</tool_call>', names)
    assert rest == "Let me check.\n" and [c["function"]["name"] for c in calls] == ["lookup"]  # as streamed
    assert json.loads(calls[0]["function"]["arguments"]) == {"query": "mill"}
    two, rest = parse_calls('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
                            '<tool_call>{"name": "get_weather", "arguments": {"city": "X", "days": 1}}', names)
    assert [c["function"]["name"] for c in two] == ["lookup", "get_weather"] and rest is None  # the last unclosed
    for text in ('<tool_call>{"name": "lookup", "arguments": </tool_call>', '<tool_call>{"name": "rm", "arguments": {}}'
                 '</tool_call>', "No call here."):
        assert parse_calls(text, names) == ([], text)  # malformed, unknown, none: left as text
    xml = ("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n12\n</parameter>\n<parameter=days>\n2\n"
           "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=lookup>\n<parameter=query>\n"
           '{"a": [1, true]}\n</parameter>\n</function>\n</tool_call>')
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    calls, rest = parse_calls(xml, names, schemas)  # the Qwen3-Coder / Qwen3.5 format
    assert rest == "Sure.\n" and [json.loads(c["function"]["arguments"]) for c in calls] == \
        [{"city": "12", "days": 2}, {"query": '{"a": [1, true]}'}]  # a declared string stays text
    untyped, _ = parse_calls("<tool_call><function=lookup><parameter=n>3</parameter><parameter=s>x y", names)
    assert json.loads(untyped[0]["function"]["arguments"]) == {"n": 3, "s": "x y"}  # undeclared: JSON if it is
    assert parse_calls("<tool_call><function=rm><parameter=p>/</parameter></function></tool_call>", names)[0] == []
    block = ('Both.\n<tool_calls>\n{"name": "lookup", "arguments": {"query": "a"}}\n'
             '{"name": "get_weather", "arguments": {"city": "Q", "days": 1}}\n</tool_calls>')
    calls, rest = parse_calls(block, names)  # MiniMax-M1's block: a call a line
    assert rest == "Both.\n" and [c["function"]["name"] for c in calls] == ["lookup", "get_weather"]
    drafted = "<think>Maybe:<tool_calls>\n" + block.split("<tool_calls>\n")[1] + "</think>" + block
    calls, rest = parse_calls(drafted, names)  # a block thought about inside <think> is no call
    assert len(calls) == 2 and rest.startswith("<think>Maybe:<tool_calls>") and rest.endswith("</think>Both.\n")
    assert parse_calls("<think>" + block, names) == ([], "<think>" + block)  # still thinking
    bad = block.replace('"get_weather"', '"rm"')  # one line not a call of a listed function: no block
    assert parse_calls(bad, names) == ([], bad)
    kimi = ("Both.<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>"
            '{"query": "a"}<|tool_call_end|><|tool_call_begin|>get_weather:1<|tool_call_argument_begin|>'
            '{"city": "Q", "days": 1}<|tool_call_end|><|tool_calls_section_end|> Done.')
    calls, rest = parse_calls(kimi, names)  # Kimi's section: name and arguments apart, "functions." optional
    assert rest == "Both. Done." and [c["function"]["name"] for c in calls] == ["lookup", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Q", "days": 1}
    # the model's own ids kept: Kimi's template writes them back into the next turn's prompt
    assert [c["id"] for c in calls] == ["functions.lookup:0", "get_weather:1"]
    assert parse_calls(block, names)[0][0]["id"].startswith("call_")  # other formats carry none: fresh ids
    for broken in (kimi.replace('{"query": "a"}', '{"query": '), kimi.replace("functions.lookup", "functions.rm")):
        assert parse_calls(broken, names) == ([], broken)  # arguments not JSON, an unknown function: text
    auto = ToolCalling(False, names, None)
    message, finish = auto.message('<tool_call>{"name": "lookup", "arguments": {"query": "a"}}</tool_call>', "stop")
    assert finish == "tool_calls" and message["content"] is None and len(message["tool_calls"]) == 1
    assert auto.message("plain", "length") == ({"role": "assistant", "content": "plain"}, "length")


def test_a_call_nested_past_python_s_stack_is_text_not_a_500() -> None:
    """A block whose JSON nests deeper than Python's stack reads (a grammar can make a model write
    one; 21 s of decoding then ended in a RecursionError, a 500) is no call: it stays text."""
    names = ("lookup",)
    for text in ("<tool_call>" + "[" * 5000, "<tool_calls>\n" + '{"a": ' * 5000):
        assert parse_calls(text, names) == ([], text)
    calls, _ = parse_calls("<tool_call><function=lookup><parameter=q>" + "[" * 5000, names)
    assert json.loads(calls[0]["function"]["arguments"]) == {"q": "[" * 5000}  # an XML value: its text, as not JSON
    forced = ToolCalling(True, names, {"type": "object"})
    assert forced.message("[" * 5000, "stop") == ({"role": "assistant", "content": "[" * 5000}, "stop")


def test_auto_none_and_a_cut_forced_call_answer_as_text(client: OpenAI) -> None:
    for choice in ("auto", "none"):
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                             max_tokens=12, temperature=0)
        c = out.choices[0]
        assert (c.finish_reason == "tool_calls") == bool(c.message.tool_calls)
        assert c.message.tool_calls or isinstance(c.message.content, str)
    cut = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=3,
                                         temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content.startswith("[{")
    assert not cut.choices[0].message.tool_calls


@pytest.mark.parametrize("body, param, needle", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "no tool is named 'nope'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "uniqueItems is supported in structured output"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "share a name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "forces a call"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "pattern"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "not set through them"),
    # a strict function's schema that is no JSON (Python's json reads Infinity): the message was the field alone,
    # "tools[0].function.parameters", without the reason
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"maximum": float("inf")}}}}}]}, "tools[0].function.parameters",
     "parameters: not JSON (Out of range float"),
])
def test_what_cannot_be_served_is_a_400_and_serving_goes_on(http: httpx.Client, client: OpenAI, body, param,
                                                            needle) -> None:
    r = http.post("/v1/chat/completions", headers={"Content-Type": "application/json"},
                  content=json.dumps({"model": MODEL, "messages": ASK, "max_tokens": 4, **body}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    after = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert after.choices[0].message.content is not None


@pytest.mark.parametrize("text", [
    "Plain text that never calls <tool a tool.",
    'Checking.<tool_call>{"name": "lookup", "arguments": {"query": "mill"}}</tool_call>',
    'A <tool_c>decoy, then <tool_call>{"name": "get_weather", "arguments": {"city": "X", "days": 2}}</tool_call>'
    ' and <tool_call>{"name": "lookup", "arguments": {}}',
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',  # an unknown function: text
    '<think>Maybe <tool_call>{"name": "lookup", "arguments": {}}</tool_call>?</think>Sure. '
    '<tool_call>{"name": "lookup", "arguments": {"query": "a"}}</tool_call>',  # a call drafted in thought: text
    "Looking.\n<tool_call>\n<function=lookup>\n<parameter=query>\nmill\n</parameter>\n</function>\n</tool_call>",
    'Two at once.\n<tool_calls>\n{"name": "lookup", "arguments": {"query": "a"}}\n'
    '{"name": "get_weather", "arguments": {"city": "Q", "days": 1}}\n</tool_calls>',  # MiniMax-M1's block
    "Looking.<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>"
    '{"query": "a"}<|tool_call_end|><|tool_calls_section_end|>',  # Kimi's section
])
def test_a_streamed_auto_answer_sends_text_as_it_comes_and_its_calls_at_the_end(text: str) -> None:
    """Split at every boundary pattern: the content streamed plus the last delta say what the whole
    answer says, and text is held back only from a (possible) tag on."""
    whole, finish = ToolCalling(False, ("get_weather", "lookup"), None).message(text, "stop")
    for seed in range(20):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        s = StreamedCalls(ToolCalling(False, ("get_weather", "lookup"), None))
        sent = ""
        for p in pieces[:-1]:
            sent += s.push(p)
            tag = min((at for at in (text.find(t) for t in OPENS) if at >= 0), default=-1)
            assert text.startswith(sent) and (tag < 0 or len(sent) <= tag)
            held = s.text[len(sent):]
            assert tag >= 0 and len(sent) == tag or len(held) < max(len(t) for t in OPENS)
        sent += s.push(pieces[-1])
        delta, got_finish = s.finish("stop")
        assert got_finish == finish
        if "tool_calls" in whole:
            assert [c["function"] for c in delta["tool_calls"]] == [c["function"] for c in whole["tool_calls"]]
            assert [c["index"] for c in delta["tool_calls"]] == list(range(len(whole["tool_calls"])))
            streamed = sent + delta.get("content", "")  # the same text, to the byte (None: whitespace at most)
            assert streamed == whole["content"] if whole["content"] is not None else not streamed.strip()
        else:
            assert sent + delta["content"] == text


def test_a_streamed_auto_answer_over_http_equals_the_whole_one(client: OpenAI) -> None:
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    if whole.message.tool_calls:
        assert [c.function.name for c in calls] == [c.function.name for c in whole.message.tool_calls]
    else:
        assert text == whole.message.content and not calls


def test_a_forced_call_cut_by_a_stop_string_answers_as_text(client: OpenAI) -> None:
    forced = ToolCalling(True, ("lookup",), None)
    whole = '{"name": "lookup", "arguments": {"query": "a"}}'
    message, finish = forced.message(whole, "stop")
    assert finish == "tool_calls" and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"query": "a"}
    for cut in ('{"name": "lookup", "argu', '{"name": "other", "arguments": {}}'):
        assert forced.message(cut, "stop") == ({"role": "assistant", "content": cut}, "stop")
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=64,
                                         temperature=0, stop=['"'], parallel_tool_calls=False)  # not a call
    c = out.choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls and c.message.content.startswith("{")


def test_a_streamed_answer_s_calls_go_one_a_chunk() -> None:
    """OpenAI and vLLM stream each call in a chunk of its own, and LlamaIndex reads only a chunk's first:
    MiniMax's two-call block, streamed, is two chunks, content with the first, each with its index."""
    text = ('Two at once.\n<tool_calls>\n{"name": "lookup", "arguments": {"query": "a"}}\n'
            '{"name": "get_weather", "arguments": {"city": "Q", "days": 1}}\n</tool_calls>')
    s = StreamedCalls(ToolCalling(False, ("get_weather", "lookup"), None))
    sent = s.push(text)
    delta, _ = s.finish("stop")
    parts = one_call_each(delta)
    assert [[c["function"]["name"] for c in p["tool_calls"]] for p in parts] == [["lookup"], ["get_weather"]]
    assert [p["tool_calls"][0]["index"] for p in parts] == [0, 1]
    assert "content" not in parts[1] and parts[0].get("content") == delta.get("content")
    assert sent == "Two at once.\n" or sent + delta.get("content", "") == "Two at once.\n"
    assert one_call_each({"content": "x"}) == [{"content": "x"}]


# ---- strict functions with tool_choice auto: the calls the model opens are held to their schemas

STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
STYLE_TEMPLATES = {  # the marker each family's template writes its calls with (abridged)
    "qwen_xml": "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}",  # Qwen3-Coder / Qwen3.5
    "minimax": "<tool_calls>\\n{\"name\": <tool-name>, \"arguments\": <args-json-object>}\\n</tool_calls>",  # M1
    "kimi": "<|tool_calls_section_begin|>{% for tc in m.tool_calls %}<|tool_call_begin|>",
    "hermes": TOOLS_TEMPLATE,  # Qwen2.5 / Qwen3: <tool_call>{"name": …, "arguments": …}</tool_call>
}


def test_a_template_s_call_format_is_told_by_its_marker() -> None:
    for style, template in STYLE_TEMPLATES.items():
        assert call_style(template) == style
    assert call_style(CHATML) == "hermes"  # a template that teaches none: the format most models know


def _valid_call(call: dict) -> None:
    """A call of a listed function: get_weather's arguments its schema accepts, lookup's an object."""
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        assert set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 10
        assert isinstance(args["days"], int) and not isinstance(args["days"], bool)
    else:
        assert call["function"]["name"] == "lookup" and isinstance(args, dict)


@pytest.mark.parametrize("style", ["hermes", "qwen_xml", "minimax"])
def test_every_call_the_strict_tag_lets_through_parses_to_a_valid_call(style: str) -> None:
    """Drawn through the bundled model at temperature 1 with a call forced (the strict tag's own call
    formats, ``call_tags``, as the whole answer): each answer that is not cut short reads back — by
    the parser ``auto`` answers go through — as calls of listed functions whose arguments the strict
    function's schema accepts. And the auto tag itself: prose and calls, prose alone, and refusals."""
    llm = LLM(device="cpu")
    tools = [STRICT_WEATHER, LOOKUP]
    tags = call_tags(tools, style)
    forced = {"type": "or", "elements": tags} if style != "minimax" else strict_calls(tools, style)["format"][
        "tags"][0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    whole = 0
    for seed in range(6):
        out = llm.generate("Where does Mira live?", SamplingParams(max_tokens=120, temperature=1.0, seed=seed,
                                                                  structural_tag={"type": "structural_tag",
                                                                                  "format": forced}))[0]
        if out.outputs[0].finish_reason != "stop":
            continue  # cut by max_tokens
        calls, rest = parse_calls(out.text, ("get_weather", "lookup"), schemas)
        assert calls and rest is None, (style, out.text)
        for call in calls:
            _valid_call(call)
        whole += 1
    assert whole >= 2, style
    node = compile_tags(strict_calls(tools, style))
    good = {"hermes": 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo","days":2}}\n</tool_call>'
                      " done",
            "qwen_xml": "Sure. <tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call> done",
            "minimax": 'Sure. <tool_calls>\n{"name": "get_weather", "arguments": {"city":"Oslo","days":2}}\n'
                       '{"name": "lookup", "arguments": {"any":[1]}}\n</tool_calls> done'}[style]
    assert accepts(node, good.encode()) and accepts(node, b"No call is needed.")
    once = compile_tags(strict_calls(tools, style, parallel=False))  # one call: the answer ends with it
    call = good.removeprefix("Sure. ").removesuffix(" done")
    if style == "minimax":  # one call in the block
        call = call.replace('\n{"name": "lookup", "arguments": {"any":[1]}}', "")
    assert accepts(once, ("Sure. " + call).encode()) and not accepts(once, good.encode())
    assert not accepts(once, ("Sure. " + call + call).encode()) and accepts(node, ("Sure. " + call + call).encode())
    for bad in (good.replace("2", "2.5"), good.replace("Oslo", "Oslo in Norway"), good.replace("get_weather", "rm"),
                good.replace("2", '"two"')):
        assert not accepts(node, bad.encode()), (style, bad)  # a strict function's schema, a listed name


def test_strict_functions_hold_auto_calls_over_http(model_dir: Path, tmp_path: Path) -> None:
    """A model whose vocabulary has ``<tool_call>`` as a token of text (as Qwen's has), pushed to
    write it by ``logit_bias``: with a strict function each call it opens is a valid call, so the
    answer is calls; without, its text is no call. A strict schema that cannot be served is a 400
    naming it (the same non-strict: served)."""
    folder = build_model(tmp_path / "model", added=("<tool_call>",))
    live = serve_with_template(folder, tmp_path / "served", TOOLS_TEMPLATE, max_completion_tokens=256)
    try:
        client = openai_client(live)
        opener = LLM(str(folder), device="cpu").tokenizer.token_to_id("<tool_call>")
        # (a random model's call is long: spaces, a long number)
        kw = dict(model=MODEL, messages=ASK, max_tokens=256, temperature=0, logit_bias={str(opener): 100})
        held = client.chat.completions.create(tools=[STRICT_WEATHER, LOOKUP], **kw).choices[0]
        assert held.finish_reason == "tool_calls" and held.message.tool_calls
        for call in held.message.tool_calls:
            _valid_call(call.model_dump())
        free = client.chat.completions.create(tools=TOOLS, **kw).choices[0]
        assert not free.message.tool_calls and free.message.content.startswith("<tool_call><tool_call>")
        # another constraint given: the request's own holds the answer (strict adds none)
        jsoned = client.chat.completions.create(tools=[STRICT_WEATHER], response_format={"type": "json_object"},
                                                **kw).choices[0]
        assert not jsoned.message.tool_calls and json.loads(jsoned.message.content) == {}
        unique = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
            "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}
        http = http_client(live)
        body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "tools": [unique]}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters.properties.xs", \
            r.text
        assert "uniqueItems" in r.json()["error"]["message"]
        unique["function"]["strict"] = False
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    finally:
        live.stop()


def test_strict_functions_hold_kimi_s_special_token_calls_over_http(tmp_path: Path) -> None:
    """Kimi writes its calls between special tokens; the strict tag names them with xgrammar's
    token-level formats, so each marker is that token. Pushed by ``logit_bias`` to open a section,
    the random model's answer is a call of a strict function whose arguments its schema accepts,
    each marker one special token, the model's own Kimi id kept; without ``strict`` the same push
    writes no call. A structural tag naming a token the tokenizer lacks is a 400 naming it."""
    folder = build_model(tmp_path / "kimi_tokens", special=KIMI_TOKENS)
    live = serve_with_template(folder, tmp_path / "kimi", KIMI_TEMPLATE, max_completion_tokens=128)
    try:
        client = openai_client(live)
        tokenizer = LLM(str(folder), device="cpu").tokenizer
        marks = {t: tokenizer.token_to_id(t) for t in KIMI_TOKENS}
        kw = dict(model=MODEL, messages=ASK, max_tokens=128, temperature=0, parallel_tool_calls=False,
                  logit_bias={str(marks["<|tool_calls_section_begin|>"]): 100})
        held = client.chat.completions.create(tools=[STRICT_WEATHER, LOOKUP], logprobs=True, **kw).choices[0]
        assert held.finish_reason == "tool_calls" and len(held.message.tool_calls) == 1, held.message
        call = held.message.tool_calls[0]
        _valid_call(call.model_dump())
        assert re.fullmatch(rf"functions\.{call.function.name}:[0-9]{{1,6}}", call.id)
        drawn = [t.token for t in held.logprobs.content]
        for mark in KIMI_TOKENS:  # each marker once, as its own token
            assert drawn.count(mark) == 1, drawn
        chunks = list(client.chat.completions.create(tools=[STRICT_WEATHER, LOOKUP], stream=True, **kw))
        streamed = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
        assert [(c.id, c.function.name, c.function.arguments) for c in streamed] == \
            [(call.id, call.function.name, call.function.arguments)]  # the same call, whole, once
        assert not any(ch.choices and "<|tool_call" in (ch.choices[0].delta.content or "") for ch in chunks)
        free = client.chat.completions.create(tools=TOOLS, **kw).choices[0]
        assert not free.message.tool_calls and free.finish_reason == "length"
        http = http_client(live)
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4,
                                                    "response_format": {"type": "structural_tag", "format": {
                                                        "type": "token", "token": "<|nope|>"}}})
        assert r.status_code == 400, r.text
        assert "token '<|nope|>' is not a special or added token" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "response_format", r.text
        assert http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4}).status_code \
            == 200
    finally:
        live.stop()
    # a template that writes Kimi's calls over a tokenizer without its call tokens: strict cannot be held
    lacking = serve_with_template(build_model(tmp_path / "no_kimi_tokens", special=KIMI_TOKENS[:2]),
                                  tmp_path / "no_kimi", KIMI_TEMPLATE, max_completion_tokens=16)
    try:
        r = http_client(lacking).post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4,
                                                                    "tools": [STRICT_WEATHER]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        assert "token '<|tool_call_begin|>' is not a special or added token" in r.json()["error"]["message"]
        loose = http_client(lacking).post("/v1/chat/completions", json={"model": MODEL, "messages": ASK,
                                                                        "max_tokens": 4, "tools": TOOLS})
        assert loose.status_code == 200, loose.text  # without strict: served as before
    finally:
        lacking.stop()


def test_required_with_parallel_calls_is_a_list_of_calls(client: OpenAI) -> None:
    """OpenAI's default ``parallel_tool_calls``: ``required`` is held to a list of one call or more
    (vLLM's shape), each a call of a listed function whose arguments its schema accepts; ``auto``
    without parallel calls keeps the first. A bias towards "]" ends the random model's list after
    its first call."""
    closer = LLM(device="cpu").tokenizer.token_to_id("]")
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         max_tokens=64, temperature=0, logit_bias={str(closer): 30})
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
    for call in c.message.tool_calls:
        _checked(call)
    names = ("get_weather", "lookup")
    listed = ToolCalling(True, names, None, kimi_index=3)
    two = '[{"name": "lookup", "arguments": {"query": "a"}}, {"name": "get_weather", "arguments": {"city": "Q", ' \
          '"days": 1}}]'
    message, finish = listed.message(two, "stop")
    assert finish == "tool_calls" and [c["function"]["name"] for c in message["tool_calls"]] == list(reversed(names))
    assert [c["id"] for c in message["tool_calls"]] == ["functions.lookup:3", "functions.get_weather:4"]  # Kimi's
    for text in ("[]", '[{"name": "rm", "arguments": {}}]', "[1]"):
        assert listed.message(text, "stop") == ({"role": "assistant", "content": text}, "stop")
    block = ('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Q", "days": 1}}</tool_call>')
    assert len(ToolCalling(False, names, None).message(block, "stop")[0]["tool_calls"]) == 2
    first = ToolCalling(False, names, None, parallel=False).message(block, "stop")[0]["tool_calls"]
    assert [c["function"]["name"] for c in first] == ["lookup"]
