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
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "contains": {}}}},
     "response_format.json_schema.schema", "'contains' is not supported"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)"}}},
     "response_format.json_schema.schema", "look-arounds"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a": {"type": "date"}}}}},
     "response_format.json_schema.schema.properties.a", "type must be"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/d0", "$defs": {
        **{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(2000)}, "d2000": {}}}}},  # past Python's stack
     "response_format.json_schema.schema", "nested too deep"),
    ({"type": "json_schema"}, "response_format.json_schema", "json_schema"),  # the field its check names
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


def test_structured_and_free_requests_decode_together(client: OpenAI) -> None:
    """Concurrent requests, constrained by different schemas or not, batched in the same decode
    steps: each constrained answer fits its own schema."""
    from concurrent.futures import ThreadPoolExecutor

    schemas = [ANSWER, {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
                        "maxItems": 3},
               {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]}, None]

    def ask(k: int) -> tuple[object, str, str]:
        schema = schemas[k % len(schemas)]
        extra = {} if schema is None else {"response_format": {"type": "json_schema",
                                                               "json_schema": {"name": f"s{k}", "schema": schema}}}
        out = client.completions.create(model=MODEL, prompt=f"{PROMPT} {k}", max_tokens=64, temperature=0.7, seed=k,
                                        extra_body=extra)
        return schema, out.choices[0].text, out.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(12)))
    for schema, text, finish in results:
        if schema is None or finish != "stop":
            continue
        value = json.loads(text)
        if schema is ANSWER:
            _fits(text)
        elif schema.get("type") == "array":
            assert isinstance(value, list) and 2 <= len(value) <= 3 and all(isinstance(v, int) and 0 <= v <= 9
                                                                             for v in value)
        else:
            assert set(value) == {"d"} and len(value["d"]) == 10 and value["d"][4] == "-"
    assert sum(finish == "stop" for schema, _, finish in results if schema is not None) >= 6
