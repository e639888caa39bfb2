"""Padded cold prefills (``cold_padded``, ``cold_graphs``): every segment padded at its end to a
fixed shape, so one CUDA graph per shape can replay them. Here, on the CPU, the padded forward runs
eagerly (``capture=False``, ``HYPIC_COLD_GRAPHS=eager``): its entries must be the unpadded build's
(fp32, to round-off) for every grouping — one slot or eight, slots left empty, several lengths and
seams in one call — and the engine's answers must not change. The captured replay is checked
against the same eager build on the GPU (``test_cold_graphs_gpu``)."""

import pytest
import torch

from hypic.cache.keys import segment_key
from hypic.cache.layout import tensors
from hypic.engine.cold import ColdContext, entry_template
from hypic.engine.cold_graphs import CALL_TOKENS, MAX_LENGTH, ColdGraphs
from hypic.engine.cold_padded import PaddedColdContext, Staging, tail_width
from hypic.models.loader import load_model
from hypic.ops.transfer import keeping

CPU = torch.device("cpu")
ATOL = 1e-5  # fp32: the padded and unpadded builds sum in different orders


def _segments(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 64, (n,), generator=g).tolist(), w) for n, w in spec]


def _keyed(segments):
    return [(ids, w, segment_key(ids, model_fingerprint="t", seam=w, dtype="f32")) for ids, w in segments]


def _unpadded(model, template, segments, device=CPU):
    ctx = ColdContext(_keyed(segments), device, template)
    with torch.no_grad():
        model.hidden_states(ctx.input_ids, ctx)
    return ctx.entries


def _assert_same(a_entries, b_entries, atol):
    assert len(a_entries) == len(b_entries)
    for a, b in zip(a_entries, b_entries, strict=True):
        assert a.key == b.key and a.header == b.header
        for (slot, layer, x), (_, _, y) in zip(tensors(a), tensors(b), strict=True):
            assert x.shape == y.shape and x.dtype == y.dtype, (slot, layer)
            assert torch.allclose(x, y, rtol=0, atol=atol), (slot, layer, (x - y).abs().max().item())


@pytest.fixture(scope="module")
def f64(model_paths):
    loaded = load_model(model_paths["qwen3_5"], device="cpu", dtype="float32")
    return loaded.model, entry_template(loaded.model, CPU)


# (length, seam) per segment: one segment; five of one padded length (a group of five slots);
# mixed lengths and seams (several groups), a length exactly at a block, a body of 1 token,
# segments longer than a block; the longest accepted
GROUPINGS = [
    [(37, 4)],
    [(20, 4), (33, 4), (64, 4), (50, 4), (41, 4)],
    [(9, 8), (70, 8), (64, 3), (5, 4), (130, 0), (65, 8), (200, 8)],
    [(MAX_LENGTH, 8), (MAX_LENGTH - 63, 8)],
]


@pytest.mark.parametrize("spec", GROUPINGS, ids=["one", "five_slots", "mixed", "longest"])
def test_padded_entries_equal_the_unpadded_build(f64, spec) -> None:
    model, template = f64
    segments = _segments(spec)
    runner = ColdGraphs(model, template, CPU, capture=False)
    assert all(runner.accepts(ids, w) for ids, w in segments)
    with torch.no_grad():
        padded = runner.prefill(_keyed(segments))
    _assert_same(_unpadded(model, template, segments), padded, atol=ATOL)
    assert runner.counts["eager"] >= 1 and runner.counts["replayed"] == 0


def test_a_shape_is_reused_with_new_inputs(f64) -> None:
    """One context per shape serves every call of that shape: the second call's tokens replace the
    first's (nothing of the first call leaks into the second's entries)."""
    model, template = f64
    runner = ColdGraphs(model, template, CPU, capture=False)
    first, second = _segments([(40, 4), (60, 4)], seed=1), _segments([(33, 4)], seed=2)
    with torch.no_grad():
        runner.prefill(_keyed(first))
        again = runner.prefill(_keyed(second))
    assert len(runner.shapes) == 2  # (2 slots, 64) then (1 slot, 64)
    _assert_same(_unpadded(model, template, second), again, atol=ATOL)
    with torch.no_grad():
        third = runner.prefill(_keyed(second + first))  # a third shape: 3 slots
    _assert_same(_unpadded(model, template, second + first), third, atol=ATOL)


def test_what_a_padded_prefill_refuses(f64, model_paths) -> None:
    model, template = f64
    runner = ColdGraphs(model, template, CPU, capture=False)
    W1 = tail_width(template)
    assert W1 > 0
    assert not runner.accepts(list(range(MAX_LENGTH + 1)), 8)  # longer than the longest shape
    assert not runner.accepts(list(range(8)), 8)  # no body
    assert not runner.accepts(list(range(W1 - 1)), 0)  # shorter than a conv tail
    big = _keyed(_segments([(MAX_LENGTH, 8)] * (CALL_TOKENS // MAX_LENGTH + 1)))
    assert runner.takes(big) == [] and len(runner.takes(big[:-1])) == len(big) - 1  # a call's tokens
    assert runner.takes(_keyed([(list(range(8)), 8), (list(range(30)), 8)]))[0][0] == list(range(30))
    assert runner.prepare(4) == 0 and not runner.shapes  # nothing to capture without graphs
    with pytest.raises(ValueError, match="does not accept"):
        runner.prefill(_keyed([(list(range(MAX_LENGTH + 1)), 8)]))
    ctx = PaddedColdContext(2, 64, 4, Staging(template, 2, 64, CPU), W1, CPU)
    with pytest.raises(ValueError, match="do not fit"):
        ctx.load(_keyed([(list(range(65)), 4)]))  # longer than the slots
    with pytest.raises(ValueError, match="do not fit"):
        ctx.load(_keyed([(list(range(30)), 3)]))  # another seam
    with pytest.raises(ValueError, match="do not fit"):
        ctx.load(_keyed([(list(range(30)), 4)] * 3))  # more segments than slots
    with pytest.raises(ValueError, match="do not fit"):
        PaddedColdContext(4, 64, 4, Staging(template, 2, 64, CPU), W1, CPU)
    kimi = load_model(model_paths["kimi_linear"], device="cpu", dtype="float32").model
    with pytest.raises(ValueError, match="GDN"):
        ColdGraphs(kimi, entry_template(kimi, CPU), CPU)


@pytest.mark.parametrize("graphs", ["eager", "0"])
def test_engine_answers_do_not_change(model_paths, monkeypatch, graphs) -> None:
    """Through the engine: misses the padded prefill takes (a body of one token among them) and one it leaves (too long)
    in one call, under ``hypic`` — the answers are the one-forward path's (``HYPIC_COLD_GRAPHS=0``)."""
    from hypic.engine.engine import Engine
    from hypic.engine.request import SamplingParams

    loaded = load_model(model_paths["qwen3_5"], device="cpu", dtype="float32")
    g = torch.Generator().manual_seed(5)
    doc = lambda n: torch.randint(0, 64, (n,), generator=g).tolist()  # noqa: E731
    prompts = [[doc(6), doc(40), doc(MAX_LENGTH + 9), doc(4), doc(70), doc(5)],
               [doc(6), doc(33), doc(90), doc(4)]]
    monkeypatch.setenv("HYPIC_COLD_GRAPHS", "0")
    reference = Engine(loaded, seam=3)
    ref_logits, _ = reference.prefill_logits(prompts)
    ref_out = reference.generate(prompts, [SamplingParams(max_tokens=4)] * 2)
    monkeypatch.setenv("HYPIC_COLD_GRAPHS", graphs)
    engine = Engine(loaded, seam=3)
    logits, metrics = engine.prefill_logits(prompts)
    assert torch.allclose(logits, ref_logits, rtol=0, atol=ATOL)
    assert [m.segment_misses for m in metrics] == [5, 3]
    runner = engine._graphs.get("eager")
    assert (runner is not None and runner.counts["eager"] >= 1) == (graphs == "eager")
    assert engine.prepare_cold_graphs() == 0  # no graphs on the CPU
    assert {e.key for e in engine.store.entries()} == {e.key for e in reference.store.entries()}
    out = engine.generate(prompts, [SamplingParams(max_tokens=4)] * 2)  # all hits now
    assert [o.token_ids for o in out] == [o.token_ids for o in ref_out]
    monkeypatch.setenv("HYPIC_COLD_GRAPHS", "yes")
    with pytest.raises(ValueError, match="HYPIC_COLD_GRAPHS"):
        engine.prefill_logits([[doc(6), doc(41), doc(3)]])
    with pytest.raises(ValueError, match="HYPIC_COLD_GRAPHS"):  # refused when the engine starts
        Engine(loaded, seam=3)


def test_a_capture_keeps_the_plans_it_reads(f64) -> None:
    """``transfer.keeping``: while a capture is under way every device plan a cached helper hands out
    is recorded (a replay reads it after the cache may have dropped it); outside, nothing is."""
    model, template = f64
    segments = _segments([(40, 4), (60, 4)])
    with keeping() as kept, torch.no_grad():
        _unpadded(model, template, segments)
    assert kept  # the conv's and the chunked recurrence's plans at least
    with keeping() as outer:
        pass
    _unpadded(model, template, segments)
    assert outer == []


def _forget_plans() -> None:
    """Drop every cached device plan and reuse the freed memory: a graph that did not keep what it
    reads would now read someone else's data."""
    from hypic.ops import attention_batch, linear_fla, rope, triton_conv

    for f in (linear_fla._chunk_plan, attention_batch._plan, triton_conv._rows):
        f.cache_clear()
    rope._TABLES.clear()
    junk = [torch.full((1 << 16,), 7, dtype=torch.long, device="cuda") for _ in range(64)]
    del junk


def _max_diff(a_entries, b_entries) -> float:
    return max(float((x.float() - y.float()).abs().max()) for a, b in zip(a_entries, b_entries, strict=True)
               for (_, _, x), (_, _, y) in zip(tensors(a), tensors(b), strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_replayed_cold_prefills_equal_the_eager_build(dtype) -> None:
    """The same calls through a runner that captures and replays and one that runs the padded forward
    eagerly: the same entries every round — the first round of each shape runs eagerly then captures,
    later rounds replay with new tokens, after every cached plan has been dropped and its memory
    reused. Against the unpadded build, within the noise of the GPU's kernels: on the CPU the two
    agree to 1e-5 in fp32, but here matmuls of another row count round differently and fla's fp32
    dots are TF32, so the bound is what the unpadded build itself moves by when the same segments
    are batched otherwise (each alone instead of together)."""
    from hypic.bench.shapes import SHAPES
    from hypic.models.random_init import random_model

    dev = torch.device("cuda")
    model = random_model(dict(SHAPES["tiny"], num_hidden_layers=8), device=dev, dtype=dtype).model
    template = entry_template(model, dev)
    graphed = ColdGraphs(model, template, dev, capture=True)
    eager = ColdGraphs(model, template, dev, capture=False)
    g = torch.Generator().manual_seed(11)
    tight, floor = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 0.1)
    for rnd in range(3):
        spec = [(int(n), 8) for n in torch.randint(20, 300, (5,), generator=g)] + [(100 + rnd, 8)]
        segments = [(torch.randint(0, 512, (n,), generator=g).tolist(), w) for n, w in spec]
        with torch.no_grad():
            got = graphed.prefill(_keyed(segments))
            want = eager.prefill(_keyed(segments))
            together = _unpadded(model, template, segments, dev)
            alone = [e for s in segments for e in _unpadded(model, template, [s], dev)]
        _assert_same(want, got, atol=tight)
        noise = _max_diff(together, alone)
        assert _max_diff(together, got) <= max(4 * noise, floor), (_max_diff(together, got), noise)
        _forget_plans()
    assert not graphed.refused and graphed.counts["replayed"] >= 2 and eager.counts["replayed"] == 0


@pytest.mark.gpu
def test_on_a_gpu_the_engine_answers_the_same_with_cold_graphs(monkeypatch) -> None:
    """Through the engine, with every shape captured first (``prepare_cold_graphs``), three rounds of
    new documents, all replayed: the logits of the padded forward eagerly (``eager``) to 1e-5, and of
    the one-forward path (``0``) within fp32's TF32 noise (measured 1.6e-3 on the H200)."""
    from hypic.bench.shapes import SHAPES
    from hypic.engine.engine import Engine
    from hypic.models.random_init import random_model

    loaded = random_model(dict(SHAPES["tiny"], num_hidden_layers=8), device="cuda", dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    doc = lambda n: torch.randint(0, 512, (n,), generator=g).tolist()  # noqa: E731
    rounds = [[[doc(6), doc(n), doc(n + 30), doc(5)] for n in (40, 90, 200)] for _ in range(3)]
    logits = {}
    for graphs in ("1", "eager", "0"):
        monkeypatch.setenv("HYPIC_COLD_GRAPHS", graphs)
        engine = Engine(loaded, seam=8)
        prepared = engine.prepare_cold_graphs()  # every shape of seam 8: 8 slot counts × 8 lengths
        assert prepared == (64 if graphs == "1" else 0) and engine.prepare_cold_graphs() == 0
        logits[graphs] = [engine.prefill_logits(prompts)[0] for prompts in rounds]
        runner = engine._graphs.get("1")
        assert (runner is not None and runner.counts["replayed"] >= 1) == (graphs == "1")
        if graphs == "1":  # every call replayed a prepared shape: no eager forward since
            assert runner.counts["eager"] == prepared and not runner.refused
    for a, b, c in zip(logits["1"], logits["eager"], logits["0"], strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-5), float((a - b).abs().max())
        assert torch.allclose(a, c, rtol=0, atol=1e-2), float((a - c).abs().max())


@pytest.mark.gpu
def test_on_a_gpu_sparing_memory_hands_the_cold_graphs_pool_back(monkeypatch) -> None:
    """What the engine does once the device has run out of memory (``_spare_memory``) frees the cold
    graphs' pool: no segment of it is left in the allocator and the device holds that much less; the
    auto device budget, lowered by half of what the graphs held, is whole again; cold prefills go on
    eagerly, answering as an engine without graphs does. (With a pool the process kept,
    30 GiB stayed held and a 9B trace failed 147 of 200 requests: session 23.)"""
    from hypic.bench.shapes import SHAPES
    from hypic.engine.engine import Engine
    from hypic.models.random_init import random_model

    monkeypatch.setenv("HYPIC_COLD_GRAPHS", "1")
    loaded = random_model(dict(SHAPES["tiny"], num_hidden_layers=8), device="cuda", dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    doc = lambda n: torch.randint(0, 512, (n,), generator=g).tolist()  # noqa: E731
    engine = Engine(loaded, seam=8)
    assert engine.prepare_cold_graphs() == 64
    pool = tuple(engine._graphs["1"].pool.id)
    auto = engine._auto_device_budget  # half the memory free beside the model, less half what the graphs hold
    assert auto is not None and engine.store.budgets["device"] == auto - engine._graphs["1"].held_bytes() // 2

    def held() -> int:
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pool)

    engine.prefill_logits([[doc(6), doc(70), doc(5)]])
    before, reserved = held(), torch.cuda.memory_reserved()
    assert before > 0
    engine._spare_memory()
    assert held() == 0 and torch.cuda.memory_reserved() <= reserved - before
    assert engine.store.budgets["device"] == auto
    assert engine._cold_graphs() is None and engine.prepare_cold_graphs() == 0
    prompts = [[doc(6), doc(n), doc(n + 30), doc(5)] for n in (40, 90)]
    after = engine.prefill_logits(prompts)[0]
    monkeypatch.setenv("HYPIC_COLD_GRAPHS", "0")
    plain = Engine(loaded, seam=8).prefill_logits(prompts)[0]
    assert torch.allclose(after, plain, rtol=0, atol=1e-5), float((after - plain).abs().max())
