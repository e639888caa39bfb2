"""The query-blind training forward: attention against a dense fp64 mask written out here (RoPE at
true positions), the model's rows before the query unchanged, its query rows changed but still
reached by the documents through the linear layers, and a gradient for every parameter."""

import numpy as np
import pytest
import torch

from hypic.eval.tokenizer import corpus, train_tokenizer
from hypic.models.context import SequenceContext, SequenceState
from hypic.models.random_init import random_model
from hypic.ops.rope import RopeSpec
from hypic.train.blind import QueryBlindContext
from hypic.train.data import pack
from hypic.train.loop import loss_of, model_config


def _rope_ref(x: torch.Tensor, pos: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    # the rotate-half convention over the first rotary_dim dims, written out independently
    half = spec.rotary_dim // 2
    freq = 1.0 / spec.theta ** (torch.arange(half, dtype=torch.float64) * 2 / spec.rotary_dim)
    ang = pos.double()[:, None] * freq[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b, rest = x[..., :half], x[..., half:spec.rotary_dim], x[..., spec.rotary_dim:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], -1)


@pytest.mark.parametrize("use_rope", [False, True])
def test_attention_matches_a_dense_query_blind_mask(use_rope: bool) -> None:
    lengths, segments = [9, 6, 5], [[2, 4, 3], [6], [1, 0, 4]]  # a sequence that is all query; an empty segment
    ctx = QueryBlindContext(lengths, segments, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    T, H, D = sum(lengths), 2, 8
    q, k, v = (torch.randn(T, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    spec = RopeSpec(rotary_dim=4, theta=100.0) if use_rope else None
    out = ctx.attend(0, q, k, v, spec, 0.5)
    ref = torch.zeros_like(out)
    pos = torch.cat([torch.arange(n) for n in lengths])
    if spec is not None:
        q, k = _rope_ref(q, pos, spec), _rope_ref(k, pos, spec)
    start = 0
    for n, segs in zip(lengths, segments, strict=True):
        query = n - segs[-1]
        i = torch.arange(n)
        mask = (i[None] <= i[:, None]) & ((i[:, None] >= query) == (i[None] >= query))
        s = slice(start, start + n)
        scores = torch.einsum("ihd,jhd->hij", q[s], k[s]) * 0.5
        p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        ref[s] = torch.einsum("hij,jhd->ihd", p, v[s])
        start += n
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_segments_must_cut_the_sequence() -> None:
    with pytest.raises(ValueError, match="do not cut a sequence of 5 tokens"):
        QueryBlindContext([5], [[2, 2]], torch.device("cpu"))


def test_the_query_reads_the_documents_only_through_the_linear_layers() -> None:
    tok = train_tokenizer(corpus(2, [-1], difficulties=(0.0,)), 512)
    model = random_model(model_config(tok, "tiny"), device="cpu", dtype=torch.float32, seed=0).model.train()
    model.requires_grad_(True)
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, 500, 31)
    marks = np.zeros(31, np.uint8)
    marks[-4:] = 1
    segments = np.array([3, 10, 8])  # query onward: the last 10 tokens
    batch = pack([(tokens, marks, segments)], doc_weight=0.1)
    cpu = torch.device("cpu")
    loss, accuracy, first = loss_of(model, batch, cpu, blind=True)
    assert torch.isfinite(loss) and 0 <= accuracy <= 1 and 0 <= first <= 1
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())

    def hidden(ids: np.ndarray, blind: bool) -> torch.Tensor:
        b = pack([(ids, marks, segments)], doc_weight=0.1)
        if blind:
            ctx = QueryBlindContext(b.lengths, b.segments, cpu)
        else:
            ctx = SequenceContext([SequenceState()], b.lengths, cpu, keep_state=False)
        with torch.no_grad():
            return model.hidden_states(b.input_ids, ctx)

    blind, full = hidden(tokens, True), hidden(tokens, False)
    torch.testing.assert_close(blind[:21], full[:21])  # before the query: attention as in context
    assert (blind[21:] - full[21:]).abs().max() > 1e-3  # the query no longer attends to the documents
    other = tokens.copy()
    other[5] = (other[5] + 1) % 500 + 5  # another document token: it still reaches the query, by the linear layers
    assert (hidden(other, True)[21:] - blind[21:]).abs().max() > 1e-4
    with pytest.raises(ValueError, match="standalone or query-blind"):
        loss_of(model, batch, cpu, standalone=True, blind=True)
