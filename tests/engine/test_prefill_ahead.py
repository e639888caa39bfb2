"""Prefilling a long prompt's documents ahead, a slice an iteration, between decode steps
(``Engine.prefill_ahead`` and the serving loop's ``max_prefill_tokens``): the running requests
decode between slices, the slices stay within the limit, and nothing about the answer changes."""

import itertools
import random
import threading
import time

import pytest
import torch

from hypic import LLM, SamplingParams
from hypic.engine.scheduler import Scheduler


def _long(seed: int, docs: int = 5, doc_len: int = 30) -> list[list[int]]:
    """A head of 8 tokens (all seam at the engine's seam 8: never cached), ``docs`` documents, a query of 6."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (8, *[doc_len] * docs, 6)]


@pytest.fixture(scope="module")
def llm(qwen3_5_path):
    return LLM(str(qwen3_5_path), device="cpu", cache_device_bytes=None)


class Calls:
    """The engine's prefill_ahead, start and step, each call logged in order with its duration
    (the real ones run)."""

    NAMES = ("prefill_ahead", "start", "step")

    def __init__(self, engine) -> None:
        self.engine, self.log, self.lock = engine, [], threading.Lock()
        for name in self.NAMES:
            setattr(engine, name, self._wrap(name, getattr(engine, name)))

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            with self.lock:
                self.log.append((name, args, kwargs, out, time.perf_counter() - t0))
            return out
        return wrapped

    def slices(self, prompt=None) -> list:
        return [c for c in self.log if c[0] == "prefill_ahead" and c[3] and (prompt is None or c[1][0] == prompt)]

    def restore(self) -> None:
        for name in self.NAMES:
            delattr(self.engine, name)


class Decoding:
    """A request decoding in ``sched`` for as long as the test needs (slicing waits for one)."""

    def __init__(self, sched: Scheduler, seed: int = 99) -> None:
        self.sub = sched.submit(_long(seed, docs=1), SamplingParams(max_tokens=100_000, ignore_eos=True))
        next(self.sub.stream(timeout=60))

    def stop(self) -> None:
        self.sub.cancel()
        assert list(self.sub.stream(timeout=60))[-1].kind == "error"


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_a_long_prompts_documents_are_prefilled_in_slices_between_decode_steps(llm, salt) -> None:
    long, sp = _long(1), SamplingParams(max_tokens=4)
    llm.engine.store.clear()
    before = llm.engine.prefill_tokens
    want = llm.generate([long], sp, cache_salt=salt)[0]  # prefilled whole, from an empty cache
    whole = llm.engine.prefill_tokens - before
    llm.engine.store.clear()
    sched = Scheduler(llm.engine, max_running=4, max_prefill_tokens=64)
    decoding = Decoding(sched)
    calls = Calls(llm.engine)
    try:
        before = llm.engine.prefill_tokens
        got = list(sched.submit(long, sp, salt=llm._salt(salt)).stream(timeout=60))
        staged = llm.engine.prefill_tokens - before
        decoding.stop()
        sched.shutdown()
    finally:
        calls.restore()
    assert got[-1].kind == "done"
    out = got[-1].output
    assert out.token_ids == want.token_ids  # a document built ahead is the one its call would build
    slices = calls.slices(long)
    assert len(slices) == 3  # five documents of 30 tokens, two a slice under 64
    assert all(sum(k.length for k in c[3]) <= 64 for c in slices)
    built = frozenset().union(*(c[3] for c in slices))
    assert {k.length for k in built} == {30} and len(built) == 5
    # the call used them: the model ran as many tokens as for the prompt prefilled whole, none twice
    assert staged == whole == 5 * 30 + 8 + 5 * 8 + 6
    names = [c[0] for c in calls.log if c[0] != "prefill_ahead" or c[3]]
    first, last = names.index("prefill_ahead"), len(names) - 1 - names[::-1].index("prefill_ahead")
    between = names[first:last + 1]  # a decode step after every slice but the last
    assert between.count("step") >= 2 and "start" not in between
    assert all(a != b for a, b in itertools.pairwise(between))
    # its metrics are a cold request's: every document its own miss, nothing cached before it, and
    # its prefill time the slices' and its call's
    m, w = out.metrics, want.metrics
    assert (m.segment_hits, m.segment_misses, m.cached_tokens) == (0, 5, 0) == (w.segment_hits, w.segment_misses,
                                                                               w.cached_tokens)
    assert m.recomputed_tokens == w.recomputed_tokens
    call = [c for c in calls.log if c[0] == "start" and c[1][0] == [long]][0]
    assert m.ttft_s >= sum(c[4] for c in slices) + 0.5 * call[4]
    assert llm.engine.store.check_integrity()


def _burst(llm, prompts, sp, **limits) -> tuple[list, "Calls"]:
    """``prompts`` submitted in one burst, in order, while a request decodes; their last events and
    the engine's calls."""
    sched = Scheduler(llm.engine, **limits)
    decoding = Decoding(sched)
    calls = Calls(llm.engine)
    try:
        with sched._cv:  # the loop cannot look at the queue before all are in
            subs = [sched.submit(p, sp) for p in prompts]
        outs = [list(s.stream(timeout=60))[-1] for s in subs]
        decoding.stop()
        sched.shutdown()
    finally:
        calls.restore()
    return outs, calls


def test_requests_behind_a_sliced_prompt_that_fit_the_limit_go_between_its_slices(llm) -> None:
    """A warm prompt queued behind a cold one is admitted after the cold one's first slice, not after
    its last; one that does not fit the limit (another long cold prompt) keeps its turn, and a
    place is kept for the head: with no place to spare, nobody overtakes it."""
    llm.engine.store.clear()
    sp = SamplingParams(max_tokens=3)
    long, cold, warm = _long(30), _long(31), _long(32, docs=2)  # warm: 8 + 2 * 8 + 6 = 30 tokens computed
    want = [llm.generate([p], sp)[0].token_ids for p in (long, cold, warm)]
    llm.engine.store.clear()
    llm.engine.prewarm(warm[1:-1])
    outs, calls = _burst(llm, [long, cold, warm], sp, max_running=4, max_prefill_tokens=64)
    assert [o.kind for o in outs] == ["done"] * 3
    assert [o.output.token_ids for o in outs] == want
    label = {id(long): "long", id(cold): "cold", id(warm): "warm"}  # the loop passes the submitted lists
    names = [("slice " if c[0] == "prefill_ahead" else "start ") + label[id(c[1][0] if c[0] == "prefill_ahead"
                                                                          else c[1][0][0])]
             for c in calls.log if c[0] != "step" and (c[0] != "prefill_ahead" or c[3])]
    assert names == ["slice long", "start warm", "slice long", "slice long", "start long",
                     "slice cold", "slice cold", "slice cold", "start cold"]
    assert outs[2].output.metrics.segment_hits == 2  # prewarmed: not built by anyone here
    # no place to spare: the warm prompt waits for the head rather than take the place it needs
    llm.engine.store.clear()
    llm.engine.prewarm(warm[1:-1])
    outs, calls = _burst(llm, [long, warm], sp, max_running=2, max_prefill_tokens=64)
    assert [o.kind for o in outs] == ["done"] * 2
    starts = [c[1][0] for c in calls.log if c[0] == "start"]
    assert len(calls.slices(long)) == 3 and starts.index([long]) < starts.index([warm])


def test_the_next_head_is_sliced_when_the_sliced_one_leaves(llm) -> None:
    """The head cancelled after its first slice (its client left): the prompt now first is sliced in
    its turn, not admitted whole while others decode."""
    llm.engine.store.clear()
    sp = SamplingParams(max_tokens=2)
    head, after = _long(40), _long(41)
    sched = Scheduler(llm.engine, max_running=4, max_prefill_tokens=64)
    decoding = Decoding(sched)
    calls = Calls(llm.engine)
    real, subs = llm.engine.prefill_ahead, {}  # Calls' wrapper: the slices are logged

    def cancelling(prompt, **kwargs):
        built = real(prompt, **kwargs)
        if prompt is head:
            subs["head"].cancel()
        return built

    llm.engine.prefill_ahead = cancelling
    try:
        with sched._cv:
            subs["head"], nxt = sched.submit(head, sp), sched.submit(after, sp)
        ends = [list(s.stream(timeout=60))[-1] for s in (subs["head"], nxt)]
        decoding.stop()
        sched.shutdown()
    finally:
        llm.engine.prefill_ahead = real
        calls.restore()
    assert [e.kind for e in ends] == ["error", "done"]
    assert len(calls.slices(head)) == 1 and len(calls.slices(after)) == 3


def test_a_prompt_is_prefilled_whole_within_the_limit_when_nothing_decodes_and_without_entries(llm) -> None:
    llm.engine.store.clear()
    sp = SamplingParams(max_tokens=2)
    calls = Calls(llm.engine)
    try:
        sched = Scheduler(llm.engine, max_prefill_tokens=500)
        decoding = Decoding(sched, seed=98)
        within = list(sched.submit(_long(3), sp).stream(timeout=60))  # 164 tokens
        decoding.stop()
        sched.shutdown()
        sched = Scheduler(llm.engine, max_prefill_tokens=64)
        idle = list(sched.submit(_long(4), sp).stream(timeout=60))  # nobody to keep waiting
        decoding = Decoding(sched, seed=97)
        full = list(sched.submit(_long(5), sp, mode="full").stream(timeout=60))
        decoding.stop()
        sched.shutdown()
    finally:
        calls.restore()
    assert within[-1].kind == idle[-1].kind == full[-1].kind == "done"
    assert not calls.slices()
    assert not [c for c in calls.log if c[0] == "prefill_ahead" and c[1][0] == _long(5)]  # nothing to build
    assert idle[-1].output.token_ids == llm.generate([_long(4)], sp)[0].token_ids
    assert full[-1].output.token_ids == llm.generate([_long(5)], sp, mode="full")[0].token_ids


def test_no_slice_while_the_running_requests_leave_no_room(llm) -> None:
    """Its slices would only make the request wait longer: it cannot run before a place frees."""
    llm.engine.store.clear()
    sched = Scheduler(llm.engine, max_running=1, max_prefill_tokens=40)
    decoding = Decoding(sched, seed=95)
    calls = Calls(llm.engine)
    try:
        waiting = sched.submit(_long(14), SamplingParams(max_tokens=2))
        time.sleep(0.3)  # decode steps go by, the long prompt waiting
        assert not calls.slices() and sched.depth == (1, 1)
        decoding.stop()
        got = list(waiting.stream(timeout=60))
        sched.shutdown()
    finally:
        calls.restore()
    assert got[-1].kind == "done" and not calls.slices()  # then alone: prefilled whole


def test_prefill_ahead_builds_in_prompt_order_and_skips_what_it_built(llm, qwen3_5_path) -> None:
    llm.engine.store.clear()
    prompt = _long(5, docs=4)
    prompt[3] = prompt[1]  # a document twice: built once
    first = llm.engine.prefill_ahead(prompt, max_tokens=45)  # one document at least, whole
    assert [k.length for k in first] == [30]
    second = llm.engine.prefill_ahead(prompt, max_tokens=60)
    assert len(second) == 2 and not first & second
    assert llm.engine.prefill_ahead(prompt, max_tokens=60) == frozenset()  # every document held
    llm.engine.store.clear()  # evicted after being built: computed by its own call, not again here
    assert llm.engine.prefill_ahead(prompt, max_tokens=1000, skip=first | second) == frozenset()
    assert llm.engine.prefill_ahead(prompt, mode="prefix", max_tokens=1000) == frozenset()
    assert llm.engine.prefill_ahead(prompt, mode="full", max_tokens=1000) == frozenset()
    with pytest.raises(ValueError, match="mode"):
        llm.engine.prefill_ahead(prompt, mode="nonsense", max_tokens=10)
    in_context = LLM(str(qwen3_5_path), device="cpu", cold="in_context")  # its entries depend on the prompt
    assert in_context.engine.prefill_ahead(prompt, max_tokens=1000) == frozenset()
    # a mode without the seam keys its entries at seam 0 (the 8-token head is cached there too)
    llm.engine.store.clear()
    naive = llm.engine.prefill_ahead(prompt, mode="naive", max_tokens=1000)
    assert sorted(k.length for k in naive) == [8, 30, 30, 30]
    out = llm.generate([prompt], SamplingParams(max_tokens=1), mode="naive")[0]
    assert out.metrics.segment_misses == 0  # found under the keys its call looks up


def test_a_slice_out_of_memory_leaves_its_documents_to_the_requests_call(qwen3_5_path, monkeypatch) -> None:
    """The engine spares memory (here it sheds part of the device tier, lowering its budget: an engine
    of its own) and the request's call builds what the slice did not."""
    llm = LLM(str(qwen3_5_path), device="cpu", cache_device_bytes=None)
    sp = SamplingParams(max_tokens=3)
    want = llm.generate([_long(11)], sp)[0].token_ids
    llm.engine.store.clear()
    real, failed = llm.engine._fill, []

    def fill(segments, mode, salt):
        if not failed:
            failed.append(len(segments))
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(segments, mode, salt)

    monkeypatch.setattr(llm.engine, "_fill", fill)
    retried = llm.engine.out_of_memory["retried"]
    sched = Scheduler(llm.engine, max_prefill_tokens=40)
    decoding = Decoding(sched, seed=96)
    got = list(sched.submit(_long(11), sp).stream(timeout=60))
    decoding.stop()
    sched.shutdown()
    assert failed == [1] and llm.engine.out_of_memory["retried"] == retried + 1
    assert llm.engine.cache_shed["times"] == 1  # the memory spared: part of the device tier
    assert got[-1].kind == "done" and got[-1].output.token_ids == want
    assert got[-1].output.metrics.segment_misses == 5  # the unbuilt one a miss like the others
    assert llm.engine.store.check_integrity()


def test_entries_evicted_between_slices_are_computed_by_the_requests_own_call(qwen3_5_path) -> None:
    """A device tier with room for about one document: each slice evicts the one before, and the
    request still gets its answer (its own call builds them again), counted as its misses."""
    probe = LLM(str(qwen3_5_path), device="cpu", cache_device_bytes=None)
    probe.engine.prefill_ahead(_long(6), max_tokens=30)
    one = probe.cache_stats()["bytes"]["device"]
    llm = LLM(str(qwen3_5_path), device="cpu", cache_device_bytes=int(1.5 * one))
    sp = SamplingParams(max_tokens=3)
    want = probe.generate([_long(7)], sp)[0].token_ids
    sched = Scheduler(llm.engine, max_prefill_tokens=40)
    decoding = Decoding(sched)
    calls = Calls(llm.engine)
    try:
        got = list(sched.submit(_long(7), sp).stream(timeout=60))
        decoding.stop()
        sched.shutdown()
    finally:
        calls.restore()
    assert len(calls.slices(_long(7))) == 5  # one document a slice, each evicting the one before
    assert got[-1].kind == "done" and got[-1].output.token_ids == want
    assert got[-1].output.metrics.segment_misses == 5 and got[-1].output.metrics.segment_hits == 0
    assert llm.engine.store.check_integrity()


def test_a_request_cancelled_or_failing_between_slices_leaves_the_loop_serving(llm) -> None:
    llm.engine.store.clear()
    sp = SamplingParams(max_tokens=2)
    sched = Scheduler(llm.engine, max_prefill_tokens=40)
    decoding = Decoding(sched)
    calls = Calls(llm.engine)
    real, subs = llm.engine.prefill_ahead, {}

    def cancelling(prompt, **kwargs):  # its client leaves after the first slice
        built = real(prompt, **kwargs)
        if prompt is subs["long"].prompt:
            subs["long"].cancel()
        return built

    llm.engine.prefill_ahead = cancelling
    try:
        with sched._cv:  # a burst, in this order
            subs["long"] = sched.submit(_long(8, docs=6), sp)
            bad = sched.submit(_long(9), sp, mode="nonsense")
            salted = sched.submit(_long(12), sp, salt=5)  # not a string: the key cannot be made
            biased = sched.submit(_long(13), SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))
            ok = sched.submit(_long(10, docs=1), sp)
        events = [list(s.stream(timeout=60))[-1] for s in (subs["long"], bad, salted, biased, ok)]
        assert decoding.sub.run is not None and not decoding.sub.run.done  # decoding all along
        decoding.stop()
        sched.shutdown()
    finally:
        llm.engine.prefill_ahead = real  # Calls' own wrapper, which restore takes away
        calls.restore()
    assert [e.kind for e in events] == ["error", "error", "error", "error", "done"]
    assert "cancelled" in str(events[0].error) and "mode" in str(events[1].error)
    assert "logit_bias" in str(events[3].error)
    assert len(calls.slices(_long(8, docs=6))) == 1  # it left before its second document was built
    assert not calls.slices(_long(12)) and not calls.slices(_long(13))  # refused before any slice
    assert llm.engine.store.check_integrity()


def test_a_call_is_bounded_by_the_tokens_it_computes_not_by_the_prompts_length(llm, qwen3_5_path) -> None:
    """Warm prompts longer than the limit are batched by what they compute (seams and query),
    where counting prompt tokens ran each alone."""
    llm.engine.store.clear()
    prompts = [_long(20 + i, docs=2) for i in range(4)]  # 8 + 60 + 6 = 74 tokens
    layout = llm.engine.layout(prompts[0])
    assert llm.engine.uncached_tokens(layout) == 8 + 2 * (30 + 8) + 6  # each document built, then its seam
    assert llm.engine.uncached_tokens(llm.engine.layout(prompts[0], mode="full"), mode="full") == 74
    for p in prompts:
        llm.engine.prewarm(p[1:-1])
    assert llm.engine.uncached_tokens(layout) == 8 + 8 + 8 + 6  # the head (all seam), two seams, the query
    assert llm.engine.uncached_tokens(llm.engine.layout(prompts[0], mode="full"), mode="full") == 74
    # an in-context engine takes a prewarmed (standalone) entry: counted as held there too
    in_context = LLM(str(qwen3_5_path), device="cpu", cold="in_context")
    mine = in_context.engine.layout(prompts[0])
    assert in_context.engine.uncached_tokens(mine) == 74  # a miss is computed in context, once
    in_context.engine.prewarm(prompts[0][1:-1])
    assert in_context.engine.uncached_tokens(mine) == 30
    calls = Calls(llm.engine)
    try:
        sched = Scheduler(llm.engine, max_running=8, max_prefill_tokens=64)
        sp = SamplingParams(max_tokens=2)
        with sched._cv:  # one burst: the loop cannot look at the queue before all four are in
            subs = [sched.submit(p, sp) for p in prompts]
        outs = [list(s.stream(timeout=60))[-1] for s in subs]
        sched.shutdown()
    finally:
        calls.restore()
    assert [o.kind for o in outs] == ["done"] * 4
    assert [len(c[1][0]) for c in calls.log if c[0] == "start"] == [2, 2]  # 30 + 30 ≤ 64 < 90
    assert not calls.slices()
    assert all(o.output.metrics.segment_hits == 2 for o in outs)
