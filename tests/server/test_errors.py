"""Bad input: every malformed request is a 4xx in OpenAI's error shape naming the field, and the
server keeps serving; a property test throws arbitrary bodies at it and never sees a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypic import LLM
from tests.server.conftest import API_KEY, MODEL, LiveServer, serve

AUTH = {"Authorization": f"Bearer {API_KEY}"}
OK_CHAT = [{"role": "user", "content": "Question: who?"}]
LONG = "word " * 2000  # over the server's 1024-token prompt limit

DEEP_SCHEMA: object = True
for _ in range(600):  # a schema compiled recursively: it ended in a RecursionError, a 500
    DEEP_SCHEMA = {"type": "array", "items": DEEP_SCHEMA}
CASES = [  # (path, body: dict or raw bytes, status, param)
    ("/v1/completions", b"{bad", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"\xff\xfe\x00", 400, None),
    ("/v1/completions", b"[]", 400, None),
    ("/v1/completions", b'"a prompt"', 400, None),
    ("/v1/completions", b"[" * 100_000, 400, None),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),  # Python reads NaN
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
     b'"json_schema", "json_schema": {"name": "n", "schema": {"enum": [NaN]}}}}', 400,
     "response_format.json_schema.schema"),  # once generated as the text NaN, which is no JSON
    ("/v1/chat/completions", {"messages": OK_CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}}, 400,
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": DEEP_SCHEMA}}}, 400, "response_format.json_schema.schema"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": "[" * 5000}}, 400,
     "structured_outputs.json"),  # the schema's own JSON text, read past Python's stack: was a 500
    ("/v1/chat/completions", {"messages": OK_CHAT, "structured_outputs": {"json": "[" * 5000 + "]" * 5000}}, 400,
     "structured_outputs.json"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, -3]}, 400, "prompt[2]"),
    ("/v1/completions", {"prompt": [1, "b"]}, 400, "prompt[1]"),
    ("/v1/completions", {"prompt": ["a"] * 33}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt[1]"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 10**7]]}, 400, "prompt[1]"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a<<PIC_SEP>>"}, 400, "prompt"),
    ("/v1/completions", {"prompt": "<<PIC_SEP>>".join(["doc"] * 17)}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "segments": ["b"]}, 400, "prompt"),
    ("/v1/completions", {"segments": []}, 400, "segments"),
    ("/v1/completions", {"segments": ["a", ""]}, 400, "segments[1]"),
    ("/v1/completions", {"segments": ["a", 3]}, 400, "segments[1]"),
    ("/v1/completions", {"segments": ["doc"] * 17}, 400, "segments"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4o"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 65}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 9}, 400, "n"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop[0]"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a"] * 33}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "stream": False, "stream_options": {}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "mode": "magic"}, 400, "mode"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": 5}, 400, "cache_salt"),
    ("/v1/completions", {"prompt": "hi", "max_token": 5}, 400, "max_token"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1, "echo": True}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"-5": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),  # past int()'s limit
    ("/v1/chat/completions", {"messages": OK_CHAT, "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "logit_bias": {"5": "big"}}, 400, "logit_bias.5"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [99999999]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids[0]"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "ignore_eos": "no"}, 400, "ignore_eos"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": None, "tool_call_id": "c"}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     400, "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": OK_CHAT * 17}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "max_completion_tokens": 100}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "max_tokens": 5, "max_completion_tokens": 100}, 400,
     "max_completion_tokens"),  # the budget comes from max_completion_tokens when both are sent
    ("/v1/chat/completions", {"messages": OK_CHAT, "max_tokens": 100}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "tools": []}, 400, "tools"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "service_tier": "flex"}, 400, "service_tier"),
    ("/v1/responses", {"input": "hi", "service_tier": "priority"}, 400, "service_tier"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "model": "other"}, 404, "model"),
    ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),  # another tokenizer's ids: refused
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model"),
    ("/v1/segments", {"segments": []}, 400, "segments"),
    ("/v1/segments", {"segments": [""]}, 400, "segments[0]"),
    ("/v1/segments", {"segments": ["doc"] * 17}, 400, "segments"),
    ("/v1/segments", {"segments": [LONG]}, 400, "segments[0]"),
    ("/v1/segments", {"documents": ["x"]}, 400, "documents"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "add_generation_prompt": "no"}, 400, "add_generation_prompt"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [99999999]}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [5], "response_format": {"type": "json_object"}}, 400,
     "allowed_token_ids"),
    ("/v1/segments", {}, 400, "segments"),
    ("/v1/segments", {"segments": ["x"], "messages": OK_CHAT}, 400, "segments"),  # one or the other
    ("/v1/segments", {"segments": ["x"], "chat_template_kwargs": {}}, 400, "chat_template_kwargs"),
    ("/v1/segments", {"messages": OK_CHAT, "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs"),
    ("/v1/segments", {"messages": []}, 400, "messages"),
    ("/v1/segments", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/v1/segments", {"messages": OK_CHAT * 17}, 400, "messages"),
    ("/v1/segments", {"messages": [*OK_CHAT, {"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/segments/evict", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
]


def _error_shape(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize("path, body, status, param", CASES, ids=range(len(CASES)))
def test_bad_input_is_a_4xx_naming_the_field(server: LiveServer, path: str, body: dict | bytes, status: int,
                                             param: str | None) -> None:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}{path}", headers=AUTH, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = _error_shape(r)
    assert err["param"] == param, err
    if param is not None:
        assert param.split(".")[0].split("[")[0] in err["message"], err


def test_a_message_says_the_real_problem(server: LiveServer) -> None:
    """A field with several shapes is reported in the shape it was sent in: too many stop strings is
    their count, not "should be a valid string" (the string shape's complaint)."""
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": OK_CHAT})):
        r = httpx.post(f"{server.url}{path}", headers=AUTH, timeout=60, json={**body, "stop": ["a"] * 33})
        assert r.status_code == 400 and _error_shape(r)["message"] == "stop: at most 32 stop strings, got 33"
        r = httpx.post(f"{server.url}{path}", headers=AUTH, timeout=60, json={**body, "stop": 5})
        assert r.status_code == 400 and _error_shape(r)["message"] == "stop: expected a string or a list of strings"
        # NaN (Python's json reads it) is not a number out of range; an empty salt would share entries
        for field in ("temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"):
            r = httpx.post(f"{server.url}{path}", headers={**AUTH, "Content-Type": "application/json"}, timeout=60,
                           content=json.dumps(body)[:-1] + f', "{field}": NaN}}')
            assert r.status_code == 400 and _error_shape(r)["message"] == f"{field}: Input should be a finite number"
        r = httpx.post(f"{server.url}{path}", headers=AUTH, timeout=60, json={**body, "cache_salt": ""})
        assert r.status_code == 400 and _error_shape(r)["param"] == "cache_salt"
        assert _error_shape(r)["message"] == "cache_salt: empty (leave it out for no salt)", r.text  # as the library
    # echo's max_tokens 0 is checked as 1 for sampling: a min_tokens over it was said to exceed "max_tokens = 1"
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "hi", "echo": True, "max_tokens": 0, "min_tokens": 2})
    assert r.status_code == 400, r.text
    assert _error_shape(r)["message"] == "min_tokens: expected an integer in [0, max_tokens = 0], got 2"
    # a list where a string or a list is allowed: the list's complaint, not the string's
    r = httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=60, json={"input": []})
    assert r.status_code == 400 and "at least 1 item" in _error_shape(r)["message"], r.text


def test_routes_methods_auth_and_still_serving(server: LiveServer) -> None:
    assert httpx.head(f"{server.url}/health").status_code == 200  # uptime checks probe with HEAD
    r = httpx.get(f"{server.url}/v1/nowhere", headers=AUTH)
    assert r.status_code == 404 and _error_shape(r)["message"] == "GET /v1/nowhere: no such route here"
    r = httpx.get(f"{server.url}/v1/completions", headers=AUTH)
    assert r.status_code == 405 and "GET /v1/completions: the route takes other methods" in _error_shape(r)["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 401 and _error_shape(r)["code"] == "invalid_api_key"
    ok = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


@pytest.fixture(scope="module")
def fuzz_server(llm: LLM) -> Iterator[LiveServer]:
    live = serve(llm, max_segments=8, max_prompt_tokens=256, max_completion_tokens=4, max_concurrent=2)
    yield live
    live.stop()


def _json_values() -> st.SearchStrategy:
    scalars = st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats() | st.text(max_size=30)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10),
                                                                                           inner, max_size=4),
                        max_leaves=10)


_any = _json_values()
_words = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
_VALID = {  # values the server accepts (within the fuzz server's limits), per field
    "model": st.just(MODEL), "max_tokens": st.integers(1, 4), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": _words | st.lists(_words, max_size=3),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "cache_salt": st.text(max_size=10), "mode": st.sampled_from(["hypic", "full", "prefix", "naive", "transition"]),
}
_segments = st.lists(_words, min_size=1, max_size=5)
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
                                  "content": _words | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                      "text": _words}),
                                                               min_size=1, max_size=3)})
_call_id = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
_item = st.one_of(  # a Responses API input item
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                           "content": _words | st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text"]), "text": _words}),
                               min_size=1, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": _call_id,
                           "name": st.sampled_from(["lookup", "get_weather"]),
                           "arguments": st.sampled_from(["{}", '{"q": 1}', "not json"])}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": _call_id, "output": _words}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.just([])}))
_RESPONSES = {"model": _VALID["model"], "max_output_tokens": st.integers(1, 4), "temperature": _VALID["temperature"],
              "top_p": _VALID["top_p"], "seed": _VALID["seed"], "stream": _VALID["stream"],
              "cache_salt": _VALID["cache_salt"], "mode": _VALID["mode"], "instructions": _words,
              "store": st.booleans(),
              "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}]),
              "tools": st.just([{"type": "function", "name": "lookup", "parameters": {"type": "object"}}])}
_BODIES = {  # (required, optional) fields of a valid body
    "/v1/completions": ({"prompt": _segments.map("<<PIC_SEP>>".join)},
                        {**_VALID, "logprobs": st.integers(0, 5)}),
    "/v1/chat/completions": ({"messages": st.lists(_message, min_size=1, max_size=5)},
                             {**_VALID, "logprobs": st.just(True), "top_logprobs": st.integers(0, 5)}),
    "/v1/segments": ({"segments": _segments}, {"cache_salt": _VALID["cache_salt"]}),
    "/v1/responses": ({"input": _words | st.lists(_item, min_size=1, max_size=4)}, _RESPONSES),
}
_WEIRD = st.sampled_from(["", "<<PIC_SEP>>", "a<<PIC_SEP>>", "\ud800", "<|im_end|>", "\x00", "é" * 300])


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid body, then (most of the time) a few fields replaced by anything at all; or junk."""
    path = draw(st.sampled_from(sorted(_BODIES)))
    kind = draw(st.sampled_from(["valid", "mutated", "mutated", "json", "bytes"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=64))
    if kind == "json":
        return path, json.dumps(draw(_any)).encode()
    required, optional = _BODIES[path]
    body = draw(st.fixed_dictionaries(required, optional=optional))
    if kind == "mutated":
        for key in draw(st.lists(st.sampled_from([*required, *optional, "extra"]), min_size=1, max_size=3)):
            body[key] = draw(_any | _WEIRD | st.lists(_WEIRD, max_size=3))
    return path, json.dumps(body).encode()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(req=requests())
def test_fuzz_never_a_5xx(fuzz_server: LiveServer, req: tuple[str, bytes]) -> None:
    path, body = req
    r = httpx.post(f"{fuzz_server.url}{path}", content=body, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        _error_shape(r)
    elif path == "/v1/responses" and r.headers["content-type"].startswith("text/event-stream"):
        last = r.text.strip().split("\n\n")[-1]
        assert last.startswith(("event: response.completed", "event: response.incomplete")), r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text, r.text
    else:
        assert "choices" in r.json() or "data" in r.json() or r.json().get("object") == "response"


def test_a_client_hanging_up_mid_upload_is_cancelled_not_an_internal_error(server: LiveServer) -> None:
    """Headers promising 1 000 bytes, 100 sent, the socket closed: counted as a cancelled request,
    never as an internal error (which logged two tracebacks and would page whoever alerts on it)."""
    import socket
    import time

    from tests.server.test_lifecycle import metric

    before = {k: metric(server.url, f'hypic_errors_total{{kind="{k}"}}') for k in ("cancelled", "internal")}
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode() + b'{"prompt": "' * 8)
            time.sleep(0.2)
    deadline = time.monotonic() + 20
    while metric(server.url, 'hypic_errors_total{kind="cancelled"}') < before["cancelled"] + 3:
        assert time.monotonic() < deadline, "the hang-ups were not counted as cancelled"
        time.sleep(0.1)
    assert metric(server.url, 'hypic_errors_total{kind="internal"}') == before["internal"]
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={"prompt": "Question: who?", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_prompts_are_tokenized_and_schemas_compiled_off_the_event_loop(server: LiveServer, monkeypatch) -> None:
    """Tokenizing a long prompt took seconds and compiling a schema can take a while: both run in a
    worker thread, so the event loop keeps answering /health and writing other streams meanwhile."""
    import asyncio

    from hypic.server import prompts

    on_loop: list[str] = []

    def watched(name: str):
        real = getattr(prompts, name)

        def call(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                on_loop.append(name)
            except RuntimeError:  # no loop in this thread: a worker's
                pass
            return real(*args, **kwargs)

        monkeypatch.setattr(prompts, name, call)

    for name in ("completion_segments", "chat_segments", "sampling"):
        watched(name)
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string", "maxLength": 4}}}
    for path, body in (("/v1/completions", {"prompt": "Question: who?", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": OK_CHAT, "max_tokens": 2, "response_format": schema})):
        r = httpx.post(f"{server.url}{path}", headers=AUTH, json=body, timeout=60)
        assert r.status_code == 200, r.text
    assert on_loop == []


def test_long_answers_and_token_lists_are_written_off_the_event_loop(server: LiveServer, monkeypatch) -> None:
    """Writing /tokenize's ids (1.5 s per million on this CPU: an 8 MiB prompt held /health 8 s) and
    a whole answer's JSON run on a worker thread, as tokenizing does."""
    import asyncio

    from starlette.responses import JSONResponse

    on_loop: list[int] = []
    real = JSONResponse.render

    def render(self, content):
        try:
            asyncio.get_running_loop()
            on_loop.append(len(str(content)))
        except RuntimeError:  # a worker thread's
            pass
        return real(self, content)

    monkeypatch.setattr(JSONResponse, "render", render)
    import fastapi.routing

    serialize = fastapi.routing.serialize_response

    async def serialized(**kwargs):  # FastAPI's own writing of a returned dict: on the loop
        on_loop.append(len(str(kwargs.get("response_content"))))
        return await serialize(**kwargs)

    monkeypatch.setattr(fastapi.routing, "serialize_response", serialized)
    for path, body in (("/tokenize", {"prompt": "Question: who? " * 200}),
                       ("/v1/completions", {"prompt": "Question: who?", "max_tokens": 3, "logprobs": 2}),
                       ("/v1/chat/completions", {"messages": OK_CHAT, "max_tokens": 2})):
        r = httpx.post(f"{server.url}{path}", headers=AUTH, json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert on_loop == [], path


def test_a_task_ended_by_an_error_after_its_request_left_is_not_logged_as_never_retrieved() -> None:
    """``respond`` cancels its consumer when the client leaves; one cancelled with an event at hand
    ends on that event's error instead, and asyncio logged it "never retrieved" once collected."""
    import asyncio
    import gc

    from hypic.server.generation import _retrieved

    logged = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: logged.append(context["message"]))

        async def fails() -> None:
            raise RuntimeError("the request was cancelled")

        for retrieve in (False, True):
            task = asyncio.ensure_future(fails())
            if retrieve:
                task.add_done_callback(_retrieved)
            await asyncio.sleep(0.01)
            del task
            gc.collect()

    asyncio.run(main())
    assert logged == ["Task exception was never retrieved"]  # the first (unread) only
