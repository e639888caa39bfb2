"""Exactness of a linear-only model, hypic vs naive, eviction and tenant isolation (Qwen3.5, fp32, CPU);
the invariants every family shares are in test_families.py."""

import random

import pytest
import torch

from hypic import LLM, SamplingParams
from tests.engine.conftest import _qwen3_5

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


def test_linear_only_model_is_exact_for_seam_at_least_conv_width(linear_only_path) -> None:
    for seam in (3, 5, 8):
        llm = LLM(str(linear_only_path), device="cpu", seam=seam)
        prompt = _segments(4, [64, 100, 65, 17])
        assert _maxdiff(_logits(llm, prompt, "hypic"), _logits(llm, prompt, "full")) <= TOL


def test_reuse_stays_exact_on_an_8_bit_model(linear_only_path) -> None:
    """Activations are quantized per token, so a segment's projections do not depend on what
    surrounds it: a linear-only model's `hypic` answer is `full`'s, as in fp32."""
    llm = LLM(str(linear_only_path), device="cpu", seam=5, quantization="fp8")
    prompt = _segments(4, [64, 100, 65, 17])
    full = _logits(llm, prompt, "full")
    err = {m: _maxdiff(_logits(llm, prompt, m), full) for m in ("hypic", "naive")}
    assert err["hypic"] <= TOL and err["naive"] > 10 * err["hypic"], err


def test_zero_state_of_a_linear_only_model_is_the_query_alone(linear_only_path) -> None:
    """With no attention layer the documents can reach the query only through linear state, so
    ``zero_state`` (every run from a zero state) answers as if the query were the whole prompt — and
    that is far from the answer with the documents (the state they carry matters)."""
    llm = LLM(str(linear_only_path), device="cpu")
    prompt = _segments(11, [16, 200, 200, 200, 6])
    alone = _logits(llm, [prompt[-1]], "full")
    assert _maxdiff(_logits(llm, prompt, "zero_state"), alone) <= 1e-5  # measured 1.5e-7
    assert _maxdiff(_logits(llm, prompt, "full"), alone) > 1e-3  # measured 4.0e-3
    out = llm.generate([prompt], SamplingParams(max_tokens=3), mode="zero_state")[0]
    assert len(out.token_ids) == 3 and out.metrics.segment_hits == 4 and llm.engine.store.check_integrity()


def test_hypic_close_to_full_and_naive_far(llm) -> None:
    prompt = _segments(7, [16, 120, 120, 120, 10])
    full = _logits(llm, prompt, "full")
    err = {m: _maxdiff(_logits(llm, prompt, m), full) for m in ("hypic", "transition", "naive")}
    assert err["naive"] > 10 * err["hypic"], err
    assert err["naive"] > 1e-3, err  # far above fp32 noise (random weights make context matter little)


@pytest.mark.parametrize("promote_after", ["1", "2"])
def test_eviction_under_a_tiny_budget_keeps_results(qwen3_5_path, monkeypatch, promote_after: str) -> None:
    """Two prompts that share nothing, in turn, through a store that holds one entry per tier: each
    request's entries displace the other's (a request's own entries are pinned, so they never
    displace each other), and the answers stay what an unbounded store gives — whether host hits
    promote at once or are first served in place (``HYPIC_PROMOTE_AFTER``)."""
    monkeypatch.setenv("HYPIC_PROMOTE_AFTER", promote_after)
    roomy = LLM(str(qwen3_5_path), device="cpu")
    prompts = [_segments(9, [40, 60, 50, 8]), _segments(19, [30, 45, 8])]
    want = [_logits(roomy, p, "hypic") for p in prompts]
    entry_bytes = roomy.cache_stats()["bytes"]["device"] // 5
    tight = LLM(str(qwen3_5_path), device="cpu", cache_device_bytes=entry_bytes + 10, cache_host_bytes=entry_bytes + 10)
    for _ in range(3):
        for p, w in zip(prompts, want, strict=True):
            assert _maxdiff(_logits(tight, p, "hypic"), w) <= TOL
            stats = tight.cache_stats()
            assert stats["entries"]["device"] <= 1 and stats["entries"]["host"] <= 1
            assert tight.engine.store.check_integrity()
    assert stats["evictions"] > 0 and stats["demotions"] > 0
    assert tight.engine.store.promote_after == int(promote_after)
    monkeypatch.setenv("HYPIC_PROMOTE_AFTER", "0")
    with pytest.raises(ValueError, match="HYPIC_PROMOTE_AFTER"):
        LLM(str(qwen3_5_path), device="cpu")


def test_cache_salt_isolates_tenants(llm) -> None:
    prompt = _segments(10, [30, 40, 9])
    llm.generate([prompt], SamplingParams(max_tokens=1), cache_salt="tenant-a")
    other = llm.generate([prompt], SamplingParams(max_tokens=1), cache_salt="tenant-b")[0]
    assert other.metrics.segment_hits == 0 and other.metrics.cached_tokens == 0
    same = llm.generate([prompt], SamplingParams(max_tokens=1), cache_salt="tenant-a")[0]
    assert same.metrics.segment_hits == 2


def test_addition_is_naive_without_the_rope_fix(llm) -> None:
    """``addition`` (the published straw man) differs from ``naive`` only in the RoPE phase of cached
    keys: where every cached segment starts at position 0 anyway (the head), the two are the same
    computation; a document further in gets keys at its standalone positions and the answer moves."""
    head_only = _segments(3, [24, 6])
    assert _maxdiff(_logits(llm, head_only, "addition"), _logits(llm, head_only, "naive")) <= 1e-6
    prompt = _segments(5, [16, 120, 120, 10])
    assert _maxdiff(_logits(llm, prompt, "addition"), _logits(llm, prompt, "naive")) > 1e-3
    out = llm.generate([prompt], SamplingParams(max_tokens=2), mode="addition")[0]
    assert len(out.token_ids) == 2 and out.metrics.segment_hits == 3  # decodes on after the straw-man prefill
    assert llm.engine.store.check_integrity()


def test_a_conv_kernel_of_width_one_keeps_no_tail_in_context_entries(tmp_path) -> None:
    """W = 1: a conv tail has no rows. An in-context entry's tail is its run's last W − 1 raw inputs,
    and ``[-0:]`` would have kept every row (a tail as long as the run, which no stack of tails fits)."""
    llm = LLM(str(_qwen3_5(tmp_path / "w1", linear_conv_kernel_dim=1)), device="cpu", cold="in_context")
    prompt = _segments(12, [20, 30, 9, 5])
    full = _logits(llm, prompt, "full")
    for _ in range(2):  # cold: entries extracted; warm: served, their tails stacked
        assert _maxdiff(_logits(llm, prompt, "hypic"), full) <= TOL
    assert all(t.shape[0] == 0 for e in llm.engine.store.entries() for t in e.conv_tails.values())
