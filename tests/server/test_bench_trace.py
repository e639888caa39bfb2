"""`hypic bench trace --url`: the same sweep against a live server over HTTP (real uvicorn, real
streaming), agreeing with the engine's own accounting of every request."""

import re
from pathlib import Path

import pytest

from hypic import LLM
from hypic.bench.trace import TraceLoad, make_trace, report, run
from hypic.bench.trace_targets import HttpTarget
from tests.server.conftest import API_KEY, serve

SMALL = dict(requests=5, warm=4, pool=12, num_docs=(2, 3), doc_tokens=(20, 40), max_tokens=3, slo_s=100.0)


def test_a_sweep_over_http(model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    llm = LLM(str(model_dir), device="cpu", cache_device_bytes=40 * 110_592)  # room for ~40 entries
    live = serve(llm, api_key=API_KEY, max_concurrent=4, max_queue=64)
    try:
        load = TraceLoad(**SMALL)
        trace = make_trace(load, [200.0])
        with pytest.raises(ValueError, match="cannot reach"):
            HttpTarget(live.url + "/nowhere", trace, api_key=API_KEY)
        target = HttpTarget(live.url, trace, api_key=API_KEY, answers=False)
        assert target.model == "tiny"
        probes = run(target, trace, load, ["prefix", "hypic"], [200.0])
        assert [(p.mode, p.rate) for p in probes] == [("prefix", 200.0), ("hypic", 200.0)]
        for p in probes:
            assert not p.errors and len(p.ttft) == load.requests and p.em is None and p.move_s is None
            # the client's clock holds the server's prefill, the queueing and the HTTP round trip
            assert all(c >= e > 0 for c, e in zip(p.ttft, p.engine_ttft, strict=True))
            assert 0 < len(p.itl) <= 2 * len(p.ttft) and min(p.itl) >= 0  # streamed chunks' gaps
        prefix, hypic = probes
        # each block's note: the server's prefill calls and decode counters over that block (a CPU server
        # never captures; this block's requests miss some documents, so some call had a cold part)
        notes = capsys.readouterr().err
        m = re.search(r"^trace hypic 200 QPS: prefill ([1-9]\d*) calls, (\d+) with a cold part; "
                      r"decode [1-9]\d* steps, 0 replayed, 0 captures", notes, re.M)
        assert m and 0 < int(m.group(2)) <= int(m.group(1))
        assert prefix.prompt_tokens == hypic.prompt_tokens > 0  # the same requests, counted by the server
        assert hypic.hits > 0 and prefix.hits <= hypic.hits  # warmed documents, reused in any order
        assert llm.engine.store.check_integrity()
        assert "over HTTP" in report(probes, load, [200.0], "t", url=live.url)
        # a mode's salt keeps its entries apart: a second hypic sweep starts cold again
        again = run(target, trace, TraceLoad(**{**SMALL, "warm": 0}), ["hypic"], [200.0])[0]
        assert again.misses > 0
    finally:
        live.stop()
