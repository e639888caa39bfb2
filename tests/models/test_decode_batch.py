"""Stacked decode state (``DecodeBatch``): sequences join, leave and move between batches between
steps, and every step's logits stay what each sequence decoding on its own state gives; a released
state continues anywhere (another batch, a plain forward) from where it was."""

import pytest
import torch

from hypic.bench.shapes import SHAPES
from hypic.models import step_graph
from hypic.models.context import SequenceContext, SequenceState
from hypic.models.decode_batch import HEADROOM, DecodeBatch, DecodeStats, gather
from hypic.models.random_init import random_model

TOL = 1e-4  # fp32: the stacked step sums attention over padded rows in another order (≈ 1e-5 after 70 steps)


@pytest.fixture(scope="module")
def model():
    return random_model(dict(SHAPES["tiny"], num_hidden_layers=4), device="cpu", dtype=torch.float32).model


def _prefill(model, prompt: torch.Tensor) -> tuple[SequenceState, torch.Tensor]:
    state = SequenceState()
    ctx = SequenceContext([state], [len(prompt)], torch.device("cpu"))
    logits = model(prompt, ctx, model.last_token_rows(ctx.cu_seqlens))
    ctx.finish()
    return state, logits[0]


def _alone(model, state: SequenceState, token: int) -> torch.Tensor:
    ctx = SequenceContext([state], [1], torch.device("cpu"))
    out = model(torch.tensor([token]), ctx)[0]
    ctx.finish()
    return out


def _stacked(model, states: list[SequenceState], tokens: list[int]) -> torch.Tensor:
    batch, slots = gather(states, torch.device("cpu"))
    ids = [0] * len(states)
    for t, i in zip(tokens, slots, strict=True):
        ids[i] = t
    return batch.step(model, ids)[torch.tensor(slots)]


def test_joins_leaves_and_moves_keep_every_step_exact(model) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = {name: torch.randint(3, 500, (n,), generator=gen) for name, n in (("a", 40), ("b", 7), ("c", 90))}
    ref, mine, last = {}, {}, {}
    for name, p in prompts.items():
        ref[name], logits = _prefill(model, p)
        mine[name], _ = _prefill(model, p)
        last[name] = int(logits.argmax())
    # who decodes together at each step: c joins, a leaves and comes back alone, then all three again
    schedule = [("a", "b"), ("a", "b", "c"), ("b", "c"), ("a",), ("c", "a", "b"), ("c", "a", "b")] + [("b", "a")] * 130
    for group in schedule:
        got = _stacked(model, [mine[n] for n in group], [last[n] for n in group])
        for row, name in zip(got, group, strict=True):
            want = _alone(model, ref[name], last[name])
            assert (row - want).abs().max() <= TOL, (group, name)
            last[name] = int(want.argmax())
    assert mine["a"].batch is mine["b"].batch and mine["c"].batch is None  # c was released, loose again
    assert mine["b"].length == ref["b"].length == 7 + 135
    assert mine["a"].length == 40 + 135 > 90 + HEADROOM  # past the arena's first size: it regrew
    # and a released state continues in a plain forward
    mine["a"].batch.release([mine["a"]])
    assert (_alone(model, mine["a"], last["a"]) - _alone(model, ref["a"], last["a"])).abs().max() <= TOL


def test_a_finished_sequence_leaves_without_being_unpacked(model) -> None:
    a, _ = _prefill(model, torch.arange(3, 30))
    b, _ = _prefill(model, torch.arange(5, 12))
    _stacked(model, [a, b], [7, 8])
    b.done = True  # its run finished: no step will come
    _stacked(model, [a], [9])
    assert b.batch is None and not (b.linear or b.conv or b.kv)  # dropped, no copies made
    assert a.batch is not None and len(a.batch.members) == 1


def test_a_leaver_frees_a_slot_that_the_next_newcomer_takes_without_a_regrow(model) -> None:
    a, b, c, d = (_prefill(model, torch.arange(3, 3 + n))[0] for n in (20, 9, 30, 12))
    _stacked(model, [a, b, c], [5, 6, 7])
    batch = a.batch
    arena = next(iter(batch.keys.values()))
    _stacked(model, [a, c], [5, 7])  # b leaves: c's rows move into b's slot
    _stacked(model, [a, c, d], [5, 7, 8])  # d takes the spare slot
    assert batch.members == [a, c, d] and next(iter(batch.keys.values())) is arena  # no regrow, no copy of a or c


def test_a_longer_newcomer_grows_the_arenas_by_a_quarter_and_the_stats_count_it(model) -> None:
    stats = DecodeStats()
    a, _ = _prefill(model, torch.arange(3, 103))
    batch, _ = gather([a], torch.device("cpu"), stats=stats)
    batch.step(model, [5])
    cap = batch.cap  # the longest member plus the headroom, rounded up
    assert cap == 176
    b, _ = _prefill(model, torch.arange(3, 3 + cap - HEADROOM + 4))  # needs just a little more room
    batch, _ = gather([a, b], torch.device("cpu"), stats=stats)
    batch.step(model, [5, 6])
    assert batch.cap >= cap + cap // 4 and batch.slots == 2
    assert (stats.steps, stats.regrows, stats.captures, stats.replays) == (2, 2, 0, 0)  # the CPU never captures


def test_a_regrow_that_runs_out_of_memory_halfway_changes_nothing(model, monkeypatch) -> None:
    a, _ = _prefill(model, torch.arange(3, 20))
    batch, _ = gather([a], torch.device("cpu"))
    batch.step(model, [5])
    before = (batch.slots, batch.cap, {k: id(v) for d in (batch.linear, batch.conv, batch.keys) for k, v in d.items()})
    real, calls = torch.Tensor.new_zeros, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # a few arenas made, the rest not
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "new_zeros", failing)
    with pytest.raises(torch.OutOfMemoryError):
        batch._regrow(batch.slots + 4, batch.cap + 64)
    monkeypatch.setattr(torch.Tensor, "new_zeros", real)
    after = (batch.slots, batch.cap, {k: id(v) for d in (batch.linear, batch.conv, batch.keys) for k, v in d.items()})
    assert after == before and len(calls) == 3
    ref, _ = _prefill(model, torch.arange(3, 20))
    _alone(model, ref, 5)
    assert (batch.step(model, [7])[0] - _alone(model, ref, 7)).abs().max() <= TOL  # and it decodes on


def test_a_capture_out_of_memory_frees_cached_blocks_retries_and_never_refuses_the_model(model, monkeypatch) -> None:
    """The policy around ``torch.cuda.CUDAGraph`` (the capture itself is tested on the GPU below):
    out of memory → free the allocator's cached blocks and try once more; still out → None, the
    model not refused; any other capture failure refuses the model for good."""
    freed, outcomes = [], []

    def once(forward, device):
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(step_graph, "_capture_once", once)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: freed.append(True))
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 MiB")
    outcomes[:] = [oom, "graph"]
    assert step_graph.capture(model, lambda: None, torch.device("cpu")) == "graph" and freed == [True]
    ended = RuntimeError("operation failed due to a previous error during capture")
    ended.__context__ = oom  # capture_end failing after the OOM: still out of memory
    outcomes[:] = [ended, oom]
    with pytest.warns(RuntimeWarning, match="lack of memory"):
        assert step_graph.capture(model, lambda: None, torch.device("cpu")) is None
    assert len(freed) == 2 and not step_graph.refused(model) and not outcomes
    other = random_model(dict(SHAPES["tiny"], num_hidden_layers=4), device="cpu", dtype=torch.float32).model
    outcomes[:] = [RuntimeError("operation not permitted when stream is capturing")]
    with pytest.warns(RuntimeWarning, match="run eagerly"):
        assert step_graph.capture(other, lambda: None, torch.device("cpu")) is None
    assert step_graph.refused(other) and step_graph.capture(other, lambda: None, torch.device("cpu")) is None
    assert len(freed) == 2  # a refused model is not tried again


def test_a_batch_whose_capture_ran_out_of_memory_decodes_eagerly_then_captures_later(model, monkeypatch) -> None:
    """``DecodeBatch``: a capture that returns None for lack of memory leaves graphs on, and the next
    try comes ``OOM_RETRY_STEPS`` eager steps later (a stand-in graph replays the eager forward)."""
    from hypic.models import decode_batch

    tries = []

    class Replays:  # the captured step's contract: replay() gives the step's logits
        def __init__(self, forward):
            self.forward = forward

        def replay(self):
            return self.forward()

    def fake_capture(m, forward, device):
        tries.append(batch.eager_steps)
        return None if len(tries) == 1 else Replays(forward)

    monkeypatch.setattr(decode_batch, "capture", fake_capture)
    a, logits = _prefill(model, torch.arange(3, 40))
    ref, _ = _prefill(model, torch.arange(3, 40))
    batch, _ = gather([a], torch.device("cpu"))
    batch.graphs = True  # as on a GPU
    token = int(logits.argmax())
    for _ in range(decode_batch.OOM_RETRY_STEPS + 4):
        got = batch.step(model, [token])[0]
        want = _alone(model, ref, token)
        assert (got - want).abs().max() <= TOL
        token = int(want.argmax())
    assert tries == [1, 1 + decode_batch.OOM_RETRY_STEPS] and batch.graph is not None and batch.graphs
    assert batch.stats.captures == 1 and batch.stats.replays == 3  # steps 18–20: the capturing step replays too


def test_a_packed_state_cannot_be_packed_twice(model) -> None:
    state, _ = _prefill(model, torch.arange(3, 20))
    batch = DecodeBatch(torch.device("cpu"))
    batch.admit([state])
    with pytest.raises(ValueError, match="packed"):
        DecodeBatch(torch.device("cpu")).admit([state])
    with pytest.raises(ValueError, match="not a member"):
        DecodeBatch(torch.device("cpu")).release([state])


def _prefilled(model, dev, lengths, copies):
    """``copies`` lists of states, each holding every prompt prefilled; and each prompt's next token."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=gen).to(dev) for n in lengths]
    lists, last = [[] for _ in range(copies)], []
    for p in prompts:
        for states in lists:
            state = SequenceState()
            ctx = SequenceContext([state], [len(p)], dev)
            logits = model(p, ctx, model.last_token_rows(ctx.cu_seqlens).to(dev))
            ctx.finish()
            states.append(state)
        last.append(int(logits[0].argmax()))
    return lists, last


def _step(batch_states, last, who, dev, graphs):
    batch, slots = gather([batch_states[i] for i in who], dev, graphs=graphs)
    ids = [0] * len(who)
    for i, slot in zip(who, slots, strict=True):
        ids[slot] = last[i]
    return batch, slots, ids


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_stacked_decode_matches_decoding_alone(dtype) -> None:
    """fla's recurrent kernel over the stacked states and SDPA over the masked arena, against each
    sequence decoding on its own state (flash attention, no mask): fp32 to 1e-3, bf16 finite and
    within bf16 noise."""
    dev = torch.device("cuda")
    model = random_model(dict(SHAPES["tiny"], num_hidden_layers=8), device=dev, dtype=dtype).model
    (ref, mine), last = _prefilled(model, dev, (5, 77, 300), 2)
    # bf16: the two paths round keys, values and partial sums differently, and the differences carry
    # over 20 steps (0.10 against logits up to 3.3 when both convs summed in bf16 on the CPU; fp32: 1.2e-5)
    tol = 1e-3 if dtype == torch.float32 else 0.25
    for _ in range(20):
        batch, slots, ids = _step(mine, last, [0, 1, 2], dev, False)
        got = batch.step(model, ids)[torch.tensor(slots, device=dev)].float()
        assert torch.isfinite(got).all()
        for i, state in enumerate(ref):
            c = SequenceContext([state], [1], dev)
            want = model(torch.tensor([last[i]], device=dev), c)[0].float()
            c.finish()
            err = float((got[i] - want).abs().max())
            assert err <= tol, err
            last[i] = int(want.argmax())


@pytest.mark.gpu
@pytest.mark.parametrize("shared_pool", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_a_captured_step_replays_what_the_eager_step_computes(dtype, shared_pool, monkeypatch) -> None:
    """The same sequences decoded by two batches, one eager and one replaying captured CUDA graphs:
    the same logits at every step, through a leave and a join (the same graph, a spare slot) and
    past the arenas' first size (a regrow, a new capture — into the first one's pool when shared)."""
    monkeypatch.setattr(step_graph, "SHARED_POOL", shared_pool)
    dev = torch.device("cuda")
    model = random_model(dict(SHAPES["tiny"], num_hidden_layers=8), device=dev, dtype=dtype).model
    (eager, graphed), last = _prefilled(model, dev, (5, 77, 300), 2)
    captured: list = []  # the graphs themselves (an id could be reused once one is freed)
    for step in range(90):  # 300 + 64 headroom rows: outgrown at step 64
        who = [0, 2] if step in (40, 41) else [0, 1, 2]  # the second sequence sits two steps out
        batch, slots, ids = _step(eager, last, who, dev, False)
        want = batch.step(model, ids)[torch.tensor(slots, device=dev)].float()
        batch, slots, ids = _step(graphed, last, who, dev, True)
        got = batch.step(model, ids)[torch.tensor(slots, device=dev)].float()
        if batch.graph is not None and all(g is not batch.graph for g in captured):
            captured.append(batch.graph)
        err = float((got - want).abs().max())
        assert err <= (1e-5 if dtype == torch.float32 else 1e-2), (step, err)
        for row, i in enumerate(who):
            last[i] = int(want[row].argmax())
    assert len(captured) == 2  # one before the regrow, one after
    assert graphed[0].batch.graph is captured[-1] and graphed[0].batch.eager_steps == 1
