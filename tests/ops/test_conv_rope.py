"""Short convolution tails across a split; RoPE re-rotation of keys and of linear states."""

import pytest
import torch
import torch.nn.functional as F

from hypic.ops import recurrence as R
from hypic.ops.conv import causal_conv1d
from hypic.ops.rope import RopeScaling, RopeSpec, apply_rope, rotate_key_axis
from hypic.ops.samples import family_inputs, token_kwargs

GEN = torch.Generator().manual_seed(0)


def _conv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    W = weight.shape[1]
    return F.conv1d(F.pad(x.T[None], (W - 1, 0)), weight[:, None, :], groups=x.shape[1])[0].T


@pytest.mark.parametrize("split", [1, 2, 3, 4, 17])
def test_conv_tail_makes_a_split_exact(split: int) -> None:
    x = torch.randn(40, 6, dtype=torch.float64, generator=GEN)
    w = torch.randn(6, 4, dtype=torch.float64, generator=GEN)
    whole = causal_conv1d(x, w, activation="silu")
    assert torch.allclose(whole.y, F.silu(_conv_reference(x, w)), atol=1e-12)
    first = causal_conv1d(x[:split], w, activation="silu")
    second = causal_conv1d(x[split:], w, initial_tail=first.tail, activation="silu")
    assert torch.allclose(torch.cat([first.y, second.y]), whole.y, atol=1e-12)
    assert torch.equal(second.tail, whole.tail) and torch.equal(whole.tail[0], x[-3:])


def test_conv_varlen_short_sequences_keep_older_tail() -> None:
    x = torch.randn(12, 5, dtype=torch.float64, generator=GEN)
    w = torch.randn(5, 4, dtype=torch.float64, generator=GEN)
    tails = torch.randn(3, 3, 5, dtype=torch.float64, generator=GEN)
    cu = torch.tensor([0, 1, 1, 12])
    out = causal_conv1d(x, w, cu_seqlens=cu, initial_tail=tails)
    assert torch.equal(out.tail[0], torch.cat([tails[0, 1:], x[:1]]))  # one new input pushes the oldest out
    assert torch.equal(out.tail[1], tails[1])  # empty sequence keeps its tail
    alone = causal_conv1d(x[1:], w, initial_tail=tails[2:])
    assert torch.allclose(out.y[1:], alone.y, atol=1e-12)
    with pytest.raises(ValueError, match="initial_tail"):
        causal_conv1d(x, w, cu_seqlens=cu, initial_tail=tails[:2])



@pytest.mark.parametrize("seed", range(6))
def test_packed_conv_equals_each_sequence_alone(seed: int) -> None:
    """The torch conv sums its taps over the whole pack and recomputes each sequence's first W−1
    rows from its own tail: packed results equal each sequence convolved alone (lengths 0 … 9,
    shorter than the window and longer, bias or not, tails given or zero), and the new tails are
    each sequence's last W−1 raw inputs."""
    gen = torch.Generator().manual_seed(seed)
    W, D = int(torch.randint(2, 6, (1,), generator=gen)), 5
    lengths = torch.randint(0, 10, (7,), generator=gen).tolist()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(int(cu[-1]), D, dtype=torch.float64, generator=gen)
    w = torch.randn(D, W, dtype=torch.float64, generator=gen)
    bias = torch.randn(D, dtype=torch.float64, generator=gen) if seed % 2 else None
    tails = torch.randn(len(lengths), W - 1, D, dtype=torch.float64, generator=gen) if seed % 3 else None
    out = causal_conv1d(x, w, bias=bias, cu_seqlens=cu, initial_tail=tails, activation="silu")
    for i, n in enumerate(lengths):
        tail = tails[i] if tails is not None else x.new_zeros(W - 1, D)
        ext = torch.cat([tail, x[cu[i]:cu[i + 1]]])
        if n:
            want = F.conv1d(ext.T[None], w[:, None, :], bias, groups=D)[0].T
            assert torch.allclose(out.y[cu[i]:cu[i + 1]], F.silu(want), atol=1e-12), (i, n)
        assert torch.equal(out.tail[i], ext[-(W - 1):])


def test_a_wider_tail_is_read_in_the_inputs_dtype() -> None:
    """An fp32 tail beside bf16 inputs is rounded to bf16 first, as the Triton conv reads it."""
    x = torch.randn(12, 8, dtype=torch.bfloat16, generator=GEN)
    w = torch.randn(8, 4, dtype=torch.bfloat16, generator=GEN)
    tail = torch.randn(1, 3, 8, generator=GEN)
    wide = causal_conv1d(x, w, initial_tail=tail)
    assert torch.equal(wide.y, causal_conv1d(x, w, initial_tail=tail.to(torch.bfloat16)).y)


def test_packed_conv_gradient() -> None:
    """Training on the CPU differentiates the torch conv (in-place tap sums and the edges put back)."""
    x = torch.randn(9, 3, dtype=torch.float64, generator=GEN, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64, generator=GEN, requires_grad=True)
    tails = torch.randn(3, 3, 3, dtype=torch.float64, generator=GEN, requires_grad=True)
    cu = torch.tensor([0, 2, 2, 9])
    torch.autograd.gradcheck(
        lambda x, w, t: causal_conv1d(x, w, cu_seqlens=cu, initial_tail=t, activation="silu"), (x, w, tails))

SPECS = {"plain": RopeSpec(8, 1e6),
         "linear": RopeSpec(8, 1e6, RopeScaling("linear", 4.0)),
         "yarn": RopeSpec(8, 1e6, RopeScaling("yarn", 4.0, original_max=4096, attention_factor=1.2))}


@pytest.mark.parametrize("name", list(SPECS))
def test_rope_shift_composes(name: str) -> None:
    """Keys roped at canonical positions then rotated by δ equal keys roped at the shifted positions:
    a re-rotation is pure, the attention factor (YaRN's) is applied once, by the first RoPE."""
    spec = SPECS[name]
    k = torch.randn(20, 3, 16, dtype=torch.float64, generator=GEN)
    pos = torch.arange(20)
    canonical = apply_rope(k, pos, spec)
    shifted = rotate_key_axis(canonical, 1234, spec)
    assert torch.allclose(shifted, apply_rope(k, pos + 1234, spec), atol=1e-10)
    assert torch.equal(shifted[..., 8:], k[..., 8:])  # partial rotary: the rest is untouched
    assert torch.allclose(rotate_key_axis(shifted, -1234, spec), canonical, atol=1e-10)
    norm = canonical[..., :8].norm(dim=-1) / k[..., :8].norm(dim=-1)
    assert torch.allclose(norm, torch.full_like(norm, spec.attention_factor), atol=1e-12)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("family", ["linear", "scalar", "deltanet", "gdn"])
def test_rerotate_moves_a_span_exactly(family: str, name: str) -> None:
    """A span summarized at canonical positions and re-rotated by δ equals the span computed at +δ."""
    x = family_inputs(family, 50, key_dim=16, seed=9)
    delta, spec = 777, SPECS[name]
    pos = torch.arange(50)

    def summarize_at(offset: int) -> R.Summary:
        k = apply_rope(x["k"], pos + offset, spec)
        return R.summarize(family, k, x["v"], **token_kwargs(x))

    moved = R.rerotate(family, summarize_at(0), delta, spec)
    direct = summarize_at(delta)
    assert torch.allclose(moved.state, direct.state, atol=1e-9)
    if moved.transition is not None:
        assert torch.allclose(moved.transition, direct.transition, atol=1e-9)


def test_rerotate_refuses_per_channel_decay() -> None:
    x = family_inputs("kda", 5)
    s = R.summarize("kda", x["k"], x["v"], **token_kwargs(x))
    with pytest.raises(ValueError, match="family"):
        R.rerotate("kda", s, 3, RopeSpec(4, 1e4))
    with pytest.raises(ValueError, match="rotary_dim"):
        rotate_key_axis(s.state, 3, RopeSpec(5, 1e4))


def test_a_bf16_conv_sums_its_taps_in_fp32_and_rounds_once() -> None:
    """The torch conv (every CPU prefill) rounds once, as the Triton conv and the decode step's conv
    do: summed in bf16, 48% of its outputs were not the correctly rounded value and a prefill and the
    decode step disagreed by 0.03 on the same token."""
    x = torch.randn(300, 64, dtype=torch.float64, generator=GEN)
    w = torch.randn(64, 4, dtype=torch.float64, generator=GEN)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    want = F.silu(_conv_reference(xb.double(), wb.double())).to(torch.bfloat16)  # exact, rounded once
    got = causal_conv1d(xb, wb, activation="silu").y
    assert got.dtype == torch.bfloat16
    assert (got != want).float().mean().item() < 0.01  # fp32 sums: a rare tie rounds the other way
    ulp = torch.finfo(torch.bfloat16).eps * want.double().abs().clamp_min(1e-3)
    assert ((got.double() - want.double()).abs() <= ulp).all()
