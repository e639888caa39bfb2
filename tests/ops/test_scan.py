"""The affine scan: every prefix state of a chain equals composing its summaries one by one."""

import pytest
import torch

from hypic.ops import recurrence as R
from hypic.ops.family import FAMILIES
from hypic.ops.samples import family_inputs, token_kwargs
from hypic.ops.scan import prefix_states, prefix_states_many, rows


def _chain(family: str, device: str = "cpu") -> list[R.Summary]:
    x = family_inputs(family, 60, device=device, seed=7)
    cuts = [0, 5, 17, 18, 40, 60]
    return [R.summarize(family, x["k"][a:b], x["v"][a:b], **token_kwargs(x, slice(a, b)))
            for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("naive", [False, True])
def test_prefix_states_equal_sequential_composition(family: str, naive: bool) -> None:
    chain = _chain(family)
    T = None if chain[0].transition is None else torch.stack([s.transition for s in chain])
    X = prefix_states(family, T, torch.stack([s.state for s in chain]), naive=naive)
    state = torch.zeros_like(chain[0].state)
    assert torch.equal(X[0], state)
    for i, s in enumerate(chain):
        state = state + s.state if naive else R.apply(family, s, state)
        assert torch.allclose(X[i + 1], state, atol=1e-12)


@pytest.mark.gpu
def test_triton_chain_matches_the_loop() -> None:
    from hypic.ops.triton_chain import matrix_chain

    gen = torch.Generator(device="cuda").manual_seed(0)
    T = torch.randn(67, 8, 128, 128, device="cuda", generator=gen) / 12
    S = torch.randn(67, 8, 128, 96, device="cuda", generator=gen)
    want = prefix_states("gdn", T.cpu().double(), S.cpu().double())
    got = matrix_chain(T, S)
    assert ((got.cpu().double() - want).norm() / want.norm()) < 1e-4


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("naive", [False, True])
def test_packed_chains_equal_each_chain_alone(family: str, naive: bool) -> None:
    """Chains of 5, 1 and 3 items packed end to end: every chain's prefix states, zero start
    included, where ``prefix_states_many`` says they are."""
    chain = _chain(family) + _chain(family)[:3] + _chain(family)[2:3]
    cu = [0, 5, 6, 9]
    T = None if chain[0].transition is None else torch.stack([s.transition for s in chain])
    S = torch.stack([s.state for s in chain])
    X = prefix_states_many(family, rows(T), rows(S), cu, naive=naive)
    assert X.shape[0] == len(chain) + 3
    for c, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        alone = prefix_states(family, None if T is None else T[a:b], S[a:b], naive=naive)
        assert torch.equal(X[a + c:b + c + 1], alone)


@pytest.mark.gpu
def test_triton_chains_match_the_loop() -> None:
    """Chains of different lengths (one of a single item) in one launch, against fp64 loops."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    cu = [0, 40, 41, 67, 100]
    T = torch.randn(100, 8, 128, 128, device="cuda", generator=gen) / 12
    S = torch.randn(100, 8, 128, 96, device="cuda", generator=gen)
    got = prefix_states_many("gdn", rows(T), rows(S), cu)  # CUDA: the kernel
    want = prefix_states_many("gdn", rows(T.cpu().double()), rows(S.cpu().double()), cu)
    assert ((got.cpu().double() - want).norm() / want.norm()) < 1e-4
