"""What OpenAI's API does in the corners clients reach: ``null`` as a field left out, retrieving the
model, the ``developer`` role, which field a token-budget error names, and refusals that say what is
not served. (A truncated Responses item: test_responses.py; ``stream_options`` without ``stream`` and
the tokenizer routes' ``model``: test_errors.py's cases.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.server.conftest import MODEL, LiveServer, http_client, openai_client, serve_with_template

OK_CHAT = [{"role": "user", "content": "Question: who?"}]
# Qwen3's template's branches: user, system, assistant and tool, no developer (rendered as nothing)
NO_DEVELOPER = ("{% for m in messages %}{% if m.role == 'system' or m.role == 'user' %}<|im_start|>{{ m.role }}\n"
                "{{ m.content }}<|im_end|>\n{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
                "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NULLS = {"temperature": None, "top_p": None, "n": None, "stream": None, "presence_penalty": None,
         "frequency_penalty": None}


def test_null_is_the_default(http: httpx.Client) -> None:
    """Typed clients write every unset field as null: OpenAI reads it as the field left out."""
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": OK_CHAT, "max_tokens": 2,
                                                   **NULLS, "logprobs": None, "stream_options": None})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 1 and chat.json()["choices"][0]["logprobs"] is None
    completion = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **NULLS, "echo": None})
    assert completion.status_code == 200, completion.text
    response = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "temperature": None,
                                                 "top_p": None, "stream": None})
    assert response.status_code == 200, response.text
    assert response.json()["temperature"] == 1.0 and response.json()["top_p"] == 1.0
    required = http.post("/v1/chat/completions", json={"messages": None})  # no default: still refused
    assert required.status_code == 400 and required.json()["error"]["param"] == "messages"


def test_a_model_is_retrieved_by_id(client: OpenAI, server: LiveServer) -> None:
    """``models.retrieve``: clients and proxies check a model (or the server) with it."""
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/other-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert e.value.body["type"] == "invalid_request_error" and "org/other-model" in e.value.body["message"]
    assert httpx.get(f"{server.url}/v1/models/{MODEL}").status_code == 401  # the key, as for the list


@pytest.fixture(scope="module")
def no_developer(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = serve_with_template(model_dir, tmp_path_factory.mktemp("no_developer"), NO_DEVELOPER)
    yield live
    live.stop()


def test_developer_is_system_for_a_template_without_it(no_developer: LiveServer) -> None:
    """OpenAI's newer name for the system role: a template with no developer branch must not drop it."""
    client = openai_client(no_developer)
    asked = {}
    for role in ("system", "developer"):
        chat = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
            {"role": role, "content": "You answer only in French."}, *OK_CHAT])
        response = client.responses.create(model=MODEL, max_output_tokens=2, temperature=0, input=[
            {"role": role, "content": "You answer only in French."}, *OK_CHAT])
        asked[role] = (chat.usage.prompt_tokens, response.usage.input_tokens)
    user_only = client.chat.completions.create(model=MODEL, max_tokens=2, messages=OK_CHAT).usage.prompt_tokens
    assert asked["developer"] == asked["system"] and asked["system"][0] > user_only


def test_a_refused_budget_names_the_field_sent(no_developer: LiveServer) -> None:
    """The SDK (and every o-series caller) sends max_completion_tokens: a refusal names it, not max_tokens."""
    http = http_client(no_developer)
    context = http.get("/v1/models").json()["data"][0]["max_model_len"]
    per_100 = http.post("/tokenize", json={"prompt": "word " * 100}).json()["count"]
    long = [{"role": "user", "content": "word " * (75 * context // per_100)}]  # ¾ of the context
    for field in ("max_completion_tokens", "max_tokens"):
        over = http.post("/v1/chat/completions", json={"messages": OK_CHAT, field: 10**6})
        past = http.post("/v1/chat/completions", json={"messages": long, field: context // 2})
        for r, why in ((over, "exceeds this server's limit"), (past, "exceed the model's context")):
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert r.json()["error"]["message"].startswith(f"{field}: ") and why in r.json()["error"]["message"]
    r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens", r.text


def test_a_field_not_served_is_refused_in_words(http: httpx.Client) -> None:
    """Insertion (``suffix``) and Responses' reasoning summaries: a 400 saying they are not supported,
    not pydantic's "Input should be None"; null is still the field left out."""
    for path, body, param in (("/v1/completions", {"prompt": "hi", "max_tokens": 3, "suffix": "end"}, "suffix"),
                              ("/v1/responses", {"input": "hi", "reasoning": {"summary": "auto"}}, "reasoning.summary"),
                              ("/v1/responses", {"input": "hi", "include": ["code_interpreter_call.outputs"]},
                               "include[0]")):
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["message"].startswith(f"{param}: not supported: "), r.text
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "suffix": None}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body, param in (("/v1/chat/completions", {**chat, "store": True}, "store"),
                              ("/v1/chat/completions", {**chat, "modalities": ["text", "audio"]}, "modalities"),
                              ("/v1/chat/completions", {**chat, "audio": {"voice": "alloy"}}, "audio"),
                              ("/v1/chat/completions", {**chat, "prediction": {"type": "content"}}, "prediction"),
                              ("/v1/chat/completions", {**chat, "web_search_options": {}}, "web_search_options"),
                              ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "best_of": 3}, "best_of")):
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "not supported" in r.json()["error"]["message"], r.text
    # what typed clients send as a matter of course: OpenAI's defaults, and metadata, are served
    for body in ({**chat, "store": False, "metadata": {"team": "a"}, "modalities": ["text"]},
                 {**chat, "store": None, "metadata": None, "prediction": None, "audio": None, "modalities": None,
                  "web_search_options": None}):
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    for best_of in (None, 1):
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "best_of": best_of})
        assert r.status_code == 200, r.text


def test_a_refusal_quotes_a_huge_input_cut_short_and_speaks_plainly(http: httpx.Client) -> None:
    """An error message quotes what was wrong; a megabyte model name or metadata key is cut, not sent
    back whole. Lengths are said in characters, and Python's own limits are not advice to the client."""
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": "m" * 1_000_000})
    assert r.status_code == 404 and len(r.content) < 5000 and "characters more)" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "metadata": {"k" * 1_000_000: "v"}})
    assert r.status_code == 400 and len(r.content) < 5000, r.text[:300]
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "cache_salt": "s" * 1025})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    assert "at most 1024 characters, got 1025" in r.json()["error"]["message"], r.text
    r = http.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
                  headers={"Content-Type": "application/json"})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "an integer of more than" in message and "set_int_max_str_digits" not in message
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
