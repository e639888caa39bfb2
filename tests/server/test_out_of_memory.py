"""A prompt that does not fit in device memory: a 503 with Retry-After naming the cause, the next
request served, the counts in /metrics. The device running out is simulated by raising
``torch.OutOfMemoryError`` from the engine's real prefill above a prompt size (the engine's recovery
itself: tests/engine/test_out_of_memory.py)."""

import pytest
import torch

from hypic import LLM
from tests.server.conftest import MODEL, http_client, serve


@pytest.fixture(scope="module")
def tight(model_dir):
    llm = LLM(str(model_dir), device="cpu")
    real = llm.engine._assemble

    def assemble(prompts, mode, salts, metrics, warmed):
        if any(sum(len(s) for s in p) > 200 for p in prompts):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(prompts, mode, salts, metrics, warmed)

    llm.engine._assemble = assemble
    live = serve(llm, retry_after_s=2)
    yield http_client(live)
    live.stop()


def test_a_prompt_too_big_for_the_device_is_a_503_and_the_next_is_served(tight) -> None:
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    r = tight.post("/v1/completions", json={**body, "prompt": "tal " * 300})
    assert r.status_code == 503 and r.headers["Retry-After"] == "2"
    assert "device memory" in r.json()["error"]["message"]
    assert tight.post("/v1/completions", json={**body, "prompt": "a short question"}).status_code == 200
    metrics = tight.get("/metrics").text
    assert 'hypic_prefill_out_of_memory_total{outcome="failed"} 1.0' in metrics
    assert 'hypic_errors_total{kind="out_of_memory"} 1.0' in metrics
    # nothing was cached on the device when it ran out, so nothing was shed (tests/engine/test_out_of_memory.py)
    assert "hypic_cache_shed_total 0.0" in metrics and "hypic_cache_shed_bytes_total 0.0" in metrics


def test_a_streamed_response_that_fails_ends_with_response_failed(tight) -> None:
    """The Responses API's stream: an ``error`` event, then ``response.failed`` carrying the error —
    its last event, as OpenAI's streams end — and the server serves on."""
    import json

    with tight.stream("POST", "/v1/responses", json={"model": MODEL, "input": "tal " * 300, "stream": True,
                                                      "max_output_tokens": 2}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert "device memory" in events[2]["message"] and events[3]["response"]["status"] == "failed"
    assert events[3]["response"]["error"]["message"] == events[2]["message"]
    assert [e["sequence_number"] for e in events] == [0, 1, 2, 3]
    ok = tight.post("/v1/responses", json={"model": MODEL, "input": "a short question", "max_output_tokens": 2})
    assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete")
