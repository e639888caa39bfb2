"""A cold prefill builds each entry in one buffer of its own, laid out by the model's entry template
(``cold.entry_template``, ``layout.resized``): the same bytes as the tensor-by-tensor build, for every
family (summaries with and without T, conv tails or none, MLA keys), owning exactly its memory, and
packed for the wire as one part."""

import pytest
import torch

from hypic.cache.keys import segment_key
from hypic.cache.layout import layout, owns_memory, resized, tensors
from hypic.engine.cold import ColdContext, entry_template
from hypic.models.loader import load_model
from hypic.parallel.wire import pack, split


def _prefill(model, segments, template=None):
    ctx = ColdContext([(ids, w, segment_key(ids, model_fingerprint="t", seam=w, dtype="bf16")) for ids, w in segments],
                      torch.device("cpu"), template)
    with torch.no_grad():
        model.hidden_states(ctx.input_ids, ctx)
    return ctx.entries


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear", "ring_linear", "minimax"])
def test_entries_built_in_one_buffer_equal_the_tensor_by_tensor_build(model_paths, family) -> None:
    loaded = load_model(model_paths[family], device="cpu", dtype="bfloat16")
    template = entry_template(loaded.model, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    segments = [(torch.randint(0, 64, (n,), generator=g).tolist(), w) for n, w in ((23, 4), (9, 0), (40, 8))]
    alone, packed = _prefill(loaded.model, segments), _prefill(loaded.model, segments, template)
    for a, b in zip(alone, packed, strict=True):
        assert b.buffer is not None and owns_memory(b) and b.storage_bytes == b.header.nbytes
        assert b.header == layout(b) == resized(template, a.key, a.token_ids, a.seam)
        assert layout(a).fields == b.header.fields  # the template's layout is the one the build would have
        for (slot, layer, x), (_, _, y) in zip(tensors(a), tensors(b), strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y), (slot, layer)
    headers, buf = pack(packed)  # each entry one part of the wire buffer
    assert buf.numel() == sum(e.buffer.numel() for e in packed)
    assert all(torch.equal(x.buffer, y.buffer) for x, y in zip(packed, split(headers, buf), strict=True))


def test_the_fused_combine_finds_summaries_at_buffer_plus_offset(model_paths) -> None:
    """``combine._buffer_tables``: a body's T and S of every linear layer at its buffer's address plus
    the common offsets — the tensors' own addresses; nothing when any body is not such a buffer."""
    from hypic.engine.combine import _buffer_tables

    loaded = load_model(model_paths["qwen3_5"], device="cpu", dtype="float32")
    template = entry_template(loaded.model, torch.device("cpu"))
    segments = [(list(range(3, 3 + n)), 2) for n in (7, 12, 30)]
    bodies = _prefill(loaded.model, segments, template)
    tables = _buffer_tables(bodies, torch.device("cpu"))
    assert sorted(tables) == sorted(bodies[0].summaries) and len(tables) > 1
    for layer, (T, S) in tables.items():
        assert T.tolist() == [e.summaries[layer].transition.data_ptr() for e in bodies]
        assert S.tolist() == [e.summaries[layer].state.data_ptr() for e in bodies]
    loose = _prefill(loaded.model, segments[:1])  # built tensor by tensor: addresses looked up per layer
    assert _buffer_tables(bodies + loose, torch.device("cpu")) == {}
    assert _buffer_tables(bodies, torch.device("meta")) == {}


@pytest.mark.parametrize("buffers", ["1", "0"])
def test_the_engine_builds_entries_in_buffers_unless_switched_off(model_paths, monkeypatch, buffers) -> None:
    """``HYPIC_ENTRY_BUFFERS=0`` (the A/B switch) builds entries tensor by tensor; the answers are the
    same bits either way."""
    from hypic.engine.engine import Engine

    monkeypatch.setenv("HYPIC_ENTRY_BUFFERS", buffers)
    loaded = load_model(model_paths["qwen3_5"], device="cpu", dtype="float32")
    prompt = [list(range(5, 17)), list(range(30, 52)), list(range(60, 66))]
    engine = Engine(loaded, seam=3)
    engine.prewarm([prompt[1]])
    warm = engine.prefill_logits([prompt])[0]
    entries = list(engine.store.entries())
    assert entries and all((e.buffer is not None) == (buffers == "1") for e in entries)
    monkeypatch.setenv("HYPIC_ENTRY_BUFFERS", "1" if buffers == "0" else "0")
    other = Engine(loaded, seam=3)
    other.prewarm([prompt[1]])
    assert torch.equal(warm, other.prefill_logits([prompt])[0])


def test_a_half_precision_host_tier_moves_answers_by_rounding_only(model_paths) -> None:
    """``cache_host_dtype="bfloat16"`` with a device tier of two entries: most documents are demoted
    and promoted back between calls, their summaries rounded once; the answers stay within that
    rounding of an engine that keeps everything in fp32 (and an unknown dtype is refused)."""
    from hypic.engine.engine import Engine

    loaded = load_model(model_paths["qwen3_5"], device="cpu", dtype="float32")
    g = torch.Generator().manual_seed(8)
    docs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (30, 41, 25, 36, 50, 28)]
    prompts = [[[5, 6, 7], *(docs[(i + j) % 6] for j in range(3)), [9, 10 + i]] for i in range(4)]
    ref = Engine(loaded, seam=3, cache_device_bytes=None)
    ref.prefill_logits(prompts)
    biggest = max(e.nbytes for e in ref.store.entries())
    small = Engine(loaded, seam=3, cache_device_bytes=2 * biggest, cache_host_bytes=None, cache_host_dtype="bfloat16")
    small.prefill_logits(prompts)  # all four at once: their documents pinned, most go straight to the host
    assert small.store.stats().entries["host"] >= 3
    assert all(s.state.dtype == torch.bfloat16 for e in small.store._tiers["host"].values()
               for s in e.summaries.values())
    # one prompt a call: host hits are promoted (widened) and others demoted; then all four at once
    # again: the device fills with pinned entries and the rest are served from the host (a widened copy)
    got = [small.prefill_logits([p])[0] for p in prompts] + [small.prefill_logits(prompts)[0]]
    want = [ref.prefill_logits([p])[0] for p in prompts] + [ref.prefill_logits(prompts)[0]]
    stats = small.store.stats()
    assert stats.promotions > 0 and stats.demotions > 0
    diffs = [float((a - b).abs().max()) for a, b in zip(got, want, strict=True)]
    assert 0 < max(diffs) < 1e-3, diffs  # rounded (≈ 5e-5 of logits up to 0.75 here), and only that
    assert small.store.check_integrity()
    with pytest.raises(ValueError, match="cache_host_dtype"):
        Engine(loaded, cache_host_dtype="int8")


def _docs(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("first", ["naive", "zero_state", "addition"])
def test_in_context_entries_serve_only_the_mode_that_built_them(model_paths, first: str) -> None:
    """An in-context entry is cut out of its first request's forward, which each mode assembles its
    own way: after a ``first`` request built them, a ``transition`` request answers as on an engine
    that served ``transition`` alone (they shared keys, and transition got naive's error: ≈ 1e-3 on
    MiniMax, where transition is exact to 1e-7)."""
    from hypic import LLM

    prompt = _docs(51, [30, 64, 50, 9])

    def logits(llm, mode: str) -> torch.Tensor:
        return llm.engine.prefill_logits([prompt], mode=mode)[0][0]

    clean = LLM(str(model_paths["minimax"]), device="cpu", cold="in_context")
    logits(clean, "transition")
    want = logits(clean, "transition")  # warm: its own entries
    mixed = LLM(str(model_paths["minimax"]), device="cpu", cold="in_context")
    logits(mixed, first)
    _, metrics = mixed.engine.prefill_logits([prompt], mode="transition")
    assert metrics[0].segment_misses == 3  # the first mode's entries are not transition's
    assert torch.allclose(logits(mixed, "transition"), want, atol=1e-6, rtol=0)
    assert mixed.evict(prompt[:3]) == [True] * 3  # eviction finds every mode's entries
    assert mixed.engine.store.stats().entries["device"] == 0


def test_in_context_and_standalone_entries_are_kept_apart(model_paths, tmp_path) -> None:
    """In-context entries carry their first context: a standalone engine never serves them (a
    ``hypic`` one shared the standalone key; saved and loaded into a standalone engine it answered
    1.44 off in the logits), while an in-context engine may take a standalone (prewarmed) entry,
    valid anywhere. Evicting a document also drops the ``prefix`` states that hold it in an
    in-context engine with a seam (their keys were missed: the document stayed served)."""
    from hypic import LLM

    a, b, q = _docs(52, [40, 36, 7])
    path = str(model_paths["qwen3_5"])
    in_context = LLM(path, device="cpu", cold="in_context", seam=4)
    in_context.engine.prefill_logits([[a, b, q]], mode="hypic")
    in_context.save_cache(tmp_path / "saved")
    standalone = LLM(path, device="cpu", seam=4)
    standalone.load_cache(tmp_path / "saved")
    got, metrics = standalone.engine.prefill_logits([[b, a, q]], mode="hypic")
    assert metrics[0].segment_hits == 0  # the in-context entries are not its
    want = LLM(path, device="cpu", seam=4).engine.prefill_logits([[b, a, q]], mode="hypic")[0]
    assert torch.allclose(got, want, atol=1e-4, rtol=0)
    fresh = LLM(path, device="cpu", cold="in_context", seam=4)
    fresh.prewarm([a, b])
    assert fresh.engine.prefill_logits([[b, a, q]], mode="hypic")[1][0].segment_hits == 2  # standalone, taken
    for llm in (in_context, fresh):
        llm.generate([[a, q]], mode="prefix")
        assert llm.evict([a])[0]
        assert llm.generate([[a, q]], mode="prefix")[0].metrics.segment_hits == 0, llm.engine.cold


def test_a_request_is_charged_the_cold_tokens_of_its_own_misses(qwen3_5_path) -> None:
    """``recomputed_tokens`` per request: a call of three prompts charged each one every entry the
    call built (a 105-token prompt reported 463)."""
    from hypic import LLM

    a, b, c, q = _docs(131, [100, 300, 50, 5])
    prompts = [[a, q], [b, q], [c, a, [7]]]
    together = LLM(str(qwen3_5_path), device="cpu").engine.prefill_logits(prompts, mode="hypic")[1]
    alone = LLM(str(qwen3_5_path), device="cpu")
    single = [alone.engine.prefill_logits([p], mode="hypic")[1][0] for p in prompts[:2]]
    # a document built (100), its seam recomputed in context (8), the query (5)
    assert [m.recomputed_tokens for m in together[:2]] == [m.recomputed_tokens for m in single] == [113, 313]
    assert together[2].recomputed_tokens == 50 + 100 + 2 * 8 + 1  # c and a missed here (a built once, for the call)


@pytest.mark.parametrize("prompt, where", [([[1, 2], []], r"prompts\[0\]\[1\]"), ([], r"prompts\[0\]: no segments"),
                                           ([[1, 2], [], [3]], r"prompts\[0\]\[1\]")])
def test_the_engine_refuses_an_empty_segment_or_query(qwen3_5_path, prompt, where: str) -> None:
    """An empty query left the logits and decode state at the last cached segment's seam, silently."""
    from hypic import LLM, SamplingParams

    engine = LLM(str(qwen3_5_path), device="cpu").engine
    with pytest.raises(ValueError, match=where):
        engine.prefill_logits([prompt])
    with pytest.raises(ValueError, match=where):
        engine.start([prompt], [SamplingParams(max_tokens=2)])
    assert engine.prefill_logits([[[1, 2], [3]]])[0].shape[0] == 1


def test_a_document_repeated_in_an_in_context_prompt_is_exact_warm_in_the_same_order(model_paths) -> None:
    """In-context entries reused in their own order give the full computation back; a document
    twice in the prompt has one key for two contexts, so its later copies are computed in context
    (the first copy's entry served the second: 0.48 off in the logits, warm, same order)."""
    from hypic import LLM

    a, b, q = _docs(53, [40, 36, 7])
    prompt = [a, b, a, q]
    llm = LLM(str(model_paths["qwen3_5"]), device="cpu", cold="in_context")
    full = llm.engine.prefill_logits([prompt], mode="full")[0]
    for _ in range(2):  # cold, then warm
        got, metrics = llm.engine.prefill_logits([prompt], mode="hypic")
        assert torch.allclose(got, full, atol=1e-4, rtol=0)
    assert metrics[0].segment_hits == 2  # a and b; the second a is computed in context
