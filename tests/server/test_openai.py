"""The server through the official ``openai`` client: completions and chat, whole and streamed;
cache hits across document orders; tenant salts; pre-warming; logprobs and stop strings; metrics."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from openai import AuthenticationError, OpenAI

from hypic import LLM, SamplingParams
from hypic.eval.trace import generate_trace
from hypic.llm import SEPARATOR
from hypic.server.chat import ChatTemplate
from tests.server.conftest import API_KEY, MODEL, LiveServer, serve

TRACE = generate_trace(7, num_requests=12, pool_size=16, num_docs=(3, 4), doc_tokens=(20, 40))
TOL = 0.05  # hypic vs full: log-probabilities this close are a tie the cache may break either way


def rag(i: int, order: slice = slice(None)) -> list[str]:
    """Request i of the trace as segments: head, documents (in ``order``), query."""
    segs = TRACE.segments(TRACE.requests[i])
    return [segs[0], *segs[1:-1][order], segs[-1]]


def complete(client: OpenAI, segments: list[str], **kw):
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=SEPARATOR.join(segments), **kw)


def scrape(http: httpx.Client) -> dict[str, float]:
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_completion_whole_streamed_and_offline_agree(client: OpenAI, llm: LLM) -> None:
    segments = rag(0)
    whole = complete(client, segments)
    assert whole.object == "text_completion" and whole.model == MODEL
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.prompt_tokens == sum(len(s) for s in llm.tokenize(segments))
    assert whole.usage.completion_tokens == 6 or whole.choices[0].finish_reason == "stop"
    chunks = list(complete(client, segments, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens and not chunks[-1].choices
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the second time: the documents hit
    assert llm.generate([segments], SamplingParams(max_tokens=6))[0].text == whole.choices[0].text


def test_penalties_reach_the_engine(client: OpenAI, llm: LLM) -> None:
    segments = rag(1)
    sp = dict(presence_penalty=-2.0, frequency_penalty=-2.0)
    want = llm.generate([segments], SamplingParams(max_tokens=16, **sp))[0].text
    assert want != llm.generate([segments], SamplingParams(max_tokens=16))[0].text  # they change this answer
    assert complete(client, segments, max_tokens=16, **sp).choices[0].text == want
    plain = llm.generate([segments], SamplingParams(max_tokens=4)).pop().token_ids
    banned = llm.generate([segments], SamplingParams(max_tokens=4, logit_bias={plain[0]: -100.0})).pop()
    assert banned.token_ids[0] != plain[0]  # a bias of −100 bans the token
    got = complete(client, segments, max_tokens=4, logit_bias={str(plain[0]): -100})
    assert got.choices[0].text == banned.text


def test_vllm_sampling_extensions_reach_the_engine(client: OpenAI, llm: LLM) -> None:
    """top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos and min_tokens (vLLM's names, sent
    as extra fields) give the offline API's answer; a stop token ends the text, whole and streamed,
    and is not part of it."""
    segments = rag(2)
    plain = llm.generate([segments], SamplingParams(max_tokens=8))[0]
    drawn = llm.generate([segments], SamplingParams(max_tokens=8, temperature=1.0, seed=3))[0]
    assert len(plain.token_ids) == 8 and drawn.text != plain.text  # so top-k 1 (greedy) is seen to act
    cases = [dict(temperature=1.0, top_k=1, seed=3), dict(temperature=1.0, min_p=0.5, seed=3),
             dict(repetition_penalty=1.8), dict(ignore_eos=True), dict(min_tokens=8)]
    for extra in cases:
        want = llm.generate([segments], SamplingParams(max_tokens=8, **extra))[0].text
        assert (want != plain.text) == ("repetition_penalty" in extra) or "min_p" in extra, extra
        openai = {k: v for k, v in extra.items() if k in ("temperature", "seed")}
        vllm = {k: v for k, v in extra.items() if k not in openai}
        got = complete(client, segments, max_tokens=8, extra_body=vllm, **openai)
        assert got.choices[0].text == want, extra
    stop = plain.token_ids[3]
    first = plain.token_ids.index(stop)
    want = llm.tokenizer.decode(plain.token_ids[:first], skip_special_tokens=True)
    offline = llm.generate([segments], SamplingParams(max_tokens=8, stop_token_ids=[stop]))[0]
    assert offline.text == want and offline.token_ids[-1] == stop and offline.finish_reason == "stop"
    got = complete(client, segments, max_tokens=8, extra_body={"stop_token_ids": [stop]})
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    streamed = list(complete(client, segments, max_tokens=8, stream=True, extra_body={"stop_token_ids": [stop]}))
    assert "".join(c.choices[0].text for c in streamed) == want and streamed[-1].choices[0].finish_reason == "stop"
    allowed = sorted(set(plain.token_ids[2:6]))
    only = complete(client, segments, max_tokens=8, temperature=1.0, seed=4, extra_body={"allowed_token_ids": allowed})
    assert only.choices[0].text == llm.generate([segments], SamplingParams(max_tokens=8, temperature=1.0, seed=4,
                                                                           allowed_token_ids=allowed))[0].text
    late = complete(client, segments, max_tokens=8, extra_body={"stop_token_ids": [stop], "min_tokens": 8})
    assert late.choices[0].finish_reason == "length" and late.usage.completion_tokens == 8  # no stop before 8
    assert late.choices[0].text == llm.generate([segments], SamplingParams(max_tokens=8, stop_token_ids=[stop],
                                                                           min_tokens=8))[0].text


def test_n_choices_whole_and_streamed(client: OpenAI, llm: LLM) -> None:
    """Choice i samples with seed + i; one response holds them all, a stream interleaves them."""
    segments = rag(2)
    kw = dict(temperature=1.0, seed=11, max_tokens=6)
    want = [llm.generate([segments], SamplingParams(max_tokens=6, temperature=1.0, seed=11 + i))[0] for i in range(3)]
    assert len({o.text for o in want}) > 1  # the seeds differ: so must the choices
    whole = complete(client, segments, n=3, **kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == [o.text for o in want]
    assert whole.usage.prompt_tokens == sum(len(s) for s in llm.tokenize(segments))
    assert whole.usage.completion_tokens == sum(len(o.token_ids) for o in want)
    chunks = list(complete(client, segments, n=3, stream=True, stream_options={"include_usage": True}, **kw))
    texts = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [o.text for o in want] and len({c.id for c in chunks}) == 1
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": s} for s in segments],
                                          max_tokens=4, temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same answer twice


def test_chat_each_message_and_part_is_a_segment(client: OpenAI, llm: LLM) -> None:
    head, *docs, query = rag(1)
    messages = [{"role": "system", "content": head}, *({"role": "user", "content": d} for d in docs[:2]),
                {"role": "user", "content": [{"type": "text", "text": t} for t in (*docs[2:], query)]}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.model_extra["hypic"]["segments"] == 1 + 2 + 1 + len(docs[2:]) + 1  # wrapper of the parts message
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    template = ChatTemplate.from_model(llm.loaded.tokenizer_config)
    texts = [s.text for s in template.segments([(m["role"], [m["content"]] if isinstance(m["content"], str)
                                                 else [p["text"] for p in m["content"]]) for m in messages])]
    assert llm.generate([texts], SamplingParams(max_tokens=6))[0].text == whole.choices[0].message.content


def test_reordered_documents_hit_the_cache_and_match_full(client: OpenAI) -> None:
    first = complete(client, rag(2), extra_body={"cache_salt": "reorder"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = complete(client, rag(2, slice(None, None, -1)), logprobs=5, extra_body={"cache_salt": "reorder"})
    full = complete(client, rag(2, slice(None, None, -1)), logprobs=5, extra_body={"mode": "full"})
    assert again.usage.prompt_tokens_details.cached_tokens > 0 and again.model_extra["hypic"]["segment_misses"] == 0
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    got, want = again.choices[0].logprobs, full.choices[0].logprobs
    for i, (a, b) in enumerate(zip(got.tokens, want.tokens, strict=False)):
        if a != b:  # only a near-tie may differ, and then the rest follows a different prefix
            assert abs(got.token_logprobs[i] - want.top_logprobs[i].get(a, -1e9)) < TOL, (i, a, b)
            break
        assert abs(got.token_logprobs[i] - want.token_logprobs[i]) < TOL
    else:
        assert again.choices[0].text == full.choices[0].text


def test_cache_salts_isolate_tenants(client: OpenAI) -> None:
    head, *docs, query = rag(3)
    segments = [*(f"{d} Filed under isolation." for d in (head, *docs)), query]  # segments no other test sends
    cached = {}
    for salt in ("tenant-a", "tenant-a", "tenant-b", None):
        extra = {} if salt is None else {"cache_salt": salt}
        cached.setdefault(salt, []).append(
            complete(client, segments, max_tokens=1, extra_body=extra).usage.prompt_tokens_details.cached_tokens)
    assert cached["tenant-a"][0] == 0 and cached["tenant-a"][1] > 0
    assert cached["tenant-b"] == [0] and cached[None] == [0]


def test_prewarm_then_query_hits(http: httpx.Client, client: OpenAI, llm: LLM) -> None:
    docs = rag(4)[1:-1]
    body = {"segments": docs, "cache_salt": "warm"}
    first = http.post("/v1/segments", json=body).json()
    assert [d["cached"] for d in first["data"]] == [False] * len(docs)
    assert [d["tokens"] for d in first["data"]] == [len(s) for s in llm.tokenize(docs)]
    assert all(d["cached"] for d in http.post("/v1/segments", json=body).json()["data"])
    stats = http.get("/v1/segments/stats").json()
    assert stats["entries"]["device"] >= len(docs) and stats["seam"] == llm.engine.seam
    out = complete(client, rag(4, slice(None, None, -1)), extra_body={"cache_salt": "warm"})
    seam = llm.engine.seam
    assert out.model_extra["hypic"]["segment_misses"] == 1  # the head was not pre-warmed
    assert out.usage.prompt_tokens_details.cached_tokens == sum(len(s) - seam for s in llm.tokenize(docs))


def test_documents_sent_as_chat_messages_are_prewarmed_and_evicted_as_messages(http: httpx.Client,
                                                                               client: OpenAI, llm: LLM) -> None:
    """``/v1/segments`` with ``messages``: each message cached as a chat request's template renders it
    among others, so a chat sending those documents as messages — in any order, with its own
    question — finds them all; a message of text parts is a segment a part (and its wrapper one);
    evicting by messages forgets the same entries."""
    docs = rag(9)[1:-1]
    messages = [{"role": "user", "content": d} for d in docs]
    messages.append({"role": "user", "content": [{"type": "text", "text": d} for d in docs[:2]]})
    body = {"messages": messages, "cache_salt": "chat-warm"}
    first = http.post("/v1/segments", json=body)
    assert first.status_code == 200, first.text
    data = first.json()["data"]
    assert [d["message"] for d in data] == [*range(len(docs)), len(docs), len(docs), len(docs)]
    assert not any(d["cached"] for d in data)
    # the parts' wrapper (<|im_start|>user\n) is shorter than the seam: nothing of it is cached
    assert [d["cacheable"] for d in data] == [True] * len(docs) + [False, True, True]
    again = http.post("/v1/segments", json=body).json()["data"]
    assert [d["cached"] for d in again] == [d["cacheable"] for d in data]
    question = {"role": "user", "content": "Question: who?"}
    chat = client.chat.completions.create(model=MODEL, messages=[*messages[::-1][1:], question], max_tokens=1,
                                          temperature=0, extra_body={"cache_salt": "chat-warm"})
    ext = chat.model_extra["hypic"]
    assert ext["segment_hits"] == len(docs) and ext["segment_misses"] == 0  # the question is not looked up
    parts = client.chat.completions.create(model=MODEL, messages=[messages[-1], question], max_tokens=1,
                                           temperature=0, extra_body={"cache_salt": "chat-warm"})
    assert parts.model_extra["hypic"]["segment_hits"] == 2  # both parts (the wrapper is all seam)
    assert parts.model_extra["hypic"]["segment_misses"] == 0
    gone = http.post("/v1/segments/evict", json={"messages": messages[:1], "cache_salt": "chat-warm"}).json()
    assert [d["evicted"] for d in gone["data"]] == [True]
    after = http.post("/v1/segments", json=body).json()["data"]
    assert [d["cached"] for d in after] == [False] + [d["cacheable"] for d in data[1:]]


def test_evicted_documents_are_recomputed_and_other_tenants_keep_theirs(http: httpx.Client, client: OpenAI,
                                                                        llm: LLM) -> None:
    docs = rag(7)[1:-1]
    for salt in ("evict", "keep"):
        http.post("/v1/segments", json={"segments": docs, "cache_salt": salt})
    before = scrape(http).get("hypic_evicted_segments_total", 0.0)
    gone = http.post("/v1/segments/evict", json={"segments": [docs[0], "never seen"], "cache_salt": "evict"})
    assert gone.status_code == 200 and [d["evicted"] for d in gone.json()["data"]] == [True, False]
    assert scrape(http)["hypic_evicted_segments_total"] == before + 1
    again = http.post("/v1/segments", json={"segments": docs, "cache_salt": "evict"}).json()["data"]
    assert [d["cached"] for d in again] == [False] + [True] * (len(docs) - 1)  # only the evicted one rebuilt
    kept = http.post("/v1/segments", json={"segments": docs, "cache_salt": "keep"}).json()["data"]
    assert all(d["cached"] for d in kept)
    bad = http.post("/v1/segments/evict", json={"segments": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "segments"
    ids = llm.tokenize([docs[1]])[0]  # the same document as token ids: the same entry
    body = {"segments": [ids], "cache_salt": "evict"}
    assert http.post("/v1/segments/evict", json=body).json()["data"][0]["evicted"]
    assert http.post("/v1/segments", json=body).json()["data"][0]["cached"] is False
    outside = http.post("/v1/segments", json={"segments": ["x", [5, llm.vocab_size]]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "segments[1]"
    assert complete(client, rag(7), max_tokens=2).choices[0].text  # still serving


def test_logprobs_and_stop_strings(client: OpenAI) -> None:
    segments = rag(5)
    base = complete(client, segments, max_tokens=12, logprobs=3)
    lp = base.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert all(len(top) <= 3 and max(top.values()) <= 0 for top in lp.top_logprobs)
    text = base.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("degenerate answer")
    cut = text[:text.index(stop)]
    stopped = complete(client, segments, max_tokens=12, stop=[stop])
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"
    streamed = list(complete(client, segments, max_tokens=12, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut and streamed[-1].choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Question: who?"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_stop_strings_wait_for_min_tokens(client: OpenAI, llm: LLM) -> None:
    """vLLM's ``min_tokens``: a stop string ending in the first ``min_tokens`` tokens' text does not end
    the output (as EOS cannot); the first one after does, whole and streamed alike."""
    segments = rag(5)
    ids = llm.generate([segments], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    text, early = (llm.tokenizer.decode(x, skip_special_tokens=True) for x in (ids, ids[:5]))
    assert " " in early and " " in text[len(early):]  # a stop string within the first 5 tokens and one after
    want = text[:text.index(" ", len(early))]
    kw = dict(max_tokens=12, stop=" ", extra_body={"ignore_eos": True, "min_tokens": 5})
    whole = complete(client, segments, **kw)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens > 5
    streamed = list(complete(client, segments, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == want and streamed[-1].choices[0].finish_reason == "stop"
    assert complete(client, segments, **{**kw, "extra_body": {"ignore_eos": True}}).choices[0].text \
        == text[:text.index(" ")]  # without min_tokens, the first stop string ends it


def test_echo_scores_the_prompt_as_a_harness_asks_and_prepends_it(client: OpenAI, http: httpx.Client,
                                                                   llm: LLM) -> None:
    """``echo`` + ``logprobs`` + ``max_tokens: 0`` (lm-eval's loglikelihood request): the prompt's own
    log-probabilities, as the library scores them; with tokens to generate, the prompt ahead of the
    completion the same request gives without echo, whole and streamed; 0 without echo is a 400."""
    segments = rag(6)
    prompt, tokenized = SEPARATOR.join(segments), llm.tokenize(segments)
    ids = [t for s in tokenized for t in s]
    want = llm.engine.prompt_logprobs(tokenized, top=2)
    before = scrape(http).get("hypic_scored_prompt_tokens_total", 0.0)
    scored = complete(client, segments, max_tokens=0, echo=True, logprobs=2)
    assert scrape(http)["hypic_scored_prompt_tokens_total"] == before + len(ids)
    c = scored.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert scored.usage.prompt_tokens == len(ids) and scored.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(abs(lp.token_logprobs[i] - want[i][ids[i]]) < 1e-5 for i in range(1, len(ids)))
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # the token and the 2 likeliest
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    plain = complete(client, segments, max_tokens=4, logprobs=1)
    echoed = complete(client, segments, max_tokens=4, logprobs=1, echo=True)
    got, base = echoed.choices[0], plain.choices[0]
    assert got.text == prompt + base.text and got.finish_reason == base.finish_reason
    n = len(base.logprobs.tokens)
    assert got.logprobs.tokens[len(ids):] == base.logprobs.tokens and len(got.logprobs.tokens) == len(ids) + n
    assert got.logprobs.token_logprobs[:len(ids)] == lp.token_logprobs
    assert got.logprobs.token_logprobs[len(ids):] == base.logprobs.token_logprobs
    assert got.logprobs.text_offset[len(ids):] == [o + len(prompt) for o in base.logprobs.text_offset]
    assert complete(client, segments, max_tokens=4, echo=True).choices[0].text == prompt + base.text
    assert complete(client, segments, max_tokens=4, echo=True).choices[0].logprobs is None

    chunks = list(complete(client, segments, max_tokens=4, echo=True, logprobs=1, stream=True))
    assert chunks[0].choices[0].text == prompt and chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(ch.choices[0].text for ch in chunks) == prompt + base.text
    only = list(complete(client, segments, max_tokens=0, echo=True, n=2, stream=True,
                         stream_options={"include_usage": True}))
    assert [ch.choices[0].text for ch in only[:2]] == [prompt, prompt] and only[-1].usage.completion_tokens == 0

    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert complete(client, segments, max_tokens=2).choices[0].text  # still serving


def test_token_id_prompts_read_as_the_text_they_encode(client: OpenAI, http: httpx.Client, llm: LLM) -> None:
    """``prompt`` as token ids (``[ids]`` or ``[[ids]]``, as lm-eval sends them): one segment, the same
    answer as the text it encodes; echoed as their decoding; ids outside the vocabulary are a 400."""
    text = "Profile of Wrenna Jessop. Question: who?"
    ids = llm.tokenize(text)[0]
    by_text = complete(client, [text], max_tokens=5, logprobs=1)
    for prompt in (ids, [ids]):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=1)
        assert got.choices[0].text == by_text.choices[0].text and got.usage.prompt_tokens == len(ids)
        assert got.choices[0].logprobs.token_logprobs == by_text.choices[0].logprobs.token_logprobs
    echoed = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert echoed.choices[0].text == llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert len(echoed.choices[0].logprobs.token_logprobs) == len(ids)
    for bad in ([5, llm.vocab_size], [5, -1], [], [[]], [[5], []], [[5], ["a"]]):
        r = http.post("/v1/completions", json={"prompt": bad, "max_tokens": 2})
        assert r.status_code == 400 and "prompt" in r.json()["error"]["message"], bad


def test_a_batch_of_prompts_is_one_response_indexed_prompt_by_prompt(client: OpenAI, llm: LLM) -> None:
    """A list of prompts (text or token ids): choice ``k · n + i`` is prompt k's choice i, each the
    answer the prompt gets alone; usage counts every prompt once; streamed, the same; echoed with
    ``max_tokens: 0``, each prompt scored on its own (lm-eval's batched loglikelihood)."""
    texts = [SEPARATOR.join(rag(8)), "Profile of Wrenna Jessop. Question: who?"]
    alone = [complete(client, t.split(SEPARATOR), max_tokens=4).choices[0].text for t in texts]
    both = client.completions.create(model=MODEL, prompt=texts, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert both.usage.prompt_tokens == sum(sum(len(s) for s in llm.tokenize(t)) for t in texts)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=texts, max_tokens=4, temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: alone[0], 1: alone[1]}
    ids = [[t for s in llm.tokenize(t) for t in s] for t in texts]
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    for c, tokens in zip(scored.choices, ids, strict=True):
        want = llm.engine.prompt_logprobs([tokens])
        assert len(c.logprobs.token_logprobs) == len(tokens) and c.logprobs.token_logprobs[0] is None
        assert all(abs(c.logprobs.token_logprobs[i] - want[i][tokens[i]]) < 1e-5 for i in range(1, len(tokens)))


def test_scoring_out_of_memory_is_a_503_to_retry(http: httpx.Client, llm: LLM, monkeypatch) -> None:
    """The device full while serving (the scoring forward stubbed to run out of memory; it is tested
    for real above): a 503 with Retry-After naming the cause, and the server goes on."""
    import torch

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 MiB")

    monkeypatch.setattr(llm.engine, "score", full)
    r = http.post("/v1/completions", json={"prompt": "Question: who?", "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 503 and "out of device memory" in r.json()["error"]["message"] and r.headers["Retry-After"]
    monkeypatch.undo()
    assert http.post("/v1/completions", json={"prompt": "Question: who?", "max_tokens": 0, "echo": True,
                                              "logprobs": 1}).status_code == 200


def test_a_round_that_fails_tells_its_requests_at_once_and_the_next_round_runs(http: httpx.Client, llm: LLM,
                                                                              monkeypatch) -> None:
    """Anything the engine raises in a scoring round (a kernel error, a bug) is every request's of
    that round at once — a 500, not a wait for the request timeout — and the rounds go on."""
    real, calls = llm.engine.score, []

    def broken_once(prompts, top, stop=None, first=None):
        calls.append(len(prompts))
        if len(calls) == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(prompts, top, stop, first)

    monkeypatch.setattr(llm.engine, "score", broken_once)
    body = {"prompt": "Question: who?", "max_tokens": 0, "echo": True, "logprobs": 1}
    t0 = time.monotonic()
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 500 and time.monotonic() - t0 < 10, r.text
    assert r.json()["error"]["message"].startswith("scoring failed: RuntimeError: CUDA error")
    assert http.post("/v1/completions", json=body).status_code == 200 and calls == [1, 1]
    assert scrape(http).get("hypic_queue_depth", 0) == 0


def test_a_round_out_of_memory_fails_only_the_request_that_does_not_fit(http: httpx.Client, llm: LLM,
                                                                        monkeypatch) -> None:
    """A round that runs out of device memory is scored again request by request: the request whose
    prompt does not fit alone gets the 503 to retry, the one beside it its scores."""
    import torch

    real, gate, calls = llm.engine.score, threading.Event(), []

    def tight(prompts, top, stop=None, first=None):
        calls.append(len(prompts))
        if len(calls) == 1:
            gate.wait(30)  # the first round held until the other two wait
        if any(sum(len(s) for s in p) > 50 for p in prompts):  # the long prompt never fits
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(prompts, top, stop, first)

    monkeypatch.setattr(llm.engine, "score", tight)
    short = {"prompt": "Question: who?", "max_tokens": 0, "echo": True, "logprobs": 1}
    long = {**short, "prompt": " ".join(f"w{i}" for i in range(40))}
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(http.post, "/v1/completions", json=short)
        while not calls:
            time.sleep(0.01)
        rest = [pool.submit(http.post, "/v1/completions", json=b) for b in (long, short)]
        deadline = time.monotonic() + 30
        while scrape(http).get("hypic_queue_depth", 0) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        gate.set()
        codes = [first.result().status_code, *(f.result().status_code for f in rest)]
    assert codes == [200, 503, 200] and calls == [1, 2, 1, 1]  # the round of two, then each alone


def test_scoring_beside_generation_under_concurrency(http: httpx.Client, llm: LLM) -> None:
    """Echo scoring runs beside the scheduler's calls (the engine's lock between them): concurrent
    scoring and generating requests all succeed, and each score equals the one computed alone."""
    prompts = [SEPARATOR.join(rag(i)) for i in (9, 10, 11)]
    alone = [http.post("/v1/completions", json={"prompt": p, "max_tokens": 0, "echo": True, "logprobs": 0}).json()
             for p in prompts]

    def score(i: int) -> dict:
        return http.post("/v1/completions", json={"prompt": prompts[i % 3], "max_tokens": 0, "echo": True,
                                                  "logprobs": 0}).json()

    def generate(i: int) -> int:
        return http.post("/v1/completions", json={"prompt": prompts[i % 3], "max_tokens": 3}).status_code

    with ThreadPoolExecutor(8) as pool:
        scores = [pool.submit(score, i) for i in range(6)]
        codes = [pool.submit(generate, i) for i in range(6)]
        assert all(c.result() == 200 for c in codes)
        for i, f in enumerate(scores):  # scored in other company: the same up to fp32 rounding
            got = f.result()["choices"][0]["logprobs"]["token_logprobs"]
            want = alone[i % 3]["choices"][0]["logprobs"]["token_logprobs"]
            assert got[0] is None and len(got) == len(want)
            assert max(abs(a - b) for a, b in zip(got[1:], want[1:], strict=True)) < 1e-4
    assert llm.engine.store.check_integrity()


def test_requests_waiting_to_be_scored_are_scored_together(http: httpx.Client, llm: LLM, monkeypatch) -> None:
    """A harness sending several echoes at once (lm-eval's ``num_concurrent``): those waiting while
    one is scored go into the next round together — one engine call for all their prompts — and each
    gets its own prompts' scores with its own ``logprobs`` count."""
    calls: list[tuple[int, list[int]]] = []
    real, gate = llm.engine.score, threading.Event()

    def counted(prompts, top, stop=None, first=None):
        calls.append((len(prompts), top))
        if len(calls) == 1:
            gate.wait(30)  # the first round held until the others wait
        return real(prompts, top, stop, first)

    texts = [SEPARATOR.join(rag(i)) for i in (9, 10, 11)]
    bodies = [{"prompt": texts[0], "max_tokens": 0, "echo": True, "logprobs": 0},
              {"prompt": texts[1], "max_tokens": 0, "echo": True, "logprobs": 2},
              {"prompt": [texts[2], texts[0]], "max_tokens": 0, "echo": True, "logprobs": 1},
              {"prompt": texts[1], "max_tokens": 1, "echo": True, "logprobs": 3}]
    monkeypatch.setattr(llm.engine, "score", counted)
    with ThreadPoolExecutor(5) as pool:
        first = pool.submit(http.post, "/v1/completions", json=bodies[0])
        while not calls:
            time.sleep(0.01)
        rest = [pool.submit(http.post, "/v1/completions", json=b) for b in bodies]
        deadline = time.monotonic() + 30
        while scrape(http).get("hypic_queue_depth", 0) < len(bodies):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        gate.set()
        answers = [first.result().json(), *(f.result().json() for f in rest)]
    assert calls[0] == (1, [0]) and len(calls) == 2  # the waiting four's five prompts in one call (in
    assert calls[1][0] == 5 and sorted(calls[1][1]) == [0, 1, 1, 2, 3]  # the order they arrived)
    monkeypatch.undo()
    for body, answer in zip([bodies[0], *bodies], answers, strict=True):
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        for text, choice in zip(prompts, answer["choices"], strict=True):
            want = llm.engine.prompt_logprobs(llm.tokenize(text), top=body["logprobs"])
            lp = choice["logprobs"]
            ids = [t for s in llm.tokenize(text) for t in s]
            assert all(abs(lp["token_logprobs"][i] - want[i][ids[i]]) < 1e-4 for i in range(1, len(ids)))
            assert all(len(top) == len(want[i]) for i, top in enumerate(lp["top_logprobs"][1:len(ids)], 1))


def test_a_harness_scores_continuations_in_a_batch(http: httpx.Client, llm: LLM) -> None:
    """lm-eval's ``local-completions`` loglikelihood request as it sends it — a batch of token-id
    prompts (context + continuation), ``echo``, ``logprobs: 1``, ``max_tokens: 1`` — read as it reads
    it: the continuation's log-probability is the sum over ``token_logprobs[ctxlen:-1]`` (the last is
    the generated token), greedy when each equals its position's best."""
    context = [t for s in llm.tokenize(rag(9)) for t in s]
    options = [llm.tokenize("Wrenna Jessop")[0], llm.tokenize("the harbour")[0]]
    body = {"model": MODEL, "prompt": [context + o for o in options], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True, "return_token_ids": True}
    prefilled = llm.engine.prefill_tokens
    out = http.post("/v1/completions", json=body).json()
    # the one-token answers were drawn from the scoring forward's last rows: nothing prefilled again
    assert llm.engine.prefill_tokens == prefilled
    for choice, option in zip(sorted(out["choices"], key=lambda c: c["index"]), options, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(context) + len(option) + 1
        token = choice["token_ids"][0]  # full's greedy token, its log-probability the scored one's
        after = llm.engine.prompt_logprobs([context + option + [token]], top=1)[-1]
        assert max(after, key=after.get) == token and abs(lp["token_logprobs"][-1] - after[token]) < 1e-4
        got = sum(lp["token_logprobs"][len(context):-1])
        scores = llm.engine.prompt_logprobs([context + option], top=1)
        want = sum(scores[i][t] for i, t in enumerate(context + option) if i >= len(context))
        assert abs(got - want) < 1e-4
        greedy = all(tok == max(top.values()) for tok, top in zip(lp["token_logprobs"][len(context):-1],
                                                                   lp["top_logprobs"][len(context):-1], strict=True))
        best = all(max(scores[i], key=scores[i].get) == t for i, t in enumerate(context + option) if i >= len(context))
        assert greedy == best


def test_an_echoed_one_token_answer_is_its_modes_own(http: httpx.Client, llm: LLM) -> None:
    """Echo with ``max_tokens: 1``: where the mode's first token is ``full``'s (one segment, or
    ``full``) it comes from the scoring forward — the same answer, usage and text as without
    scoring, nothing prefilled; a prompt of several segments under ``hypic`` is prefilled by its
    mode (its documents cached), as is a request whose answer goes on past one token."""
    single = {"prompt": " ".join(rag(11)), "max_tokens": 1, "echo": True, "temperature": 0.8, "seed": 5, "n": 2}
    plain = http.post("/v1/completions", json={**single, "mode": "full"}).json()  # no logprobs: no scoring
    prefilled = llm.engine.prefill_tokens
    scored = http.post("/v1/completions", json={**single, "logprobs": 2}).json()
    assert llm.engine.prefill_tokens == prefilled
    assert [c["text"] for c in scored["choices"]] == [c["text"] for c in plain["choices"]]
    assert scored["usage"] == plain["usage"] and scored["usage"]["completion_tokens"] == 2
    segmented = {"prompt": SEPARATOR.join(rag(11)), "max_tokens": 1, "echo": True, "logprobs": 1,
                 "cache_salt": "echo-one"}
    entries = llm.engine.store.stats().entries
    http.post("/v1/completions", json=segmented).raise_for_status()
    assert llm.engine.prefill_tokens > prefilled and llm.engine.store.stats().entries != entries
    prefilled = llm.engine.prefill_tokens
    http.post("/v1/completions", json={**single, "logprobs": 1, "max_tokens": 2}).raise_for_status()
    assert llm.engine.prefill_tokens > prefilled


def _ranked(llm: LLM, ids: list[int]) -> list[int]:
    """Each prompt token's rank in its position's distribution, from the model's own logits (1: the likeliest)."""
    from hypic.models.context import SequenceContext, SequenceState

    with torch.no_grad():
        ctx = SequenceContext([SequenceState()], [len(ids)], llm.engine.device)
        logp = llm.engine.model(torch.tensor(ids), ctx).log_softmax(-1)
    return [int((logp[i - 1] > logp[i - 1, ids[i]]).sum()) + 1 for i in range(1, len(ids))]


def test_prompt_logprobs_as_vllm_gives_them(http: httpx.Client, llm: LLM, monkeypatch) -> None:
    """vLLM's ``prompt_logprobs``: a completion's in its choice, a chat's at the response's top level —
    per prompt token (the first null) its own log-probability and the k likeliest, keyed by token id,
    each ranked (its own over the whole vocabulary) and named; equal to the engine's scores. Asked
    with echo's ``logprobs`` too, one scoring gives both, each cut to its own count; not with stream."""
    text = SEPARATOR.join(rag(10))
    out = http.post("/v1/completions", json={"prompt": text, "max_tokens": 2, "prompt_logprobs": 3,
                                             "return_token_ids": True}).json()
    choice = out["choices"][0]
    ids = choice["prompt_token_ids"]
    got, want = choice["prompt_logprobs"], llm.engine.prompt_logprobs(llm.tokenize(text), top=3)
    ranks = _ranked(llm, ids)
    assert len(got) == len(ids) == out["usage"]["prompt_tokens"] and got[0] is None
    for i in range(1, len(ids)):
        row, own = got[i], str(ids[i])
        assert next(iter(row)) == own and {int(t) for t in row} == set(want[i])  # its own first, then the 3 likeliest
        assert all(abs(entry["logprob"] - want[i][int(t)]) < 1e-5 for t, entry in row.items())
        assert row[own]["rank"] == ranks[i - 1] and row[own]["decoded_token"] == llm.tokenizer.decode([ids[i]])
        by_logprob = sorted(row.values(), key=lambda e: -e["logprob"])  # the ranks follow the log-probabilities
        assert [e["rank"] for e in by_logprob] == sorted(e["rank"] for e in row.values())
        assert sorted(e["rank"] for e in row.values())[:3] == [1, 2, 3]
    messages = [{"role": "user", "content": "Who is Wrenna Jessop?"}]
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "prompt_logprobs": 0,
                                                   "return_token_ids": True}).json()
    ids = chat["prompt_token_ids"]
    want = llm.engine.prompt_logprobs([ids], top=0)
    assert "prompt_logprobs" not in chat["choices"][0] and len(chat["prompt_logprobs"]) == len(ids)
    assert all(list(row) == [str(ids[i])] and abs(row[str(ids[i])]["logprob"] - want[i][ids[i]]) < 1e-5
               for i, row in enumerate(chat["prompt_logprobs"][1:], 1))
    calls, real = [], llm.engine.score
    monkeypatch.setattr(llm.engine, "score", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    both = http.post("/v1/completions", json={"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1,
                                              "prompt_logprobs": 4}).json()["choices"][0]
    assert calls == [[4]]  # one scoring, for the larger count
    assert max(len(t) for t in both["logprobs"]["top_logprobs"][1:]) == 2  # 1 and its own
    assert max(len(row) for row in both["prompt_logprobs"][1:]) == 5  # 4 and its own
    r = http.post("/v1/chat/completions", json={"messages": messages, "stream": True, "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_the_tokenizer_over_http_as_vllm_serves_it(server: LiveServer, http: httpx.Client, llm: LLM) -> None:
    """``/tokenizer_info``, ``/tokenize``, ``/detokenize`` (lm-eval's remote tokenizer probes the first
    two): the ids the server itself reads, behind the API key like every route."""
    info = http.get("/tokenizer_info").json()
    assert "eos_token" in info and info["model_max_length"] == llm.max_positions and info["chat_template"]
    text = "Profile of Wrenna Jessop."
    got = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert got["tokens"] == llm.tokenize(text)[0] and got["count"] == len(got["tokens"])
    segmented = "Profile of Wrenna Jessop.<<PIC_SEP>>Question: who?"  # read part by part, as a completion is
    ids = http.post("/tokenize", json={"prompt": segmented, "add_special_tokens": False}).json()["tokens"]
    assert ids == [t for s in llm.tokenize(segmented) for t in s]
    usage = http.post("/v1/completions", json={"prompt": segmented, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == len(ids)
    back = http.post("/detokenize", json={"tokens": got["tokens"]}).json()["prompt"]
    assert back == llm.tokenizer.decode(got["tokens"], skip_special_tokens=False)
    named = http.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()
    assert named["tokens"] == got["tokens"]  # the served model named: as without a name (another is a 404)
    assert http.post("/detokenize", json={"model": MODEL, "tokens": got["tokens"]}).json()["prompt"] == back
    for path, body, param in (("/detokenize", {"tokens": [1, llm.vocab_size]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens[0]"), ("/tokenize", {}, "prompt")):
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
    assert httpx.get(f"{server.url}/tokenizer_info").status_code == 401  # no key


def test_metrics_move(http: httpx.Client, client: OpenAI) -> None:
    before = scrape(http)
    salt = {"cache_salt": "metrics"}  # a fresh tenant: the first request misses every segment, the second hits
    complete(client, rag(6), extra_body=salt)
    complete(client, rag(6, slice(None, None, -1)), extra_body=salt)
    http.post("/v1/completions", json={"prompt": ""})
    after = scrape(http)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta['hypic_requests_total{endpoint="completions"}'] == 2
    cacheable = len(rag(6)) - 1
    assert delta["hypic_segment_hits_total"] == delta["hypic_segment_misses_total"] == cacheable
    assert delta["hypic_cached_tokens_total"] > 0 and delta["hypic_recomputed_tokens_total"] > 0
    assert delta['hypic_errors_total{kind="invalid_request"}'] == 1
    assert delta["hypic_request_seconds_count"] == 2  # both answered to their end
    # every token after a request's first is an interval: generated tokens less one per request
    assert delta["hypic_inter_token_seconds_count"] == delta["hypic_generated_tokens_total"] - 2 > 0
    assert delta["hypic_request_seconds_sum"] >= sum(v for k, v in delta.items()
                                                     if k.startswith("hypic_time_to_first_token_seconds_sum"))
    ttft = sum(v for k, v in delta.items() if k.startswith("hypic_time_to_first_token_seconds_count"))
    assert ttft == 2 and delta['hypic_time_to_first_token_seconds_count{cache="hit"}'] == 1
    assert delta["hypic_wait_seconds_count"] == 2  # the time to first token, split into the wait and the prefill
    assert 0 <= delta["hypic_wait_seconds_sum"] <= sum(v for k, v in delta.items()
                                                        if k.startswith("hypic_time_to_first_token_seconds_sum"))
    assert after['hypic_cache_bytes{tier="device"}'] > 0 and after['hypic_cache_entries{tier="device"}'] > 0
    assert after["hypic_queue_depth"] == 0 and "hypic_running_requests" in after
    assert after["hypic_cache_host_pinned_bytes"] == 0  # a CPU engine's host tier moves nothing, pins nothing
    assert after["hypic_cache_move_seconds_total"] == 0.0  # … and, unbounded, never demotes
    assert delta['hypic_cold_segments_total{rank="0"}'] == cacheable and after["hypic_cold_devices"] == 1
    assert delta['hypic_cold_tokens_total{rank="0"}'] > 0
    assert after['hypic_cold_worker_failures_total{kind="lost"}'] == 0
    assert delta["hypic_decode_steps_total"] > 0 and delta["hypic_decode_arena_regrows_total"] >= 1
    assert after["hypic_decode_graph_replays_total"] == after["hypic_decode_graph_captures_total"] == 0  # CPU: eager
    # one prefill call each: the first prefilled its documents cold, the second found them all
    assert delta['hypic_prefill_calls_total{cold="yes"}'] == delta['hypic_prefill_calls_total{cold="no"}'] == 1
    # the model's work: the cold documents once, then each request's seams and query (its own usage counts
    # the same here, as no other request shared its call)
    assert delta["hypic_recomputed_tokens_total"] > delta['hypic_cold_tokens_total{rank="0"}']
    assert 'hypic_request_seconds_bucket{le="960.0"}' in after  # up past the default request timeout


def test_metrics_of_the_prefix_mode_echo_and_prewarm(http: httpx.Client, client: OpenAI, llm: LLM) -> None:
    """The prefix mode's kept states are in /metrics as in the stats route; an echo answered without
    queueing counts its prompt tokens; a document prewarmed twice in one request is prefilled once."""
    complete(client, rag(9), extra_body={"mode": "prefix", "cache_salt": "prefix-metrics"})
    stats, now = http.get("/v1/segments/stats").json(), scrape(http)
    assert now["hypic_prefix_states"] == stats["prefix_states"] > 0
    assert now["hypic_prefix_bytes"] == stats["prefix_bytes"] > 0
    before = now
    echo = http.post("/v1/completions", json={"prompt": "one two three", "max_tokens": 0, "echo": True}).json()
    doc = rag(9)[1]
    warm = http.post("/v1/segments", json={"segments": [doc, doc], "cache_salt": "prewarm-metrics"}).json()
    assert [d["cached"] for d in warm["data"]] == [False, False]  # neither was cached before the call
    delta = {k: v - before.get(k, 0.0) for k, v in scrape(http).items()}
    assert delta["hypic_prompt_tokens_total"] == echo["usage"]["prompt_tokens"] > 0
    assert delta["hypic_prewarmed_segments_total"] == 1
    assert delta["hypic_recomputed_tokens_total"] == delta['hypic_cold_tokens_total{rank="0"}'] == len(
        llm.tokenize([doc])[0])


def test_models_health_and_auth(server: LiveServer, client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert re.search(r"^hypic_cache_bytes", httpx.get(f"{server.url}/metrics").text, re.M)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).completions.create(
            model=MODEL, prompt="hi", max_tokens=1)


def test_the_cache_is_saved_on_request_into_the_servers_cache_dir(http: httpx.Client, model_dir: Path,
                                                                  tmp_path: Path) -> None:
    refused = http.post("/v1/segments/save")  # the shared server was started without a folder
    assert refused.status_code == 400 and "--cache-dir" in refused.json()["error"]["message"]
    mine = LLM(str(model_dir), device="cpu")
    live = serve(mine, api_key=API_KEY, cache_dir=str(tmp_path / "cache"))
    try:
        h = httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        assert httpx.post(f"{live.url}/v1/segments/save").status_code == 401  # behind the API key
        h.post("/v1/segments", json={"segments": rag(2)[1:-1]}).raise_for_status()
        saved = h.post("/v1/segments/save")
        assert saved.status_code == 200 and saved.json()["entries"] == sum(mine.cache_stats()["entries"].values()) > 0
        assert LLM(str(model_dir), device="cpu").load_cache(tmp_path / "cache") == saved.json()["entries"]
        # saves while requests are being served: each waits its turn at the engine, nothing is lost
        with ThreadPoolExecutor(8) as pool:
            answers = [pool.submit(h.post, "/v1/completions", json={"segments": rag(i), "max_tokens": 2})
                       for i in range(3, 9)]
            saves = [pool.submit(h.post, "/v1/segments/save") for _ in range(2)]
            assert all(f.result().status_code == 200 for f in answers + saves)
        assert mine.engine.store.check_integrity()
        again = LLM(str(model_dir), device="cpu")
        loaded = again.load_cache(tmp_path / "cache")
        assert loaded >= saved.json()["entries"] and again.engine.store.check_integrity()
        # an evicted document leaves the saved cache too: a restart does not bring it back
        doc = rag(2)[1]
        assert h.post("/v1/segments/evict", json={"segments": [doc]}).json()["data"][0]["evicted"]
        after = LLM(str(model_dir), device="cpu")
        assert after.load_cache(tmp_path / "cache") == loaded - 1
        assert after.prewarm([doc]) == [False]
        # a saved folder damaged under the server: a 500 that says so, the documents gone from memory anyway
        other = rag(2)[0]
        h.post("/v1/segments", json={"segments": [other]}).raise_for_status()
        (tmp_path / "cache" / "manifest.json").write_text("{damaged")
        broken = h.post("/v1/segments/evict", json={"segments": [doc, other]})
        assert broken.status_code == 500 and "manifest.json" in broken.json()["error"]["message"]
        assert h.post("/v1/segments", json={"segments": [other]}).json()["data"][0]["cached"] is False
    finally:
        live.stop()


def test_a_stop_string_seen_only_as_the_output_ends_answers_stop(client: OpenAI, llm: LLM) -> None:
    """The last token begins a character it never completes: flushed at the end as U+FFFD, it ends a
    stop string there — the answer is cut and its finish_reason is 'stop', not the engine's 'length'."""
    lead = next(i for i in range(llm.vocab_size) if llm.tokenizer.decode([i]) == "\ufffd")  # a lone lead byte
    kw = dict(max_tokens=1, stop="\ufffd", logit_bias={str(lead): 100})
    whole = complete(client, rag(5), **kw)
    assert whole.choices[0].text == "" and whole.choices[0].finish_reason == "stop"
    streamed = list(complete(client, rag(5), stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == "" and streamed[-1].choices[0].finish_reason == "stop"


def test_choices_name_what_stopped_them_as_vllm_and_the_library(client: OpenAI, http: httpx.Client,
                                                                  llm: LLM) -> None:
    """vLLM's ``stop_reason`` on every choice: the stop string found, the stop token's id, or null (the
    length reached, EOS) — whole and in a stream's last chunk, null in the chunks before; the same as
    the library's ``stop_reason``; chat answers too."""
    segments = rag(5)
    ids = llm.generate([segments], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    text = llm.tokenizer.decode(ids, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    body = {"model": MODEL, "prompt": SEPARATOR.join(segments), "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    cases = [({"stop": [stop]}, SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]), stop),
             ({"stop_token_ids": [ids[4]]}, SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[ids[4]]),
              ids[4]),
             ({}, SamplingParams(max_tokens=12, ignore_eos=True), None)]
    for extra, params, want in cases:
        assert llm.generate([segments], params)[0].stop_reason == want
        whole = http.post("/v1/completions", json={**body, **extra}).json()["choices"][0]
        assert "stop_reason" in whole and whole["stop_reason"] == want, extra
        assert whole["finish_reason"] == ("length" if want is None else "stop")
        lines = http.post("/v1/completions", json={**body, **extra, "stream": True}).text.splitlines()
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert [c["choices"][0]["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [want], extra
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Question: who?"}],
                                          max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    said = chat.choices[0].message.content
    assert len(said) > 3 and chat.choices[0].model_extra["stop_reason"] is None
    cut = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Question: who?"}],
                                         max_tokens=8, temperature=0, stop=said[2:4], extra_body={"ignore_eos": True})
    assert cut.choices[0].model_extra["stop_reason"] == said[2:4] and cut.choices[0].finish_reason == "stop"


def test_chat_continues_a_prefilled_answer_as_the_library(client: OpenAI, llm: LLM) -> None:
    """vLLM's ``continue_final_message`` / ``add_generation_prompt`` on the chat route: the answer continues
    the last message's content, as ``LLM.chat`` does it."""
    messages = [{"role": "user", "content": "Question: who?"}, {"role": "assistant", "content": "The answer is"}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    want = llm.chat(messages, SamplingParams(max_tokens=6), **flags)[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body=flags)
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    fresh = llm.chat(messages, SamplingParams(max_tokens=6))[0]  # a new turn: a prompt of its own
    assert len(fresh.prompt_token_ids) > len(want.prompt_token_ids)


def test_include_stop_str_in_output_and_skip_special_tokens_as_the_library(client: OpenAI, llm: LLM) -> None:
    """vLLM's two text options reach the server's answer as the library's, whole and streamed."""
    segments = rag(5)
    text = llm.generate([segments], SamplingParams(max_tokens=12, ignore_eos=True))[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    kw = dict(max_tokens=12, stop=stop, extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    whole = complete(client, segments, **kw)
    want = llm.generate([segments], SamplingParams(max_tokens=12, ignore_eos=True, stop=stop,
                                                   include_stop_str_in_output=True))[0].text
    assert whole.choices[0].text == want == text[:text.index(stop) + len(stop)]
    assert "".join(c.choices[0].text for c in complete(client, segments, stream=True, **kw)) == want
    end = llm.tokenizer.token_to_id("<|end|>")
    shown = {"ignore_eos": True, "skip_special_tokens": False}
    forced = complete(client, segments, max_tokens=3, logit_bias={str(end): 100}, extra_body=shown)
    assert forced.choices[0].text == "<|end|>" * 3
    assert complete(client, segments, max_tokens=3, logit_bias={str(end): 100},
                    extra_body={"ignore_eos": True}).choices[0].text == ""
