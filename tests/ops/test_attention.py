"""The mask-free attention variants equal the explicit position-causal mask they stand for."""

import pytest
import torch

from hypic.ops.attention import attention


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_flag_variants_equal_the_explicit_mask(heads: tuple[int, int]) -> None:
    hq, hkv = heads
    gen = torch.Generator().manual_seed(0)
    past, new = 37, 11
    q = torch.randn(new, hq, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(past + new, hkv, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(past + new, hkv, 8, generator=gen, dtype=torch.float64)
    k_pos = torch.arange(past + new)
    cases = [  # (flags, query positions, number of keys): a continuation, a plain prefill, a decode step
        (dict(causal_suffix=True), torch.arange(past, past + new), past + new),
        (dict(causal_prefill=True), torch.arange(new), new),
        (dict(all_visible=True, causal_suffix=True), torch.tensor([past + new - 1]), past + new),
    ]
    for flags, q_pos, n in cases:
        qq = q[: len(q_pos)]
        ref = attention(qq, k[:n], v[:n], q_positions=q_pos, k_positions=k_pos[:n], scale=0.25)
        got = attention(qq, k[:n], v[:n], q_positions=q_pos, k_positions=k_pos[:n], scale=0.25, **flags)
        assert (got - ref).abs().max() < 1e-12, flags
    # and the mask path is really position-causal: a later key changes nothing before it
    k2 = k.clone()
    k2[-1] += 1.0
    kw = dict(q_positions=torch.arange(past, past + new), k_positions=k_pos, scale=0.25, causal_suffix=True)
    a, b = attention(q, k, v, **kw), attention(q, k2, v, **kw)
    assert torch.equal(a[:-1], b[:-1]) and not torch.equal(a[-1], b[-1])


def test_grouping_bounds_padding() -> None:
    from hypic.ops.attention_batch import group_lengths

    lengths = [5, 100, 98, 3, 0, 97, 50, 1, 400]
    groups = group_lengths(lengths)
    assert sorted(i for g in groups for i in g) == [i for i, n in enumerate(lengths) if n > 0]
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert len(g) == 1 or longest * len(g) <= 1.25 * sum(lengths[i] for i in g)


def test_batched_causal_prefill_equals_one_call_per_sequence() -> None:
    from hypic.ops.attention_batch import causal_prefill_batch

    gen = torch.Generator().manual_seed(1)
    lengths = [5, 100, 98, 3, 0, 97, 50, 1]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    T = int(cu[-1])
    q, k, v = (torch.randn(T, h, d, generator=gen, dtype=torch.float64, requires_grad=True)
               for h, d in ((8, 16), (2, 16), (2, 8)))
    runs = [(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True) if b > a]
    ref = torch.cat([attention(q[a:b], k[a:b], v[a:b], q_positions=torch.arange(b - a),
                               k_positions=torch.arange(b - a), scale=0.3, causal_prefill=True) for a, b in runs])
    got = causal_prefill_batch(q, k, v, cu, 0.3)
    assert (got - ref).abs().max() < 1e-12
    for a, b in zip(torch.autograd.grad(ref.square().sum(), (q, k, v)),
                    torch.autograd.grad(got.square().sum(), (q, k, v)), strict=True):
        assert (a - b).abs().max() < 1e-12


def test_long_lengths_are_bucketed_a_few_per_octave() -> None:
    from hypic.ops.attention import long_length

    for n in range(1, 70_000, 7):
        m = long_length(n, 8)
        assert n <= m and m % 64 == 0 and long_length(m, 8) == m and long_length(n, 0) == n
        assert m <= n * 9 / 8 if n >= 512 else m - n < 64  # below 512 tokens: the next multiple of 64
    # one octave meets at most 8 shapes, each a multiple of 1/8 of the octave's start
    octave = {long_length(n, 8) for n in range(8193, 16385)}
    assert len(octave) == 8 and all(m % 1024 == 0 for m in octave)
    assert sorted({long_length(n, 4) for n in range(8193, 16385)}) == [10240, 12288, 14336, 16384]


def test_long_prefill_padded_to_its_bucket_equals_the_exact_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """The long path (cuDNN on CUDA) pads the tokens to a bucketed length; causal masking hides the
    padding from every real query, so the outputs equal the unpadded ones. Forced on here on CPU."""
    from hypic.ops import attention as attention_module
    from hypic.ops import attention_batch
    from hypic.ops.attention import long_length
    from hypic.ops.attention_batch import causal_prefill_batch

    gen = torch.Generator().manual_seed(2)
    n = 75
    assert long_length(n) == 128  # so padding does happen
    q, k, v = (torch.randn(n, h, d, generator=gen, dtype=torch.float64) for h, d in ((8, 16), (2, 16), (2, 8)))
    cu = torch.tensor([0, 30, 30 + n])
    qq, kk, vv = (torch.cat([x[:30], x]) for x in (q, k, v))  # two sequences: 30 and n tokens
    kw = dict(q_positions=None, k_positions=None, scale=0.3, causal_prefill=True)
    ref, ref_batch = attention(q, k, v, **kw), causal_prefill_batch(qq, kk, vv, cu, 0.3)
    padded = []
    real = attention_module.pad_tokens
    monkeypatch.setattr(attention_module, "long_prefill", lambda tokens, q: True)
    monkeypatch.setattr(attention_batch, "long_prefill", lambda tokens, q: True)

    def spy(x: torch.Tensor, length: int, dim: int = 0) -> torch.Tensor:
        padded.append(length)
        return real(x, length, dim)

    for module in (attention_module, attention_batch):
        monkeypatch.setattr(module, "pad_tokens", spy)
    got, got_batch = attention(q, k, v, **kw), causal_prefill_batch(qq, kk, vv, cu, 0.3)
    assert 128 in padded and got.shape == ref.shape and got_batch.shape == ref_batch.shape
    assert (got - ref).abs().max() < 1e-12 and (got_batch - ref_batch).abs().max() < 1e-12


def test_the_long_paths_settings_are_checked_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from hypic.ops.attention import _env_count

    for raw, match in (("abc", "non-negative integer, got 'abc'"), ("-1", "got -1"), ("6", "power of two, got 6")):
        monkeypatch.setenv("HYPIC_CUDNN_BUCKETS", raw)
        with pytest.raises(ValueError, match=f"HYPIC_CUDNN_BUCKETS: expected .*{match}"):
            _env_count("HYPIC_CUDNN_BUCKETS", 8, power_of_two=True)
    for raw, want in (("0", 0), ("16", 16)):
        monkeypatch.setenv("HYPIC_CUDNN_BUCKETS", raw)
        assert _env_count("HYPIC_CUDNN_BUCKETS", 8, power_of_two=True) == want
