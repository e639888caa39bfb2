"""Kimi-Linear (``KimiLinearForCausalLM``): KDA layers interleaved with NoPE MLA layers, and a
DeepSeek-V3-style MoE (sigmoid router with a selection bias, plus a shared expert) after the first
``first_k_dense_replace`` dense layers.

Which layers are full attention comes from ``linear_attn_config``'s 1-based ``full_attn_layers`` /
``kda_layers`` (transformers also writes a 0-based ``layer_types``, which wins when present). The
checkpoint names MoE blocks ``block_sparse_moe`` and experts ``w1/w2/w3``; ``checkpoint_name`` maps
them onto the shared MoE module's names.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hypic.models.hybrid import Backbone, DecoderLayer, HybridLM, LayerKinds
from hypic.models.layers.kda import KDAConfig, KimiDeltaAttention
from hypic.models.layers.mla import LatentAttention, MLAConfig
from hypic.models.layers.mlp import SwiGLU
from hypic.models.layers.moe import MoE, MoEConfig, mixtral_names
from hypic.models.layers.norm import RMSNorm


def _get(c: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first key present: checkpoints and transformers spell some keys differently."""
    for name in names:
        if c.get(name) is not None:
            return c[name]
    return default


def layer_kinds(c: dict[str, Any]) -> LayerKinds:
    n, lac = c["num_hidden_layers"], c.get("linear_attn_config") or {}
    types = c.get("layer_types")
    if types is None and "full_attn_layers" in lac and "kda_layers" in lac:
        types = [None] * n
        for i in lac["full_attn_layers"]:
            types[i - 1] = "full_attention"
        for i in lac["kda_layers"]:
            types[i - 1] = "linear_attention"
    if types is None:  # transformers' default when the config names no layers
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or any(t not in ("full_attention", "linear_attention") for t in types):
        raise ValueError(f"config: layer types {types} do not give each of the {n} layers a kind")
    return LayerKinds(tuple("attention" if t == "full_attention" else "linear" for t in types), "kda")


def sparse_layers(c: dict[str, Any]) -> list[bool]:
    """Whether each layer's FFN is the MoE (else the dense SwiGLU)."""
    n, types = c["num_hidden_layers"], c.get("mlp_layer_types")
    if types is None:
        return [i >= c.get("first_k_dense_replace", 1) for i in range(n)]
    if len(types) != n:
        raise ValueError(f"config.mlp_layer_types: {len(types)} entries for {n} layers")
    return [t == "sparse" for t in types]


def moe_config(c: dict[str, Any]) -> MoEConfig:
    act = c.get("moe_router_activation_func", "sigmoid")
    if act != "sigmoid":
        raise ValueError(f"config.moe_router_activation_func: hypic supports 'sigmoid', got {act!r}")
    inter = c["moe_intermediate_size"]
    experts = _get(c, "num_experts", "num_local_experts")
    top_k = _get(c, "num_experts_per_token", "num_experts_per_tok")
    return MoEConfig(
        c["hidden_size"], experts, top_k, inter, "sigmoid",
        renormalize=_get(c, "moe_renormalize", "norm_topk_prob", default=True),
        shared_intermediate=inter * _get(c, "num_shared_experts", "n_shared_experts", default=1),
        scaling=c.get("routed_scaling_factor", 1.0), groups=_get(c, "num_expert_group", "n_group", default=1),
        top_groups=c.get("topk_group") or 1, selection_bias=True,
        # transformers' Kimi router scores the dropped groups' experts −inf: with a negative
        # selection bias a 0 would choose them over the kept groups' experts
        dropped_group_score=float("-inf"))


def build_kimi_linear(config: dict[str, Any]) -> HybridLM:
    c, lac = config, config.get("linear_attn_config") or {}
    kinds = layer_kinds(c)
    hidden, eps = c["hidden_size"], c.get("rms_norm_eps", 1e-5)
    kda = KDAConfig(hidden, _get(lac, "num_heads", default=c.get("linear_num_heads", 32)),
                    _get(lac, "head_dim", default=c.get("linear_head_dim", 128)),
                    _get(lac, "short_conv_kernel_size", default=c.get("linear_conv_kernel_dim", 4)), eps)
    mla = MLAConfig(hidden, c["num_attention_heads"], c.get("q_lora_rank"), c["kv_lora_rank"], c["qk_nope_head_dim"],
                    c["qk_rope_head_dim"], c["v_head_dim"], bool(c.get("attention_bias", False)))
    moe, sparse = moe_config(c), sparse_layers(c)

    def norm() -> nn.Module:
        return RMSNorm(hidden, eps)

    layers = [
        DecoderLayer("self_attn", KimiDeltaAttention(kda, i) if kind == "linear" else LatentAttention(mla, i),
                     MoE(moe) if sparse[i] else SwiGLU(hidden, c["intermediate_size"]), norm)
        for i, kind in enumerate(kinds.kinds)
    ]
    backbone = Backbone(c["vocab_size"], hidden, layers, norm())
    return HybridLM(backbone, c["vocab_size"], hidden, kinds, tie_embeddings=c.get("tie_word_embeddings", False),
                    max_positions=_get(c, "model_max_length", "max_position_embeddings", default=1048576))


def checkpoint_name(name: str) -> str | None:
    """Checkpoint tensor name → hypic parameter name."""
    return mixtral_names(name).replace(".shared_experts.", ".shared_expert.")
