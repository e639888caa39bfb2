"""flash-linear-attention path vs the fp64 chunked reference (GPU only)."""

import pytest
import torch

from hypic.ops.linear import linear_attention
from hypic.ops.samples import family_inputs, token_kwargs

pytestmark = pytest.mark.gpu


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("family", ["gdn", "kda", "scalar"])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("lens", [[1, 3, 63, 64, 65, 500], [1, 8, 8, 3, 64]], ids=["chunked", "short"])
def test_fla_matches_fp64_reference(family: str, with_state: bool, lens: list[int]) -> None:
    """Long runs take the chunked kernels; runs of ≤ 64 tokens (a warm request's seams and query)
    take GDN's recurrent kernel, summary included."""
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0)
    x = family_inputs(family, sum(lens), heads=2, value_heads=4, key_dim=64, value_dim=32, device="cuda", seed=3)
    s0 = torch.randn(len(lens), 4, 64, 32, device="cuda", dtype=torch.float64) if with_state else None
    ref = linear_attention(family, x["q"], x["k"], x["v"], **token_kwargs(x), cu_seqlens=cu, initial_state=s0,
                           output_summary=True, backend="torch")
    xb = {n: t.bfloat16() for n, t in x.items()}
    out = linear_attention(family, xb["q"], xb["k"], xb["v"], **token_kwargs(xb), cu_seqlens=cu,
                           initial_state=None if s0 is None else s0.float(), output_summary=True, backend="fla")
    assert out.o.dtype == torch.bfloat16 and out.final_state.dtype == torch.float32
    assert _rel(out.o, ref.o) < 2e-2
    assert _rel(out.final_state, ref.final_state) < 2e-2
    assert _rel(out.summary.state, ref.summary.state) < 2e-2
    if family != "scalar":
        assert _rel(out.summary.transition, ref.summary.transition) < 2e-2


@pytest.mark.parametrize("family", ["gdn", "kda", "scalar"])
def test_fla_decode_step_matches_reference(family: str) -> None:
    """One token per sequence takes fla's recurrent kernels: same answer as the chunked reference."""
    n = 6
    x = family_inputs(family, n, heads=2, value_heads=4, key_dim=64, value_dim=32, device="cuda", seed=4)
    s0 = torch.randn(n, 4, 64, 32, device="cuda", dtype=torch.float64)
    cu = torch.arange(n + 1)
    ref = linear_attention(family, x["q"], x["k"], x["v"], **token_kwargs(x), cu_seqlens=cu, initial_state=s0,
                           backend="torch")
    xb = {k: t.bfloat16() for k, t in x.items()}
    out = linear_attention(family, xb["q"], xb["k"], xb["v"], **token_kwargs(xb), cu_seqlens=cu,
                           initial_state=s0.float(), backend="fla")
    assert _rel(out.o, ref.o) < 2e-2 and _rel(out.final_state, ref.final_state) < 2e-2


@pytest.mark.parametrize("kernel", ["triton", "fla"])
@pytest.mark.parametrize("with_tails", [True, False])
def test_cuda_conv_matches_fp64_conv_with_tails(kernel: str, with_tails: bool, monkeypatch) -> None:
    """hypic's Triton conv (the default) and fla's (HYPIC_FLA_CONV=1) against the torch conv in fp64:
    sequences of 0 (Triton only), 1, 2 and many tokens, fp32 and bf16."""
    import hypic.ops.conv as conv

    monkeypatch.setattr(conv, "_FLA_CONV", kernel == "fla")
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(300, 130, device="cuda", generator=gen)[:, 17:113]  # strided rows, as a fused projection's
    w = torch.randn(96, 4, device="cuda", generator=gen)
    # an empty sequence only for hypic's kernel: fla's is not asked to handle one
    cu = torch.tensor([0, 1, 2, 2, 150, 300] if kernel == "triton" else [0, 1, 2, 150, 300])
    tails = torch.randn(len(cu) - 1, 3, 96, device="cuda", generator=gen) if with_tails else None
    want = conv.causal_conv1d(x.cpu().double(), w.cpu().double(), cu_seqlens=cu,
                              initial_tail=None if tails is None else tails.cpu().double(), activation="silu")
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        got = conv.causal_conv1d(x.to(dtype), w.to(dtype), cu_seqlens=cu,
                                 initial_tail=None if tails is None else tails.to(dtype), activation="silu")
        assert got.y.dtype == dtype
        assert torch.allclose(got.y.cpu().double(), want.y, atol=tol, rtol=tol)
        assert torch.allclose(got.tail.cpu().double(), want.tail, atol=tol, rtol=tol)


def test_gdn_summary_of_more_sequences_than_a_grid_axis_holds() -> None:
    """A cold batch of thousands of segments: the transition kernel launches a program per
    (sequence, value head), 66 000 here — more than CUDA's 65 535 on a grid's second axis, where it
    once stood (`Triton Error [CUDA]: invalid argument` at 600 prompts per engine call). Every
    sequence's summary must equal the one it gets in a small batch."""
    n, length = 16_500, 80  # > kernels.RECURRENT_MAX: the chunked path and its transition kernel
    cu = torch.arange(n + 1, device="cuda") * length
    x = family_inputs("gdn", n * length, heads=2, value_heads=4, key_dim=64, value_dim=32, device="cuda", seed=5)
    xb = {name: t.bfloat16() for name, t in x.items()}
    out = linear_attention("gdn", xb["q"], xb["k"], xb["v"], **token_kwargs(xb), cu_seqlens=cu, output_summary=True,
                           backend="fla")
    for i in (0, 8_191, 16_383, 16_384, n - 1):  # either side of the old limit
        span = slice(i * length, (i + 1) * length)
        one = linear_attention("gdn", xb["q"][span], xb["k"][span], xb["v"][span], **token_kwargs(xb, span),
                               output_summary=True, backend="fla")
        assert _rel(out.summary.transition[i], one.summary.transition[0]) < 1e-5, i
        assert _rel(out.summary.state[i], one.summary.state[0]) < 1e-5, i
