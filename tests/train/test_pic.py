"""The standalone-segment training forward equals the engine's hypic mode at seam 0 (fp32, per
family), and differs from the in-context forward (so the check can fail)."""

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


@pytest.mark.parametrize("build", [_qwen3_5, _kimi], ids=["gdn", "kda"])
@torch.no_grad()
def test_standalone_segments_forward_is_hypic_at_seam_0(build, tmp_path) -> None:
    loaded = load_model(build(tmp_path / "m"), device="cpu", dtype=torch.float32)
    model = loaded.model
    prompts = _prompts(model.vocab_size, 0)
    want, _ = Engine(loaded, seam=0).prefill_logits(prompts, mode="hypic")
    ids = torch.tensor([t for p in prompts for s in p for t in s])
    lengths = [sum(map(len, p)) for p in prompts]
    ctx = StandaloneSegmentsContext(lengths, [[len(s) for s in p] for p in prompts], torch.device("cpu"))
    last = torch.tensor(lengths).cumsum(0) - 1
    got = model(ids, ctx, last)
    assert (got - want).abs().max() <= 1e-4
    full = model(ids, SequenceContext([SequenceState() for _ in lengths], lengths, torch.device("cpu")), last)
    assert (full - want).abs().max() > 1e-3  # in context is measurably different


@torch.no_grad()
def test_standalone_segments_refuses_bad_cuts_and_rope_in_linear_layers(tmp_path) -> None:
    with pytest.raises(ValueError, match="do not cut"):
        StandaloneSegmentsContext([10], [[3, 4]], torch.device("cpu"))
    loaded = load_model(_ring(tmp_path / "ring"), device="cpu", dtype=torch.float32)
    ctx = StandaloneSegmentsContext([6], [[3, 3]], torch.device("cpu"))
    with pytest.raises(ValueError, match="RoPE"):
        loaded.model(torch.arange(6), ctx)
