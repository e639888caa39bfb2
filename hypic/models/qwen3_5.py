"""Qwen3.5 (dense ``Qwen3_5ForCausalLM``) and Qwen3-Next-style GDN + gated attention stacks.

Layer ``i`` is full attention when ``layer_types[i] == "full_attention"`` (default: every
``full_attention_interval``-th layer), else a Gated DeltaNet layer. Norms are zero-centred RMSNorms.
Text positions only, so Qwen3.5's interleaved M-RoPE is plain neox RoPE on the first
``partial_rotary_factor · head_dim`` dims.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from hypic.models.hybrid import Backbone, DecoderLayer, HybridLM, LayerKinds
from hypic.models.layers.attention import AttentionConfig, GatedAttention
from hypic.models.layers.gdn import GatedDeltaNet, GDNConfig
from hypic.models.layers.mlp import SwiGLU
from hypic.models.layers.norm import RMSNorm
from hypic.models.rope_config import max_positions, rope_spec
from hypic.ops.rope import RopeSpec


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text part of a config (``...ForConditionalGeneration`` checkpoints nest it)."""
    return config.get("text_config", config)


def layer_kinds(c: dict[str, Any]) -> LayerKinds:
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or [
        "full_attention" if (i + 1) % c.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(n)
    ]
    if len(types) != n:
        raise ValueError(f"config.layer_types: {len(types)} entries for {n} layers")
    return LayerKinds(tuple("attention" if t == "full_attention" else "linear" for t in types), "gdn")


def rope_of(c: dict[str, Any]) -> RopeSpec:
    rp = c.get("rope_parameters") or {}
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    factor = rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
    return rope_spec(c, int(head_dim * factor), 10000.0)


def build_gdn_stack(c: dict[str, Any], *, interleaved: bool, mlp: Callable[[int], nn.Module]) -> HybridLM:
    """GDN + gated attention layers with zero-centred norms; ``mlp(i)`` builds layer i's FFN."""
    kinds = layer_kinds(c)
    hidden, eps = c["hidden_size"], c.get("rms_norm_eps", 1e-6)
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    rope = rope_of(c)
    gdn = GDNConfig(hidden, c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                    c["linear_value_head_dim"], c.get("linear_conv_kernel_dim", 4), eps, interleaved)
    attn = AttentionConfig(hidden, c["num_attention_heads"], c["num_key_value_heads"], head_dim, rope,
                           eps, c.get("attn_output_gate", True), zero_centred_norm=True)

    def norm() -> nn.Module:
        return RMSNorm(hidden, eps, zero_centred=True)

    layers = [
        DecoderLayer("linear_attn", GatedDeltaNet(gdn, i), mlp(i), norm) if kind == "linear"
        else DecoderLayer("self_attn", GatedAttention(attn, i), mlp(i), norm)
        for i, kind in enumerate(kinds.kinds)
    ]
    backbone = Backbone(c["vocab_size"], hidden, layers, norm())
    return HybridLM(backbone, c["vocab_size"], hidden, kinds, tie_embeddings=c.get("tie_word_embeddings", False),
                    max_positions=max_positions(c, rope, 32768))


def build_qwen3_5(config: dict[str, Any]) -> HybridLM:
    c = text_config(config)
    return build_gdn_stack(c, interleaved=False, mlp=lambda i: SwiGLU(c["hidden_size"], c["intermediate_size"]))


def checkpoint_name(name: str) -> str | None:
    """Checkpoint tensor name → hypic parameter name (None: not part of the text model)."""
    for prefix in ("model.language_model.", "language_model.model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name.startswith(("model.visual.", "visual.", "mtp.", "model.mtp.")):
        return None
    return name
