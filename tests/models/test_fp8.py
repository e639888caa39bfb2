"""Weights held in 8 bits (``quantization="fp8"``): per-row e4m3 values and scales, checked against a
direct computation here; each projection is the fp64 product of the two quantized matrices; a
loaded model keeps the decay projections, routers and head in the serving dtype and stays close to
the unquantized one; position-independent reuse keeps its exactness on it."""

import pytest
import torch
import transformers as T

from hypic import LLM
from hypic.models.fingerprint import same_weights, weight_fingerprint
from hypic.models.layers.fp8 import FP8, Fp8Linear, fp8_linear, grouped_fp8, quantize_rows
from hypic.models.layers.fused import fuse_projections
from hypic.models.layers.moe import Experts
from hypic.models.loader import load_model
from hypic.parallel.spec import ModelSpec
from tests.models.harness import TINY_BASE, TINY_GDN, TINY_MOE, hypic_greedy, hypic_logits, save_checkpoint
from tests.models.test_qwen3_next import randomize_routers


def reference_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: scale amax / 448 (1 for a zero row), values x / scale rounded to e4m3 — in fp64."""
    amax = x.double().abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (x.double() / scale).to(FP8), scale.squeeze(-1)


def test_rows_are_quantized_by_their_own_largest_value() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=gen) * torch.logspace(-3, 3, 9)[:, None]
    x[4] = 0.0
    q, s = quantize_rows(x)
    want_q, want_s = reference_rows(x)
    assert q.dtype == FP8 and s.dtype == torch.float32
    assert torch.allclose(s.double(), want_s, rtol=1e-6) and s[4] == 1.0
    assert (q.float() != want_q.float()).sum() <= 2  # fp32 vs fp64 division may round one tie the other way
    back = q.double() * s.double()[:, None]
    assert torch.all((back - x.double()).abs() <= x.double().abs() / 16 + s.double()[:, None] * 2 ** -9)
    rows = torch.arange(9) != 4  # the largest value of a row is 448 · scale: the top of e4m3's range, used
    assert torch.allclose(back.abs().amax(-1)[rows], x.double().abs().amax(-1)[rows], rtol=1e-6)


def test_a_projection_is_the_product_of_the_quantized_matrices() -> None:
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(37, 96, generator=gen), torch.randn(48, 96, generator=gen) / 10
    qw, sw = quantize_rows(w)
    y = fp8_linear(x, qw, sw)
    qx, sx = reference_rows(x)
    exact = (qx.double() * sx[:, None]) @ (qw.double() * sw.double()[:, None]).T
    assert y.dtype == torch.float32 and y.shape == (37, 48)
    assert ((y.double() - exact).abs().max() / exact.abs().max()) <= 1e-6
    true = x.double() @ w.double().T  # what 8 bits cost against the unquantized product: a few percent
    assert 1e-3 <= (y.double() - true).norm() / true.norm() <= 0.08
    assert fp8_linear(x[:0], qw, sw).shape == (0, 48)
    assert fp8_linear(x.reshape(1, 37, 96), qw, sw).shape == (1, 37, 48)


def test_experts_multiply_their_own_rows() -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(4, 32, 64, generator=gen)
    q, s = quantize_rows(weight)
    counts = torch.tensor([5, 0, 17, 3])
    x = torch.randn(int(counts.sum()), 64, generator=gen)
    got = grouped_fp8(*quantize_rows(x), q, s, counts, torch.float32)
    owner = torch.repeat_interleave(torch.arange(4), counts)
    qx, sx = reference_rows(x)
    for r in range(x.shape[0]):
        e = owner[r]
        want = (qx[r].double() * sx[r]) @ (q[e].double() * s[e].double()[:, None]).T
        assert (got[r].double() - want).abs().max() <= 1e-5 * want.abs().max()


CONFIG = dict(**TINY_BASE, **TINY_GDN, **TINY_MOE, intermediate_size=256, mlp_only_layers=[2])


@pytest.fixture(scope="module")
def next_path(tmp_path_factory):
    torch.manual_seed(0)
    ref = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**CONFIG)).eval()
    randomize_routers(ref)
    return save_checkpoint(ref, tmp_path_factory.mktemp("next"))


def test_a_model_holds_its_projections_and_experts_in_8_bits(next_path) -> None:
    plain, held = load_model(next_path, device="cpu"), load_model(next_path, device="cpu", quantization="fp8")
    assert held.quantization == "fp8"
    modules = dict(held.model.named_modules())
    eight = {n for n, m in modules.items() if isinstance(m, Fp8Linear)}
    layers = TINY_BASE["num_hidden_layers"]
    # per layer: the mixer's big projections (GDN qkvz + out, or attention q k v o) and a shared
    # expert's (or, layer 2, the dense MLP's) three
    assert len(eight) == 3 * (2 + 3) + (4 + 3)
    assert not any(n.endswith(("in_proj_ba", "shared_expert_gate", "lm_head")) for n in eight)
    assert sum(isinstance(m, Experts) and m.gate_proj.dtype == FP8 for m in modules.values()) == layers - 1
    assert held.model.lm_head.weight.dtype == torch.float32
    plain_params = dict(plain.model.named_parameters())
    for name, p in held.model.named_parameters():
        if p.dtype != FP8:
            if not name.endswith("_scale"):
                assert torch.equal(p, plain_params[name]), name
            continue
        want_q, want_s = reference_rows(plain_params[name])
        got_s = dict(held.model.named_parameters())[f"{name}_scale"]
        assert torch.allclose(got_s.double(), want_s, rtol=1e-6), name
        assert (p.float() != want_q.float()).float().mean() <= 1e-3, name
    ids = torch.randint(3, 512, (120,), generator=torch.Generator().manual_seed(3))
    a, b = hypic_logits(plain, ids), hypic_logits(held, ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    assert (a - b).norm() / a.norm() <= 0.1
    before = hypic_logits(held, ids)
    assert fuse_projections(held.model) > 0  # GDN's fused run is split: qkvz in 8 bits, ba not
    assert torch.equal(hypic_logits(held, ids), before)
    tokens, _ = hypic_greedy(held, [ids[:40], ids[40:]], 4, stacked=True)
    assert all(len(t) == 4 for t in tokens)


def test_workers_rebuild_the_same_8_bit_weights(next_path) -> None:
    held = load_model(next_path, device="cpu", quantization="fp8")
    spec = ModelSpec.of(held)
    assert spec.quantization == "fp8"
    again = spec.build(torch.device("cpu"))
    assert same_weights(weight_fingerprint(again.model), weight_fingerprint(held.model))
    plain = load_model(next_path, device="cpu")
    assert not same_weights(weight_fingerprint(plain.model), weight_fingerprint(held.model))


def test_unknown_quantization_is_refused(next_path) -> None:
    with pytest.raises(ValueError, match="quantization: expected one of fp8, auto or None, got .int4."):
        load_model(next_path, device="cpu", quantization="int4")
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(next_path), device="cpu", quantization="awq")


@pytest.mark.gpu
def test_the_gpu_kernels_compute_what_the_cpu_does() -> None:
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(77, 256, generator=gen), torch.randn(4, 128, 256, generator=gen) / 16
    x[3] = 0.0
    q, s = quantize_rows(w)
    counts = torch.tensor([20, 0, 50, 7])
    xb = x.bfloat16()
    gq, gs = quantize_rows(xb.cuda())  # the Triton pass
    want_q, want_s = reference_rows(xb.float())
    assert torch.allclose(gs.cpu().double(), want_s, rtol=1e-6) and gs[3] == 1.0
    assert (gq.cpu().float() != want_q.float()).float().mean() <= 1e-3
    cpu = grouped_fp8(*quantize_rows(xb.float()), q, s, counts, torch.float32)
    gpu = grouped_fp8(gq, gs, q.cuda(), s.cuda(), counts.cuda(), torch.bfloat16).float().cpu()
    assert (gpu - cpu).abs().max() <= 0.01 * cpu.abs().max()  # bf16 output rounding
    dense = fp8_linear(xb.cuda(), q[0].cuda(), s[0].cuda()).float().cpu()
    assert (dense - fp8_linear(xb.float(), q[0], s[0])).abs().max() <= 0.01 * dense.abs().max()


def test_experts_whose_sizes_the_gpu_gemm_cannot_take_stay_in_the_serving_dtype(tmp_path) -> None:
    """The GPU's grouped fp8 GEMM needs both expert sizes multiples of 16 (an expert width of 40
    failed every request there): such experts are left as they are, the rest still held in 8 bits."""
    torch.manual_seed(0)
    ref = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**{**CONFIG, "moe_intermediate_size": 40})).eval()
    held = load_model(save_checkpoint(ref, tmp_path / "m"), device="cpu", quantization="fp8")
    experts = [m for m in held.model.modules() if isinstance(m, Experts)]
    assert experts and all(e.gate_proj.dtype == torch.float32 for e in experts)
    assert any(isinstance(m, Fp8Linear) for m in held.model.modules())
    assert hypic_logits(held, torch.arange(3, 40)).isfinite().all()


def test_a_fused_run_of_8_bit_and_full_precision_projections_computes_what_they_do_apart(tmp_path) -> None:
    """Qwen3.5's GDN fuses qkv, z, b and a: in 8 bits qkv and z are one 8-bit matmul and b, a (decay
    projections, kept in the serving dtype) another — what the four compute apart."""
    from hypic.models.layers.gdn import GatedDeltaNet

    torch.manual_seed(0)
    ref = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**TINY_BASE, **TINY_GDN, intermediate_size=256)).eval()
    held = load_model(save_checkpoint(ref, tmp_path / "m"), device="cpu", quantization="fp8")
    gdn = next(m for m in held.model.modules() if isinstance(m, GatedDeltaNet))
    assert isinstance(gdn.in_proj_qkv, Fp8Linear) and not isinstance(gdn.in_proj_b, Fp8Linear)
    ids = torch.randint(3, 512, (50,), generator=torch.Generator().manual_seed(7))
    apart = hypic_logits(held, ids)
    assert fuse_projections(held.model) > 0 and gdn._fused is not None
    assert [len(sizes) for _, _, sizes in gdn._fused.parts] == [2, 2]  # [qkv, z] in 8 bits, [b, a] not
    assert (hypic_logits(held, ids) - apart).abs().max() <= 1e-5  # one GEMM for two: fp32 rounding (6e-8)
