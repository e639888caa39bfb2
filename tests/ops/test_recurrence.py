"""The summary algebra against the fp64 token loop: summarize / compose / apply == run."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hypic.ops import recurrence as R
from hypic.ops.family import FAMILIES
from hypic.ops.samples import family_inputs, token_kwargs

LENGTHS = [1, 3, 63, 64, 65, 500]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("length", LENGTHS)
def test_compose_equals_run(family: str, length: int) -> None:
    """apply(compose(summarize(c1), summarize(c2)), S0) == run(c1 + c2 from S0): fp64 ≤ 1e-10, fp32 ≤ 1e-5."""
    x = family_inputs(family, 2 * length, heads=2, value_heads=4, seed=length)
    s0 = torch.randn(4, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = R.run(family, x["q"], x["k"], x["v"], initial_state=s0, **token_kwargs(x)).final_state
    cut = slice(0, length), slice(length, 2 * length)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        xs = {n: t.to(dtype) for n, t in x.items()}
        s1, s2 = (R.summarize(family, xs["k"][c], xs["v"][c], **token_kwargs(xs, c)) for c in cut)
        composed = R.apply(family, R.compose(family, s1, s2), s0.to(dtype))
        assert composed.dtype == dtype
        assert _rel(composed, ref) <= tol, (dtype, _rel(composed, ref))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transition_form_is_the_cheapest(family: str) -> None:
    x = family_inputs(family, 10)
    T = R.summarize(family, x["k"], x["v"], **token_kwargs(x)).transition
    form = FAMILIES[family].transition
    expected = {"none": None, "scalar": (2,), "diagonal": (2, 8), "matrix": (2, 8, 8)}[form]
    assert (T is None) if expected is None else tuple(T.shape) == expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_identity_is_neutral(family: str) -> None:
    x = family_inputs(family, 17)
    s = R.summarize(family, x["k"], x["v"], **token_kwargs(x))
    e = R.identity(family, 2, 8, 4, dtype=torch.float64)
    for composed in (R.compose(family, e, s), R.compose(family, s, e)):
        assert _rel(composed.state, s.state) < 1e-14
        if s.transition is not None:
            assert torch.allclose(composed.transition, s.transition, atol=1e-14)


@settings(max_examples=25, deadline=None)
@given(family=st.sampled_from(sorted(FAMILIES)), lengths=st.tuples(*(st.integers(1, 40),) * 3),
       seed=st.integers(0, 2**16))
def test_compose_is_associative(family: str, lengths: tuple[int, int, int], seed: int) -> None:
    x = family_inputs(family, sum(lengths), seed=seed)
    bounds = [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    a, b, c = (R.summarize(family, x["k"][s:e], x["v"][s:e], **token_kwargs(x, slice(s, e)))
               for s, e in zip(bounds[:-1], bounds[1:], strict=True))
    left = R.compose(family, R.compose(family, a, b), c)
    right = R.compose(family, a, R.compose(family, b, c))
    whole = R.summarize(family, x["k"], x["v"], **token_kwargs(x))
    for s in (left, right):
        assert _rel(s.state, whole.state) < 1e-10
        if s.transition is not None:
            assert (s.transition - whole.transition).abs().max() < 1e-10


def test_naive_addition_is_wrong_for_decaying_families() -> None:
    """S1 + S2 (dropping T) is right only for plain linear attention: the reason T is cached."""
    for family in sorted(FAMILIES):
        x = family_inputs(family, 128, seed=5)
        s1 = R.summarize(family, x["k"][:64], x["v"][:64], **token_kwargs(x, slice(0, 64)))
        s2 = R.summarize(family, x["k"][64:], x["v"][64:], **token_kwargs(x, slice(64, 128)))
        whole = R.summarize(family, x["k"], x["v"], **token_kwargs(x)).state
        err = _rel(s1.state + s2.state, whole)
        assert (err < 1e-12) if family == "linear" else (err > 1e-2), (family, err)


def test_bad_inputs_raise_value_errors() -> None:
    x = family_inputs("gdn", 6)
    q, k, v = x["q"], x["k"], x["v"]
    with pytest.raises(ValueError, match="family"):
        R.run("retnet", q, k, v)
    with pytest.raises(ValueError, match="g"):
        R.run("gdn", q, k, v, beta=x["beta"])
    with pytest.raises(ValueError, match="beta"):
        R.summarize("gdn", k, v, g=x["g"])
    with pytest.raises(ValueError, match="dtype"):
        R.run("gdn", q, k, v.float(), g=x["g"], beta=x["beta"])
    with pytest.raises(ValueError, match="v"):
        R.run("gdn", q, k, v[:3], g=x["g"], beta=x["beta"])
    with pytest.raises(ValueError, match="initial_state"):
        R.run("gdn", q, k, v, g=x["g"], beta=x["beta"], initial_state=torch.zeros(2, 8, 5, dtype=torch.float64))
    s = R.summarize("gdn", k, v, g=x["g"], beta=x["beta"])
    with pytest.raises(ValueError, match="S_in"):
        R.apply("gdn", s, torch.zeros(2, 4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="transition"):
        R.apply("scalar", s, torch.zeros(2, 8, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="first"):
        R.compose("gdn", (s.transition, s.state), s)
