"""The fused Triton norms (the CUDA default) against the PyTorch norms (HYPIC_FUSED_NORMS=0) and an
fp64 reference, on the GPU."""

import pytest
import torch
import torch.nn.functional as F

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


@torch.no_grad()
@pytest.mark.parametrize("D", [64, 96, 128, 256, 4096])
def test_triton_norm_matches_fp64_at_any_row_count(D: int) -> None:
    from hypic.ops.triton_norm import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(D)
    w = torch.randn(D, device="cuda", generator=gen)
    for rows in (1, 7, 64, 65, 2049, 40_000):  # partial tiles, one tile, many tiles
        x = torch.randn(rows, D, device="cuda", generator=gen)
        z = torch.randn(rows, D, device="cuda", generator=gen)
        ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        for gate, act, f in ((None, None, None), (z, "silu", F.silu), (z, "sigmoid", torch.sigmoid)):
            want = ref if gate is None else ref * f(z.double())
            got = rms_norm(x, w, 1e-6, gate, act)
            assert (got.double() - want).abs().max() < 1e-4 * want.abs().max()
            got16 = rms_norm(x.bfloat16(), w, 1e-6, None if gate is None else gate.bfloat16(), act)
            assert got16.dtype == torch.bfloat16
            assert ((got16.double() - want).norm() / want.norm()) < 1e-2


@torch.no_grad()
def test_gdn_gates_kernel_matches_torch() -> None:
    from hypic.ops.triton_gates import gdn_gates

    gen = torch.Generator(device="cuda").manual_seed(7)
    wide = (8 * torch.randn(3000, 80, device="cuda", generator=gen)).bfloat16()
    a, b = wide[:, :32], wide[:, 40:72]  # strided rows, as slices of the fused projection
    A_log, dt_bias = torch.randn(32, device="cuda", generator=gen), torch.randn(32, device="cuda", generator=gen)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    want = -A_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    assert g.dtype == beta.dtype == torch.float32
    assert ((g.double() - want).abs() <= 1e-5 * (1 + want.abs())).all()
    assert (beta.double() - torch.sigmoid(b.double())).abs().max() < 1e-6
