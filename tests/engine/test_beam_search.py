"""Beam search (vLLM's ``LLM.beam_search``): one beam is greedy decoding; several are the beams a
direct search over `full`'s logits keeps; EOS completes a beam; the documents are cached once and
no beam's tokens become an entry; bad parameters are refused by name."""

import pytest
import torch

from hypic import LLM, BeamSearchParams, SamplingParams
from hypic.engine.beam_search import score
from tests.engine.test_families import _segments


@pytest.fixture(scope="module")
def llm(qwen3_5_path):
    return LLM(str(qwen3_5_path), device="cpu")


def test_one_beam_is_greedy_decoding(llm) -> None:
    prompts = [_segments(1, [30, 40, 6]), _segments(2, [25, 5])]
    got = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True), mode="full")
    want = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), mode="full")
    for out, greedy, p in zip(got, want, prompts, strict=True):
        (beam,) = out.sequences
        assert beam.tokens == [t for s in p for t in s] + greedy.token_ids and beam.finish_reason == "length"


def reference(llm: LLM, prompt: list[list[int]], width: int, steps: int,
              eos: set[int]) -> list[tuple[list[int], float]]:
    """The search done directly: every beam's next-token log-probabilities from `full`'s logits of its
    whole text, the 2·width likeliest of each, the best `width` kept by vLLM's score."""
    start = [t for s in prompt for t in s]
    beams, done = [(start, 0.0)], []
    for _ in range(steps):
        grown = []
        for tokens, cum in beams:
            logits = llm.engine.prefill_logits([[*prompt[:-1], prompt[-1] + tokens[len(start):]]], mode="full")[0][0]
            top = torch.log_softmax(logits.double(), -1).topk(2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                (done if t in eos else grown).append((tokens + [t], cum + lp))
        key = lambda b: b[1] / (len(b[0]) - (b[0][-1] in eos)) ** 1.0  # noqa: E731
        beams = sorted(grown, key=key, reverse=True)[:width]
    return sorted(done + beams, key=key, reverse=True)[:width]


def test_several_beams_are_what_a_direct_search_keeps(llm, monkeypatch) -> None:
    prompt = _segments(3, [40, 30, 7])
    first = llm.engine.prefill_logits([prompt], mode="full")[0][0]
    eos = {int(first.argsort()[-2])}  # the second likeliest first token ends a beam at once
    monkeypatch.setattr(llm.engine, "eos", eos)
    got = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=4), mode="full")[0].sequences
    want = reference(llm, prompt, 3, 4, eos)
    assert [b.tokens for b in got] == [w[0] for w in want]
    assert all(abs(b.cum_logprob - w[1]) < 1e-4 for b, w in zip(got, want, strict=True))
    assert [score(b, eos, 1.0) for b in got] == sorted((score(b, eos, 1.0) for b in got), reverse=True)
    ended = [b for b in got if b.finish_reason == "stop"]
    assert ended and all(b.tokens[-1] in eos for b in ended)
    assert all(len(b.logprobs) == len(b.tokens) - sum(map(len, prompt)) for b in got)


def test_documents_are_cached_once_and_no_beam_becomes_an_entry(qwen3_5_path) -> None:
    llm = LLM(str(qwen3_5_path), device="cpu")
    prompt = _segments(4, [40, 60, 50, 6])
    # more tokens than the seam: long enough to be cached, were a beam's tokens ever a segment before the query
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=12, ignore_eos=True))[0]
    assert len(out.sequences) == 2 and llm.cache_stats()["entries"]["device"] == 3  # the segments before the query
    assert llm.engine.store.check_integrity()


def test_beams_are_ranked_by_vllms_score() -> None:
    """The summed log-probability over the length to the power ``length_penalty``, the prompt's tokens
    counted and a final EOS not."""
    from hypic import BeamSearchSequence

    ended, live = BeamSearchSequence([5] * 9 + [2], cum_logprob=-4.5), BeamSearchSequence([5] * 12, cum_logprob=-6.0)
    assert score(ended, {2}, 2.0) == -4.5 / 81 and score(live, {2}, 2.0) == -6.0 / 144
    assert score(ended, {2}, 0.0) == -4.5 and score(live, set(), 1.0) == -0.5


@pytest.mark.parametrize("changes, message", [
    ({"beam_width": 0}, r"beam_width: expected an integer in \[1, 10\]"),
    ({"beam_width": 11}, r"beam_width: expected an integer in \[1, 10\]"),
    ({"max_tokens": 0}, "max_tokens: expected an integer ≥ 1"),
    ({"temperature": 0.7}, "temperature: beam search scores the model's log-probabilities"),
    ({"length_penalty": float("nan")}, "length_penalty: expected a finite number"),
    ({"ignore_eos": 1}, "ignore_eos: expected a boolean"),
])
def test_bad_parameters_are_refused_by_name(changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **changes})


def test_bad_calls_are_refused_by_name(llm) -> None:
    with pytest.raises(ValueError, match="params: expected a BeamSearchParams"):
        llm.beam_search([[1, 2, 3]], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens: the prompt's 3 tokens plus"):
        llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=llm.max_positions))
