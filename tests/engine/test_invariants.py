"""The exactness invariants of DESIGN §5 and the behaviour of cached reuse, on CPU in fp32."""

import random

import pytest
import torch

from hypic import LLM, SamplingParams

TOL = 1e-4


def _segments(seed: int, lengths: list[int], vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _logits(llm: LLM, prompt: list[list[int]], mode: str) -> torch.Tensor:
    return llm.engine.prefill_logits([prompt], mode=mode)[0][0]


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture
def llm(qwen3_5_path):
    return LLM(str(qwen3_5_path), device="cpu")


def test_one_segment_equals_full(llm) -> None:
    prompt = _segments(0, [90])
    for mode in ("hypic", "transition", "naive", "prefix"):
        assert _maxdiff(_logits(llm, prompt, mode), _logits(llm, prompt, "full")) <= TOL


def test_seam_covering_every_segment_equals_full(qwen3_5_path) -> None:
    llm = LLM(str(qwen3_5_path), device="cpu", seam=1000)
    prompt = _segments(1, [40, 70, 33, 20])
    assert _maxdiff(_logits(llm, prompt, "hypic"), _logits(llm, prompt, "full")) <= TOL


def test_prefix_equals_full_cold_and_warm(llm) -> None:
    docs = _segments(2, [30, 50, 40])
    for query in _segments(3, [10, 12]):
        prompt = docs + [query]
        got, metrics = llm.engine.prefill_logits([prompt], mode="prefix")
        assert _maxdiff(got[0], _logits(llm, prompt, "full")) <= TOL
    assert metrics[0].segment_hits == 3 and metrics[0].cached_tokens == 120


def test_linear_only_model_is_exact_for_seam_at_least_conv_width(linear_only_path) -> None:
    for seam in (3, 5, 8):
        llm = LLM(str(linear_only_path), device="cpu", seam=seam)
        prompt = _segments(4, [64, 100, 65, 17])
        assert _maxdiff(_logits(llm, prompt, "hypic"), _logits(llm, prompt, "full")) <= TOL


def test_reuse_in_new_positions_and_orders_equals_cold(qwen3_5_path) -> None:
    """Entries are position-free: a warm request in an unseen order equals that order computed cold."""
    head, *docs = _segments(5, [20, 60, 45, 80, 33])
    query = _segments(6, [9])[0]
    warm = LLM(str(qwen3_5_path), device="cpu")
    _logits(warm, [head, *docs, query], "hypic")  # fills the cache in one order
    for order in ([3, 1, 0, 2], [2, 3, 1, 0]):
        prompt = [head, *[docs[i] for i in order], query]
        got, m = warm.engine.prefill_logits([prompt], mode="hypic")
        assert m[0].segment_hits == 5 and m[0].segment_misses == 0 and m[0].cached_tokens > 0
        cold = LLM(str(qwen3_5_path), device="cpu")
        assert _maxdiff(got[0], _logits(cold, prompt, "hypic")) <= TOL


def test_hypic_close_to_full_and_naive_far(llm) -> None:
    prompt = _segments(7, [16, 120, 120, 120, 10])
    full = _logits(llm, prompt, "full")
    err = {m: _maxdiff(_logits(llm, prompt, m), full) for m in ("hypic", "transition", "naive")}
    assert err["naive"] > 10 * err["hypic"], err
    assert err["naive"] > 1e-3, err  # far above fp32 noise (random weights make context matter little)


def test_in_context_cold_equals_full_and_fills_the_cache(qwen3_5_path) -> None:
    """With every segment missing, the in-context strategy computes the whole prompt in context."""
    llm = LLM(str(qwen3_5_path), device="cpu", cold="in_context")
    prompt = _segments(8, [30, 70, 50, 11])
    got, m = llm.engine.prefill_logits([prompt], mode="hypic")
    assert m[0].segment_misses == 3
    assert _maxdiff(got[0], _logits(llm, prompt, "full")) <= TOL
    again, m2 = llm.engine.prefill_logits([prompt], mode="hypic")
    assert m2[0].segment_hits == 3
    assert llm.engine.store.check_integrity()


def test_eviction_under_a_tiny_budget_keeps_results(qwen3_5_path) -> None:
    roomy = LLM(str(qwen3_5_path), device="cpu")
    prompt = _segments(9, [40, 60, 50, 8])
    want = _logits(roomy, prompt, "hypic")
    entry_bytes = roomy.cache_stats()["bytes"]["device"] // 3
    tight = LLM(str(qwen3_5_path), device="cpu", cache_device_bytes=entry_bytes + 10, cache_host_bytes=entry_bytes + 10)
    for _ in range(3):
        assert _maxdiff(_logits(tight, prompt, "hypic"), want) <= TOL
        stats = tight.cache_stats()
        assert stats["entries"]["device"] <= 1 and stats["entries"]["host"] <= 1
        assert tight.engine.store.check_integrity()
    assert stats["evictions"] + stats["demotions"] > 0


def test_cache_salt_isolates_tenants(llm) -> None:
    prompt = _segments(10, [30, 40, 9])
    llm.generate([prompt], SamplingParams(max_tokens=1), cache_salt="tenant-a")
    other = llm.generate([prompt], SamplingParams(max_tokens=1), cache_salt="tenant-b")[0]
    assert other.metrics.segment_hits == 0 and other.metrics.cached_tokens == 0
    same = llm.generate([prompt], SamplingParams(max_tokens=1), cache_salt="tenant-a")[0]
    assert same.metrics.segment_hits == 2
