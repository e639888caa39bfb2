"""`hypic bench trace` on the CPU: real-time replay through the serving loop, the sweep's stopping
rule, the sustainable-rate arithmetic, and the command line's errors."""

import pytest
import torch

from hypic import LLM
from hypic.bench.shapes import SHAPES
from hypic.bench.trace import Probe, TraceLoad, _ratio, make_trace, nearest_rank, report, run, sustainable
from hypic.bench.trace_targets import DevicePeak, EngineTarget
from hypic.cli import main
from hypic.engine.engine import Engine
from hypic.models.random_init import random_model

SMALL = dict(requests=5, warm=4, pool=12, num_docs=(2, 3), doc_tokens=(20, 40), max_tokens=4)


@pytest.fixture(scope="module")
def bundled() -> LLM:
    return LLM(device="cpu")


def test_replay_serves_every_request_and_counts_queueing(bundled: LLM) -> None:
    load = TraceLoad(**SMALL, slo_s=100.0)
    trace = make_trace(load, [500.0, 1000.0])
    target = EngineTarget(bundled.engine, trace, bundled.tokenizer, answers_from=bundled.tokenizer)
    probes = run(target, trace, load, ["prefix", "hypic"], [1000.0, 500.0])
    assert [(p.mode, p.rate) for p in probes] == [("prefix", 500.0), ("prefix", 1000.0),
                                                  ("hypic", 500.0), ("hypic", 1000.0)]  # ascending, per mode
    for p in probes:
        assert not p.errors and len(p.ttft) == load.requests
        # a client's TTFT holds the engine's prefill and whatever the request waited before it
        assert all(c >= e > 0 for c, e in zip(p.ttft, p.engine_ttft, strict=True))
        assert p.em is not None and 0 <= p.em <= 100
        # inter-token gaps: at most max_tokens − 1 a request (an answer may end sooner), none negative
        assert 0 < len(p.itl) <= (load.max_tokens - 1) * len(p.ttft) and min(p.itl) >= 0
    by = {(p.mode, p.rate): p for p in probes}
    for rate in (500.0, 1000.0):  # every mode meets the same requests at a rate
        assert by["prefix", rate].prompt_tokens == by["hypic", rate].prompt_tokens
    assert by["hypic", 500.0].hits > 0  # the warm-up filled the cache with the popular documents
    for p in probes:  # a request with a miss is counted once, however many documents it missed
        assert min(p.misses, 1) <= p.missing <= min(p.misses, len(p.ttft))
    assert all(p.moves == (0, 0, 0) for p in probes)  # an unbounded store never moves an entry
    assert bundled.engine.store.check_integrity()
    calls = bundled.engine.prefill_calls  # every call of the cached modes, warm-ups included
    assert 0 < calls["with_cold"] <= calls["calls"]
    table = report(probes, load, [500.0, 1000.0], "t")
    assert "| hypic | ≥ 1000 | ? (neither bounded) | – |" in table
    itl = [round(1e3 * q, 1) for q in (nearest_rank(by["hypic", 500.0].itl, 0.5), max(by["hypic", 500.0].itl))]
    assert f" | {itl[0]:.1f} / " in table and f" / {itl[1]:.1f} | " in table
    h = by["hypic", 500.0]
    assert f"| {100 * h.hits / (h.hits + h.misses):.0f}% ({100 * h.missing / len(h.ttft):.0f}%) |" in table


def test_the_sweep_stops_at_the_first_rate_over_the_slo() -> None:
    loaded = random_model(SHAPES["tiny"], device="cpu", dtype=torch.float32)
    from tokenizers import Tokenizer

    from hypic.llm import bundled_model_path
    tok = Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))
    probe_engine = Engine(loaded, seam=4)
    probe_engine.prewarm([list(range(30))])
    entry_bytes = probe_engine.store.stats().bytes["device"]  # one 30-token document's entry
    engine = Engine(loaded, seam=4, cache_device_bytes=3 * entry_bytes,  # room for about three
                    cache_host_bytes=None)  # the rest demoted (a CPU's auto host tier holds nothing)
    load = TraceLoad(**SMALL, slo_s=1e-6)
    trace = make_trace(load, [1.0, 2.0])
    probes = run(EngineTarget(engine, trace, tok), trace, load, ["full", "hypic"], [1.0, 2.0])  # ids wrap
    assert [(p.mode, p.rate) for p in probes] == [("full", 1.0), ("hypic", 1.0)]
    assert all(p.em is None and not p.sustained(load.slo_s) for p in probes)
    assert probes[0].moves == (0, 0, 0) and probes[1].moves[1] > 0  # hypic's documents overflow to the host
    assert probes[0].move_s == 0 and probes[1].move_s > 0
    assert engine.store.check_integrity()
    assert "| hypic | < 1 | – | – |" in report(probes, load, [1.0, 2.0], "t")


def _probe(mode: str, rate: float, p90_s: float, errors: int = 0) -> Probe:
    return Probe(mode, rate, ttft=[p90_s] * 10, errors=["x"] * errors)


def test_sustainable_rates_and_their_ratios() -> None:
    probes = [_probe("prefix", 1, 0.2), _probe("prefix", 2, 0.9), _probe("prefix", 4, 3.0),
              _probe("hypic", 1, 0.1), _probe("hypic", 2, 0.1), _probe("hypic", 4, 0.3), _probe("hypic", 8, 0.5),
              _probe("full", 1, 0.5), _probe("full", 2, 0.5, errors=1)]
    assert sustainable(probes, "prefix", 1.0) == (2, False)
    assert sustainable(probes, "hypic", 1.0) == (8, True)  # never failed: a lower bound
    assert sustainable(probes, "full", 1.0) == (1, False)  # a failed request fails the rate
    assert sustainable(probes, "none", 1.0) == (None, False)
    assert _ratio((8, True), (2, False)) == "≥ 4.00×"
    assert _ratio((2, False), (8, True)) == "≤ 0.25×"
    assert _ratio((2, False), (1, False)) == "2.00×"
    assert _ratio((None, False), (1, False)) == "–"
    q = Probe("m", 1, ttft=[float(i) for i in range(1, 11)])
    assert (q.quantile(0.5), q.quantile(0.9), q.quantile(0.99)) == (5.0, 9.0, 10.0)
    assert Probe("m", 1).quantile(0.9) == float("inf")


def test_quantiles_are_nearest_rank_so_a_p90_within_the_slo_means_90_percent_within() -> None:
    """The rank rounded up, never to the nearest: a block of 16 with 2 requests (12.5%) over a 1 s
    SLO reported its 14th value, 0.5 s, as its p90 and passed."""
    block = Probe("hypic", 8, ttft=[0.5] * 14 + [5.0] * 2)
    assert block.quantile(0.9) == 5.0 and not block.sustained(1.0)
    for n in range(1, 250):  # the smallest value with at least q of the values at or below it
        values = [float(i) for i in range(n, 0, -1)]
        for q in (0.5, 0.9, 0.99):
            v = nearest_rank(values, q)
            assert sum(x <= v for x in values) >= q * n - 1e-9 > sum(x < v for x in values), (n, q)
    rising = [float(i) for i in range(1, 65)]
    assert nearest_rank(rising[:48], 0.9) == 44 and nearest_rank(rising, 0.99) == 64  # --requests 48, 64
    # the prefill column ranks as the TTFT columns do (it took the upper median of an even count)
    even = Probe("m", 1, ttft=[1.0, 2.0, 3.0, 4.0], engine_ttft=[1.0, 2.0, 3.0, 4.0])
    assert "| m | 1 | 2000.0 | 4000.0 | 4000.0 | 2000.0 |" in report([even], TraceLoad(), [1.0], "t")


def test_the_lower_bound_of_a_mode_that_sustained_nothing_is_the_lowest_rate() -> None:
    """``--rates 8,4,2,1``: the sweep runs ascending, so a mode failing its first rate failed 1 QPS."""
    probes = [Probe("full", 1.0, ttft=[3.0] * 4), Probe("hypic", 1.0, ttft=[0.1] * 4),
              Probe("hypic", 2.0, ttft=[2.0] * 4)]
    table = report(probes, TraceLoad(requests=4, warm=0), [8.0, 4.0, 2.0, 1.0], "t")
    assert "| full | < 1 | – | – |" in table and "| hypic | 1 | – | – |" in table


def test_bad_arguments_are_named() -> None:
    """The library's own checks (the command line's: tests/bench/test_commands.py)."""
    with pytest.raises(ValueError, match="--slo-ms"):
        TraceLoad(slo_s=0)
    with pytest.raises(ValueError, match="--requests"):
        TraceLoad(requests=0)
    trace = make_trace(TraceLoad(**SMALL), [1.0])
    for rates in ([0.0], [float("nan")], []):
        with pytest.raises(ValueError, match="rates"):
            run(None, trace, TraceLoad(**SMALL), ["hypic"], rates)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the sweep needs"):
        run(None, trace, TraceLoad(**SMALL), ["hypic"], [1.0, 2.0])  # type: ignore[arg-type]


def test_the_peak_device_memory_is_the_runs_across_the_blocks_resets(monkeypatch) -> None:
    """Each block's note resets the allocator's peak (its line is its block's); the "peak" printed
    after the sweep read the allocator after the last note, so it covered only the time since then.
    CUDA's allocator simulated here: the bookkeeping only."""
    allocator = {"now": 0, "peak": 0}

    def allocate(nbytes: int) -> None:
        allocator["now"] += nbytes
        allocator["peak"] = max(allocator["peak"], allocator["now"])

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocator["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: allocator.update(peak=allocator["now"]))
    peak = DevicePeak(torch.device("cuda"))
    allocate(10)  # the first block's activations
    allocate(-8)
    peak.reset()
    allocate(3)  # the last block's
    allocate(-3)
    peak.reset()
    assert torch.cuda.max_memory_allocated() == 2 and peak.bytes() == 10
    allocate(20)
    assert peak.bytes() == 22


def test_the_command_with_a_cold_worker_writes_its_table(tmp_path) -> None:
    out = tmp_path / "trace.md"
    assert main(["bench", "trace", "--shape", "tiny", "--device", "cpu", "--workers", "1", "--modes", "hypic",
                 "--rates", "50", "--requests", "4", "--warm", "4", "--pool", "12", "--num-docs", "2,3",
                 "--doc-tokens", "20,40", "--max-tokens", "2", "--out", str(out)]) == 0
    text = out.read_text()
    assert "cold segments over 2 devices" in text and "| hypic | 50 |" in text and "Command: `hypic bench trace" in text


def test_profile_writes_the_serving_loops_statistics_per_mode(tmp_path, capsys) -> None:
    """``--profile``: the serving loop's thread under cProfile, its statistics saved per mode."""
    import pstats

    base = tmp_path / "loop.prof"
    assert main(["bench", "trace", "--shape", "tiny", "--device", "cpu", "--modes", "hypic,full", "--rates", "50",
                 "--requests", "3", "--warm", "2", "--pool", "8", "--num-docs", "2,3", "--doc-tokens", "20,30",
                 "--max-tokens", "2", "--profile", str(base), "--out", str(tmp_path / "t.md")]) == 0
    err = capsys.readouterr().err
    for mode in ("hypic", "full"):
        stats = pstats.Stats(f"{base}.{mode}")
        assert any(name == "step" for _, _, name in stats.stats)  # Engine.step ran on the profiled thread
        assert f"the serving loop's profile ({mode}" in err


@pytest.mark.gpu
def test_the_trace_on_a_gpu_serves_every_request_and_entries_own_their_memory() -> None:
    from tokenizers import Tokenizer

    from hypic.llm import bundled_model_path
    engine = Engine(random_model(SHAPES["tiny"], device="cuda", dtype=torch.bfloat16), seam=4)
    tok = Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))
    load = TraceLoad(**SMALL, slo_s=100.0)
    trace = make_trace(load, [200.0])
    probes = run(EngineTarget(engine, trace, tok), trace, load, ["full", "hypic"], [200.0])
    assert all(not p.errors and len(p.ttft) == load.requests for p in probes)
    assert probes[1].hits > 0 and engine.store.stats().budgets["device"] is not None  # "auto" is bounded here
    assert engine.store.check_integrity()  # the GPU kernels' entries are copies too, not views of a batch
