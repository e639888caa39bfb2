"""Kimi-Linear: parity with transformers (fp32, CPU) over KDA, NoPE MLA, dense and MoE layers;
batched varlen; the checkpoint's names."""

import pytest
import torch
import transformers as T

from hypic.models.kimi_linear import checkpoint_name
from hypic.models.loader import load_model
from tests.models.harness import (
    assert_greedy_matches_transformers,
    assert_prefill_matches_transformers,
    assert_varlen_equals_alone,
    hypic_logits,
    randomize_norms,
    save_checkpoint,
)

# Layers 1-3 KDA, 4 MLA; layer 0 dense, 1-3 MoE (first_k_dense_replace defaults to 1).
TINY_KIMI = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
                 qk_nope_head_dim=32, v_head_dim=32, num_local_experts=8, num_experts_per_tok=2, n_group=1,
                 topk_group=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 linear_attn_config={"head_dim": 32, "num_heads": 4, "short_conv_kernel_size": 4,
                                     "full_attn_layers": [4], "kda_layers": [1, 2, 3]})


def tiny_kimi(path, **overrides):
    torch.manual_seed(0)
    ref = T.KimiLinearForCausalLM(T.KimiLinearConfig(**{**TINY_KIMI, **overrides})).eval()
    randomize_norms(ref)  # also dt_bias; A_log is initialised at random already
    with torch.no_grad():  # a zero selection bias would hide using it for the weights too
        for name, buf in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=torch.Generator().manual_seed(5)))
    return ref, load_model(save_checkpoint(ref, path), device="cpu")


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return tiny_kimi(tmp_path_factory.mktemp("kimi_linear"))


def test_model_has_every_layer_kind(kimi) -> None:
    _, loaded = kimi
    layers = loaded.model.model.layers
    assert loaded.model.kinds.kinds == ("linear", "linear", "linear", "attention")
    assert [type(layer.mlp).__name__ for layer in layers] == ["SwiGLU", "MoE", "MoE", "MoE"]


def test_prefill_logits_match_transformers(kimi) -> None:
    assert_prefill_matches_transformers(*kimi)


def test_greedy_decode_matches_transformers(kimi) -> None:
    assert_greedy_matches_transformers(*kimi)


def test_varlen_batch_equals_sequences_alone(kimi) -> None:
    assert_varlen_equals_alone(kimi[1])


def test_low_rank_query_matches_transformers(tmp_path) -> None:
    ref, loaded = tiny_kimi(tmp_path, q_lora_rank=16)
    ids = torch.randint(3, 512, (64,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    assert (hypic_logits(loaded, ids) - expected).abs().max() <= 1e-4


def test_checkpoint_names_map_onto_the_shared_modules() -> None:
    moe = "model.layers.3.block_sparse_moe."
    assert checkpoint_name(moe + "experts.12.w1.weight") == "model.layers.3.mlp.experts.12.gate_proj.weight"
    assert checkpoint_name(moe + "experts.12.w2.weight") == "model.layers.3.mlp.experts.12.down_proj.weight"
    assert checkpoint_name(moe + "experts.12.w3.weight") == "model.layers.3.mlp.experts.12.up_proj.weight"
    assert checkpoint_name(moe + "shared_experts.up_proj.weight") == "model.layers.3.mlp.shared_expert.up_proj.weight"
    assert checkpoint_name(moe + "gate.e_score_correction_bias") == "model.layers.3.mlp.gate.e_score_correction_bias"
    assert checkpoint_name("model.layers.0.mlp.gate_proj.weight") == "model.layers.0.mlp.gate_proj.weight"


def test_routers_and_dt_bias_stay_fp32_in_a_bf16_model(kimi) -> None:
    """As transformers keeps them: a router's weights and selection bias and KDA's dt_bias are not
    rounded to the serving dtype. Rounded, 20 of 20 000 tokens chose another expert set than the
    fp32 router on the same bf16 inputs; kept, every choice is the same."""
    from hypic.models.layers.kda import KimiDeltaAttention
    from hypic.models.layers.moe import Router

    _, full = kimi
    half = load_model(full.path, device="cpu", dtype="bfloat16")

    def kept(loaded):
        return {n: p for n, p in loaded.model.named_parameters()
                if n.endswith((".gate.weight", "e_score_correction_bias", ".dt_bias"))}

    assert kept(half) and all(p.dtype == torch.float32 for p in kept(half).values())
    assert all(torch.equal(p, kept(full)[n]) for n, p in kept(half).items())
    assert half.model.lm_head.weight.dtype == torch.bfloat16
    assert any(isinstance(m, KimiDeltaAttention) for m in half.model.modules())
    routers = [(a, b) for a, b in zip(full.model.modules(), half.model.modules(), strict=True) if isinstance(a, Router)]
    x = torch.randn(20000, TINY_KIMI["hidden_size"], generator=torch.Generator().manual_seed(1)).bfloat16()
    for a, b in routers:
        assert torch.equal(a(x)[1].sort(-1).values, b(x)[1].sort(-1).values)


def test_grouped_routing_with_a_negative_bias_matches_transformers(tmp_path) -> None:
    """Two expert groups, one kept per token, and a selection bias that makes every score negative:
    a dropped group's experts must never be chosen (transformers scores them −inf; a 0 chose them)."""
    torch.manual_seed(0)
    ref = T.KimiLinearForCausalLM(T.KimiLinearConfig(**{**TINY_KIMI, "n_group": 2, "topk_group": 1})).eval()
    randomize_norms(ref)
    with torch.no_grad():
        for name, buf in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(-2.0 + 0.1 * torch.randn(buf.shape, generator=torch.Generator().manual_seed(5)))
    assert_prefill_matches_transformers(ref, load_model(save_checkpoint(ref, tmp_path), device="cpu"))
