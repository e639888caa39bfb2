"""Fused sibling projections (inference) compute what the separate ones do, with no second copy of
the weights, and the model keeps its parameter names and shapes."""

import pytest
import torch
from torch import nn

from hypic.bench.shapes import SHAPES
from hypic.models.context import SequenceContext, SequenceState
from hypic.models.layers.fused import FusedLinears, fuse_projections
from hypic.models.random_init import random_model


@torch.no_grad()
def test_fused_projections_keep_the_forward_and_the_parameters() -> None:
    torch.manual_seed(0)
    model = random_model(SHAPES["tiny"], device="cpu", dtype=torch.float32).model
    ids = torch.randint(0, model.vocab_size, (40,))

    def forward() -> torch.Tensor:
        return model(ids, SequenceContext([SequenceState()], [40], torch.device("cpu")))

    before, params = forward(), {k: v.clone() for k, v in model.state_dict().items()}
    storage = sum(p.numel() for p in model.parameters())
    assert fuse_projections(model) == 4 + 3 + 1  # every layer's MLP, 3 GDN layers, 1 attention layer
    assert fuse_projections(model) == 0  # once only
    after = forward()
    assert (after - before).abs().max() <= 1e-4  # one GEMM instead of several: rounding may differ
    state = model.state_dict()
    assert state.keys() == params.keys() and all(torch.equal(state[k], params[k]) for k in params)
    gdn = model.model.layers[0].linear_attn
    assert gdn.in_proj_z.weight.untyped_storage().data_ptr() == gdn._fused.weight.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == storage


def test_fusing_refuses_biased_linears() -> None:
    with pytest.raises(ValueError, match="bias-free"):
        FusedLinears([nn.Linear(4, 3), nn.Linear(4, 2, bias=False)])
