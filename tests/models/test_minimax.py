"""MiniMax-Text-01 / M1: parity with transformers' ``MiniMaxForCausalLM`` (fp32, CPU) over lightning
and softmax layers, the MoE and the scaled post-norm residual; the remote code's config dialect;
batched varlen decoding.

transformers' MiniMax decodes wrongly with its cache (``MiniMaxCache`` finds no full-attention
layer, so positions restart at 0; ../shared/reference/models.md §10), so decoding is checked against
its forward *without* a cache over the whole sequence at every step.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T

from hypic.models.loader import load_model
from hypic.models.minimax import build_minimax, checkpoint_name, layer_kinds
from tests.models.harness import (
    assert_prefill_matches_transformers,
    assert_varlen_equals_alone,
    hypic_greedy,
    hypic_logits,
    randomize_norms,
    save_checkpoint,
)
from tests.models.test_qwen3_next import randomize_routers

# Layers: lightning, softmax, lightning, lightning, softmax. Residual factors away from 1 and apart
# from each other, so a swapped or dropped factor shows.
TINY_MINIMAX = dict(vocab_size=512, hidden_size=128, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, block_size=16,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                                 "full_attention"], max_position_embeddings=4096,
                    full_attn_alpha_factor=1.7, full_attn_beta_factor=0.8, linear_attn_alpha_factor=1.3,
                    linear_attn_beta_factor=1.1, mlp_alpha_factor=1.5, mlp_beta_factor=0.9)


def tiny_reference(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    ref = T.MiniMaxForCausalLM(T.MiniMaxConfig(**{**TINY_MINIMAX, **overrides})).eval()
    randomize_norms(ref)
    randomize_routers(ref)
    with torch.no_grad():  # lightning q/k/v and softmax scores large enough that the state and the
        for name, p in ref.named_parameters():  # positions, not just the gates, move the output
            if name.endswith(("qkv_proj.weight", "q_proj.weight", "k_proj.weight")):
                p.mul_(6.0)
    return ref


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    ref = tiny_reference()
    return ref, load_model(save_checkpoint(ref, tmp_path_factory.mktemp("minimax")), device="cpu")


@torch.no_grad()
def greedy_without_cache(ref: torch.nn.Module, prompt: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    ids, tokens, logits = prompt[None], [], []
    for _ in range(steps):
        last = ref(ids, use_cache=False).logits[0, -1]
        logits.append(last)
        tokens.append(int(last.argmax()))
        ids = torch.cat([ids, ids.new_tensor([[tokens[-1]]])], dim=1)
    return tokens, torch.stack(logits)


def test_model_has_both_mixers_and_moe(minimax) -> None:
    _, loaded = minimax
    assert loaded.model.kinds.kinds == ("linear", "attention", "linear", "linear", "attention")
    assert loaded.model.kinds.linear_family == "scalar"
    kinds = [type(layer.self_attn).__name__ for layer in loaded.model.model.layers]
    assert kinds == ["MiniMaxLightningAttention", "GatedAttention", "MiniMaxLightningAttention",
                     "MiniMaxLightningAttention", "GatedAttention"]


def test_prefill_logits_match_transformers(minimax) -> None:
    assert_prefill_matches_transformers(*minimax)


def test_prefill_longer_than_transformers_blocks(minimax) -> None:
    """transformers runs lightning layers in blocks of ``block_size`` (16 here) carrying the state
    between them: 300 tokens cross 18 block boundaries, hypic's chunks cross theirs elsewhere."""
    assert_prefill_matches_transformers(*minimax, length=300, seed=7)


def test_greedy_decode_matches_transformers_without_cache(minimax) -> None:
    ref, loaded = minimax
    prompt = torch.randint(3, 512, (37,), generator=torch.Generator().manual_seed(2))
    want, want_logits = greedy_without_cache(ref, prompt, 12)
    for stacked in (False, True):
        got, got_logits = hypic_greedy(loaded, [prompt], 12, stacked)
        assert got[0] == want
        assert (got_logits[:, 0] - want_logits).abs().max() <= 1e-4


def test_varlen_batch_equals_sequences_alone(minimax) -> None:
    assert_varlen_equals_alone(minimax[1])


def test_remote_code_config_dialect_runs_the_same_model(minimax, tmp_path) -> None:
    """The checkpoints' own config.json (remote code: ``attn_type_list``, ``layernorm_*_alpha``,
    ``rotary_dim``) over the same tensors gives the same logits; ``rotary_dim`` below the head size
    rotates fewer dims (what the released checkpoints' remote code does) and so changes them."""
    ref, loaded = minimax
    path = save_checkpoint(ref, tmp_path / "remote")
    hf = json.loads((path / "config.json").read_text())
    remote = {k: v for k, v in hf.items() if not k.endswith("_factor") and k not in ("layer_types", "rope_parameters")}
    remote.update(architectures=["MiniMaxText01ForCausalLM"], model_type="minimax_text_01", postnorm=True,
                  attn_type_list=[0 if t == "linear_attention" else 1 for t in hf["layer_types"]],
                  rope_theta=hf["rope_parameters"]["rope_theta"], rotary_dim=hf["head_dim"],
                  shared_intermediate_size=0,
                  **{f"layernorm_{part}_{ab}": hf[f"{short}_{ab}_factor"]
                     for part, short in (("full_attention", "full_attn"), ("linear_attention", "linear_attn"),
                                         ("mlp", "mlp")) for ab in ("alpha", "beta")})
    (path / "config.json").write_text(json.dumps(remote))
    ids = torch.randint(3, 512, (90,), generator=torch.Generator().manual_seed(5))
    want = hypic_logits(loaded, ids)
    assert (hypic_logits(load_model(path, device="cpu"), ids) - want).abs().max() <= 1e-5
    (path / "config.json").write_text(json.dumps({**remote, "rotary_dim": hf["head_dim"] // 2}))
    assert (hypic_logits(load_model(path, device="cpu"), ids) - want).abs().max() > 1e-3


def test_a_head_count_not_a_power_of_two_takes_each_dialect_s_slopes(tmp_path) -> None:
    """Six heads: transformers' geometric slopes ``2^(−8(h+1)/6)`` (its logits matched), the remote
    code's ALiBi interleaving (the slopes of 4 heads, then every other of 8) under its own config."""
    from hypic.models.layers.lightning import MiniMaxLightningAttention, alibi_slopes, minimax_layer_decay

    ref = tiny_reference(num_attention_heads=6, num_key_value_heads=2)
    path = save_checkpoint(ref, tmp_path / "six")
    assert_prefill_matches_transformers(ref, load_model(path, device="cpu"))
    assert alibi_slopes(6) == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]
    geometric, alibi = (minimax_layer_decay(6, 2, 5, geometric=g) for g in (True, False))
    assert geometric != alibi and geometric[0] / geometric[1] == pytest.approx(2 ** (8 / 6))
    with torch.device("meta"):
        remote = build_minimax({**ref.config.to_dict(), "attn_type_list": [0, 1, 0, 0, 1]})
    layer = getattr(remote.model.layers[2], remote.model.layers[2].mixer_name)
    assert isinstance(layer, MiniMaxLightningAttention)
    assert layer.decay == pytest.approx(alibi)


def test_postnorm_follows_each_dialect() -> None:
    """transformers' layer always adds the normed input; the remote code's only with ``postnorm``,
    whose default there is false."""
    remote = {**TINY_MINIMAX, "attn_type_list": [0, 1, 0, 0, 1]}
    with torch.device("meta"):
        for config, normed in ((TINY_MINIMAX, True), ({**TINY_MINIMAX, "postnorm": False}, False),
                               (remote, False), ({**remote, "postnorm": True}, True)):
            assert {layer.residual.normed for layer in build_minimax(config).model.layers} == {normed}


def test_unsupported_configs_are_refused_by_name() -> None:
    for key, value in (("shared_intermediate_size", 64), ("sliding_window", 128)):
        with pytest.raises(ValueError, match=key), torch.device("meta"):
            build_minimax({**TINY_MINIMAX, key: value})


def test_layer_kinds_from_each_dialect() -> None:
    assert layer_kinds({"num_hidden_layers": 3, "attn_type_list": [0, 0, 1]}).kinds == ("linear", "linear", "attention")
    assert layer_kinds({"num_hidden_layers": 3}).kinds == ("attention", "linear", "attention")  # transformers' default
    with pytest.raises(ValueError, match="layer_types"):
        layer_kinds({"num_hidden_layers": 3, "layer_types": ["full_attention"]})


def test_checkpoint_names() -> None:
    moe = "model.layers.7.block_sparse_moe."
    assert checkpoint_name(moe + "experts.31.w1.weight") == "model.layers.7.mlp.experts.31.gate_proj.weight"
    assert checkpoint_name(moe + "experts.31.w3.weight") == "model.layers.7.mlp.experts.31.up_proj.weight"
    assert checkpoint_name(moe + "experts.31.w2.weight") == "model.layers.7.mlp.experts.31.down_proj.weight"
    assert checkpoint_name(moe + "gate.weight") == "model.layers.7.mlp.gate.weight"
    assert checkpoint_name("model.layers.0.self_attn.slope_rate") is None
    assert checkpoint_name("model.layers.0.self_attn.diagonal_decay") is None
    assert checkpoint_name("model.layers.0.self_attn.qkv_proj.weight") == "model.layers.0.self_attn.qkv_proj.weight"
