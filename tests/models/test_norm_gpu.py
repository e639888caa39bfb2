"""fla's fused norms (the CUDA default) against the PyTorch norms (HYPIC_FUSED_NORMS=0), on the GPU."""

import pytest
import torch

from hypic.models.layers.gdn import l2norm
from hypic.models.layers.norm import GatedRMSNorm, RMSNorm

pytestmark = pytest.mark.gpu


@torch.no_grad()
def test_fused_norms_match(monkeypatch) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(333, 8, 128, device="cuda", generator=gen).bfloat16()
    z = torch.randn(333, 8, 128, device="cuda", generator=gen).bfloat16()
    norms = [RMSNorm(128, zero_centred=True), RMSNorm(128), GatedRMSNorm(128), GatedRMSNorm(128, activation="sigmoid")]
    for n in norms:
        n.weight.data.add_(0.1)
        n.cuda().bfloat16()
    monkeypatch.setenv("HYPIC_FUSED_NORMS", "0")
    plain = [norms[0](x), norms[1](x), norms[2](x, z), norms[3](x, z), l2norm(x)]
    monkeypatch.delenv("HYPIC_FUSED_NORMS")
    fast = [norms[0](x), norms[1](x), norms[2](x, z), norms[3](x, z), l2norm(x)]
    for a, b in zip(plain, fast, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert ((a.float() - b.float()).norm() / a.float().norm()) < 1e-2
