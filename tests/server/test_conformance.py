"""What OpenAI's API does in the corners clients reach: ``null`` as a field left out, retrieving the
model, the ``developer`` role, which field an error names, a truncated Responses item, options that
only mean something together, the tokenizer routes' ``model``, and refusals that say what is not served."""

from __future__ import annotations

import httpx

from tests.server.conftest import MODEL

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
