"""``response_format`` over HTTP through the ``openai`` client: JSON-schema and JSON-object outputs
parse and fit, whole and streamed, the same as the offline API; a schema the matcher cannot enforce
is a 400 naming the keyword, and the server goes on serving."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import BadRequestError, OpenAI

from hypic import LLM, SamplingParams
from tests.server.conftest import MODEL

ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["answer", "n"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
PROMPT = "Question: who founded the mill?\nAnswer:"


def _fits(text: str) -> dict:
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) <= {"answer", "n", "ok"} and {"answer", "n"} <= set(value)
    assert isinstance(value["answer"], str) and len(value["answer"]) <= 8
    assert isinstance(value["n"], int) and not isinstance(value["n"], bool)
    return value


def test_chat_with_a_json_schema_whole_and_streamed(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "Who founded the mill? Reply in JSON."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                           response_format=FORMAT)
    assert whole.choices[0].finish_reason == "stop"
    _fits(whole.choices[0].message.content)
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                            response_format=FORMAT, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content


def test_completions_take_it_too_and_agree_with_the_offline_api(client: OpenAI, llm: LLM) -> None:
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, temperature=0,
                                    extra_body={"response_format": FORMAT})
    want = llm.generate([PROMPT], SamplingParams(max_tokens=64, json_schema=ANSWER))[0]
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason == "stop"
    _fits(got.choices[0].text)
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, temperature=1.0, seed=5, n=3,
                                        extra_body={"response_format": {"type": "json_object"}})
    for choice in sampled.choices:
        if choice.finish_reason == "stop":  # a free object may outrun 64 tokens; a whole one is an object
            assert isinstance(json.loads(choice.text), dict)
        else:
            assert choice.text.startswith("{")


@pytest.mark.parametrize("fmt, param, needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "multipleOf": 3}}},
     "response_format.json_schema.schema", "'multipleOf' is not supported"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)"}}},
     "response_format.json_schema.schema", "look-arounds"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a": {"type": "date"}}}}},
     "response_format.json_schema.schema.properties.a", "type must be"),
    ({"type": "json_schema"}, "response_format", "json_schema"),
    ({"type": "xml"}, "response_format.type", "json_object"),
])
def test_a_schema_it_cannot_enforce_is_a_400_and_serving_goes_on(http: httpx.Client, client: OpenAI, fmt, param,
                                                                 needle) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4,
                                           "response_format": fmt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    with pytest.raises(BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format=fmt)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).choices[0].text is not None
