"""MiniMax-Text-01 / MiniMax-M1: lightning linear-attention layers with softmax attention in every
eighth, a Mixtral-style MoE after each, and MiniMax's scaled residual.

Two config dialects describe the same model: transformers' ``MiniMaxForCausalLM`` (``layer_types``,
``{full_attn,linear_attn,mlp}_{alpha,beta}_factor``, ``rope_parameters``) and the checkpoints' remote
code (``MiniMaxText01ForCausalLM`` / ``MiniMaxM1ForCausalLM``: ``attn_type_list`` with 1 = softmax,
``layernorm_{full_attention,linear_attention,mlp}_{alpha,beta}``, ``rotary_dim``, ``postnorm: true``). Both
name the tensors alike: every mixer ``self_attn``, the MoE ``block_sparse_moe`` with experts
``w1`` (gate), ``w3`` (up), ``w2`` (down); the lightning layers' decay buffers are not weights.
Where the two disagree, each config gets its own code's behaviour: the residual adds the normed input
always in transformers, only with ``postnorm`` in the remote code (default false); a head count
that is not a power of two takes geometric slopes in transformers, ALiBi's in the remote code.

RoPE: the remote code rotates the first ``rotary_dim`` (64) of the 128 head dims; transformers'
port rotates all of them (transformers #48241). A config that names ``rotary_dim`` gets it, one
that does not gets transformers' behaviour, so each dialect runs as its own reference does.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hypic.models.hybrid import Backbone, DecoderLayer, HybridLM, LayerKinds, Residual
from hypic.models.layers.attention import AttentionConfig, GatedAttention
from hypic.models.layers.lightning import MiniMaxLightningAttention
from hypic.models.layers.moe import MoE, MoEConfig, mixtral_names
from hypic.models.layers.norm import RMSNorm
from hypic.models.rope_config import max_positions, rope_spec
from hypic.ops.rope import RopeSpec


def layer_kinds(c: dict[str, Any]) -> LayerKinds:
    """``layer_types``, else ``attn_type_list`` (0 lightning, 1 softmax), else transformers'
    default (even layers softmax)."""
    n = c["num_hidden_layers"]
    if c.get("layer_types"):
        full = [t == "full_attention" for t in c["layer_types"]]
    elif c.get("attn_type_list"):
        full = [t == 1 for t in c["attn_type_list"]]
    else:
        full = [i % 2 == 0 for i in range(n)]
    if len(full) != n:
        raise ValueError(f"config.layer_types: {len(full)} entries for {n} layers")
    return LayerKinds(tuple("attention" if f else "linear" for f in full), "scalar")


def _factor(c: dict[str, Any], hf_key: str, remote_key: str) -> float:
    return float(c.get(hf_key, c.get(remote_key, 1.0)))


def remote_dialect(c: dict[str, Any]) -> bool:
    """Whether ``c`` is the checkpoints' own config (the remote code's), not transformers'."""
    return "attn_type_list" in c or c.get("model_type") in ("minimax_text_01", "minimax_m1")


def residual(c: dict[str, Any], kind: str) -> Residual:
    mixer = "full" if kind == "attention" else "linear"
    remote = "full_attention" if kind == "attention" else "linear_attention"
    return Residual(mixer_alpha=_factor(c, f"{mixer}_attn_alpha_factor", f"layernorm_{remote}_alpha"),
                    mixer_beta=_factor(c, f"{mixer}_attn_beta_factor", f"layernorm_{remote}_beta"),
                    mlp_alpha=_factor(c, "mlp_alpha_factor", "layernorm_mlp_alpha"),
                    mlp_beta=_factor(c, "mlp_beta_factor", "layernorm_mlp_beta"),
                    # transformers' layer always adds the normed input; the remote code only with
                    # postnorm (its default false; the released checkpoints set it true)
                    normed=bool(c.get("postnorm", not remote_dialect(c))))


def rope(c: dict[str, Any], head_dim: int) -> RopeSpec:
    return rope_spec(c, int(c.get("rotary_dim") or head_dim), 1e6)


def build_minimax(config: dict[str, Any]) -> HybridLM:
    c = config
    if c.get("shared_intermediate_size"):
        raise ValueError(f"config.shared_intermediate_size: hypic supports MiniMax without a shared expert "
                         f"(0), got {c['shared_intermediate_size']}")
    if c.get("sliding_window"):
        raise ValueError(f"config.sliding_window: hypic supports MiniMax's full attention only, "
                         f"got {c['sliding_window']}")
    kinds = layer_kinds(c)
    n, hidden, eps = c["num_hidden_layers"], c["hidden_size"], c.get("rms_norm_eps", 1e-5)
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    spec = rope(c, head_dim)
    attn = AttentionConfig(hidden, heads, c.get("num_key_value_heads") or heads, head_dim, spec, eps,
                           output_gate=False, zero_centred_norm=False, qk_norm=False)
    moe = MoEConfig(hidden, c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"], "softmax",
                    renormalize=True)

    def mixer(i: int, kind: str) -> nn.Module:
        if kind == "linear":
            return MiniMaxLightningAttention(hidden, heads, head_dim, i, n, geometric=not remote_dialect(c))
        return GatedAttention(attn, i)

    def norm() -> nn.Module:
        return RMSNorm(hidden, eps)

    layers = [DecoderLayer("self_attn", mixer(i, kind), MoE(moe), norm, residual(c, kind))
              for i, kind in enumerate(kinds.kinds)]
    backbone = Backbone(c["vocab_size"], hidden, layers, norm())
    return HybridLM(backbone, c["vocab_size"], hidden, kinds, tie_embeddings=c.get("tie_word_embeddings", False),
                    max_positions=max_positions(c, spec, 131072))


_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay", "inv_freq")


def checkpoint_name(name: str) -> str | None:
    """Checkpoint tensor name → hypic parameter name (None: a buffer the model recomputes)."""
    if name.rsplit(".", 1)[-1] in _BUFFERS:
        return None
    return mixtral_names(name)
