"""The differentiable affine chain training uses across chunks: values and gradients."""

import pytest
import torch

from hypic.ops.chain_grad import affine_chain


def _reference(A: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    X = [torch.zeros_like(S[0])]
    for a, s in zip(A, S, strict=True):
        X.append(a @ X[-1] + s)
    return torch.stack(X)


def test_affine_chain_values_and_gradients_match_autograd_of_the_loop() -> None:
    g = torch.Generator().manual_seed(0)
    A = (0.5 * torch.randn(6, 3, 4, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    S = torch.randn(6, 3, 4, 5, generator=g, dtype=torch.float64).requires_grad_(True)
    w = torch.randn(7, 3, 4, 5, generator=g, dtype=torch.float64)
    got = affine_chain(A, S)
    want = _reference(A, S)
    assert (got - want).abs().max() < 1e-12
    ga = torch.autograd.grad((got * w).sum(), (A, S))
    gw = torch.autograd.grad((want * w).sum(), (A, S))
    for a, b in zip(ga, gw, strict=True):
        assert (a - b).abs().max() < 1e-10
    assert torch.autograd.gradcheck(affine_chain, (A[:3, :1, :2, :2].detach().requires_grad_(True),
                                                   S[:3, :1, :2, :3].detach().requires_grad_(True)))


def test_affine_chain_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match="affine_chain"):
        affine_chain(torch.zeros(2, 1, 3, 3), torch.zeros(2, 1, 4, 5))
