"""Qwen3-Next (``Qwen3NextForCausalLM``) and Qwen3.5-MoE (``Qwen3_5MoeForCausalLM`` /
``Qwen3_5MoeForConditionalGeneration``): the Qwen3.5 GDN + gated-attention stack of qwen3_5.py with
a mixture-of-experts FFN.

The MoE block is the same in both: softmax over ``num_experts`` router logits, top
``num_experts_per_tok``, plus one shared expert scaled by ``sigmoid(shared_expert_gate(x))``.
The families differ in three places:

- GDN projections: Qwen3-Next interleaves them per key-head group (``in_proj_qkvz``, ``in_proj_ba``).
- Which layers are MoE: Qwen3-Next keeps a dense SwiGLU of ``intermediate_size`` in the layers
  listed in ``mlp_only_layers`` and where ``(i + 1) % decoder_sparse_step != 0``; Qwen3.5-MoE has
  MoE in every layer.
- Top-k renormalisation: Qwen3-Next follows ``norm_topk_prob``; Qwen3.5-MoE always renormalises
  (its reference implementation has no switch, whatever the config says).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hypic.models.hybrid import HybridLM
from hypic.models.layers.mlp import SwiGLU
from hypic.models.layers.moe import MoE, MoEConfig
from hypic.models.qwen3_5 import build_gdn_stack, text_config


def moe_config(c: dict[str, Any], *, renormalize: bool) -> MoEConfig:
    return MoEConfig(c["hidden_size"], c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"],
                     "softmax", renormalize=renormalize,
                     shared_intermediate=c.get("shared_expert_intermediate_size", 0), shared_gate=True)


def is_sparse_layer(c: dict[str, Any], i: int) -> bool:
    """Whether Qwen3-Next layer ``i`` has the MoE block (else a dense SwiGLU)."""
    return (i not in (c.get("mlp_only_layers") or []) and c.get("num_experts", 0) > 0
            and (i + 1) % c.get("decoder_sparse_step", 1) == 0)


def build_qwen3_next(config: dict[str, Any]) -> HybridLM:
    c = text_config(config)
    moe = moe_config(c, renormalize=c.get("norm_topk_prob", True))

    def mlp(i: int) -> nn.Module:
        return MoE(moe) if is_sparse_layer(c, i) else SwiGLU(c["hidden_size"], c["intermediate_size"])

    return build_gdn_stack(c, interleaved=True, mlp=mlp)


def build_qwen3_5_moe(config: dict[str, Any]) -> HybridLM:
    c = text_config(config)
    moe = moe_config(c, renormalize=True)
    return build_gdn_stack(c, interleaved=False, mlp=lambda i: MoE(moe))
