"""Ring-linear 2.0 (``BailingMoeLinearV2ForCausalLM``, model_type ``bailing_moe_linear``): lightning
linear-attention layers with RoPE inside, a full-attention layer closing every ``layer_group_size``
group, and a DeepSeek-V3-style MoE after the first ``first_k_dense_replace`` dense layers.

Not in transformers: the checkpoints ship remote code. Their tensor names (``model.word_embeddings``,
``model.layers.{i}.attention.{query_key_value,dense,query_layernorm,key_layernorm,g_proj,g_norm}``,
``mlp.gate.expert_bias``, ``mlp.shared_experts``) are what the mixers here are named or what
``checkpoint_name`` maps onto the shared modules. The router is Bailing's: experts of unchosen groups
score −inf, and the top-k weights are renormalised only when more than one expert is chosen.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from hypic.models.context import ForwardContext, RopeSpec
from hypic.models.hybrid import Backbone, DecoderLayer, HybridLM, LayerKinds
from hypic.models.layers.lightning import LightningAttention, LightningConfig
from hypic.models.layers.mlp import SwiGLU
from hypic.models.layers.moe import MoE, MoEConfig
from hypic.models.layers.norm import RMSNorm
from hypic.models.rope_config import max_positions, rope_spec

# Config switches the released checkpoints leave at these values; others would need code we lack.
_FIXED = {"use_qk_norm": True, "use_qkv_bias": False, "use_bias": False, "linear_silu": False, "norm_head": False,
          "linear_rope": True, "score_function": "sigmoid"}


def _check_supported(c: dict[str, Any]) -> None:
    for key, want in _FIXED.items():
        if key in c and c[key] != want:
            raise ValueError(f"config.{key}: hypic supports {want!r} for Ring-linear, got {c[key]!r}")


def layer_kinds(c: dict[str, Any]) -> LayerKinds:
    """Full attention closes each group of ``layer_group_size`` layers; the layers after the last
    whole group are all full attention."""
    n, size = c["num_hidden_layers"], c["layer_group_size"]
    full = [(i + 1) % size == 0 or i >= n // size * size for i in range(n)]
    return LayerKinds(tuple("attention" if f else "linear" for f in full), "scalar")


class FusedQKVAttention(nn.Module):
    """GQA softmax attention from one fused ``query_key_value`` projection ``[q | k | v]``, q/k
    RMSNorm per head, partial RoPE (applied by the context), no output gate."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, rope: RopeSpec, eps: float,
                 layer: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rope, self.layer = heads, kv_heads, head_dim, rope, layer
        self.query_key_value = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.query_layernorm = RMSNorm(head_dim, eps)
        self.key_layernorm = RMSNorm(head_dim, eps)
        self.dense = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        T = x.shape[0]
        qkv = self.query_key_value(x).view(T, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)  # [T, Hq | Hkv | Hkv, d]
        q, k = self.query_layernorm(q), self.key_layernorm(k)
        o = ctx.attend(self.layer, q, k, v, self.rope, self.head_dim**-0.5)  # [T, Hq, d]
        return self.dense(o.reshape(T, -1))


def moe_config(c: dict[str, Any]) -> MoEConfig:
    top_k, inter = c["num_experts_per_tok"], c["moe_intermediate_size"]
    shared = (c.get("moe_shared_expert_intermediate_size") or inter) * c.get("num_shared_experts", 0)
    return MoEConfig(c["hidden_size"], c["num_experts"], top_k, inter, "sigmoid",
                     renormalize=top_k > 1 and c.get("norm_topk_prob", True), shared_intermediate=shared,
                     scaling=c.get("routed_scaling_factor", 1.0), groups=c.get("n_group") or 1,
                     top_groups=c.get("topk_group") or 1,
                     selection_bias=c.get("moe_router_enable_expert_bias", False),
                     dropped_group_score=float("-inf"))


def build_ring_linear(config: dict[str, Any]) -> HybridLM:
    c = config
    _check_supported(c)
    kinds = layer_kinds(c)
    n, hidden, eps = c["num_hidden_layers"], c["hidden_size"], c.get("rms_norm_eps", 1e-6)
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    rotary_dim = c.get("rotary_dim") or int(head_dim * c.get("partial_rotary_factor", 1.0))
    rope, moe = rope_spec(c, rotary_dim, 600000.0), moe_config(c)  # 600 000: the ports' θ when a config has none
    lightning = LightningConfig(hidden, heads, head_dim, rope, eps, c.get("group_norm_size", 1), n)

    def mixer(i: int, kind: str) -> nn.Module:
        if kind == "linear":
            return LightningAttention(lightning, i)
        return FusedQKVAttention(hidden, heads, c["num_key_value_heads"], head_dim, rope, eps, i)

    def mlp(i: int) -> nn.Module:
        return MoE(moe) if i >= c.get("first_k_dense_replace", 0) else SwiGLU(hidden, c["intermediate_size"])

    def norm() -> nn.Module:
        return RMSNorm(hidden, eps)

    layers = [DecoderLayer("attention", mixer(i, kind), mlp(i), norm) for i, kind in enumerate(kinds.kinds)]
    backbone = Backbone(c["vocab_size"], hidden, layers, norm())
    return HybridLM(backbone, c["vocab_size"], hidden, kinds, tie_embeddings=c.get("tie_word_embeddings", False),
                    max_positions=max_positions(c, rope, 131072))


_RENAMES = (("model.word_embeddings.", "model.embed_tokens."),
            (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"),
            (".mlp.shared_experts.", ".mlp.shared_expert."))


def checkpoint_name(name: str) -> str | None:
    """Checkpoint tensor name → hypic parameter name (None: not part of the model we run)."""
    if name.startswith("model.mtp.") or name.endswith(".inv_freq"):  # next-token heads; RoPE caches
        return None
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name
