"""The standalone-segment training forward equals the engine's hypic mode at its seam w (fp32, per
family, w = 0, 4, 8), and differs from the in-context forward and from other seams (so the check
can fail)."""

import pytest
import torch

from hypic.engine.engine import Engine
from hypic.models.context import SequenceContext, SequenceState
from hypic.models.loader import load_model
from hypic.train.pic import StandaloneSegmentsContext
from tests.engine.conftest import _kimi, _qwen3_5, _ring


def _prompts(vocab: int, seed: int) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    # head, documents, query; every segment at least W − 1 = 3 tokens long: the engine warms a conv up
    # from the previous segment's own tail only, so a shorter segment would leave zeros where this
    # forward has the tokens before it
    shapes = [[5, 17, 9, 23, 6], [3, 11, 4], [8, 30, 3, 7]]
    return [[torch.randint(0, vocab, (n,), generator=g).tolist() for n in s] for s in shapes]


def _seam_prompts(vocab: int, seed: int) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    # at w = 4 and 8: segments of at most w tokens (computed in context whole) and bodies of at least
    # W − 1 = 3 tokens (the engine warms the next conv up from a body's own tail)
    shapes = [[3, 17, 12, 23, 6], [4, 11, 7], [13, 30, 2, 7]]
    return [[torch.randint(0, vocab, (n,), generator=g).tolist() for n in s] for s in shapes]


def _pic_logits(model, prompts: list[list[list[int]]], seam: int) -> torch.Tensor:
    ids = torch.tensor([t for p in prompts for s in p for t in s])
    lengths = [sum(map(len, p)) for p in prompts]
    ctx = StandaloneSegmentsContext(lengths, [[len(s) for s in p] for p in prompts], torch.device("cpu"), seam=seam)
    last_token = torch.tensor(lengths).cumsum(0) - 1  # the query's last token is never a seam copy
    last = torch.stack([(ctx.source == i).nonzero()[0, 0] for i in last_token])
    return model(ids[ctx.source], ctx, last)


@pytest.mark.parametrize("build", [_qwen3_5, _kimi], ids=["gdn", "kda"])
@torch.no_grad()
def test_standalone_segments_forward_is_hypic_at_its_seam(build, tmp_path) -> None:
    loaded = load_model(build(tmp_path / "m"), device="cpu", dtype=torch.float32)
    model = loaded.model
    # seam 0 on the first prompts; seams 4 and 8 on prompts with all-seam segments too (at seam 0 their
    # segments shorter than the conv window would not match: see _prompts)
    for prompts, exact in ((_prompts(model.vocab_size, 0), (0,)), (_seam_prompts(model.vocab_size, 1), (4, 8))):
        got = {w: _pic_logits(model, prompts, w) for w in (0, 4, 8)}
        for w in exact:
            want, _ = Engine(loaded, seam=w).prefill_logits(prompts, mode="hypic")
            assert (got[w] - want).abs().max() <= 1e-4, w
            if w:
                assert (got[0] - want).abs().max() > 1e-3  # the seam changes the answer: the check can fail
        lengths = [sum(map(len, p)) for p in prompts]
        ids = torch.tensor([t for p in prompts for s in p for t in s])
        last = torch.tensor(lengths).cumsum(0) - 1
        full = model(ids, SequenceContext([SequenceState() for _ in lengths], lengths, torch.device("cpu")), last)
        assert (full - got[0]).abs().max() > 1e-3  # in context is measurably different
    assert (got[4] - got[8]).abs().max() > 1e-3


def test_seam_copies_follow_the_engine_plan() -> None:
    # one sequence: head 3 (≤ w: all in context), document 10 (seam 4, body 6), query 5
    ctx = StandaloneSegmentsContext([18], [[3, 10, 5]], torch.device("cpu"), seam=4)
    assert ctx.source.tolist() == [*range(13), 0, 1, 2, 3, 4, 5, 6, *range(13, 18)]
    assert ctx.seam_copy.tolist() == [False] * 13 + [True] * 7 + [False] * 5
    assert ctx.positions.tolist() == [*range(13), 0, 1, 2, 3, 4, 5, 6, *range(13, 18)]
    # the request in true-position order: the head's copy, the document's seam copy, its body, the query
    assert ctx.virtual.tolist() == [13, 14, 15, 16, 17, 18, 19, 7, 8, 9, 10, 11, 12, *range(20, 25)]
    assert ctx.in_context.tolist() == [False] * 13 + [True] * 12
    # at seam 0 there are no copies and the request is the physical order: nothing to gather
    ctx0 = StandaloneSegmentsContext([18], [[3, 10, 5]], torch.device("cpu"), seam=0)
    assert ctx0.source.tolist() == list(range(18)) and ctx0.virtual is None
    with pytest.raises(ValueError, match="seam"):
        StandaloneSegmentsContext([18], [[3, 10, 5]], torch.device("cpu"), seam=-1)


@torch.no_grad()
def test_standalone_segments_refuses_bad_cuts_and_rope_in_linear_layers(tmp_path) -> None:
    with pytest.raises(ValueError, match="do not cut"):
        StandaloneSegmentsContext([10], [[3, 4]], torch.device("cpu"))
    loaded = load_model(_ring(tmp_path / "ring"), device="cpu", dtype=torch.float32)
    ctx = StandaloneSegmentsContext([6], [[3, 3]], torch.device("cpu"))
    with pytest.raises(ValueError, match="RoPE"):
        loaded.model(torch.arange(6), ctx)
