"""The offline API: generation, sampling, logprobs, metrics, concurrency, and bad input."""

import json
import math
import random
import threading

import pytest
import torch

from hypic import LLM, SamplingParams
from hypic.llm import bundled_model_path


def _segments(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def llm(qwen3_5_path):
    return LLM(str(qwen3_5_path), device="cpu")


def test_generate_greedy_matches_full_and_reports_metrics(llm) -> None:
    prompt = _segments(0, [20, 50, 40, 8])
    sp = SamplingParams(max_tokens=6)
    full = llm.generate([prompt], sp, mode="full")[0]
    cold = llm.generate([prompt], sp)[0]
    warm = llm.generate([prompt], sp)[0]
    assert len(full.token_ids) == 6 and full.finish_reason == "length"
    assert cold.metrics.segment_misses == 3 and cold.metrics.cached_tokens == 0
    assert warm.metrics.segment_hits == 3 and warm.metrics.cached_tokens == (20 - 8) + (50 - 8) + (40 - 8)
    assert warm.metrics.recomputed_tokens == 3 * 8 + 8 and warm.metrics.prompt_tokens == 118
    assert warm.metrics.ttft_s > 0 and warm.token_ids == cold.token_ids


def test_batched_generate_equals_one_by_one(llm) -> None:
    prompts = [_segments(i, [30, 25 + i, 7]) for i in range(3)]
    sp = SamplingParams(max_tokens=5)
    together = llm.generate(prompts, sp, mode="full")
    alone = [llm.generate([p], sp, mode="full")[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_a_batch_past_max_num_seqs_decodes_in_turns_with_the_same_answers(llm, qwen3_5_path) -> None:
    """``LLM(max_num_seqs=2)``: five prompts (one with n = 2, one ending at its first token) start as
    slots free up, never more than two answers decoding or prefilled at once, and every answer is
    the one the unbounded batch gives — greedy, and seeded samples."""
    small = LLM(str(qwen3_5_path), device="cpu", max_num_seqs=2)
    starts, steps = [], []
    start, step = small.engine.start, small.engine.step
    small.engine.start = lambda prompts, *a, **k: starts.append(len(prompts)) or start(prompts, *a, **k)
    small.engine.step = lambda runs: steps.append(len(runs)) or step(runs)
    prompts = [_segments(40 + i, [30, 10 + 3 * i, 7]) for i in range(5)]
    params = [SamplingParams(max_tokens=m) for m in (3, 7, 1, 5)]
    params.append(SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=3))
    got = small.generate(prompts, params)
    want = llm.generate(prompts, params)
    answers = [[o.token_ids for o in (out, *out.others)] for out in got]
    assert answers == [[o.token_ids for o in (out, *out.others)] for out in want]
    assert [len(a) for a in answers] == [1, 1, 1, 1, 2] and [len(t) for t in answers[1]] == [7]
    assert max(starts) <= 2 and sum(starts) == 6 and max(steps) == 2  # six answers, two at a time
    assert len(starts) >= 3  # later prompts started as earlier answers ended
    with pytest.raises(ValueError, match="max_num_seqs: expected an integer ≥ 1, got 0"):
        LLM(str(qwen3_5_path), device="cpu", max_num_seqs=0)


def test_priority_orders_who_starts_when_slots_are_short(qwen3_5_path) -> None:
    """vLLM's ``generate(..., priority=[...])``: past ``max_num_seqs``, a lower value starts first,
    ties in the prompts' order; the outputs keep the prompts' order and their answers."""
    one = LLM(str(qwen3_5_path), device="cpu", max_num_seqs=1)
    started = []
    start = one.engine.start
    one.engine.start = lambda prompts, *a, **k: started.extend(p[1][0] for p in prompts) or start(prompts, *a, **k)
    prompts = [_segments(60 + i, [20, 8, 5]) for i in range(4)]
    sp = SamplingParams(max_tokens=2)
    got = one.generate(prompts, sp, priority=[3, -1, 3, 0])
    assert started == [prompts[i][1][0] for i in (1, 3, 0, 2)]
    assert [o.token_ids for o in got] == [o.token_ids for o in one.generate(prompts, sp)]
    for bad in ([1], [1, 2, 3, True], "0123"):
        with pytest.raises(ValueError, match="priority: expected one integer per prompt"):
            one.generate(prompts, sp, priority=bad)


def test_a_generate_that_fails_midway_leaves_no_decode_state_behind(qwen3_5_path) -> None:
    """A decode step that raises in the second wave: the error reaches the caller, and every run
    started — the wave decoding, and the first wave's runs that had ended — holds no batch."""
    small = LLM(str(qwen3_5_path), device="cpu", max_num_seqs=2)
    started, steps = [], []
    start, step = small.engine.start, small.engine.step

    def failing_step(runs):
        steps.append(len(runs))
        if len(steps) == 4:
            raise RuntimeError("the device fell over")
        return step(runs)

    small.engine.start = lambda *a, **k: started.extend(out := start(*a, **k)) or out
    small.engine.step = failing_step
    prompts = [_segments(60 + i, [30, 12, 7]) for i in range(4)]
    with pytest.raises(RuntimeError, match="the device fell over"):
        small.generate(prompts, SamplingParams(max_tokens=3))
    assert len(started) == 4 and all(r.done and r.state.batch is None for r in started)
    small.engine.step = step  # the engine serves on
    assert len(small.generate(prompts[:1], SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_stacked_decode_state_is_freed_when_every_run_has_ended(llm) -> None:
    """Runs that decode together share one DecodeBatch; one that ends leaves it at the next step,
    and the batch lets go of its tensors after the last step of its last run (not whenever the
    cycle collector gets to it)."""
    prompts = [_segments(20 + i, [30, 12 + 5 * i, 7]) for i in range(3)]
    runs = llm.engine.start(prompts, [SamplingParams(max_tokens=n) for n in (2, 5, 9)], mode="full")
    assert llm.engine.eos == set()  # the test model has no eos: each run ends at its max_tokens
    llm.engine.step(runs)
    batch = runs[2].state.batch
    assert runs[0].done and batch is not None and len(batch.members) == 3 and batch.keys
    llm.engine.step(runs)
    assert runs[0].state.batch is None and len(batch.members) == 2  # left at the next step
    llm.engine.finish(runs)
    assert all(r.done and r.state.batch is None for r in runs)
    assert batch.members == [] and not (batch.keys or batch.linear or batch.conv)
    alone = [llm.generate([p], SamplingParams(max_tokens=n), mode="full")[0].token_ids
             for p, n in zip(prompts, (2, 5, 9), strict=True)]
    assert [r.output.token_ids for r in runs] == alone


def test_a_folder_that_is_not_a_path_is_a_value_error(llm, tmp_path, monkeypatch) -> None:
    for call in (lambda: LLM(5), lambda: llm.save_cache(5), lambda: llm.load_cache(["cache"])):
        with pytest.raises(ValueError, match="expected a folder path"):
            call()
    monkeypatch.chdir(tmp_path)  # "" is the working directory to pathlib: a save wrote (and pruned) there
    for call in (lambda: llm.save_cache(""), lambda: llm.load_cache("")):
        with pytest.raises(ValueError, match="folder: empty path"):
            call()
    (tmp_path / "file").write_text("not a folder")
    for folder in (tmp_path / "file", tmp_path / "file" / "below"):  # mkdir's FileExistsError, NotADirectoryError
        with pytest.raises(ValueError, match=f"folder: {tmp_path / 'file'} is a file, not a folder"):
            llm.save_cache(folder)
    assert list(tmp_path.iterdir()) == [tmp_path / "file"]


def test_a_run_keeps_its_first_logits_only_when_asked(llm) -> None:
    """A row of the call's logits is a view: a serving run holding it kept the call's whole
    [N, vocab] tensor alive until it ended. Kept on request (the quality runner), equal to prefill_logits'."""
    prompts = [_segments(60 + i, [20, 9]) for i in range(2)]
    sp = [SamplingParams(max_tokens=1)] * 2
    assert all(r.first_logits is None for r in llm.engine.start(prompts, sp, mode="full"))
    kept = llm.engine.start(prompts, sp, mode="full", keep_logits=True)
    want, _ = llm.engine.prefill_logits(prompts, mode="full")
    assert torch.equal(torch.stack([r.first_logits for r in kept]), want)


def test_sampling_is_seeded_and_logprobs_are_reported(llm) -> None:
    prompt = _segments(3, [40, 10])
    sp = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7, logprobs=3)
    a, b = llm.generate([prompt], sp)[0], llm.generate([prompt], sp)[0]
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == 8 and all(len(lp) >= 3 for lp in a.logprobs)
    for tok, lp in zip(a.token_ids, a.logprobs, strict=True):
        assert tok in lp and all(v <= 0 for v in lp.values())
    greedy = llm.generate([prompt], SamplingParams(max_tokens=1, logprobs=1))[0]
    assert max(greedy.logprobs[0], key=greedy.logprobs[0].get) == greedy.token_ids[0]
    # what is reported: log_softmax of the adjusted logits at temperature 1, before top-k/top-p/min-p
    # (vLLM's raw logprobs), whatever the draw's temperature and truncation
    raw = llm.generate([prompt], SamplingParams(max_tokens=1, logprobs=3))[0].logprobs[0]
    drawn = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.5, top_k=2, top_p=0.5, min_p=0.5,
                                                  seed=1, logprobs=3))[0]
    assert drawn.logprobs[0] == pytest.approx(raw)


@pytest.mark.parametrize(("presence", "frequency", "bias"), [(1.5, 0.7, None), (-2.0, -0.5, None),
                                                             (0.0, 0.0, {72: -100.0, 13: 4.5}), (1.0, 0.0, {13: 3.0})])
def test_adjustments_follow_their_definition_token_by_token(llm, presence: float, frequency: float,
                                                           bias: dict[int, float] | None) -> None:
    """Greedy decoding with penalties and a logit bias vs an independent reference: each step's logits
    from a whole `full` prefill of the prompt plus the tokens so far, adjusted by hand."""
    prompt = _segments(9, [40, 30, 6])  # its greedy answer repeats tokens within 16 (72 among them)
    sp = SamplingParams(max_tokens=16, presence_penalty=presence, frequency_penalty=frequency, logit_bias=bias,
                        logprobs=1)
    got = llm.generate([prompt], sp, mode="full")[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=16), mode="full")[0]
    assert got.token_ids != plain.token_ids  # the adjustments changed the answer: the check below bites
    for i, tok in enumerate(got.token_ids):
        logits = llm.engine.prefill_logits([prompt[:-1] + [prompt[-1] + got.token_ids[:i]]], mode="full")[0][0]
        want = logits.double()
        for t, b in (bias or {}).items():
            want[t] += b
        counts = torch.zeros_like(want)
        for t in got.token_ids[:i]:
            counts[t] += 1
        want = want - frequency * counts - presence * (counts > 0).double()
        assert want[tok] >= want.max() - 1e-4, (i, tok, int(want.argmax()))
        assert abs(got.logprobs[i][tok] - torch.log_softmax(want, -1)[tok].item()) < 1e-4


def test_a_strong_bias_forces_every_token(llm) -> None:
    out = llm.generate([_segments(9, [40, 6])], SamplingParams(max_tokens=5, logit_bias={13: 100.0}))[0]
    assert out.token_ids == [13] * 5
    with pytest.raises(ValueError, match="logit_bias: token id 1026"):
        llm.generate([_segments(9, [40, 6])], SamplingParams(logit_bias={1026: 1.0}))
    assert llm.generate([_segments(9, [40, 6])], SamplingParams(max_tokens=2))[0].token_ids  # still serving


def test_adjust_leaves_rows_without_adjustments_and_its_input_alone() -> None:
    from hypic.engine.sampling import TokenCounts, adjust

    logits = torch.arange(12, dtype=torch.float32).view(2, 6)
    before = logits.clone()
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={5: -2.0}), SamplingParams()]
    counts = [TokenCounts.of([1, 1, 4], 6, torch.device("cpu")), None]
    out = adjust(logits, params, [3, 2], counts)
    assert torch.equal(logits, before) and torch.equal(out[1], before[1])
    assert out[0].tolist() == [0.0, 1 - 0.5 - 0.5, 2.0, 3.0, 4 - 0.25 - 0.5, 5.0 - 2.0]
    assert adjust(logits, [SamplingParams(presence_penalty=1.0), SamplingParams()], [0, 0],
                  [TokenCounts(6, torch.device("cpu")), None]) is logits
    # every kind at once, each row by its own request, against the rows adjusted one at a time
    rows = torch.randn(4, 6)
    mixed = [SamplingParams(repetition_penalty=1.5, logit_bias={0: 3.0}),
             SamplingParams(frequency_penalty=1.0, min_tokens=5, stop_token_ids=[2]),
             SamplingParams(), SamplingParams(presence_penalty=-1.0, repetition_penalty=0.5)]
    hist = [[3], [1, 1], [], [5, 4]]
    made = [TokenCounts.of(h, 6, torch.device("cpu"), [0, 2] if p.repetition_penalty != 1.0 else None)
            if p.penalized or p.repetition_penalty != 1.0 else None for p, h in zip(mixed, hist, strict=True)]
    allowed = [None, None, torch.tensor([1, 4]), None]
    together = adjust(rows, mixed, [len(h) for h in hist], made, eos=[5], allowed=allowed)
    for i in range(4):
        alone = adjust(rows[i:i + 1], mixed[i:i + 1], [len(hist[i])], made[i:i + 1], eos=[5], allowed=allowed[i:i + 1])
        assert torch.equal(together[i], alone[0])
    assert together[1, 2] == together[1, 5] == float("-inf")  # min_tokens: the stop token and EOS
    assert together[2].isinf().tolist() == [True, False, True, True, False, True]
    assert together[0, 0] == pytest.approx((rows[0, 0] + 3.0).item() / 1.5 if rows[0, 0] + 3 > 0
                                           else (rows[0, 0] + 3.0).item() * 1.5)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_follows_its_definition_token_by_token(llm, penalty: float) -> None:
    """vLLM's repetition penalty over the prompt's and the generated tokens (a positive logit divided
    by it, a negative one multiplied), greedy, against whole `full` prefills adjusted by hand."""
    prompt = _segments(9, [40, 30, 6])
    sp = SamplingParams(max_tokens=12, repetition_penalty=penalty, logprobs=1)
    got = llm.generate([prompt], sp, mode="full")[0]
    assert got.token_ids != llm.generate([prompt], SamplingParams(max_tokens=12), mode="full")[0].token_ids
    seen = {t for s in prompt for t in s}
    for i, tok in enumerate(got.token_ids):
        want = llm.engine.prefill_logits([prompt[:-1] + [prompt[-1] + got.token_ids[:i]]], mode="full")[0][0].double()
        ids = torch.tensor(sorted(seen | set(got.token_ids[:i])))
        want[ids] = torch.where(want[ids] > 0, want[ids] / penalty, want[ids] * penalty)
        assert want[tok] >= want.max() - 1e-4, (i, tok, int(want.argmax()))
        assert abs(got.logprobs[i][tok] - torch.log_softmax(want, -1)[tok].item()) < 1e-4


def test_penalties_and_cuts_that_read_as_zero_in_fp32_leave_the_batch_drawing(llm) -> None:
    """A repetition penalty or top-p too small for fp32 (1e-300 reads as 0): the penalty's quotient
    stays finite (a seen token's logit at most ``LOGIT_LIMIT``), top-p keeps the likeliest — the row
    draws finite log-probabilities and the requests beside it get the tokens they get alone (they
    all failed with "logits are not finite", a decode step later for the penalty)."""
    prompts = [_segments(20 + i, [30, 8]) for i in range(3)]
    plain = SamplingParams(max_tokens=8, logprobs=1, ignore_eos=True)
    alone = [llm.generate([p], plain)[0].token_ids for p in prompts]
    for odd in (SamplingParams(max_tokens=8, logprobs=1, temperature=1.0, seed=1, repetition_penalty=1e-300,
                               ignore_eos=True),
                SamplingParams(max_tokens=8, logprobs=1, repetition_penalty=1e-300, ignore_eos=True),
                SamplingParams(max_tokens=8, logprobs=1, temperature=1.0, seed=1, top_p=1e-300, ignore_eos=True)):
        outs = llm.generate([*prompts, [[9]]], [plain, plain, plain, odd])
        assert [o.token_ids for o in outs[:3]] == alone
        assert all(math.isfinite(v) for lp in outs[3].logprobs for v in lp.values()), odd
    greedy = llm.generate([prompts[0]], plain)[0].token_ids  # top-p ≈ 0 keeps only the likeliest: greedy
    assert llm.generate([prompts[0]], SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=3,
                                                     top_p=1e-300))[0].token_ids == greedy


def test_min_p_top_k_and_top_p_keep_what_they_define_in_vllm_order() -> None:
    """The draw's distribution, cut as vLLM (V1) cuts it: min-p drops what is less likely than
    min_p × the likeliest, top-k then keeps the k likeliest and every token tied with the k-th, top-p
    then reads what is left, renormalised."""
    from hypic.engine.sampling import _filter

    def cut(probs: torch.Tensor, **kw) -> torch.Tensor:
        return _filter(probs[None], [SamplingParams(**kw)])[0]

    def kept(probs: torch.Tensor, **kw) -> list[int]:
        return torch.nonzero(cut(probs, **kw)).flatten().tolist()

    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    assert kept(probs, top_k=2) == [1, 3]
    assert kept(probs, top_k=3, top_p=0.7) == [1, 3]  # 0.4/.85 + 0.3/.85 ≥ 0.7
    assert kept(probs, min_p=0.5) == [1, 3] and kept(probs, min_p=0.3) == [1, 3, 4]
    for off in (0, -1, 5):
        assert torch.equal(cut(probs, top_k=off), probs)
    # min-p before top-p: min-p leaves [.4 .3 .2]/.9, whose top-p 0.75 is the first two; top-p first
    # would have kept the third (.4 + .3 < .75 of the whole)
    assert kept(torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05]), top_p=0.75, min_p=0.2) == [0, 1]
    # ties with the k-th are kept: top-k 1 among two equally likely tokens samples both
    tied = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.1])
    assert kept(tied, top_k=1) == [1, 2] and kept(tied, top_k=2) == [1, 2] and kept(tied, top_k=3) == [1, 2, 3]
    share = cut(tied, top_k=3, top_p=0.5)  # renormalised: .3/.8 + .3/.8 ≥ 0.5
    assert torch.nonzero(share).flatten().tolist() == [1, 2]
    # rows of one batch, each cut by its own request's parameters, as each alone
    rows = torch.stack([probs, tied, torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05]), probs])
    params = [SamplingParams(top_k=2), SamplingParams(top_k=3, top_p=0.5), SamplingParams(top_p=0.75, min_p=0.2),
              SamplingParams()]
    together = _filter(rows, params)
    for row, p, got in zip(rows, params, together, strict=True):
        alone = _filter(row[None], [p])[0]
        assert torch.allclose(got / got.sum(), alone / alone.sum())


def test_a_sampled_row_of_non_finite_logits_is_an_error_not_a_token_past_the_vocabulary() -> None:
    from hypic.engine.sampling import sample

    logits = torch.zeros(2, 7)
    logits[1, 3] = float("nan")
    sp = SamplingParams(temperature=1.0, seed=1)
    with pytest.raises(RuntimeError, match="not finite"):
        sample(logits, [SamplingParams(), sp], [None, torch.Generator().manual_seed(1)])
    with pytest.raises(RuntimeError, match="not finite"):  # asking for logprobs too (their gather came first)
        sample(logits, [SamplingParams(), SamplingParams(temperature=1.0, seed=1, logprobs=2)],
               [None, torch.Generator().manual_seed(1)])
    tokens, _ = sample(logits[:1], [sp], [torch.Generator().manual_seed(1)])
    assert 0 <= tokens[0] < 7
    # isolated: the broken row's token is -1 and the others keep theirs — a greedy row of NaN too
    # (argmax took the NaN's index, a token that looked valid)
    for broken in (sp, SamplingParams(logprobs=1)):
        tokens, tops = sample(logits, [SamplingParams(logprobs=1), broken], [None, torch.Generator().manual_seed(1)],
                              isolate=True)
        assert tokens[1] == -1 and tops[1] is None and 0 <= tokens[0] < 7 and tops[0] is not None
    with pytest.raises(RuntimeError, match="not finite"):
        sample(logits, [SamplingParams(), SamplingParams()], [None, None])  # greedy, not isolated


def test_a_rows_logprobs_are_its_own_whatever_the_batch_asks() -> None:
    """Tied values: the alternatives a row reports are those it reports alone (one top-k per k),
    with its sampled token's own log-probability; k 0 the sampled token's alone."""
    from hypic.engine.sampling import sample

    logits = torch.zeros(3, 8)
    logits[:, :6] = 1.0  # six tied likeliest tokens
    params = [SamplingParams(logprobs=2), SamplingParams(logprobs=5), SamplingParams(logprobs=0)]
    _, together = sample(logits, params, [None] * 3)
    for i, p in enumerate(params):
        _, alone = sample(logits[i:i + 1], [p], [None])
        assert together[i] == alone[0]
    assert list(together[2]) == [0] and len(together[1]) == 5


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_draw_follows_the_cut_distribution_and_its_seed(device: str) -> None:
    """Inverse-CDF draws on the logits' device: frequencies within 4.5 standard deviations of each
    token's probability (top-p/top-k/min-p cuts made first: a cut token is never drawn), and a seeded
    generator gives the same token whatever the batch around it."""
    from hypic.engine.sampling import _draw, _filter

    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15], device=device)
    n = 20_000
    for p, want in ((SamplingParams(), probs), (SamplingParams(top_p=0.75, min_p=0.2), None)):
        rows = _filter(probs.repeat(n, 1), [p] * n)
        gen = torch.Generator().manual_seed(3)
        tokens = _draw(rows, [gen] * n)
        assert tokens.device == probs.device  # drawn where the logits are
        freq = torch.bincount(tokens, minlength=5).double().cpu() / n
        expect = ((rows[0] / rows[0].sum()) if want is None else want).double().cpu()
        sigma = (expect * (1 - expect) / n).sqrt()
        assert ((freq - expect).abs() <= 4.5 * sigma + 1e-12).all(), (freq, expect)
        assert (freq[expect == 0] == 0).all()
    alone = [int(_draw(probs[None], [torch.Generator().manual_seed(s)])[0]) for s in range(20)]
    batch = _draw(probs.repeat(20, 1), [torch.Generator().manual_seed(s) for s in range(20)]).tolist()
    assert alone == batch and len(set(alone)) > 1


def test_sampled_tokens_stay_within_top_k_and_min_p(llm) -> None:
    """Seeded sampling at temperature 1 with top-k 3 (and then min-p 0.2): every drawn token is among
    the step's 3 likeliest (is at least 0.2 × the likeliest's probability), checked against whole
    `full` prefills; top-k 1 is greedy decoding whatever the seed."""
    prompt = _segments(4, [40, 30, 6])
    for sp, check in ((SamplingParams(max_tokens=8, temperature=1.0, top_k=3, seed=1),
                       lambda p, t: t in p.topk(3).indices.tolist()),
                      (SamplingParams(max_tokens=8, temperature=1.0, min_p=0.2, seed=2),
                       lambda p, t: p[t] >= 0.2 * p.max() - 1e-6)):
        got = llm.generate([prompt], sp, mode="full")[0]
        for i, tok in enumerate(got.token_ids):
            logits = llm.engine.prefill_logits([prompt[:-1] + [prompt[-1] + got.token_ids[:i]]], mode="full")[0][0]
            assert check(torch.softmax(logits.double(), -1), tok), (i, tok)
    greedy = llm.generate([prompt], SamplingParams(max_tokens=6))[0].token_ids
    for seed in (0, 1, 2):
        sp = SamplingParams(max_tokens=6, temperature=1.5, top_k=1, seed=seed)
        assert llm.generate([prompt], sp)[0].token_ids == greedy


def test_stop_tokens_eos_ignore_eos_and_min_tokens(llm, monkeypatch) -> None:
    """A stop token ends the output as EOS does (kept in token_ids); ``ignore_eos`` decodes past EOS;
    ``min_tokens`` makes EOS and the stop tokens impossible until then (the output then differs
    from plain greedy exactly where one was the likeliest)."""
    prompt = _segments(9, [40, 30, 6])
    plain = llm.generate([prompt], SamplingParams(max_tokens=8))[0].token_ids
    stop = plain[2]
    first = plain.index(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, stop_token_ids=[stop]))[0]
    assert out.token_ids == plain[:first + 1] and out.finish_reason == "stop"
    monkeypatch.setattr(llm.engine, "eos", {stop})
    assert llm.generate([prompt], SamplingParams(max_tokens=8))[0].token_ids == plain[:first + 1]
    past = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert past.token_ids == plain and past.finish_reason == "length"
    late = llm.generate([prompt], SamplingParams(max_tokens=8, min_tokens=first + 2, logprobs=1))[0]
    assert stop not in late.token_ids[:first + 2] and late.token_ids[:first] == plain[:first]
    assert late.token_ids[first] != stop and late.logprobs[first][late.token_ids[first]] > -1e9
    monkeypatch.setattr(llm.engine, "eos", set())
    with pytest.raises(ValueError, match="stop_token_ids: token id 1026"):
        llm.generate([prompt], SamplingParams(stop_token_ids=[1026]))
    assert llm.generate([prompt], SamplingParams(max_tokens=2))[0].token_ids == plain[:2]  # still serving


def test_concurrent_generate_calls(llm) -> None:
    prompts = [_segments(10 + i, [30, 40, 20, 6]) for i in range(4)]
    sp = SamplingParams(max_tokens=4)
    got: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        got[i] = llm.generate([prompts[i]], sp)[0].token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(got[i]) == 4 for i in range(4))
    assert llm.engine.store.check_integrity()
    assert [llm.generate([p], sp)[0].token_ids for p in prompts] == [got[i] for i in range(4)]


@pytest.mark.parametrize("prompt, needle", [
    ([], "empty"),
    ("", "empty prompt"),
    ([[1, 2], []], "empty segment"),
    ([[1, 2], [3, 99999]], "outside the vocabulary"),
    ([[1, 2], [3, -1]], "outside the vocabulary"),
    ([[1, 2.5]], "integers"),
    ([[1, 2], 7], "segment must be"),
    ([[1] * 5000], "exceed the model's limit"),
    (42, "expected"),
    (["text needs a tokenizer"], "tokenizer"),
])
def test_bad_input_raises_and_engine_survives(llm, prompt, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        llm.generate(prompt if prompt == [] or isinstance(prompt, (str, int)) else [prompt])
    assert llm.generate([[[5, 6, 7], [8, 9]]], SamplingParams(max_tokens=2))[0].token_ids
    assert llm.engine.store.check_integrity()


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(logprobs=-2), "logprobs"), (dict(seed="x"), "seed"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=True), "frequency_penalty"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={3: 101.0}), "logit_bias: token 3"), (dict(logit_bias=[3]), "logit_bias"),
    (dict(top_k=-2), "top_k"), (dict(top_k=2.0), "top_k"), (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=2.5), "repetition_penalty"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(seed=2**64), "seed"), (dict(seed=-2**63 - 1), "seed"),
    (dict(temperature=True), "temperature"), (dict(top_p=True), "top_p"),
    (dict(stop=["\udc80"]), "stop: a string holds a lone surrogate"),
    (dict(choice=["\ud800"]), "choice: a string holds a lone surrogate"),
])
def test_bad_sampling_params(kwargs, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_bad_engine_arguments(llm, qwen3_5_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="mode"):
        llm.generate([[[1, 2], [3]]], mode="magic")
    with pytest.raises(ValueError, match="seam"):
        LLM(str(qwen3_5_path), device="cpu", seam=-1)
    with pytest.raises(ValueError, match="cold"):
        LLM(str(qwen3_5_path), device="cpu", cold="lukewarm")
    with pytest.raises(ValueError, match="cache_device_bytes"):
        LLM(str(qwen3_5_path), device="cpu", cache_device_bytes=-5)
    with pytest.raises(ValueError, match="not a directory"):
        LLM("/nonexistent/model", device="cpu")
    monkeypatch.setenv("HYPIC_COMBINE_PRECISION", "fp8")  # a GPU switch, refused at start on any device
    with pytest.raises(ValueError, match="HYPIC_COMBINE_PRECISION"):
        LLM(str(qwen3_5_path), device="cpu")
    monkeypatch.delenv("HYPIC_COMBINE_PRECISION")
    assert torch.isfinite(llm.engine.prefill_logits([[[1, 2, 3], [4]]])[0]).all()
    ask = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat(ask, chat_template_kwargs="x")
    with pytest.raises(ValueError, match="tools"):
        llm.chat(ask, tools="get_weather")
    with pytest.raises(ValueError, match="saved"):
        llm.evict(["a document"], saved=3)


def test_evicted_documents_miss_and_leave_other_tenants_and_documents_alone(llm) -> None:
    """``evict_segments``: the document's entries (seamed and seamless modes alike) and the prefix
    states holding it go; other documents, and the same document under another salt, stay."""
    head, doc_a, doc_b, query = _segments(21, [12, 30, 25, 5])  # each document longer than the seam
    prompt = [head, doc_a, doc_b, query]
    for mode in ("hypic", "naive", "prefix"):
        llm.generate([prompt], SamplingParams(max_tokens=1), mode=mode)
    llm.generate([prompt], SamplingParams(max_tokens=1), cache_salt="other")
    with pytest.raises(ValueError, match="cache_salt: empty"):  # it would read unsalted entries
        llm.generate([prompt], SamplingParams(max_tokens=1), cache_salt="")
    assert llm.engine.evict_segments([doc_a, [7, 8, 9, 10] * 10]) == [True, False]
    again = {m: llm.generate([prompt], SamplingParams(max_tokens=1), mode=m)[0].metrics for m in ("hypic", "naive")}
    assert all(m.segment_misses == 1 and m.segment_hits == 2 for m in again.values())  # head and doc_b hit
    prefix = llm.generate([prompt], SamplingParams(max_tokens=1), mode="prefix")[0].metrics
    assert prefix.segment_hits == 1  # only the head's state survives: every longer prefix held doc_a
    other = llm.generate([prompt], SamplingParams(max_tokens=1), cache_salt="other")[0].metrics
    assert other.segment_misses == 0 and llm.engine.store.check_integrity()


def test_the_library_prewarms_and_evicts_documents_by_content(llm) -> None:
    doc, other = _segments(22, [30, 20])
    assert llm.prewarm([doc, other], cache_salt="lib") == [False, False]
    assert llm.prewarm([doc], cache_salt="lib") == [True]
    assert llm.evict([doc], cache_salt="lib") == [True] and llm.evict([doc], cache_salt="lib") == [False]
    assert llm.prewarm([doc, other], cache_salt="lib") == [False, True]  # only the evicted one rebuilt
    for call, needle in ((lambda: llm.evict([]), "documents"), (lambda: llm.prewarm([[10**6]]), r"documents\[0\]"),
                         (lambda: llm.evict([doc], cache_salt=5), "cache_salt")):
        with pytest.raises(ValueError, match=needle):
            call()
    assert llm.engine.store.check_integrity()


def test_a_document_no_prompt_could_hold_is_not_prewarmed(qwen3_5_path) -> None:
    """A document as long as the context fits no prompt (its query needs a token): its prefill was
    wasted, and unbounded (a 40 000-token text ran a minute past the bundled model's context)."""
    short = LLM(str(qwen3_5_path), device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match=r"documents\[1\]: 64 tokens exceed the model's limit of 63"):
        short.prewarm([[5] * 30, [6] * 64])
    assert short.cache_stats()["entries"]["device"] == 0  # refused before any was built
    assert short.prewarm([[6] * 63]) == [False]


def test_evicting_with_a_saved_cache_keeps_the_document_from_coming_back(qwen3_5_path, tmp_path) -> None:
    """``saved``: the document leaves the saved cache too (manifest first, then its file), so a
    restart that loads the folder does not bring it back; the other documents stay saved."""
    doc, other = _segments(23, [30, 20])
    first = LLM(str(qwen3_5_path), device="cpu")
    first.prewarm([doc, other])
    assert first.save_cache(tmp_path) == 2
    assert first.evict([doc], saved=tmp_path) == [True]
    assert first.evict([doc], saved=tmp_path) == [False]  # nothing left of it anywhere
    assert len(list(tmp_path.glob("*.entry"))) == 1  # its file is gone, the other stays
    restarted = LLM(str(qwen3_5_path), device="cpu")
    assert restarted.load_cache(tmp_path) == 1
    assert restarted.prewarm([doc, other]) == [False, True]  # the evicted one rebuilt, the other loaded
    # a saved folder that cannot be updated: the error names it, and every document left memory first
    (tmp_path / "manifest.json").write_text("{damaged")
    with pytest.raises(ValueError, match="unreadable manifest.json"):
        restarted.evict([doc, other], saved=tmp_path)
    assert restarted.prewarm([doc, other]) == [False, False]


def test_a_prompt_and_max_tokens_beyond_the_context_are_refused(tmp_path) -> None:
    """The bundled model with a 64-token context: prompt + max_tokens may fill it, not exceed it, in
    generate, stream and chat alike (the server's 400 says the same)."""
    bundled = bundled_model_path()
    for f in bundled.iterdir():
        (tmp_path / f.name).symlink_to(f)
    config = json.loads((bundled / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    short = LLM(str(tmp_path))
    prompt = "Profile of Mira. Mira lives in Quorvane and keeps bees on the roof."
    n = sum(len(s) for s in short.tokenize(prompt))
    fits = SamplingParams(max_tokens=64 - n, ignore_eos=True)
    assert len(short.generate(prompt, fits)[0].token_ids) == 64 - n
    assert len(list(short.stream(prompt, fits))[-1].output.token_ids) == 64 - n
    over = SamplingParams(max_tokens=65 - n, ignore_eos=True)
    needle = f"max_tokens: the prompt's {n} tokens plus {65 - n} to generate exceed the model's context of 64"
    with pytest.raises(ValueError, match=needle):
        short.generate(prompt, over)
    with pytest.raises(ValueError, match=needle):
        next(short.stream(prompt, over))
    with pytest.raises(ValueError, match=rf"max_tokens: prompts\[1\]'s {n} tokens plus {65 - n}"):
        short.generate([prompt, prompt], [fits, over])
    with pytest.raises(ValueError, match="max_tokens: the prompt's"):
        short.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=64))
    # max_tokens None (vLLM's meaning): up to the context
    rest = short.generate(prompt, SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert len(rest.token_ids) == 64 - n and rest.finish_reason == "length"
    assert len(list(short.stream(prompt, SamplingParams(max_tokens=None, ignore_eos=True)))[-1].output.token_ids) \
        == 64 - n
    with pytest.raises(ValueError, match="leave 0 of the model's context of 64"):
        short.engine.start([[list(range(3, 67))]], [SamplingParams(max_tokens=None)])
    with pytest.raises(ValueError, match=rf"leave {64 - n} of the model's context of 64 tokens, fewer than min_tokens"):
        short.generate(prompt, SamplingParams(max_tokens=None, min_tokens=64 - n + 1))


def test_cache_stats_count_the_prefix_modes_states(qwen3_5_path) -> None:
    """The ``prefix`` mode's kept states are not entries of the tiers; ``cache_stats`` shows how
    many and their bytes (each shared buffer once), and they go with the documents evicted."""
    llm = LLM(str(qwen3_5_path), device="cpu")
    head, doc, q1, q2 = _segments(31, [20, 60, 5, 6])
    assert (llm.cache_stats()["prefix_states"], llm.cache_stats()["prefix_bytes"]) == (0, 0)
    llm.generate([[head, doc, q1]], SamplingParams(max_tokens=1), mode="prefix")
    stats = llm.cache_stats()
    config = llm.loaded.config
    attention = sum(1 for k in llm.engine.model.kinds.kinds if k == "attention")
    kv_floor = attention * 80 * 2 * config["num_key_value_heads"] * config["head_dim"] * 4  # fp32 keys + values
    assert stats["prefix_states"] == 2 and stats["prefix_bytes"] >= kv_floor  # after the head, after head+doc
    llm.generate([[head, doc, q2]], SamplingParams(max_tokens=1), mode="prefix")  # the same states reused
    assert llm.cache_stats()["prefix_states"] == 2
    llm.evict([head])
    assert (llm.cache_stats()["prefix_states"], llm.cache_stats()["prefix_bytes"]) == (0, 0)


def test_the_prefix_modes_states_are_bounded_and_hold_their_own_bytes(qwen3_5_path) -> None:
    """A kept state holds its own bytes, not the forward's stack of every prompt (n copies of a prompt
    kept n times one state's bytes); the kept states take at most the device tier's budget, least
    recently used out first, and all go when the device runs out of memory (the engine spares memory)."""
    llm = LLM(str(qwen3_5_path), device="cpu", cache_device_bytes=None)
    head, doc, q = _segments(41, [20, 60, 5])
    llm.generate([[head, doc, q]], SamplingParams(max_tokens=1), mode="prefix")
    one = llm.cache_stats()["prefix_bytes"]
    many = LLM(str(qwen3_5_path), device="cpu", cache_device_bytes=None)
    many.generate([[head, doc, q]] * 8, SamplingParams(max_tokens=1), mode="prefix")  # one call of eight
    assert many.cache_stats()["prefix_states"] == 2 and many.cache_stats()["prefix_bytes"] == one
    bounded = LLM(str(qwen3_5_path), device="cpu", cache_device_bytes=int(2.5 * one))
    for seed in range(6):  # six distinct heads and documents: twelve states, room for about five
        h, d, q = _segments(100 + seed, [20, 60, 5])
        bounded.generate([[h, d, q]], SamplingParams(max_tokens=1), mode="prefix")
        assert bounded.cache_stats()["prefix_bytes"] <= int(2.5 * one)
    assert 2 <= bounded.cache_stats()["prefix_states"] < 12
    assert bounded.generate([[h, d, q]], SamplingParams(max_tokens=1), mode="prefix")[0].metrics.cached_tokens > 0
    bounded.engine._spare_memory(shed=False)
    assert (bounded.cache_stats()["prefix_states"], bounded.cache_stats()["prefix_bytes"]) == (0, 0)


@pytest.mark.gpu
def test_on_a_gpu_seeded_sampling_is_the_same_alone_and_in_a_batch() -> None:
    """The draw on the device: a seed gives the same tokens whatever the batch around it, with every
    cut (min-p, top-k, top-p) and greedy rows mixed in; stop strings end their own run only."""
    llm = LLM(device="cuda", dtype="float32")
    prompts = [["You are a careful reader.", f"Profile of Mira{i}. Mira lives in Quorvane.", "Tell me a story:"]
               for i in range(4)]
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=20, min_p=0.02, seed=8, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.3, seed=9, ignore_eos=True)]
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone
    assert len({tuple(a) for a in alone}) == 4
