"""A prompt's own log-probabilities (``Engine.prompt_logprobs``, ``SamplingParams.prompt_logprobs``):
every token's given the ones before it, checked token by token against transformers' model of the
same checkpoint in fp64 — in chunks of rows or all at once — and against the generation's first token."""

import random

import pytest
import torch
import transformers as T

from hypic import LLM, SamplingParams
from hypic.engine import scoring


@pytest.fixture(scope="module")
def llm(qwen3_5_path):
    return LLM(str(qwen3_5_path), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(qwen3_5_path):
    return T.Qwen3_5ForCausalLM.from_pretrained(str(qwen3_5_path), dtype=torch.float64).eval()


def _prompt(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize(("rows", "piece"), [(scoring.ROWS, scoring.PIECE), (7, scoring.PIECE), (scoring.ROWS, 10),
                                             (3, 11), (scoring.ROWS, 76), (scoring.ROWS, 77)])
def test_every_prompt_token_matches_fp64_transformers(llm, reference, monkeypatch, rows: int, piece: int) -> None:
    """In one forward or in pieces continuing each other's state (ragged last pieces, a last piece
    of one token, the prompt's exact length), one head chunk or many."""
    monkeypatch.setattr(scoring, "ROWS", rows)
    monkeypatch.setattr(scoring, "PIECE", piece)
    prompt = _prompt(0, [5, 40, 23, 9])  # segments: scored as one sequence, whatever the cache holds
    ids = [t for s in prompt for t in s]
    llm.engine.prewarm(prompt[1:3])  # cached documents change nothing: scoring is a full forward
    got = llm.engine.prompt_logprobs(prompt, top=4)
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        row = got[i]
        assert ids[i] in row and abs(row[ids[i]] - float(want[i - 1, ids[i]])) < 1e-4, i
        top = want[i - 1].topk(4)
        assert set(row) == set(top.indices.tolist()) | {ids[i]}, i  # the token, and the 4 likeliest
        for t, lp in row.items():
            assert abs(lp - float(want[i - 1, t])) < 1e-4, (i, t)


@pytest.mark.parametrize("piece", [scoring.PIECE, 13, 40])
def test_prompts_scored_together_match_fp64_transformers_each(llm, reference, monkeypatch, piece: int) -> None:
    """A batch packed into shared forwards (a harness's contexts): each prompt's scores are its own —
    with forwards of 13 or 40 tokens, prompts start beside others already going on and continue
    across forwards — each with its own ``top``; and one prompt's scores do not depend on its company."""
    monkeypatch.setattr(scoring, "PIECE", piece)
    prompts = [[t for s in _prompt(10 + k, [n]) for t in s] for k, n in enumerate([1, 30, 7, 52, 2, 19])]
    tops = [0, 3, 1, 5, 2, 0]
    got = scoring.score_prompts(llm.engine.model, llm.engine.device, prompts, tops)
    assert len(got) == len(prompts)
    for ids, top, scores in zip(prompts, tops, got, strict=True):
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0].log_softmax(-1)
        assert len(scores) == len(ids) and scores[0] is None
        for i in range(1, len(ids)):
            row = scores[i]
            assert abs(row[ids[i]] - float(want[i - 1, ids[i]])) < 1e-4, (len(ids), i)
            assert set(row) == set(want[i - 1].topk(top).indices.tolist()) | {ids[i]}, (len(ids), i)
    alone = scoring.score_prompt(llm.engine.model, llm.engine.device, prompts[3], 5)
    assert all(abs(a[t] - b[t]) < 1e-5 for a, b in zip(alone[1:], got[3][1:], strict=True) for t in a)


def test_shared_prefixes_group_a_questions_options() -> None:
    """Prompts sharing at least SHARED_MIN tokens, each with one of its own after them, grouped by
    their common prefix; a member that would shrink what the group saves starts its own."""
    context, other = list(range(3, 43)), list(range(100, 140))
    prompts = [context + [7], other + [1, 2], context + [8, 9], [5, 6], context + [7], context[:35] + [1], other + [3]]
    groups = sorted((n, sorted(m)) for n, m in scoring.shared_prefixes(prompts))
    assert groups == [(35, [0, 2, 4, 5]), (40, [1, 6])], groups
    assert [(n, sorted(m)) for n, m in scoring.shared_prefixes([context, context[:-1] + [0]])] == [(39, [0, 1])]
    assert scoring.shared_prefixes([context[:20] + [1], context[:20] + [2]]) == []  # under SHARED_MIN
    assert scoring.shared_prefixes([[1], [1]]) == []  # nothing of their own would be left


@pytest.mark.parametrize(("piece", "wave"), [(scoring.PIECE, scoring.WAVE), (13, 1)])
def test_a_shared_prefix_is_scored_once_and_each_prompt_as_alone(llm, reference, monkeypatch, piece: int,
                                                                  wave: int) -> None:
    """A harness's options of one question (one context, several continuations) and a duplicate, beside
    unrelated prompts: the context runs through the model once, and every prompt's rows, ranks and
    first-token logits are fp64 transformers' — in pieces of 13 tokens and in waves of one group too."""
    monkeypatch.setattr(scoring, "PIECE", piece)
    monkeypatch.setattr(scoring, "WAVE", wave)
    context = [t for s in _prompt(50, [70]) for t in s]
    prompts = [context + [11], context + [12, 13, 14], _prompt(51, [25])[0], context + [11],
               context[:40] + [t for s in _prompt(52, [9]) for t in s], _prompt(53, [40])[0]]
    tops = [2, 0, 3, 1, 4, 2]
    seen = []
    real = llm.engine.model.hidden_states
    monkeypatch.setattr(llm.engine.model, "hidden_states", lambda ids, ctx: seen.append(len(ids)) or real(ids, ctx))
    got = scoring.score_with_first(llm.engine.model, llm.engine.device, prompts, tops, first=[True] * len(prompts))
    groups = scoring.shared_prefixes(prompts)
    assert any(sorted(m)[:3] == [0, 1, 3] and n >= 40 for n, m in groups)  # the options share the context
    grouped = {k for _, m in groups for k in m}
    own = sum(len(p) for k, p in enumerate(prompts) if k not in grouped)
    assert sum(seen) == own + sum(n + sum(len(prompts[k]) - n for k in m) for n, m in groups) < \
        sum(len(p) for p in prompts)  # each shared prefix through the model once, each prompt's own after it
    for ids, top, rows, ranks, last in zip(prompts, tops, got.rows, got.ranks, got.first_logits, strict=True):
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0]
        logp = logits.log_softmax(-1)
        assert len(rows) == len(ranks) == len(ids) and rows[0] is None and ranks[0] is None
        for i in range(1, len(ids)):
            want = logp[i - 1]
            assert set(rows[i]) == set(want.topk(top).indices.tolist()) | {ids[i]}, (len(ids), i)
            assert all(abs(lp - float(want[t])) < 1e-4 for t, lp in rows[i].items()), (len(ids), i)
            assert ranks[i] == int((want > want[ids[i]]).sum()) + 1, (len(ids), i)
        assert float((last.double() - logits[-1]).abs().max()) < 1e-4


def _packs(lengths: list[int], max_seqs: int = 1 << 30) -> list[list[tuple[int, int, int]]]:
    """Every forward ``score_prompts`` would run for prompts of ``lengths``, its cap fixed."""
    done, packs = [0] * len(lengths), []
    while pack := scoring._next_pack(lengths, done, max_seqs):
        packs.append(pack)
    return packs


def test_packs_cover_each_prompt_in_order_within_the_piece(monkeypatch) -> None:
    """Every token scored once, each prompt's spans consecutive and in order, at most one span of a
    prompt per forward, no forward over ``PIECE`` tokens and every forward but the last full."""
    monkeypatch.setattr(scoring, "PIECE", 10)
    lengths = [3, 25, 1, 9, 14]
    packs = _packs(lengths)
    seen = {k: 0 for k in range(len(lengths))}
    for pack in packs:
        assert len({k for k, _, _ in pack}) == len(pack) and sum(b - a for _, a, b in pack) <= 10
        for k, a, b in pack:
            assert a == seen[k] and b > a
            seen[k] = b
    assert seen == dict(enumerate(lengths))
    assert all(sum(b - a for _, a, b in pack) == 10 for pack in packs[:-1])
    assert len(packs) == -(-sum(lengths) // 10)
    capped = _packs([2, 2, 2, 2, 2], max_seqs=2)  # room for five, two sequences a forward
    assert [[k for k, _, _ in p] for p in capped] == [[0, 1], [2, 3], [4]]


def test_a_forwards_sequences_are_capped_by_their_states_size(llm, monkeypatch) -> None:
    """Each sequence of a forward holds a whole state (48 MiB at the 9B shape): the first forward
    takes FIRST_SEQS prompts, the next as many as STATE_BYTES of states allow (measured on the
    first), and a prompt scored whole lets its state go; the scores stay each prompt's own."""
    seen = []
    real = scoring.SequenceContext.__init__

    def counted(self, states, lengths, device, **kw):
        seen.append(len(states))
        return real(self, states, lengths, device, **kw)

    one = scoring._state_bytes(_scored_state(llm))
    monkeypatch.setattr(scoring.SequenceContext, "__init__", counted)
    monkeypatch.setattr(scoring, "STATE_BYTES", 3 * one)
    prompts = [[t for s in _prompt(40 + k, [6]) for t in s] for k in range(12)]
    got = scoring.score_prompts(llm.engine.model, llm.engine.device, prompts, [1] * 12)
    assert seen == [scoring.FIRST_SEQS, 3, 3, 2]  # 4, then 3 a forward: 12 prompts
    for ids, scores in zip(prompts, got, strict=True):
        alone = scoring.score_prompt(llm.engine.model, llm.engine.device, ids, 1)
        assert all(abs(a[t] - b[t]) < 1e-5 for a, b in zip(scores[1:], alone[1:], strict=True) for t in b)


def _scored_state(llm):
    from hypic.models.context import SequenceContext, SequenceState
    from hypic.ops.transfer import to_device

    state = SequenceState()
    ctx = SequenceContext([state], [6], llm.engine.device)
    llm.engine.model.hidden_states(to_device([5, 6, 7, 8, 9, 10], llm.engine.device), ctx)
    return state


def test_the_last_prompt_position_scores_the_generated_token(llm) -> None:
    """Scoring the prompt plus the greedy token generated after it gives that token as the likeliest at
    the last position, with the log-probability the generation reported."""
    prompt = _prompt(1, [12, 30, 8])
    out = llm.generate([prompt], SamplingParams(max_tokens=1, logprobs=3, prompt_logprobs=2), mode="full")[0]
    first = out.token_ids[0]
    scored = llm.engine.prompt_logprobs([*prompt, [first]], top=1)
    assert max(scored[-1], key=scored[-1].get) == first
    assert abs(scored[-1][first] - out.logprobs[0][first]) < 1e-4
    ids = [t for s in prompt for t in s]  # SamplingParams.prompt_logprobs: the same scores, on the output
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    assert all(abs(a[t] - b[t]) < 1e-6 for a, b, t in zip(out.prompt_logprobs[1:], scored[1:len(ids)], ids[1:],
                                                                strict=True))
    plain = llm.generate([prompt], SamplingParams(max_tokens=1), mode="hypic")[0]
    assert plain.prompt_logprobs is None and plain.token_ids == out.token_ids


@pytest.mark.parametrize("piece", [scoring.PIECE, 9])
def test_first_token_logits_come_from_the_scoring_forward(llm, reference, monkeypatch, piece: int) -> None:
    """``score(first=…)``: the logits of the token after each prompt that asks, from its last row —
    in a shared forward or in pieces (9 tokens: prompts end mid-forward and at a piece's end) — equal
    fp64 transformers' last row, and the prompts' rows are the same as without."""
    monkeypatch.setattr(scoring, "PIECE", piece)
    prompts = [_prompt(20 + k, [n]) for k, n in enumerate([1, 17, 9, 30])]
    got = llm.engine.score(prompts, 2, first=[True, False, True, True])
    assert got.rows == llm.engine.prompts_logprobs(prompts, 2)
    assert got.first_logits[1] is None
    for k in (0, 2, 3):
        with torch.no_grad():
            want = reference(torch.tensor(prompts[k])).logits[0, -1]
        row = got.first_logits[k]
        assert row.device == llm.engine.device and row.dtype == torch.float32 and row.shape == want.shape
        assert float((row.double() - want).abs().max()) < 1e-4, k
    for prompt, ranks in zip(prompts, got.ranks, strict=True):  # each token's rank in its position's distribution
        ids = prompt[0]
        with torch.no_grad():
            logp = reference(torch.tensor([ids])).logits[0].log_softmax(-1)
        assert ranks == [None] + [int((logp[i - 1] > logp[i - 1, ids[i]]).sum()) + 1 for i in range(1, len(ids))]
    with pytest.raises(ValueError, match="first: expected one flag per prompt"):
        llm.engine.score(prompts, 2, first=[True])


def test_a_one_token_answer_drawn_from_given_logits_is_the_full_prefills(llm) -> None:
    """``start(first_logits=…)`` prefills nothing (the cache and the prefill counter untouched) and
    draws what a ``full`` prefill's logits draw — greedy, seeded with a bias, its logprobs alike —
    its metrics counting the whole prompt computed; a run that would need a decode state is refused."""
    prompts = [_prompt(30, [6, 11]), _prompt(31, [25])]
    params = [SamplingParams(max_tokens=1, temperature=0, logprobs=3),
              SamplingParams(max_tokens=1, temperature=0.9, seed=7, logit_bias={5: 2.0}, logprobs=1)]
    want = llm.engine.start(prompts, params, mode="full")
    scored = llm.engine.score(prompts, 0, first=[True, True])
    before = (llm.engine.prefill_tokens, llm.engine.store.stats().entries)
    got = llm.engine.start(prompts, params, mode="hypic", first_logits=scored.first_logits)
    assert (llm.engine.prefill_tokens, llm.engine.store.stats().entries) == before
    for g, w, prompt in zip(got, want, prompts, strict=True):
        assert g.done and g.output.finish_reason == w.output.finish_reason == "length"
        assert g.output.token_ids == w.output.token_ids
        assert all(abs(g.output.logprobs[0][t] - lp) < 1e-5 for t, lp in w.output.logprobs[0].items())
        assert g.output.metrics.recomputed_tokens == sum(len(s) for s in prompt)
    with pytest.raises(ValueError, match="max_tokens is 2"):
        llm.engine.start(prompts[:1], [SamplingParams(max_tokens=2)], first_logits=scored.first_logits[:1])
    with pytest.raises(ValueError, match="expected one per prompt"):
        llm.engine.start(prompts[:1], [SamplingParams(max_tokens=1)], first_logits=scored.first_logits)
    with pytest.raises(ValueError, match=r"expected shape"):
        llm.engine.start(prompts[:1], [SamplingParams(max_tokens=1)], first_logits=[torch.zeros(3)])


def test_scoring_with_one_token_is_the_prefill(llm, monkeypatch) -> None:
    """vLLM's scoring idiom (``max_tokens=1, prompt_logprobs=k``) on prompts whose token their mode
    draws as ``full`` does (one segment; or ``full``): one forward scores them and gives the token —
    the same token, logprobs and prompt scores as the two passes, TTFT covering the forward; a prompt
    of several segments under ``hypic``, or a second token, is prefilled by its mode."""
    prompts = [_prompt(40, [33]), _prompt(41, [12])]
    params = SamplingParams(max_tokens=1, logprobs=2, prompt_logprobs=1)
    plain = llm.generate(prompts, SamplingParams(max_tokens=1, logprobs=2), mode="hypic")
    assembled = []
    real = llm.engine._assemble_in_memory

    def spy(*args, **kwargs):
        assembled.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "_assemble_in_memory", spy)
    got = llm.generate(prompts, params, mode="hypic")
    assert assembled == []
    for g, p, prompt in zip(got, plain, prompts, strict=True):
        assert g.token_ids == p.token_ids and g.metrics.ttft_s > 0
        assert all(abs(g.logprobs[0][t] - lp) < 1e-5 for t, lp in p.logprobs[0].items())
        want = llm.engine.prompt_logprobs(prompt, top=1)
        assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(want)
        assert all(abs(a[t] - b[t]) < 1e-6 for a, b in zip(g.prompt_logprobs[1:], want[1:], strict=True) for t in b)
    llm.generate([_prompt(42, [10, 20])], params, mode="hypic")  # documents: hypic's own first token
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, prompt_logprobs=1), mode="full")
    assert assembled == [1, 1]


@pytest.mark.parametrize("call, needle", [
    (lambda e: e.prompt_logprobs([[5, 6]], top=21), "prompt_logprobs"),
    (lambda e: e.prompt_logprobs([[5, 6]], top=True), "prompt_logprobs"),
    (lambda e: e.prompt_logprobs([[], []]), "at least one token"),
    (lambda e: e.prompt_logprobs([[5, 10**6]]), "outside the vocabulary"),
])
def test_bad_input_is_refused_by_name_and_the_engine_goes_on(llm, call, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        call(llm.engine)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    assert llm.engine.prompt_logprobs([[5, 6, 7]])[1:] and llm.generate([[[5, 6, 7]]], SamplingParams(max_tokens=2))


@pytest.mark.gpu
def test_on_a_gpu_scores_equal_the_models_own_logits_and_the_cpus() -> None:
    """On the GPU (the fla kernels, chunks of rows, gathered on the device): the same scores as the
    model's whole-sequence logits on the GPU and as the same weights scored on the CPU (fp32)."""
    from hypic.bench.shapes import SHAPES
    from hypic.engine.engine import Engine
    from hypic.models.context import SequenceContext, SequenceState
    from hypic.models.random_init import random_model

    gpu_loaded = random_model(SHAPES["tiny"], device="cuda", dtype=torch.float32)
    cpu_loaded = random_model(SHAPES["tiny"], device="cpu", dtype=torch.float32)
    # the same weights, copied before either engine fuses its projections
    cpu_loaded.model.load_state_dict({k: v.cpu() for k, v in gpu_loaded.model.state_dict().items()})
    gpu, cpu = Engine(gpu_loaded), Engine(cpu_loaded)
    ids = [t % SHAPES["tiny"]["vocab_size"] for t in _prompt(3, [300])[0]]
    got = gpu.prompt_logprobs([ids], top=3)
    with torch.no_grad():
        ctx = SequenceContext([SequenceState()], [len(ids)], gpu.device)
        want = gpu.model(torch.tensor(ids, device="cuda"), ctx).log_softmax(-1).cpu()
    on_cpu = cpu.prompt_logprobs([ids], top=3)
    short = [[t % SHAPES["tiny"]["vocab_size"] for t in _prompt(4 + k, [n])[0]] for k, n in enumerate([40, 9, 120])]
    packed = gpu.prompts_logprobs([[ids], *([p] for p in short)], top=3)  # fla's varlen runs, one forward
    # each token's own log-probability (near-ties may rank the alternatives otherwise)
    assert max(abs(packed[0][i][ids[i]] - got[i][ids[i]]) for i in range(1, len(ids))) < 1e-2
    for p, scores in zip(short, packed[1:], strict=True):
        alone = gpu.prompts_logprobs([[p]], top=3)[0]
        # scored in other company, fla's varlen kernels cut and sum in tf32 otherwise: 3.1e-3 measured
        # (session 30); a row read at a wrong position or from another prompt's state is ≫ 0.1 off
        assert max(abs(scores[i][p[i]] - alone[i][p[i]]) for i in range(1, len(p))) < 1e-2
    for i in range(1, len(ids)):
        assert abs(got[i][ids[i]] - float(want[i - 1, ids[i]])) < 1e-3, i
    # against the CPU a looser bound: fla's kernels multiply fp32 in tf32 (10-bit mantissas), the CPU
    # in full fp32 — the largest difference over the 299 positions measured 7.1e-3 (session 21); a
    # row scored at the wrong position is off by ≫ 0.1
    off = max(abs(got[i][ids[i]] - on_cpu[i][ids[i]]) for i in range(1, len(ids)))
    assert off < 2e-2, off
    # the first-token logits the same packed forward gives (echo's one token) are a `full` prefill's
    prompts = [[ids], *([p] for p in short)]
    first = gpu.score(prompts, 3, first=[True] * len(prompts)).first_logits
    full, _ = gpu.prefill_logits(prompts, mode="full")
    gap = max(float((row.to(full.device) - full[k]).abs().max()) for k, row in enumerate(first))
    assert gap < 2e-2, gap


def test_scoring_stops_between_pieces_and_frees_the_engine_between_them(llm, monkeypatch) -> None:
    """``stop`` is asked before each piece and its reason ends the scoring; between pieces the
    engine's lock is free (another request's step can run), and a stopped scoring leaves the engine
    serving."""
    monkeypatch.setattr(scoring, "PIECE", 16)
    prompt = _prompt(3, [70])
    asked, free_between = [], []

    def stop() -> str | None:
        free_between.append(llm.engine._lock.acquire(blocking=False))
        if free_between[-1]:
            llm.engine._lock.release()
        asked.append(len(asked))
        return "the client left" if len(asked) == 3 else None

    with pytest.raises(scoring.ScoringStopped, match="the client left"):
        llm.engine.prompt_logprobs(prompt, stop=stop)
    assert len(asked) == 3 and all(free_between)  # pieces 1 and 2 ran, the third was not started
    whole = llm.engine.prompt_logprobs(prompt, stop=lambda: None)
    assert len(whole) == 70 and llm.generate([prompt], SamplingParams(max_tokens=2))[0].token_ids
