"""What OpenAI's API does in the corners clients reach: ``null`` as a field left out, retrieving the
model, the ``developer`` role, which field an error names, a truncated Responses item, options that
only mean something together, the tokenizer routes' ``model``, and refusals that say what is not served."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from tests.server.conftest import MODEL, LiveServer

OK_CHAT = [{"role": "user", "content": "Question: who?"}]
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
