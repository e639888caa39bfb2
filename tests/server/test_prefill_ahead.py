"""``hypic serve --max-prefill-tokens``: a long cold prompt arriving while a stream decodes has its
documents prefilled ahead in slices, and the client sees an ordinary answer — a cold request's
usage and extension — while the stream goes on."""

from __future__ import annotations

import json
import re
import threading

from hypic import LLM, SamplingParams
from hypic.eval.trace import generate_trace
from hypic.llm import SEPARATOR
from tests.server.conftest import API_KEY, MODEL, http_client, serve


def _slices(metrics: str) -> int:
    return int(float(re.search(r'^hypic_prefill_calls_total\{cold="yes"\} (\S+)$', metrics, re.M).group(1)))


def test_a_long_cold_prompt_is_prefilled_ahead_while_a_stream_decodes(model_dir) -> None:
    llm = LLM(str(model_dir), device="cpu")
    trace = generate_trace(5, num_requests=2, pool_size=12, num_docs=(6, 6), doc_tokens=(40, 60))
    long = SEPARATOR.join(trace.segments(trace.requests[0]))
    want = llm.generate([trace.segments(trace.requests[0])], SamplingParams(max_tokens=4))[0].text  # whole
    llm.engine.store.clear()
    live = serve(llm, api_key=API_KEY, max_prefill_tokens=64)
    try:
        with http_client(live) as client:
            streamed, started = [], threading.Event()

            def stream() -> None:
                body = {"model": MODEL, "prompt": "a stream", "max_tokens": 400, "ignore_eos": True,
                        "temperature": 0, "stream": True}
                with client.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            streamed.append(json.loads(line[6:]))
                            started.set()

            t = threading.Thread(target=stream)
            t.start()
            assert started.wait(60)
            before = _slices(client.get("/metrics").text)
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": long, "max_tokens": 4,
                                                     "temperature": 0})
            during = len(streamed)
            t.join(120)
            after = _slices(client.get("/metrics").text)
            again = client.post("/v1/completions", json={"model": MODEL, "prompt": long, "max_tokens": 4,
                                                         "temperature": 0}).json()
    finally:
        live.stop()
    assert r.status_code == 200, r.text
    out = r.json()
    ext = out["hypic"]
    assert (ext["segment_hits"], ext["segment_misses"]) == (0, 7)  # the head and documents its own misses
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert after - before >= 3  # 6 documents of 40-60 tokens, at most one a slice over 64 → six slices, + its call
    assert 0 < during < 400  # the stream decoded meanwhile and was still going
    assert out["choices"][0]["text"] == want
    assert again["hypic"]["segment_hits"] == 7 and again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert llm.engine.store.check_integrity()
