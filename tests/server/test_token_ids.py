"""vLLM's ``return_token_ids`` (the prompt's and the answer's token ids beside the text: what an RL
rollout over the OpenAI API trains on) and ``return_tokens_as_token_ids`` (log-probabilities name
each token ``token_id:N``), on the bundled model over HTTP: the ids are the offline engine's for the
same prompt, a stream's chunks join to the whole answer's, and the prompt's ids come once."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from hypic import LLM, SamplingParams
from tests.server.conftest import http_client, serve

PROMPT = "Question: where was Ann born, and when?\nAnswer:"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")


@pytest.fixture(scope="module")
def http(llm: LLM) -> Iterator[httpx.Client]:
    live = serve(llm)
    yield http_client(live)
    live.stop()


def _chunks(http: httpx.Client, route: str, body: dict) -> list[dict]:
    text = http.post(route, json={**body, "stream": True}).text
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_a_completion_returns_the_prompt_and_answer_ids_the_engine_computes(http: httpx.Client, llm: LLM) -> None:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "mode": "full", "return_token_ids": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    offline = llm.generate([PROMPT], SamplingParams(max_tokens=12), mode="full")[0]
    assert choice["prompt_token_ids"] == offline.prompt_token_ids
    assert choice["token_ids"] == offline.token_ids and choice["token_ids"]
    assert choice["text"] == offline.text
    chunks = _chunks(http, "/v1/completions", body)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["prompt_token_ids"] == offline.prompt_token_ids  # once, with the first chunk
    assert all("prompt_token_ids" not in c for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == offline.token_ids  # every token, text or not
    plain = http.post("/v1/completions", json={**body, "return_token_ids": None}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain  # only when asked


def test_an_echoed_prompt_keeps_its_ids_apart_from_the_answer(http: httpx.Client, llm: LLM) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "return_token_ids": True}
    ids = llm.tokenizer.encode(PROMPT).ids
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["prompt_token_ids"] == ids and 1 <= len(whole["token_ids"]) <= 3
    only = http.post("/v1/completions", json={**body, "max_tokens": 0}).json()["choices"][0]  # nothing queued
    assert only["prompt_token_ids"] == ids and only["token_ids"] == []
    first = [c["choices"][0] for c in _chunks(http, "/v1/completions", body) if c["choices"]]
    assert first[0]["text"] == PROMPT and first[0]["prompt_token_ids"] == ids and first[0]["token_ids"] == []
    assert [t for c in first for t in c["token_ids"]] == whole["token_ids"]


def test_a_chat_answer_returns_its_ids_and_the_rendered_prompts(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Where was Ann born?"}], "max_tokens": 10, "temperature": 0,
            "return_token_ids": True}
    answer = http.post("/v1/chat/completions", json=body).json()
    prompt_ids, ids = answer["prompt_token_ids"], answer["choices"][0]["token_ids"]
    assert len(prompt_ids) == answer["usage"]["prompt_tokens"] and len(ids) == answer["usage"]["completion_tokens"]
    rendered = http.post("/detokenize", json={"tokens": prompt_ids}).json()["prompt"]
    assert "Where was Ann born?" in rendered  # the conversation as the template renders it
    alone = http.post("/v1/completions", json={"prompt": prompt_ids, "max_tokens": 10, "temperature": 0,
                                               "return_token_ids": True}).json()["choices"][0]
    assert alone["prompt_token_ids"] == prompt_ids and alone["token_ids"] == ids  # the same prompt, the same answer
    decoded = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert decoded.startswith(answer["choices"][0]["message"]["content"])  # (an end token after it, if any)
    chunks = _chunks(http, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == ids


def test_tokens_named_by_id_in_every_logprobs_shape(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 3, "return_token_ids": True,
            "return_tokens_as_token_ids": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(len(top) == 3 and all(k.startswith("token_id:") for k in top) for top in lp["top_logprobs"])
    assert all(lp["top_logprobs"][i][name] == lp["token_logprobs"][i] for i, name in enumerate(lp["tokens"])
               if name in lp["top_logprobs"][i])
    echoed = http.post("/v1/completions", json={**body, "echo": True, "max_tokens": 0, "logprobs": 0}).json()
    echo = echoed["choices"][0]
    assert echo["logprobs"]["tokens"] == [f"token_id:{t}" for t in echo["prompt_token_ids"]]
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                                   "temperature": 0, "logprobs": True, "top_logprobs": 2,
                                                   "return_token_ids": True, "return_tokens_as_token_ids": True}).json()
    content, ids = chat["choices"][0]["logprobs"]["content"], chat["choices"][0]["token_ids"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)  # the name's bytes, as vLLM's
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])
    named = http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()["choices"][0]
    assert not any(t.startswith("token_id:") for t in named["logprobs"]["tokens"])  # text again when not asked


CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Where was Ann born?"}]


def test_a_chat_tokenized_is_the_prompt_the_chat_route_reads(http: httpx.Client) -> None:
    """``/tokenize`` with ``messages`` (vLLM's chat form) renders the conversation as the chat route does:
    its ids are that route's ``prompt_token_ids``, with or without the generation prompt, and continuing
    an assistant's last message."""
    answer = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1,
                                                     "return_token_ids": True}).json()
    got = http.post("/tokenize", json={"messages": CHAT}).json()
    assert got["tokens"] == answer["prompt_token_ids"] and got["count"] == len(got["tokens"])
    assert got["max_model_len"] > 0
    bare = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert len(bare) < len(got["tokens"]) and got["tokens"][:len(bare)] == bare  # the answer's opening after it
    started = [*CHAT, {"role": "assistant", "content": "She was born in"}]
    body = {"messages": started, "add_generation_prompt": False, "continue_final_message": True}
    cont = http.post("/v1/chat/completions", json={**body, "max_tokens": 1, "return_token_ids": True}).json()
    assert http.post("/tokenize", json=body).json()["tokens"] == cont["prompt_token_ids"]
    text = http.post("/detokenize", json={"tokens": cont["prompt_token_ids"]}).json()["prompt"]
    assert text.endswith("She was born in")  # left open, to be continued


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "messages": CHAT}, "prompt"),
    ({}, "prompt"),
    ({"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
    ({"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt"),
    ({"prompt": "x", "chat_template_kwargs": {"a": 1}}, "chat_template_kwargs"),
    ({"messages": []}, "messages"),
    ({"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
])
def test_a_tokenize_request_of_neither_or_both_forms_is_refused_by_name(http: httpx.Client, body: dict,
                                                                       param: str) -> None:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert http.post("/tokenize", json={"prompt": "x"}).status_code == 200  # and the server goes on


SEGMENTED = "Ann was born in Westerholm in 1931.<<PIC_SEP>>Ben was born in Lorn.<<PIC_SEP>>" + PROMPT


@pytest.mark.parametrize("keep", [1, 5, 12, 30, 200, -1])
def test_a_prompt_cut_to_its_last_tokens_reads_as_those_tokens_sent(http: httpx.Client, keep: int) -> None:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens are read — across segments (those
    before the cut left out, the one it falls in keeping its tail) — and answered as that tail sent
    as a prompt of its own; -1 and a k past the prompt's length keep it whole."""
    body = {"max_tokens": 6, "temperature": 0, "mode": "full", "return_token_ids": True}
    whole = http.post("/v1/completions", json={**body, "prompt": SEGMENTED}).json()["choices"][0]["prompt_token_ids"]
    cut = http.post("/v1/completions", json={**body, "prompt": SEGMENTED, "truncate_prompt_tokens": keep}).json()
    want = whole if keep == -1 else whole[-keep:]
    assert cut["choices"][0]["prompt_token_ids"] == want and cut["usage"]["prompt_tokens"] == len(want)
    alone = http.post("/v1/completions", json={**body, "prompt": want}).json()["choices"][0]
    assert cut["choices"][0]["token_ids"] == alone["token_ids"]
    chat = {"messages": CHAT, "max_tokens": 1, "return_token_ids": True}
    full = http.post("/v1/chat/completions", json=chat).json()["prompt_token_ids"]
    short = http.post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": keep}).json()
    assert short["prompt_token_ids"] == (full if keep == -1 else full[-keep:])


@pytest.mark.parametrize("extra", [{"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": -2},
                                   {"truncate_prompt_tokens": 10**9}, {"truncate_prompt_tokens": 4, "echo": True}])
def test_a_cut_the_model_cannot_read_is_refused_by_name(http: httpx.Client, extra: dict) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_a_prompt_longer_than_the_context_is_read_cut_when_asked() -> None:
    """The point of the cut: a prompt past the context is refused whole, and read as its last tokens
    with ``truncate_prompt_tokens`` (-1: the longest prompt the context reads, one token's room left);
    /tokenize still counts it."""
    short = LLM(device="cpu", max_model_len=256)  # a context a CPU reads whole in a moment
    live = serve(short)
    http = http_client(live)
    longest = short.max_positions - 1
    ids = [(7 * i) % 1000 + 20 for i in range(longest + 40)]
    body = {"prompt": ids, "max_tokens": 1, "return_token_ids": True}
    assert http.post("/v1/completions", json=body).status_code == 400
    for keep, want in ((-1, ids[-longest:]), (100, ids[-100:])):
        got = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": keep}).json()
        assert got["choices"][0]["prompt_token_ids"] == want and got["usage"]["prompt_tokens"] == len(want)
    r = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": longest + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    # /tokenize counts a chat however long (as vLLM's, and as its text form does): to see if it fits
    chat = [{"role": "user", "content": "Ann was born in Westerholm. " * 60}]
    assert http.post("/tokenize", json={"messages": chat}).json()["count"] > short.max_positions
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(301)]
    assert http.post("/tokenize", json={"messages": many}).json()["count"] > 301  # past --max-segments (256)
    assert http.post("/v1/chat/completions", json={"messages": chat, "max_tokens": 1}).status_code == 400
    live.stop()
