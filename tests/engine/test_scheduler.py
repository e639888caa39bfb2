"""The serving loop: batched decode across concurrent requests, streaming, bounds, cancellation."""

import random
import threading

import pytest
import torch

import hypic.engine.engine as engine_module
from hypic import LLM, SamplingParams
from hypic.engine.scheduler import QueueFull, Scheduler
from hypic.models.decode_batch import DecodeBatch


def _prompt(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (30, 40, 6)]


@pytest.fixture(scope="module")
def llm(qwen3_5_path):
    return LLM(str(qwen3_5_path), device="cpu")


def test_concurrent_streams_equal_offline_generate(llm) -> None:
    sched = Scheduler(llm.engine, max_running=4)
    prompts = [_prompt(i) for i in range(6)]
    sp = SamplingParams(max_tokens=5)
    want = [llm.generate([p], sp)[0].token_ids for p in prompts]
    results: dict[int, list[int]] = {}

    def client(i: int) -> None:
        sub = sched.submit(prompts[i], sp)
        events = list(sub.stream(timeout=60))
        assert events[-1].kind == "done"
        streamed = [e.token for e in events if e.kind == "token"]
        assert streamed == events[-1].output.token_ids
        results[i] = streamed

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(6)] == want
    sched.shutdown()
    assert llm.engine.store.check_integrity()


def test_queue_bound_cancellation_and_shutdown(llm) -> None:
    sched = Scheduler(llm.engine, max_running=1, max_queue=1)
    long = sched.submit(_prompt(1), SamplingParams(max_tokens=400))
    next(long.stream(timeout=60))  # running now
    waiting = sched.submit(_prompt(2), SamplingParams(max_tokens=2))
    with pytest.raises(QueueFull):
        sched.submit(_prompt(3), SamplingParams(max_tokens=2))
    long.cancel()
    assert [e for e in long.stream(timeout=60)][-1].kind == "error"
    assert [e.kind for e in waiting.stream(timeout=60)][-1] == "done"
    bad = sched.submit([[1, 2], [3]], SamplingParams(max_tokens=2), mode="nonsense")
    assert list(bad.stream(timeout=60))[-1].kind == "error"
    ok = sched.submit(_prompt(4), SamplingParams(max_tokens=2))  # the loop survived the bad request
    assert list(ok.stream(timeout=60))[-1].kind == "done"
    sched.shutdown()
    with pytest.raises(QueueFull):
        sched.submit(_prompt(5), SamplingParams(max_tokens=2))


def test_a_request_s_choices_are_queued_together_or_not_at_all(llm) -> None:
    """Refused, a request with several choices holds no place meanwhile (queued one by one, its first
    choices took places a request arriving then was refused for, then were taken back)."""
    sched = Scheduler(llm.engine, max_running=1, max_queue=2)
    busy = sched.submit(_prompt(1), SamplingParams(max_tokens=400))
    next(busy.stream(timeout=60))  # running: the queue's 2 places are all there are
    with pytest.raises(QueueFull, match="this request needs 3 places"):
        sched.submit_all([(_prompt(i), SamplingParams(max_tokens=2), "hypic", None) for i in range(3)])
    assert sched.depth == (0, 1)  # nothing of it was queued
    pair = sched.submit_all([(_prompt(i), SamplingParams(max_tokens=2), "hypic", None) for i in range(2)])
    busy.cancel()
    assert [[e.kind for e in sub.stream(timeout=60)][-1] for sub in pair] == ["done", "done"]
    sched.shutdown()


# a cold prompt here computes 92 tokens: 76, and each document's seam again in context
@pytest.mark.parametrize("cap, most", [(200, 2), (10, 1)])
def test_a_prefill_call_takes_at_most_max_prefill_tokens(llm, cap: int, most: int) -> None:
    calls: list[int] = []
    start = llm.engine.start

    def counting_start(prompts, *args, **kwargs):  # the real start, with each call's size noted
        calls.append(len(prompts))
        return start(prompts, *args, **kwargs)

    llm.engine.start = counting_start
    try:
        sched = Scheduler(llm.engine, max_running=8, max_prefill_tokens=cap)
        prompts = [_prompt(20 + i) for i in range(6)]
        sp = SamplingParams(max_tokens=3)
        with llm.engine._lock:  # the loop blocks in its first prefill: the rest arrive as one burst
            subs = [sched.submit(p, sp) for p in prompts]
        outs = [list(s.stream(timeout=60))[-1] for s in subs]
        sched.shutdown()
    finally:
        del llm.engine.start
    assert [o.kind for o in outs] == ["done"] * 6
    assert sum(calls) == 6 and max(calls) == most and len(calls) >= 6 // most
    assert [o.output.token_ids for o in outs] == [llm.generate([p], sp)[0].token_ids for p in prompts]
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Scheduler(llm.engine, max_prefill_tokens=0)


def test_a_decode_step_out_of_memory_fails_its_requests_and_the_loop_serves_on(llm, monkeypatch) -> None:
    """Out of memory again after the engine spared memory and retried (Engine.step): the step's
    requests fail, and the loop goes on."""
    sched = Scheduler(llm.engine, max_running=2)
    want = llm.generate([_prompt(7)], SamplingParams(max_tokens=4))[0].token_ids
    real, calls = DecodeBatch.reserve, []

    def failing(self) -> None:
        calls.append(1)
        if len(calls) <= 2:  # the step's arenas, and the retry after sparing memory
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        real(self)

    monkeypatch.setattr(DecodeBatch, "reserve", failing)
    failed = sched.submit(_prompt(6), SamplingParams(max_tokens=4))
    events = list(failed.stream(timeout=60))
    assert events[-1].kind == "error" and "out of memory" in str(events[-1].error)
    assert failed.run.state.batch is None and not failed.run.state.kv  # its stacked state let go at once
    events = list(sched.submit(_prompt(7), SamplingParams(max_tokens=4)).stream(timeout=60))
    assert events[-1].kind == "done" and events[-1].output.token_ids == want  # the loop decodes on
    sched.shutdown()
    assert llm.engine.store.check_integrity()


def test_a_cancelled_request_lets_go_of_its_decode_state_at_once(llm) -> None:
    sched = Scheduler(llm.engine, max_running=2)
    sub = sched.submit(_prompt(8), SamplingParams(max_tokens=400))
    stream = sub.stream(timeout=60)
    for _ in range(3):  # a few decode steps: its state is packed in a batch
        assert next(stream).kind == "token"
    batch = sub.run.state.batch
    assert batch is not None and sub.run.state in batch.members
    sub.cancel()
    assert [e.kind for e in stream][-1] == "error"
    assert sub.run.state.batch is None and not batch.members and not batch.keys  # the arenas went with it
    sched.shutdown()


def _joining_fails(monkeypatch, times: int) -> list[int]:
    """DecodeBatch.admit into a batch that decodes already runs out of memory ``times`` times (as the
    arenas' growth for a newcomer does, before anything changed)."""
    real, calls = DecodeBatch.admit, []

    def failing(self, states) -> None:
        if self.members and states and len(calls) < times:
            calls.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        real(self, states)

    monkeypatch.setattr(DecodeBatch, "admit", failing)
    return calls


def test_a_newcomer_s_arena_growth_out_of_memory_is_retried(llm, monkeypatch) -> None:
    """A request joining the running ones grows the batch's arenas (Engine.step's gather): out of
    memory there is retried after sparing memory, as the step's own growth is; nobody fails."""
    sched = Scheduler(llm.engine, max_running=2)
    first, second = SamplingParams(max_tokens=12), SamplingParams(max_tokens=4)
    want = [llm.generate([_prompt(9)], first)[0].token_ids, llm.generate([_prompt(10)], second)[0].token_ids]
    calls = _joining_fails(monkeypatch, 1)
    a = sched.submit(_prompt(9), first)
    stream = a.stream(timeout=60)
    assert next(stream).kind == "token" and next(stream).kind == "token"  # decoding: packed in a batch
    b = sched.submit(_prompt(10), second)
    outs = [list(stream)[-1], list(b.stream(timeout=60))[-1]]
    sched.shutdown()
    assert calls == [1]
    assert [o.kind for o in outs] == ["done", "done"]
    assert [o.output.token_ids for o in outs] == want


def test_a_failed_step_lets_go_of_its_decode_state(llm, monkeypatch) -> None:
    """Out of memory again when a request joins, or any error after the step (sampling): the step's
    requests fail and their stacked state — the running one's arenas too — goes at once."""
    sched = Scheduler(llm.engine, max_running=2)
    _joining_fails(monkeypatch, 2)
    a = sched.submit(_prompt(13), SamplingParams(max_tokens=400))
    stream = a.stream(timeout=60)
    assert next(stream).kind == "token" and next(stream).kind == "token"
    batch = a.run.state.batch
    assert batch is not None
    b = sched.submit(_prompt(14), SamplingParams(max_tokens=4))
    outs = [list(stream)[-1], list(b.stream(timeout=60))[-1]]
    assert [o.kind for o in outs] == ["error", "error"] and "out of memory" in str(outs[0].error)
    assert a.run.state.batch is None and not batch.members and not batch.keys
    monkeypatch.undo()
    real, calls = engine_module.sample, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # the first token, then the third decode step
            raise RuntimeError("probability tensor contains either inf, nan or element < 0 (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "sample", failing)
    c = sched.submit(_prompt(15), SamplingParams(max_tokens=400))
    events = list(c.stream(timeout=60))
    assert events[-1].kind == "error" and "simulated" in str(events[-1].error)
    assert c.run.state.batch is None  # not left packed for the cycle collector
    sched.shutdown()


def test_forgetting_the_last_live_run_frees_the_batch(llm) -> None:
    """A run that finished at the last step is still packed (the next step would release it); when
    the others are forgotten instead (cancelled), the batch and its arenas go all the same."""
    engine = llm.engine
    short, long = engine.start([_prompt(11), _prompt(12)], [SamplingParams(max_tokens=3),
                                                            SamplingParams(max_tokens=400)])
    while not short.done:
        engine.step([short, long])
    batch = long.state.batch
    assert batch is not None and short.state in batch.members
    engine.forget([long])
    assert not batch.members and not batch.keys and short.state.batch is None


def test_a_failure_outside_the_step_fails_its_requests_and_the_loop_serves_on(llm, monkeypatch) -> None:
    """Emitting a token raising (a bug, simulated) killed the loop's thread: every later request
    waited for its timeout while the server looked healthy."""
    sched = Scheduler(llm.engine, max_running=2)
    want = llm.generate([_prompt(7)], SamplingParams(max_tokens=4))[0].token_ids
    real, calls = Scheduler._emit, []

    def once(self, s) -> None:
        calls.append(1)
        if len(calls) == 2:  # the first decode step's emit (the first was the prefill's)
            raise RuntimeError("simulated: a bug after the step")
        real(self, s)

    monkeypatch.setattr(Scheduler, "_emit", once)
    events = list(sched.submit(_prompt(6), SamplingParams(max_tokens=4)).stream(timeout=60))
    assert events[-1].kind == "error" and "simulated" in str(events[-1].error)
    assert sched._thread.is_alive()
    events = list(sched.submit(_prompt(7), SamplingParams(max_tokens=4)).stream(timeout=60))
    assert events[-1].kind == "done" and events[-1].output.token_ids == want  # the loop decodes on
    sched.shutdown()
    assert llm.engine.store.check_integrity()


def test_a_request_still_prefilling_when_the_shutdown_timeout_passes_is_cancelled_too(llm, monkeypatch) -> None:
    """Past the shutdown timeout every running request is cancelled; one that was inside its
    prefill then (in neither the queue nor the running list) was added afterwards and decoded to
    its max_tokens while the shutdown waited for it."""
    from hypic.engine.scheduler import SHUTDOWN

    started = threading.Event()
    real = llm.engine.start

    def slow_start(*args, **kwargs):
        started.set()
        threading.Event().wait(1.0)  # still prefilling as the 0.2 s timeout passes
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "start", slow_start)
    sched = Scheduler(llm.engine, max_running=2, max_queue=2)
    sub = sched.submit(_prompt(6), SamplingParams(max_tokens=1500, ignore_eos=True))
    assert started.wait(30)
    sched.shutdown(timeout=0.2)
    events = list(sub.stream(timeout=60))
    assert events[-1].kind == "error" and str(events[-1].error) == SHUTDOWN
    assert sum(e.kind == "token" for e in events) < 1500


def test_requests_being_prefilled_count_as_running(llm) -> None:
    """While a prefill call runs, its requests are neither waiting nor decoding: they count as running
    (a replica busy with long prompts read as idle in /metrics), and the count settles after it."""
    inside, release = threading.Event(), threading.Event()
    start = llm.engine.start

    def held_start(*args, **kwargs):
        inside.set()
        assert release.wait(60)
        return start(*args, **kwargs)

    llm.engine.start = held_start
    try:
        sched = Scheduler(llm.engine, max_running=4)
        subs = [sched.submit(_prompt(i), SamplingParams(max_tokens=2)) for i in range(3)]
        assert inside.wait(60)
        assert sched.depth == (0, 3)  # all three in the one call being prefilled
        release.set()
        assert all(list(s.stream(timeout=60))[-1].kind == "done" for s in subs)
        assert sched.depth == (0, 0)
        llm.engine.start = lambda *a, **k: (_ for _ in ()).throw(ValueError("broken"))  # a failing call
        bad = sched.submit(_prompt(4), SamplingParams(max_tokens=2))
        assert list(bad.stream(timeout=60))[-1].kind == "error"
        assert sched.depth == (0, 0)  # a failed call's requests are not left counted
        sched.shutdown()
    finally:
        llm.engine.start = start
        release.set()


def test_prefill_tokens_count_a_shared_cold_segment_once(llm) -> None:
    """The engine's prefill_tokens (hypic_recomputed_tokens_total) is the model's work: a new document
    shared by two prompts of one call is prefilled once, while each request's own recomputed_tokens
    (its usage) counts the document whole; full counts every token, and each call is counted with or
    without a cold part."""
    engine = llm.engine
    rng = random.Random(77)
    doc = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [[[5, 6, 7], doc, [rng.randrange(3, 512) for _ in range(6)]] for _ in range(2)]
    tokens, calls = engine.prefill_tokens, dict(engine.prefill_calls)
    _, metrics = engine.prefill_logits(prompts, salts=["shared-once"] * 2)
    assert all(m.segment_misses == 1 for m in metrics)
    assert engine.prefill_tokens - tokens == sum(m.recomputed_tokens for m in metrics) - len(doc)
    assert engine.prefill_calls["with_cold"] == calls["with_cold"] + 1
    tokens = engine.prefill_tokens
    engine.prefill_logits(prompts, salts=["shared-once"] * 2)  # warm now
    assert engine.prefill_calls["without_cold"] == calls["without_cold"] + 1
    assert engine.prefill_calls["calls"] == engine.prefill_calls["with_cold"] + engine.prefill_calls["without_cold"]
    assert 0 < engine.prefill_tokens - tokens < 2 * (3 + 40 + 6)  # the seams and queries only
    tokens = engine.prefill_tokens
    engine.prefill_logits(prompts, mode="full")
    assert engine.prefill_tokens - tokens == 2 * (3 + 40 + 6)
    tokens = engine.prefill_tokens
    other = [rng.randrange(3, 512) for _ in range(30)]
    engine.prewarm([other, other, doc], salt="shared-once")  # one new document, given twice
    assert engine.prefill_tokens - tokens == len(other)


@pytest.mark.parametrize("at_step", [0, 3])
def test_a_row_whose_logits_are_not_finite_fails_its_request_alone(llm, monkeypatch, at_step: int) -> None:
    """A row that comes out NaN (here made so for one request, at its first token or a later decode
    step; ``sample``'s detection is tested on real NaN logits in test_api) fails that request with
    an error event, and the requests beside it — prefilled or decoding with it — end with the tokens
    they get alone (they all failed with it)."""
    from hypic.engine import sampling

    prompts = [_prompt(30 + i) for i in range(3)]
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = [llm.generate([p], plain)[0].token_ids for p in prompts]
    poisoned = SamplingParams(max_tokens=6, ignore_eos=True, seed=666, temperature=1.0)
    real = sampling.adjust

    def adjust(logits, params, generated, *args, **kwargs):
        out = real(logits, params, generated, *args, **kwargs).clone()
        for i, p in enumerate(params):
            if p.seed == 666 and generated[i] == at_step:
                out[i] = float("nan")
        return out

    monkeypatch.setattr(sampling, "adjust", adjust)
    sched = Scheduler(llm.engine, max_running=4)
    with llm.engine._lock:  # one burst: the four are prefilled in one call and decode together
        subs = [sched.submit(p, plain) for p in prompts] + [sched.submit(_prompt(40), poisoned)]
    ends = [list(s.stream(timeout=60))[-1] for s in subs]
    sched.shutdown()
    assert [e.kind for e in ends] == ["done", "done", "done", "error"]
    assert "not finite" in str(ends[3].error)
    assert [e.output.token_ids for e in ends[:3]] == alone
    with pytest.raises(RuntimeError, match="not finite"):  # the library's caller is told
        llm.generate([_prompt(40)], poisoned)
    with pytest.raises(RuntimeError, match="not finite"):  # and the engine's (evaluation, benchmarks)
        llm.engine.generate([_prompt(40), prompts[0]], [poisoned, plain])
    assert llm.engine.store.check_integrity()


def test_waiting_requests_are_admitted_by_priority_then_arrival(llm) -> None:
    """vLLM's priority scheduling: behind a running request, the queue holds each newcomer behind
    every request of a lower or equal priority value; one slot, so they finish in that order. The
    running request is never stopped for them."""
    sched = Scheduler(llm.engine, max_running=1)
    busy = sched.submit(_prompt(1), SamplingParams(max_tokens=400))
    next(busy.stream(timeout=60))
    arrivals = [("b", 5), ("c", 0), ("d", 5), ("e", -1), ("f", 0)]
    subs = {name: sched.submit_all([(_prompt(i + 2), SamplingParams(max_tokens=2), "hypic", None)], priorities=[p])[0]
            for i, (name, p) in enumerate(arrivals)}
    names = {id(s): n for n, s in subs.items()}
    assert [names[id(s)] for s in sched._waiting] == ["e", "c", "f", "b", "d"]
    finished: list[str] = []
    lock = threading.Lock()

    def consume(name: str) -> None:
        events = list(subs[name].stream(timeout=60))
        with lock:
            finished.append(name if events[-1].kind == "done" else f"{name}!")

    threads = [threading.Thread(target=consume, args=(n,)) for n in subs]
    for t in threads:
        t.start()
    assert sched.depth == (5, 1)  # still running, not preempted
    busy.cancel()
    for t in threads:
        t.join()
    assert finished == ["e", "c", "f", "b", "d"]
    with pytest.raises(ValueError, match="priorities: expected one per item"):
        sched.submit_all([(_prompt(9), SamplingParams(max_tokens=2), "hypic", None)], priorities=[1, 2])
    sched.shutdown()
