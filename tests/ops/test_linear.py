"""The chunked torch kernel (the CPU backend) against the token loop, varlen and with summaries."""

import pytest
import torch

from hypic.ops import recurrence as R
from hypic.ops.family import FAMILIES
from hypic.ops.linear import linear_attention
from hypic.ops.samples import family_inputs, token_kwargs

LENGTHS = [1, 3, 63, 64, 65, 500]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunked_varlen_matches_run(family: str) -> None:
    """Packed sequences of every test length, GVA (2 key heads, 4 value heads), each with its own S_in."""
    cu = torch.tensor([0, *LENGTHS]).cumsum(0)
    x = family_inputs(family, int(cu[-1]), heads=2, value_heads=4, seed=11)
    s0 = torch.randn(len(LENGTHS), 4, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x32 = {n: t.float() for n, t in x.items()}
    out = linear_attention(family, x32["q"], x32["k"], x32["v"], **token_kwargs(x32), cu_seqlens=cu,
                           initial_state=s0.float(), output_summary=True)
    assert out.o.shape == (int(cu[-1]), 4, 4) and out.o.dtype == torch.float32
    assert out.final_state.shape == (len(LENGTHS), 4, 8, 4)
    for i in range(len(LENGTHS)):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        ref = R.run(family, x["q"][sl], x["k"][sl], x["v"][sl], initial_state=s0[i], **token_kwargs(x, sl))
        summ = R.summarize(family, x["k"][sl], x["v"][sl], **token_kwargs(x, sl))
        assert _rel(out.o[sl], ref.o) <= 1e-5
        assert _rel(out.final_state[i], ref.final_state) <= 1e-5
        assert _rel(out.summary.state[i], summ.state) <= 1e-5
        if summ.transition is not None:  # T contracts; measure its error on the scale of the state it maps
            assert (out.summary.transition[i].double() - summ.transition).norm() <= 1e-5 * max(
                1.0, summ.transition.norm().item())
        # the summary reproduces the final state from the initial one
        assert _rel(R.apply(family, R.Summary(*(None if t is None else t[i] for t in out.summary)), s0[i].float()),
                    ref.final_state) <= 1e-5


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunked_fp64_is_exact(family: str) -> None:
    x = family_inputs(family, 200, seed=4)
    out = linear_attention(family, x["q"], x["k"], x["v"], **token_kwargs(x), output_summary=True)
    ref = R.run(family, x["q"], x["k"], x["v"], **token_kwargs(x))
    assert out.final_state.dtype == torch.float64
    assert _rel(out.o, ref.o) < 1e-12 and _rel(out.final_state, ref.final_state) < 1e-12


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("with_state", [False, True])
def test_a_decode_step_of_one_token_per_sequence_matches_run(family: str, with_state: bool) -> None:
    """The decode step's path (every sequence one token: the recurrence applied once, batched) against
    the token loop per sequence, GVA heads, fp32 and its output dtype; a summary asks the chunked path."""
    n = 5
    x = family_inputs(family, n, heads=2, value_heads=4, seed=21)
    s0 = torch.randn(n, 4, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) if with_state \
        else None
    x32 = {name: t.float() for name, t in x.items()}
    out = linear_attention(family, x32["q"], x32["k"], x32["v"], **token_kwargs(x32), cu_seqlens=torch.arange(n + 1),
                           initial_state=None if s0 is None else s0.float())
    assert out.o.dtype == torch.float32 and out.final_state.shape == (n, 4, 8, 4)
    for i in range(n):
        sl = slice(i, i + 1)
        ref = R.run(family, x["q"][sl], x["k"][sl], x["v"][sl], initial_state=None if s0 is None else s0[i],
                    **token_kwargs(x, sl))
        assert _rel(out.o[sl], ref.o) <= 1e-6 and _rel(out.final_state[i], ref.final_state) <= 1e-6
    low = {name: t.half() if name in ("q", "k", "v", "a", "b") else t for name, t in x32.items()}
    half = linear_attention(family, low["q"], low["k"], low["v"], **token_kwargs(low), cu_seqlens=torch.arange(n + 1))
    assert half.o.dtype == torch.float16 and half.final_state.dtype == torch.float32


@pytest.mark.parametrize("family", ["gdn", "kda", "scalar"])
def test_packed_equals_alone(family: str) -> None:
    """Two sequences in one varlen call give what each gives alone (chunks never cross sequences)."""
    x = family_inputs(family, 150, seed=8, dtype=torch.float32)
    both = linear_attention(family, x["q"], x["k"], x["v"], **token_kwargs(x), cu_seqlens=torch.tensor([0, 70, 150]))
    for i, sl in enumerate((slice(0, 70), slice(70, 150))):
        alone = linear_attention(family, x["q"][sl], x["k"][sl], x["v"][sl], **token_kwargs(x, sl))
        assert torch.allclose(both.o[sl], alone.o, atol=1e-6)
        assert torch.allclose(both.final_state[i], alone.final_state[0], atol=1e-6)


def test_empty_sequence_keeps_its_state() -> None:
    x = family_inputs("gdn", 10, dtype=torch.float32)
    s0 = torch.randn(2, 2, 8, 4)
    out = linear_attention("gdn", x["q"], x["k"], x["v"], **token_kwargs(x), cu_seqlens=torch.tensor([0, 0, 10]),
                           initial_state=s0, output_summary=True)
    assert torch.equal(out.final_state[0], s0[0])
    assert torch.allclose(out.summary.transition[0], torch.eye(8).expand(2, 8, 8))


def test_bad_inputs_name_the_argument() -> None:
    x = family_inputs("gdn", 10, dtype=torch.float32)
    kw = token_kwargs(x)
    cases = [
        (dict(family="mamba9"), "family"),
        (dict(k=x["k"][:, :, :4]), "q"),
        (dict(v=x["v"][:5]), "v"),
        (dict(g=None), "g"),
        (dict(beta=None), "beta"),
        (dict(g=x["g"].double()), "g"),
        (dict(cu_seqlens=torch.tensor([0, 4])), "cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0.0, 10.0])), "cu_seqlens"),
        (dict(initial_state=torch.zeros(2, 8, 4)), "initial_state"),
        (dict(backend="cuda-magic"), "backend"),
    ]
    for override, name in cases:
        args = dict(family="gdn", q=x["q"], k=x["k"], v=x["v"], **kw) | override
        with pytest.raises(ValueError, match=name):
            linear_attention(args.pop("family"), args.pop("q"), args.pop("k"), args.pop("v"), **args)
    with pytest.raises(ValueError, match="beta"):
        linear_attention("scalar", x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sequences_of_unlike_lengths_run_in_groups_with_the_same_results(family: str) -> None:
    """A cold prefill's short seams beside long bodies would pad every sequence to the longest (2.9
    slots a token): they run grouped by chunk count, each group padded to its own longest — outputs,
    final states and transitions the ungrouped pass's and, per sequence, the fp64 recurrence's."""
    from hypic.ops.chunk import _by_chunks, _chunked, chunk_linear_attention
    from hypic.ops.family import get_family

    lengths = [8, 246, 8, 120, 8, 60, 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    assert len(_by_chunks(lengths, 64)) == 3  # grouped: 1, 2 and 4 chunks
    x = family_inputs(family, int(cu[-1]), heads=2, value_heads=4, seed=5)
    s0 = torch.randn(len(lengths), 4, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    kw = token_kwargs(x)
    args = [kw.get(n) for n in ("g", "beta", "a", "b")]
    fam = get_family(family)
    for init in (None, s0):
        for transition in (False, True):
            got = chunk_linear_attention(fam, x["q"], x["k"], x["v"], *args, cu, init, 0.5, transition, parallel=False)
            whole = _chunked(fam, x["q"], x["k"], x["v"], *args, cu, cu[1:] - cu[:-1], init, 0.5, transition, 64,
                             False)
            for a_, b_ in zip(got, whole, strict=True):
                assert (a_ is None) == (b_ is None) and (a_ is None or _rel(a_, b_) < 1e-12)
    for i in (1, 4):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        ref = R.run(family, x["q"][sl], x["k"][sl], x["v"][sl], initial_state=s0[i], scale=0.5, **token_kwargs(x, sl))
        assert _rel(got.o[sl], ref.o) < 1e-12 and _rel(got.final_state[i], ref.final_state) < 1e-12


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parallel_scan_equals_sequential_and_run(family: str) -> None:
    """The training path (prefix scan over chunk maps) computes the same thing as the chunk loop."""
    from hypic.ops.chunk import chunk_linear_attention
    from hypic.ops.family import get_family

    cu = torch.tensor([0, 1, 64, 200, 330])
    x = family_inputs(family, 330, heads=2, value_heads=4, seed=12)
    s0 = torch.randn(4, 4, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    kw = token_kwargs(x)
    args = [kw.get(n) for n in ("g", "beta", "a", "b")]
    seq = chunk_linear_attention(get_family(family), x["q"], x["k"], x["v"], *args, cu, s0, 0.5, True, parallel=False)
    par = chunk_linear_attention(get_family(family), x["q"], x["k"], x["v"], *args, cu, s0, 0.5, True, parallel=True)
    for a_, b_ in zip(seq, par, strict=True):
        assert (a_ is None) == (b_ is None) and (a_ is None or _rel(b_, a_) < 1e-12)
    i = 2
    sl = slice(int(cu[i]), int(cu[i + 1]))
    ref = R.run(family, x["q"][sl], x["k"][sl], x["v"][sl], initial_state=s0[i], scale=0.5, **token_kwargs(x, sl))
    assert _rel(par.o[sl], ref.o) < 1e-12 and _rel(par.final_state[i], ref.final_state) < 1e-12


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_pass_restarted_from_later_states_equals_a_pass_from_them(family: str) -> None:
    """Outputs and final states are affine in the state a sequence starts from, so a pass run from
    zero with ``output_input_map`` and then ``restart``-ed gives, in fp64, what a pass started from
    those states gives — grouped (seam-like and body-like lengths), in one group, by the training
    scan, and moved on from states it already started from. (The cold prefill and the combine pass
    each run one pass instead of two on it.)"""
    from hypic.ops.chunk import chunk_linear_attention
    from hypic.ops.family import get_family
    from hypic.ops.linear import restart

    for lengths in ([8, 246, 8, 120, 8, 60, 3], [40, 64, 0, 130]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        x = family_inputs(family, int(cu[-1]), heads=2, value_heads=4, seed=6)
        gen = torch.Generator().manual_seed(7)
        s0 = torch.randn(len(lengths), 4, 8, 4, dtype=torch.float64, generator=gen)
        s1 = torch.randn(len(lengths), 4, 8, 4, dtype=torch.float64, generator=gen)
        seqs = list(range(1, len(lengths), 2))
        started = torch.zeros_like(s0)
        started[seqs] = s0[seqs]
        kw = token_kwargs(x)
        want = linear_attention(family, x["q"], x["k"], x["v"], **kw, cu_seqlens=cu, initial_state=started,
                                output_summary=True)
        out = linear_attention(family, x["q"], x["k"], x["v"], **kw, cu_seqlens=cu, output_input_map=True)
        assert out.input_map.shape == (int(cu[-1]), 4, 8) and out.summary is not None
        o, final = restart(family, out, cu, seqs, s0[seqs], torch.float64)
        assert _rel(o, want.o) < 1e-12 and _rel(final, want.final_state) < 1e-12
        for a_, b_ in zip(out.summary, want.summary, strict=True):
            assert (a_ is None) == (b_ is None) and (a_ is None or _rel(a_, b_) < 1e-12)
        moved = linear_attention(family, x["q"], x["k"], x["v"], **kw, cu_seqlens=cu, initial_state=s1,
                                 output_input_map=True)
        o, final = restart(family, moved, cu, list(range(len(lengths))), started - s1, torch.float64)
        assert _rel(o, want.o) < 1e-12 and _rel(final, want.final_state) < 1e-12
        args = [kw.get(n) for n in ("g", "beta", "a", "b")]
        fam = get_family(family)
        seq = chunk_linear_attention(fam, x["q"], x["k"], x["v"], *args, cu, s1, 0.5, False, parallel=False,
                                     input_map=True)
        par = chunk_linear_attention(fam, x["q"], x["k"], x["v"], *args, cu, s1, 0.5, False, parallel=True,
                                     input_map=True)
        for a_, b_ in zip(seq, par, strict=True):
            assert _rel(b_, a_) < 1e-12
    with pytest.raises(ValueError, match="output_input_map"):
        restart(family, want, cu, seqs, s0[seqs], torch.float64)


def test_a_restarted_fp32_pass_is_rounded_once() -> None:
    """The pass keeps its outputs in fp32 until ``restart`` moves them, then rounds to the asked dtype."""
    from hypic.ops.linear import restart

    x = family_inputs("gdn", 70, seed=8)
    x = {n: t.to(torch.bfloat16) for n, t in x.items()}
    cu = torch.tensor([0, 30, 70])
    out = linear_attention("gdn", x["q"], x["k"], x["v"], **token_kwargs(x), cu_seqlens=cu, output_input_map=True)
    assert out.o.dtype == torch.float32 and out.input_map.dtype == torch.float32
    o, final = restart("gdn", out, cu, [], out.final_state[:0], torch.bfloat16)
    assert o.dtype == torch.bfloat16 and torch.equal(o, out.o.to(torch.bfloat16))
