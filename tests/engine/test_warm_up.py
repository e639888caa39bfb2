"""The warm-up before serving: every path run once, and nothing of it left in the cache or the counters."""

import pytest
import torch

from hypic.engine import warm_up as warm
from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams
from hypic.models.loader import load_model


def _engine(path) -> Engine:
    return Engine(load_model(path, device="cpu", dtype=torch.float32), seam=4)


DOCS = [[5 + (7 * i + j) % 50 for j in range(30 + 11 * i)] for i in range(3)]
QUERY = [3, 9, 27, 81 % 50]


def _history(engine: Engine) -> None:
    """Traffic before the warm-up: documents cached, a prefix state kept, counters moved."""
    engine.prewarm(DOCS[:2])
    engine.generate([[DOCS[0], DOCS[2], QUERY]], [SamplingParams(max_tokens=3, temperature=0.0)])
    engine.generate([[DOCS[1], DOCS[0], QUERY]], [SamplingParams(max_tokens=2, temperature=0.0)], mode="prefix")


def _snapshot(engine: Engine) -> tuple:
    return (engine.store.stats(), sorted(e.key.digest for e in engine.store.entries()), engine.prefix.stats(),
            engine.prefill_tokens, dict(engine.prefill_calls), {k: list(v) for k, v in engine.cold_counts.items()},
            dict(engine.cold_failures), dict(engine.out_of_memory), dict(engine.cache_shed),
            repr(engine.decode_stats))


def test_warm_up_runs_every_path_and_leaves_cache_and_counters_as_they_were(qwen3_5_path, monkeypatch) -> None:
    engine = _engine(qwen3_5_path)
    _history(engine)
    before = _snapshot(engine)
    assert before[0].entries["device"] > 0 and before[2][0] > 0 and before[3] > 0  # a history to keep
    calls = []
    real = engine.generate

    def spy(prompts, params, *, mode="hypic", salts=None):
        outs = real(prompts, params, mode=mode, salts=salts)
        calls.append((mode, [(o.metrics.segment_misses, o.metrics.segment_hits, len(o.token_ids)) for o in outs]))
        return outs

    monkeypatch.setattr(engine, "generate", spy)
    done = warm.warm_up(engine)
    monkeypatch.undo()
    assert done.requests == 7 and done.tokens > 600 and done.seconds > 0
    assert [m for m, _ in calls] == ["full", "hypic", "hypic", "prefix", "prefix"]
    cold, warm_call = calls[1][1][0], calls[2][1]
    assert cold[0] == 1 + len(warm.DOCUMENTS) and cold[1] == 0  # the head and every document built cold
    assert warm_call[0][:2] == (0, 1 + len(warm.DOCUMENTS))  # then all hit, in another order
    assert all(n == warm.DECODE for _, outs in calls for *_, n in outs)  # decode ran (EOS ignored)
    assert _snapshot(engine) == before and engine.store.check_integrity()

    # and it changed nothing a request reads: the same next request as an engine that never warmed up
    twin = _engine(qwen3_5_path)
    _history(twin)
    for mode in ("hypic", "prefix"):
        prompt = [[DOCS[1], DOCS[0], DOCS[2], QUERY]]
        got, _ = engine.prefill_logits(prompt, mode=mode)
        want, _ = twin.prefill_logits(prompt, mode=mode)
        assert torch.equal(got, want), mode


def test_a_warm_up_that_fails_leaves_nothing_behind(qwen3_5_path, monkeypatch) -> None:
    engine = _engine(qwen3_5_path)
    _history(engine)
    before = _snapshot(engine)

    def broken(*args, **kwargs):
        raise RuntimeError("scoring broke")

    monkeypatch.setattr(engine, "score", broken)  # the last path: every other one has run
    with pytest.raises(RuntimeError, match="scoring broke"):
        warm.warm_up(engine)
    assert _snapshot(engine) == before and engine.store.check_integrity()


def test_out_of_memory_in_the_warm_up_keeps_the_budget_and_reports_the_fault(qwen3_5_path, monkeypatch) -> None:
    """A call out of memory makes the cache shed part of its device tier and lower the budget for
    good, measured against what the tier held then — during the warm-up, its own few entries. The
    budget comes back; the fault stays counted and is reported."""
    engine = _engine(qwen3_5_path)
    _history(engine)
    budget, floor = engine.store.budgets["device"], engine._shed_floor
    shed = []
    real_shed, real_prefix = engine._shed_device_tier, engine._prefix

    def shedding() -> None:
        real_shed()
        shed.append(engine.store.budgets["device"])

    def out_once(*args, **kwargs):
        if not shed:
            raise torch.OutOfMemoryError("simulated")
        return real_prefix(*args, **kwargs)

    monkeypatch.setattr(engine, "_shed_device_tier", shedding)
    monkeypatch.setattr(engine, "_prefix", out_once)  # the warm-up's first prefix call runs out, once
    done = warm.warm_up(engine)
    assert shed and shed[0] < budget  # it did shed, and lowered the budget
    assert engine.store.budgets["device"] == budget and engine._shed_floor == floor
    assert engine.cache_shed == {"times": 0, "bytes": 0}
    assert done.out_of_memory == 1 == engine.out_of_memory["retried"] and done.workers_lost == 0
    assert engine.store.check_integrity()


def test_the_counters_come_back_when_the_eviction_fails(qwen3_5_path, monkeypatch) -> None:
    engine = _engine(qwen3_5_path)
    _history(engine)
    before = (engine.prefill_tokens, dict(engine.prefill_calls), engine.store.hits, engine.store.misses)

    def broken(*args, **kwargs):
        raise RuntimeError("eviction broke")

    monkeypatch.setattr(engine, "evict_segments", broken)
    with pytest.raises(RuntimeError, match="eviction broke"):
        warm.warm_up(engine)
    assert (engine.prefill_tokens, dict(engine.prefill_calls), engine.store.hits, engine.store.misses) == before


def test_a_small_context_scales_the_prompts_down(qwen3_5_path, monkeypatch) -> None:
    engine = _engine(qwen3_5_path)
    engine.max_positions = 48
    longest = []
    real = engine.generate

    def spy(prompts, params, *, mode="hypic", salts=None):
        longest.extend(sum(map(len, p)) + q.max_tokens for p, q in zip(prompts, params, strict=True))
        return real(prompts, params, mode=mode, salts=salts)

    monkeypatch.setattr(engine, "generate", spy)
    assert warm.warm_up(engine).requests == 7 and longest and max(longest) <= 48
    engine.max_positions = warm.MIN_CONTEXT - 1  # too small to be worth it: nothing runs
    longest.clear()
    assert warm.warm_up(engine).requests == 0 and not longest


def test_every_device_gets_a_segment_longer_than_the_seam() -> None:
    lengths = [24, 40, 96, 200, 1000]
    segments = [[1] * n for n in lengths]
    assert warm._extra_count(8, segments, 6) == 1  # all five prefilled cold
    assert warm._extra_count(64, segments, 6) == 3  # 24 and 40 are all seam: in context, never cold
    assert warm._extra_count(64, segments, 2) == 0
    assert warm._extra_count(0, segments, 1) == 0


def test_the_documents_fit_the_context() -> None:
    assert warm._fitting(10**6) == list(warm.DOCUMENTS)
    assert warm._fitting(200) == [40, 96, 64] and sum(warm._fitting(1000)) == 1000
    assert warm._fitting(5) == [5]


def test_on_a_gpu_long_prompts_take_attentions_long_path_when_the_context_holds_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hypic.ops import attention

    n = attention.CUDNN_MIN_TOKENS
    assert attention.LONG_BUCKETS > 0 and warm._long_prompts("cuda", 262144) == [n + warm.ODD]  # one, padded
    assert attention.long_length(n + warm.ODD) > n + warm.ODD
    assert warm._long_prompts("cuda", n + warm.ODD) == []  # the context cannot hold it (and one token out)
    assert warm._long_prompts("cpu", 262144) == []  # cuDNN is CUDA's
    monkeypatch.setattr(attention, "LONG_BUCKETS", 0)  # exact lengths: a multiple of 64, and a length that is not
    assert warm._long_prompts("cuda", 262144) == [n, n + warm.ODD] and (n + warm.ODD) % 2 == 1
    assert warm._long_prompts("cuda", n + warm.ODD) == []


def test_with_a_tokenizer_the_structured_path_is_warmed_too(qwen3_5_path) -> None:
    """The bundled model has a tokenizer: the trie is built and a constrained answer runs; the tiny
    test model has none, and its warm-up leaves structured output alone."""
    from hypic.llm import LLM

    llm = LLM(device="cpu")
    assert llm.engine._token_vocab is None
    done = llm.warm_up()
    assert done.requests == 8 and llm.engine._token_vocab is not None
    assert llm.cache_stats()["entries"] == {"device": 0, "host": 0}
    bare = _engine(qwen3_5_path)
    assert warm.warm_up(bare).requests == 7 and bare._token_vocab is None
