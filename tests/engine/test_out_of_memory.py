"""Prefill calls that run the device out of memory (``hypic.engine.memory``): retried after sparing
memory, split in halves, a prompt too big even alone failing by itself; the answers of the others
unchanged, the cache consistent, cold graphs let go (the client's 503: tests/server/test_out_of_memory.py).

The device running out is simulated by raising ``torch.OutOfMemoryError`` from the engine's real
prefill (``Engine._assemble``) above a size: the recovery is host logic, and where memory runs out
on a real device is not reproducible in a test."""

import random
import threading
import weakref

import pytest
import torch

from hypic import LLM, SamplingParams
from hypic.engine.memory import within_memory
from hypic.engine.scheduler import Scheduler


def _prompt(seed: int, doc: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (12, doc, 30, 6)]


def _oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory (simulated)")


def test_within_memory_retries_then_splits_and_keeps_the_order() -> None:
    calls, spared = [], []

    def run(lo: int, hi: int):
        calls.append((lo, hi))
        if hi - lo > 2 or (len(calls) == 1):  # the first call fails however small
            raise _oom()
        return torch.arange(lo, hi, dtype=torch.float32)[:, None], list(range(lo, hi))

    counts = {"retried": 0, "split": 0, "failed": 0}
    logits, states = within_memory(run, 5, lambda: spared.append(1), counts)
    assert logits[:, 0].tolist() == [0, 1, 2, 3, 4] and states == [0, 1, 2, 3, 4]
    assert calls == [(0, 5), (0, 5), (0, 2), (2, 5), (2, 5), (2, 3), (3, 5)]
    assert counts == {"retried": 2, "split": 2, "failed": 0} and len(spared) == 2


def test_within_memory_raises_for_a_prompt_that_never_fits() -> None:
    counts = {"retried": 0, "split": 0, "failed": 0}

    def run(lo: int, hi: int):
        if lo <= 1 < hi:
            raise _oom()
        return torch.zeros(hi - lo, 1), [None] * (hi - lo)

    with pytest.raises(torch.OutOfMemoryError):
        within_memory(run, 3, lambda: None, counts)
    assert counts["failed"] == 1
    assert within_memory(run, 1, lambda: None, counts)[1] == [None]  # prompt 0 alone fits


@pytest.fixture
def tight(qwen3_5_path, monkeypatch):
    """An engine whose prefill runs out of memory for a call of more than one prompt, or for any call
    holding a prompt whose document is 77 tokens long (too big even alone)."""
    llm = LLM(str(qwen3_5_path), device="cpu")
    real = llm.engine._assemble
    sizes: list[int] = []

    def assemble(prompts, mode, salts, metrics, warmed):
        sizes.append(len(prompts))
        if len(prompts) > 1 or any(len(p[1]) == 77 for p in prompts):
            raise _oom()
        return real(prompts, mode, salts, metrics, warmed)

    monkeypatch.setattr(llm.engine, "_assemble", assemble)
    return llm, sizes


def test_a_call_out_of_memory_answers_as_one_that_fit(qwen3_5_path, tight) -> None:
    llm, sizes = tight
    prompts, sp = [_prompt(i) for i in range(3)], SamplingParams(max_tokens=4)
    want = [o.token_ids for o in LLM(str(qwen3_5_path), device="cpu").generate(prompts, sp)]
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    assert sizes == [3, 3, 1, 2, 2, 1, 1]
    assert llm.engine.out_of_memory == {"retried": 2, "split": 2, "failed": 0}
    assert llm.engine.store.check_integrity() and not llm.engine.store._pins
    again = llm.generate([prompts[1]], sp)[0]  # cached by the split calls: every document hits
    assert again.token_ids == want[1] and again.metrics.segment_misses == 0


def test_out_of_memory_lets_go_of_the_cold_graphs(qwen3_5_path, tight, monkeypatch) -> None:
    monkeypatch.setenv("HYPIC_COLD_GRAPHS", "eager")  # the padded cold prefill, runnable on the CPU
    llm, _ = tight
    llm.generate([_prompt(7)], SamplingParams(max_tokens=1))
    assert llm.engine._graphs and llm.engine._cold_graphs() is not None
    llm.generate([_prompt(8), _prompt(9)], SamplingParams(max_tokens=1))
    assert not llm.engine._graphs and llm.engine._cold_graphs() is None  # for good


def test_the_scheduler_serves_the_others_when_one_prompt_never_fits(tight) -> None:
    llm, sizes = tight
    sched = Scheduler(llm.engine, max_running=4)
    prompts = [_prompt(1), _prompt(2, doc=77), _prompt(3)]
    with sched._cv:  # the loop waits until all three are queued: admitted in one call
        subs = [sched.submit(p, SamplingParams(max_tokens=3)) for p in prompts]
    ends = [list(s.stream(timeout=60))[-1] for s in subs]
    sched.shutdown()
    assert [e.kind for e in ends] == ["done", "error", "done"]
    assert isinstance(ends[1].error, torch.OutOfMemoryError)
    assert sizes[0] == 3 and llm.engine.out_of_memory["failed"] >= 1
    assert llm.engine.store.check_integrity() and not llm.engine.store._pins


def test_concurrent_clients_after_an_out_of_memory_still_served(tight) -> None:
    """After an out-of-memory every later call is served, not refused like the first (the H200
    trace's failure mode: 192 of 200 requests)."""
    llm, _ = tight
    sched = Scheduler(llm.engine, max_running=4)
    results: dict[int, str] = {}

    def client(i: int) -> None:
        results[i] = list(sched.submit(_prompt(20 + i), SamplingParams(max_tokens=2)).stream(timeout=60))[-1].kind

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sched.shutdown()
    assert list(results.values()) == ["done"] * 6


def test_a_decode_step_whose_arenas_cannot_grow_is_retried_after_sparing_memory(qwen3_5_path, monkeypatch) -> None:
    """The arenas grow (by a quarter) as sequences lengthen; a growth out of memory changes nothing
    (tests/models/test_decode_batch.py), so the step spares memory and grows them again: the same
    tokens as a run that never ran out."""
    from hypic.models.decode_batch import DecodeBatch

    prompts, sp = [_prompt(i) for i in range(2)], SamplingParams(max_tokens=90, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(qwen3_5_path), device="cpu").generate(prompts, sp)]
    llm = LLM(str(qwen3_5_path), device="cpu")
    real, calls = DecodeBatch.reserve, []

    def reserve(self) -> None:
        calls.append(max(self.lengths, default=0) + 1 > self.cap and bool(self.keys))  # a growth due
        if calls[-1] and calls.count(True) == 1:
            raise _oom()
        real(self)

    monkeypatch.setattr(DecodeBatch, "reserve", reserve)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    assert calls.count(True) >= 2 and llm.engine.decode_stats.regrow_oom_retries == 1


def test_a_decode_step_that_runs_out_twice_fails_its_runs_and_the_engine_serves_on(qwen3_5_path, monkeypatch) -> None:
    from hypic.models.decode_batch import DecodeBatch

    llm = LLM(str(qwen3_5_path), device="cpu")
    real = DecodeBatch.reserve
    monkeypatch.setattr(DecodeBatch, "reserve", lambda self: (_ for _ in ()).throw(_oom()))
    with pytest.raises(torch.OutOfMemoryError):
        llm.generate([_prompt(1)], SamplingParams(max_tokens=3))
    assert llm.engine.decode_stats.regrow_oom_retries == 1
    monkeypatch.setattr(DecodeBatch, "reserve", real)
    assert len(llm.generate([_prompt(2)], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3
    assert llm.engine.store.check_integrity() and not llm.engine.store._pins


def test_a_decode_step_out_of_memory_fails_its_runs_and_spares_memory(qwen3_5_path, monkeypatch) -> None:
    """A step whose forward runs out cannot run again (it writes the states in place), so its runs
    fail; but the engine spares memory at once (the cold graphs go), so the next step finds room —
    on the H200 ten steps failed in a row while only a prefill's failure spared memory (session 23)."""
    from hypic.models.decode_batch import DecodeBatch

    monkeypatch.setenv("HYPIC_COLD_GRAPHS", "eager")
    llm = LLM(str(qwen3_5_path), device="cpu")
    llm.generate([_prompt(3)], SamplingParams(max_tokens=1))
    assert llm.engine._cold_graphs() is not None
    real = DecodeBatch.step
    monkeypatch.setattr(DecodeBatch, "step", lambda self, model, by_slot: (_ for _ in ()).throw(_oom()))
    with pytest.raises(torch.OutOfMemoryError):
        llm.generate([_prompt(4)], SamplingParams(max_tokens=3))
    assert llm.engine._cold_graphs() is None and llm.engine._graphs_released
    monkeypatch.setattr(DecodeBatch, "step", real)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    want = LLM(str(qwen3_5_path), device="cpu").generate([_prompt(5)], sp)[0].token_ids
    assert llm.generate([_prompt(5)], sp)[0].token_ids == want
    assert llm.engine.store.check_integrity() and not llm.engine.store._pins


def test_an_auto_device_budget_leaves_half_of_what_the_cold_graphs_hold(qwen3_5_path, monkeypatch) -> None:
    """On a GPU the auto device budget is half the memory free beside the model; the cold graphs'
    pool and staging come out of that memory, so the budget drops by half of what they hold, entries
    beyond it leave at once, and it comes back whole when they are released. (The CPU's auto budget
    is unbounded: here one is set, and the runner is the padded forward without graphs, whose
    staging is what it holds.)"""
    from hypic.engine.cold_graphs import ColdGraphs

    monkeypatch.setenv("HYPIC_COLD_GRAPHS", "eager")
    llm = LLM(str(qwen3_5_path), device="cpu")
    engine = llm.engine
    llm.generate([_prompt(i) for i in range(3)], SamplingParams(max_tokens=1))
    used = engine.store.stats().bytes["device"]
    runner = engine._graphs.pop("eager")
    assert runner.held_bytes() > 0 and isinstance(runner, ColdGraphs)
    engine._auto_device_budget = used + runner.held_bytes() // 4  # entries fit only without the graphs
    engine._graphs["1"] = runner  # as if captured
    engine._fit_cache_to_cold_graphs()
    assert engine.store.budgets["device"] == used + runner.held_bytes() // 4 - runner.held_bytes() // 2
    assert engine.store.stats().bytes["device"] <= engine.store.budgets["device"] and engine.store.check_integrity()
    engine.release_cold_graphs()
    assert engine.store.budgets["device"] == used + runner.held_bytes() // 4
    engine._auto_device_budget = None  # a budget the user named: the graphs never change it
    engine.store.set_budget("device", 123)
    engine._graphs["1"] = runner
    engine._fit_cache_to_cold_graphs()
    assert engine.store.budgets["device"] == 123


def _filled(qwen3_5_path, n: int = 6) -> LLM:
    """An engine whose device tier holds ``n`` prompts' documents under a generous budget."""
    # a GPU's host tier: room to demote to
    llm = LLM(str(qwen3_5_path), device="cpu", cache_device_bytes=1 << 40, cache_host_bytes=None)
    llm.generate([_prompt(100 + i) for i in range(n)], SamplingParams(max_tokens=1))
    return llm


def _out_of_memory_above(llm: LLM, monkeypatch, capacity: int) -> None:
    """The device 'runs out' whenever a prefill starts with the device tier holding more than ``capacity``."""
    real = llm.engine._assemble

    def assemble(prompts, mode, salts, metrics, warmed):
        if llm.engine.store.stats().bytes["device"] > capacity:
            raise _oom()
        return real(prompts, mode, salts, metrics, warmed)

    monkeypatch.setattr(llm.engine, "_assemble", assemble)


def test_out_of_memory_with_nothing_else_to_spare_sheds_an_eighth_of_the_device_tier(qwen3_5_path, monkeypatch) -> None:
    """A device budget set larger than the device holds: the first call out of memory makes the
    tier give up an eighth (demoted to the host tier, the budget lowered to match), and the call
    and every later one are served, answering as an engine that never ran out; the tier stays below
    its new budget."""
    llm = _filled(qwen3_5_path)
    used = llm.engine.store.stats().bytes["device"]
    _out_of_memory_above(llm, monkeypatch, int(0.9 * used))
    prompts, later = [_prompt(i) for i in range(3)], [_prompt(50), _prompt(51)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    fresh = LLM(str(qwen3_5_path), device="cpu")
    want, want_later = ([o.token_ids for o in fresh.generate(p, sp)] for p in (prompts, later))
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    e = llm.engine
    assert e.cache_shed["times"] == 1 and e.out_of_memory == {"retried": 1, "split": 0, "failed": 0}
    assert e.store.budgets["device"] == int(used * (1 - 0.125)) and e.cache_shed["bytes"] >= used // 8
    assert e.store.stats().demotions >= 1 and e.store.check_integrity() and not e.store._pins
    assert [o.token_ids for o in llm.generate(later, sp)] == want_later
    assert e.cache_shed["times"] == 1 and e.store.stats().bytes["device"] <= e.store.budgets["device"]


def test_a_call_sheds_once_however_often_its_halves_run_out(qwen3_5_path, monkeypatch) -> None:
    """Far too little memory: one shed for the call, its prompts failing alone, not the cache halved
    again at every split (a call of 4 prompts runs out 7 times before its last prompt fails)."""
    llm = _filled(qwen3_5_path)
    used = llm.engine.store.stats().bytes["device"]
    _out_of_memory_above(llm, monkeypatch, used // 4)
    with pytest.raises(torch.OutOfMemoryError):
        llm.generate([_prompt(i) for i in range(4)], SamplingParams(max_tokens=1))
    assert llm.engine.cache_shed["times"] == 1 and llm.engine.out_of_memory["failed"] >= 1
    assert llm.engine.store.budgets["device"] == int(used * (1 - 0.125)) and llm.engine.store.check_integrity()


def test_the_cold_graphs_go_before_any_of_the_cache(qwen3_5_path, monkeypatch) -> None:
    """With cold graphs held, running out releases them and leaves the cache whole; only a later out
    of memory, with no graphs left, sheds."""
    from hypic.models.decode_batch import DecodeBatch

    monkeypatch.setenv("HYPIC_COLD_GRAPHS", "eager")
    llm = _filled(qwen3_5_path)
    budget = llm.engine.store.budgets["device"]
    real = DecodeBatch.step
    monkeypatch.setattr(DecodeBatch, "step", lambda self, model, by_slot: (_ for _ in ()).throw(_oom()))
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError):
            llm.generate([_prompt(4)], SamplingParams(max_tokens=3))
        if not llm.engine.cache_shed["times"]:  # the first: the graphs released, the cache whole
            assert not llm.engine._graphs and llm.engine.store.budgets["device"] == budget
    monkeypatch.setattr(DecodeBatch, "step", real)
    assert llm.engine.cache_shed["times"] == 1 and llm.engine.store.budgets["device"] < budget
    assert llm.engine.store.check_integrity() and not llm.engine.store._pins


def test_a_lookup_out_of_memory_leaves_no_pin_behind(qwen3_5_path, monkeypatch) -> None:
    """An out of memory in the second prompt's lookup (a promotion's device copy): the call is retried
    and served, and the first prompt's keys, pinned by its lookup, are not left pinned for good."""
    llm = LLM(str(qwen3_5_path), device="cpu")
    e = llm.engine
    prompts = [_prompt(1), _prompt(2)]
    llm.generate(prompts, SamplingParams(max_tokens=1))
    real, calls = e.store.lookup, []

    def lookup(key, ids):
        calls.append(key)
        if len(calls) == 2:
            raise _oom()
        return real(key, ids)

    monkeypatch.setattr(e.store, "lookup", lookup)
    llm.generate(prompts, SamplingParams(max_tokens=1))  # retried after sparing memory: served
    assert e.out_of_memory["retried"] == 1
    assert not e.store._pins, e.store._pins  # the first prompt's key not left pinned


def test_the_arena_growth_retry_runs_without_the_failed_attempts_memory(qwen3_5_path, monkeypatch) -> None:
    """The arena growth is retried outside the handler of its failure: the first attempt's traceback
    (``_regrow``'s half-grown arenas in its frame) is gone before memory is spared and it runs again."""
    from hypic.models.decode_batch import DecodeBatch

    llm = LLM(str(qwen3_5_path), device="cpu")
    real, seen = DecodeBatch.reserve, []

    def reserve(self):
        if not seen:
            grown = torch.zeros(1 << 16)  # the arenas made before the allocator gave out
            seen.append(weakref.ref(grown))
            raise _oom()
        if len(seen) == 1:
            seen.append(seen[0]() is None)
        return real(self)

    monkeypatch.setattr(DecodeBatch, "reserve", reserve)
    llm.generate([_prompt(3)], SamplingParams(max_tokens=3, ignore_eos=True))
    assert llm.engine.decode_stats.regrow_oom_retries == 1
    assert seen[1] is True  # the half-grown arenas were let go first


def test_a_prompt_that_never_fits_does_not_shrink_the_cache_at_every_retry(qwen3_5_path, monkeypatch) -> None:
    """The server answers such a prompt 503 Retry-After, and each retry is a call of its own: shedding
    stops at half of what the tier held at its first shed, not an eighth more at every retry."""
    llm = LLM(str(qwen3_5_path), device="cpu")
    e = llm.engine
    e.store.set_budget("device", 1 << 40)
    llm.generate([_prompt(100 + i) for i in range(6)], SamplingParams(max_tokens=1))
    used = e.store.stats().bytes["device"]
    big = _prompt(999, doc=300)
    real = e._assemble

    def assemble(prompts, mode, salts, metrics, warmed):
        if any(p == big for p in prompts):
            raise _oom()
        return real(prompts, mode, salts, metrics, warmed)

    monkeypatch.setattr(e, "_assemble", assemble)
    for _ in range(10):
        with pytest.raises(torch.OutOfMemoryError):
            llm.generate([big], SamplingParams(max_tokens=1))
    assert e.store.budgets["device"] >= used // 2  # the floor: without it ≈ 0.26 × used (7/8 ** 10)
