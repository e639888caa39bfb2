"""OpenAI's Responses API (``POST /v1/responses``) through the official client: the same answer as
the chat route for the same conversation, documents cached across orders, the typed event stream
agreeing with the whole answer, function calls out and their outputs back in, JSON output, the
token limit as ``incomplete``, kept responses continued by ``previous_response_id``, read and
deleted, and what is not served refused by name."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from hypic.server.responses import ResponseStore
from tests.server.conftest import MODEL, LiveServer, http_client, openai_client, serve
from tests.server.test_tools import TOOLS, tool_server  # noqa: F401 — its tools server, module-scoped: one here

DOCS = ["Profile of Mira. Mira lives in Quorvane and keeps bees on the roof.",
        "Profile of Tal. Tal plays the harp in Westvale every evening."]
QUESTION = "Question: Where does Mira live?\nAnswer:"
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def client(tool_server: LiveServer) -> OpenAI:  # noqa: F811
    return openai_client(tool_server)


@pytest.fixture(scope="module")
def http(tool_server: LiveServer) -> httpx.Client:  # noqa: F811
    return http_client(tool_server)


def _input(docs: list[str]) -> list[dict]:
    return [*({"role": "user", "content": d} for d in docs), {"role": "user", "content": QUESTION}]


def test_an_answer_equals_the_chat_routes_and_documents_hit_the_cache_in_a_new_order(client: OpenAI) -> None:
    r = client.responses.create(model=MODEL, instructions="You are a careful reader.", input=_input(DOCS),
                                max_output_tokens=8, temperature=0, extra_body={"cache_salt": "responses"})
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "You are a careful reader."}, *_input(DOCS)],
        max_tokens=8, temperature=0, extra_body={"cache_salt": "responses"})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    again = client.responses.create(model=MODEL, instructions="You are a careful reader.",
                                    input=_input(DOCS[::-1]), max_output_tokens=8, temperature=0,
                                    extra_body={"cache_salt": "responses"})
    assert again.usage.input_tokens_details.cached_tokens > 0  # both documents, in the other order


def test_a_stream_is_the_apis_typed_events_and_equals_the_whole_answer(client: OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input=_input(DOCS), max_output_tokens=12, temperature=0)
    events = list(client.responses.create(model=MODEL, input=_input(DOCS), max_output_tokens=12, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole.status}" and [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    done = events[-1].response
    assert done.output_text == whole.output_text and done.usage.output_tokens == whole.usage.output_tokens
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == [o.type for o in done.output]


def test_openais_routing_hints_are_accepted(client: OpenAI) -> None:
    kw = dict(prompt_cache_key="tenant-a/rag", safety_identifier="user-7", service_tier="auto")
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=1, **kw)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1, **kw)
    assert r.status in ("completed", "incomplete") and c.choices[0].finish_reason in ("stop", "length")


def test_the_token_limit_is_an_incomplete_response(client: OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Tell me everything about Quorvane.", max_output_tokens=2,
                                temperature=0)
    assert r.usage.output_tokens == 2  # the test model does not end on its own this soon
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.status) for o in r.output] == [("message", "incomplete")]  # the item was cut off too
    events = list(client.responses.create(model=MODEL, input="Tell me everything about Quorvane.",
                                          max_output_tokens=2, temperature=0, stream=True))
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]
    assert events[-1].type == "response.incomplete"
    assert [o.status for o in events[-1].response.output] == ["incomplete"]


def test_a_forced_call_goes_out_as_a_function_call_and_its_output_comes_back(client: OpenAI) -> None:
    ask = [{"role": "user", "content": "What is the weather in Quorvane for two days?"}]
    r = client.responses.create(model=MODEL, input=ask, tools=FLAT_TOOLS, tool_choice="required",
                                max_output_tokens=64, temperature=0, parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id.startswith("call_") and calls[0].name in ("get_weather", "lookup")
    args = json.loads(calls[0].arguments)
    assert set(args) == ({"city", "days"} if calls[0].name == "get_weather" else {"query"})
    named = client.responses.create(model=MODEL, input=ask, tools=FLAT_TOOLS, max_output_tokens=64, temperature=0,
                                    tool_choice={"type": "function", "name": "lookup"})
    assert [o.name for o in named.output if o.type == "function_call"] == ["lookup"]
    events = list(client.responses.create(model=MODEL, input=ask, tools=FLAT_TOOLS, tool_choice="required",
                                          max_output_tokens=64, temperature=0, stream=True, parallel_tool_calls=False))
    streamed = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(streamed) == 1 and json.loads(streamed[0].arguments) == args  # greedy: the same call
    follow = client.responses.create(
        model=MODEL, tools=FLAT_TOOLS, max_output_tokens=6, temperature=0,
        input=[*ask, *[o.model_dump(exclude_none=True) for o in r.output],
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C."}])
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > r.usage.input_tokens


def test_a_json_schema_format_gives_json_the_schema_accepts(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
              "required": ["city"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input=_input(DOCS), max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    value = json.loads(r.output_text)
    assert set(value) == {"city"} and isinstance(value["city"], str) and len(value["city"]) <= 8
    assert r.text.format.type == "json_schema"


def test_included_logprobs_are_the_chat_routes_whole_and_streamed(client: OpenAI) -> None:
    ask = dict(model=MODEL, input=_input(DOCS), max_output_tokens=8, temperature=0)
    r = client.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=3)
    chat = client.chat.completions.create(model=MODEL, messages=_input(DOCS), max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3)
    part = r.output[0].content[0]
    want = chat.choices[0].logprobs.content
    assert len(part.logprobs) == r.usage.output_tokens == 8  # every token made text (none was EOS)
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in part.logprobs] == \
        [(e.token, [t.token for t in e.top_logprobs]) for e in want]
    assert [e.logprob for e in part.logprobs] == pytest.approx([e.logprob for e in want])
    text = b"".join(bytes(e.bytes) for e in part.logprobs).decode(errors="replace")
    assert text == r.output_text  # the random model's bytes need not be UTF-8: replaced, as in the text
    for e in part.logprobs:  # greedy: each token its position's likeliest
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
    events = list(client.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=3,
                                          stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [e.token for e in streamed] == [e.token for e in part.logprobs]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in part.logprobs])
    assert [(e.token, e.logprob) for e in done.logprobs] == [(e.token, e.logprob) for e in streamed]
    plain = client.responses.create(**ask, include=["reasoning.encrypted_content"])  # accepted: nothing to add
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == r.output_text


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),  # never made
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].message.content"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "include": ["file_search_call.results"]}, "include[0]"),
    ({"input": "hi", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": "hi", "text": {"format": {"type": "json_object", "schema": {"type": "integer"}}}},
     "text.format.schema"),  # was dropped without a word: an answer not held to it
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": "hi", "max_output_tokens": 10**9}, "max_output_tokens"),  # the chat route's limit, this API's name
    ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata"),
    ({"input": "hi", "tools": FLAT_TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "text.format"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),  # refused in words: "not supported: …"
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "hi", "max_tool_calls": 0}, "max_tool_calls"),
])
def test_what_is_not_served_is_a_400_naming_the_field(http: httpx.Client, body: dict, param: str) -> None:
    r = http.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()
    if param in ("conversation", "prompt"):
        assert "not supported" in r.json()["error"]["message"]
    assert http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 1}).status_code == 200


def test_options_that_ask_nothing_hypic_lacks_are_accepted(http: httpx.Client) -> None:
    """``max_tool_calls`` bounds built-in tools' calls (hypic has none); ``stream_options``'
    ``include_obfuscation`` pads events against side channels (hypic's carry none): the Agents SDK and
    others send them."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "max_tool_calls": 2}
    assert http.post("/v1/responses", json=body).status_code == 200
    r = http.post("/v1/responses", json={**body, "stream": True, "stream_options": {"include_obfuscation": False}})
    assert r.status_code == 200 and ("event: response.completed" in r.text or "event: response.incomplete" in r.text)


def test_a_kept_response_is_continued_read_and_deleted(client: OpenAI, http: httpx.Client) -> None:
    first = client.responses.create(model=MODEL, input=_input(DOCS), max_output_tokens=6, temperature=0)
    kept = http.get(f"/v1/responses/{first.id}").json()
    assert first.store is True and kept["id"] == first.id and kept["output"][0]["id"] == first.output[0].id
    assert kept["output"][0]["content"][0]["text"] == first.output_text
    follow = client.responses.create(model=MODEL, previous_response_id=first.id, input="And where does Tal play?",
                                     max_output_tokens=6, temperature=0)
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the earlier turn's documents, from the cache
    spelled_out = client.responses.create(  # the same conversation sent whole: the same answer
        model=MODEL, max_output_tokens=6, temperature=0, store=False,
        input=[*_input(DOCS), *[o.model_dump(exclude_none=True) for o in first.output],
               {"role": "user", "content": "And where does Tal play?"}])
    assert spelled_out.output_text == follow.output_text and spelled_out.store is False
    assert http.get(f"/v1/responses/{spelled_out.id}").status_code == 404  # store: false keeps nothing
    # a kept response's own input items, as the client lists them (newest first by default), ids kept
    listed = client.responses.input_items.list(first.id)
    texts = [item.content[0].text for item in listed.data]
    assert texts == list(reversed([m["content"] for m in _input(DOCS)])) and not listed.has_more
    assert all(item.type == "message" and item.role == "user" and item.id.startswith("msg_") for item in listed.data)
    again = client.responses.input_items.list(first.id, order="asc", limit=1, after=listed.data[-1].id)
    assert [i.id for i in again.data] == [listed.data[-2].id] and again.has_more  # the page after the oldest
    assert [i.content[0].text for i in client.responses.input_items.list(follow.id).data] == \
        ["And where does Tal play?"]  # a continuation's own items only
    for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=msg_nope", "after")):
        r = http.get(f"/v1/responses/{first.id}/input_items?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert http.get("/v1/responses/resp_nope/input_items").status_code == 404
    assert http.delete(f"/v1/responses/{first.id}").json() == {"id": first.id, "object": "response.deleted",
                                                               "deleted": True}
    gone = http.get(f"/v1/responses/{first.id}")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "previous_response_id": first.id})
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"


def test_the_store_keeps_the_latest() -> None:
    store = ResponseStore(2)
    for k in range(3):
        store.keep({"id": f"r{k}", "output": []}, [])
    assert store.get("r0") is None and store.get("r1") is not None
    store.conversation("r1")  # a continuation uses it: the most recent now
    store.keep({"id": "r3", "output": []}, [])
    assert store.get("r2") is None and store.get("r1") is not None


def test_a_server_that_keeps_no_responses_says_so(llm) -> None:
    live = serve(llm, max_stored_responses=0)
    try:
        http = http_client(live)
        r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 1})
        assert r.status_code == 200 and r.json()["store"] is False
        assert http.get(f"/v1/responses/{r.json()['id']}").status_code == 404
        refused = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "store": True})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "store"
    finally:
        live.stop()


def test_what_the_prompt_does_not_read_is_not_kept(http: httpx.Client, tool_server) -> None:  # noqa: F811
    big = "x" * (1 << 20)  # reasoning, ids, annotations: free of the prompt's limit, they would fill the store
    r = http.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 1, "input": [
        {"type": "reasoning", "encrypted_content": big},
        {"role": "user", "id": big, "content": [{"type": "input_text", "text": "hi", "annotations": [big]}]}]})
    assert r.status_code == 200, r.text
    _, items, own = tool_server.app.state.hypic.responses._kept[r.json()["id"]]
    assert len(json.dumps([i.model_dump() for i in items])) < 1000 and len(json.dumps(own)) < 1000
    follow = http.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 1, "input": "and?",
                                              "previous_response_id": r.json()["id"]})
    assert follow.status_code == 200 and follow.json()["usage"]["input_tokens"] > r.json()["usage"]["input_tokens"]
