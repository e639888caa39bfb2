"""Log-probabilities spelled from the tokens' own bytes, on the bundled model, whose byte-level BPE
splits "é" into two tokens (129: byte 0xC3, 104: byte 0xA9): chat's ``bytes`` rebuild the character,
completions' ``text_offset`` indexes the text returned (an echoed prompt as sent included), and a
``top_logprobs`` dict keeps each token under a key of its own — whole and streamed alike."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from hypic import LLM
from hypic.server.logprobs import TokenTexts
from tests.server.conftest import http_client, serve

# 0xC3 first, then the penalties make 0xA9 and 0xC3 take turns: "éé…"
E_ACUTE = {"logit_bias": {"129": 100, "104": 99}, "frequency_penalty": 2.0, "presence_penalty": 2.0,
           "temperature": 0}
C3, A9 = "bytes:\\xc3", "bytes:\\xa9"  # OpenAI's name for a token that is not UTF-8 by itself


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")  # a CPU test wherever it runs (on a GPU LLM() is bf16)


@pytest.fixture(scope="module")
def http(llm: LLM) -> Iterator[httpx.Client]:
    live = serve(llm)
    yield http_client(live)
    live.stop()


def _streamed_offsets(http: httpx.Client, body: dict) -> list[int]:
    chunks = [json.loads(line[6:]) for line in http.post("/v1/completions", json={**body, "stream": True}).text
              .splitlines() if line.startswith("data: {")]
    return [o for c in chunks for o in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])]


def test_chat_bytes_are_the_tokens_own(http: httpx.Client) -> None:
    choice = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Say café"}],
                                                     "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
                                                     **E_ACUTE}).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["message"]["content"] == "éé"
    assert [(e["token"], e["bytes"]) for e in content] == [(C3, [0xC3]), (A9, [0xA9])] * 2
    assert bytes(b for e in content for b in e["bytes"]).decode() == "éé"
    assert all({t["token"] for t in e["top_logprobs"]} == {C3, A9} for e in content)


def test_completion_offsets_index_the_text_and_top_keys_are_distinct(http: httpx.Client) -> None:
    body = {"prompt": "Say café", "max_tokens": 5, "logprobs": 5, **E_ACUTE}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "éé\ufffd"  # the fifth token, a character's first byte, ends the text alone
    assert lp["tokens"] == [C3, A9, C3, A9, C3]
    assert lp["text_offset"] == [0, 0, 1, 1, 2]  # a character's two tokens start where it does
    assert all(len(top) == 5 and {C3, A9} <= top.keys() for top in lp["top_logprobs"])  # none share a key
    assert _streamed_offsets(http, body) == lp["text_offset"]  # a stream's chunks joined: the same text


def test_echoed_prompt_offsets_index_the_prompt_as_sent(http: httpx.Client) -> None:
    prompt = "Mira drinks café.<<PIC_SEP>>Where?"
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 0, "echo": True}
    answer = http.post("/v1/completions", json=body).json()
    text, lp = answer["choices"][0]["text"], answer["choices"][0]["logprobs"]
    n = answer["usage"]["prompt_tokens"]
    assert text.startswith(prompt)
    # each segment's first token has the space the tokenizer adds, which the prompt as sent has not
    assert list(zip(lp["tokens"][:n], lp["text_offset"][:n], strict=True)) == [
        (" M", 0), ("i", 1), ("ra", 2), (" d", 4), ("rin", 6), ("ks", 9), (" c", 11), ("af", 13), (C3, 15),
        (A9, 15), (".", 16), (" Where", 28), ("?", 33)]
    generated = list(zip(lp["tokens"][n:], lp["text_offset"][n:], strict=True))
    assert generated and all(text.startswith(t, o) and o >= len(prompt) for t, o in generated)
    assert _streamed_offsets(http, body) == lp["text_offset"]


def test_token_id_prompts_are_placed_in_their_decoding(http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": "Mira drinks café.", "add_special_tokens": False}).json()["tokens"]
    choice = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "logprobs": 0,
                                                "echo": True}).json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text == " Mira drinks café." and lp["tokens"].count(C3) == 1
    assert all(text[o] == "é" if t in (C3, A9) else text.startswith(t, o)
               for t, o in zip(lp["tokens"], lp["text_offset"], strict=True))


def test_tokens_with_one_name_keep_keys_of_their_own(llm: LLM) -> None:
    texts = TokenTexts(llm.tokenizer)  # ids past the tokenizer's 1 860 (the model has 1 920) decode to ""
    assert texts.name(1900) == texts.name(1901) == ""
    assert texts.keyed([(1900, -1.0), (1901, -2.0), (129, -3.0)]) == {"": -1.0, "token_id:1901": -2.0, C3: -3.0}


def test_completion_top_logprobs_hold_the_sampled_token(http: httpx.Client) -> None:
    """OpenAI's completions (and vLLM's) "always return the logprob of the sampled token, so there may
    be up to logprobs+1 elements": sampled at a high temperature, some tokens are not among the
    likeliest, and each position's dict holds it beside them; with ``logprobs: 0``, it alone."""
    outside = 0
    for seed in range(4):
        for k in (0, 1):
            body = {"prompt": "The weather", "max_tokens": 6, "logprobs": k, "seed": seed, "temperature": 1.8}
            lp = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
            for name, own, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
                assert top.get(name) == own or own in top.values(), (name, own, top)  # (a shared name: by id)
                assert len(top) <= k + 1
                if k == 0:
                    assert list(top.values()) == [own]
                elif len(top) == 2:
                    outside += 1
                    assert max(top.values()) > own  # the likeliest first, then the sampled one
    assert outside > 0
