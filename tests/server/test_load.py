"""Bounded load: 200 RAG requests from the trace generator, 16 at a time, through the ``openai``
client (half streamed), against a server whose cache budgets force demotions and evictions.
No request may fail, every answer must equal the offline ``LLM.generate`` answer, and the
cache must pass ``check_integrity()`` afterwards. Also measures TTFT with and without hits
(printed with ``-s``; the numbers in docs/benchmarks.md come from here)."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from hypic import LLM, SamplingParams
from hypic.eval.trace import generate_trace
from hypic.llm import SEPARATOR
from hypic.server.metrics import cache_outcome
from tests.server.conftest import MODEL, LiveServer, serve

REQUESTS, CONCURRENCY, MAX_TOKENS = 200, 16, 4
TRACE = generate_trace(11, num_requests=REQUESTS, pool_size=24, num_docs=(2, 4), doc_tokens=(20, 40))
ENTRY_BYTES = 110_592  # one cached segment of the tiny model (three GDN layers' (T, S) + one layer's body KV)


@pytest.fixture(scope="module")
def load_llm(model_dir: Path) -> LLM:
    """Its own cache, budgets a third of the working set: entries are demoted, promoted and evicted."""
    return LLM(str(model_dir), device="cpu", cache_device_bytes=10 * ENTRY_BYTES, cache_host_bytes=6 * ENTRY_BYTES)


@pytest.fixture(scope="module")
def load_server(load_llm: LLM) -> Iterator[LiveServer]:
    live = serve(load_llm, max_concurrent=8, max_queue=64, max_completion_tokens=MAX_TOKENS)
    yield live
    live.stop()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def ttft_table(title: str, groups: dict[str, list[float]]) -> str:
    rows = [f"| {name} | {len(v)} | {1e3 * percentile(v, 50):.1f} | {1e3 * percentile(v, 99):.1f} |"
            for name, v in groups.items() if v]
    return "\n".join([title, "", "| requests | n | p50 TTFT (ms) | p99 TTFT (ms) |", "|---|---|---|---|", *rows])


async def _one(client: AsyncOpenAI, gate: asyncio.Semaphore, i: int) -> tuple[str, dict]:
    prompt = SEPARATOR.join(TRACE.segments(TRACE.requests[i]))
    async with gate:
        if i % 2:
            out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            return out.choices[0].text, out.model_extra["hypic"]
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].model_extra["hypic"]


async def _run(url: str) -> list[tuple[str, dict]]:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    gate = asyncio.Semaphore(CONCURRENCY)
    try:
        return await asyncio.gather(*(_one(client, gate, i) for i in range(REQUESTS)))
    finally:
        await client.close()


def test_load_no_errors_offline_answers_and_cache_integrity(load_server: LiveServer, load_llm: LLM) -> None:
    results = asyncio.run(_run(load_server.url))  # any failed request raises here
    assert len(results) == REQUESTS
    offline = [o.text for b in range(0, REQUESTS, 25) for o in load_llm.generate(
        [TRACE.segments(r) for r in TRACE.requests[b:b + 25]], SamplingParams(max_tokens=MAX_TOKENS))]
    mismatches = [i for i, ((text, _), want) in enumerate(zip(results, offline, strict=True)) if text != want]
    assert not mismatches, mismatches
    store = load_llm.engine.store
    assert store.check_integrity()
    stats = store.stats()
    assert stats.demotions > 0 and stats.evictions > 0 and stats.promotions > 0, stats
    assert stats.bytes["device"] <= 10 * ENTRY_BYTES and stats.bytes["host"] <= 6 * ENTRY_BYTES
    groups: dict[str, list[float]] = {"hit": [], "partial": [], "miss": []}
    for _, ext in results:
        groups[cache_outcome_of(ext)].append(ext["ttft_s"])
    print("\n" + ttft_table(f"Load: {REQUESTS} RAG requests, {CONCURRENCY} concurrent (server TTFT incl. queueing)",
                            groups))


def cache_outcome_of(ext: dict) -> str:
    from hypic.engine.request import RequestMetrics

    return cache_outcome(RequestMetrics(segment_hits=ext["segment_hits"], segment_misses=ext["segment_misses"]))


@pytest.fixture(scope="module")
def bench_server(model_dir: Path) -> Iterator[LiveServer]:
    """An unbounded cache: nothing a request needs is evicted before it reuses it."""
    live = serve(LLM(str(model_dir), device="cpu"), max_concurrent=1)
    yield live
    live.stop()


def test_ttft_with_and_without_hits(bench_server: LiveServer) -> None:
    """One request at a time, long documents: every segment cold (a fresh tenant salt), then the
    same documents in reverse order under that salt (every segment hot), then mode=full."""
    trace = generate_trace(12, num_requests=20, pool_size=64, num_docs=(6, 8), doc_tokens=(150, 250))
    client = AsyncOpenAI(base_url=f"{bench_server.url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def ttft(segments: list[str], **extra) -> tuple[float, dict]:
        out = await client.completions.create(model=MODEL, prompt=SEPARATOR.join(segments), max_tokens=1,
                                              temperature=0, extra_body=extra)
        return out.model_extra["hypic"]["ttft_s"], out.model_extra["hypic"]

    async def main() -> dict[str, list[float]]:
        groups: dict[str, list[float]] = {"no hits (cold)": [], "all hits": [], "mode=full": []}
        for i, r in enumerate(trace.requests):
            head, *docs, query = trace.segments(r)
            cold, ext = await ttft([head, *docs, query], cache_salt=f"bench-{i}")
            assert ext["segment_hits"] == 0
            hot, ext = await ttft([head, *reversed(docs), query], cache_salt=f"bench-{i}")
            assert ext["segment_misses"] == 0
            full, _ = await ttft([head, *reversed(docs), query], mode="full")
            for name, t in zip(groups, (cold, hot, full), strict=True):
                groups[name].append(t)
        await client.close()
        return groups

    groups = asyncio.run(main())
    print("\n" + ttft_table("Sequential: 20 RAG prompts of 6-8 documents (150-250 words each)", groups))
    assert statistics.median(groups["all hits"]) < statistics.median(groups["no hits (cold)"])
