"""Grouped-query softmax attention with optional q/k RMSNorm, partial RoPE and an optional sigmoid
output gate (Qwen3-Next / Qwen3.5 full-attention layers; MiniMax's without the norms or the gate).

Keys leave this layer (normed where the model norms them) but *before* RoPE: the context ropes them
at true positions, which is what lets a cached segment's keys be placed anywhere later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hypic.models.context import ForwardContext, RopeSpec
from hypic.models.layers.fused import FusedLinears
from hypic.models.layers.norm import RMSNorm


@dataclass(frozen=True)
class AttentionConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rope: RopeSpec
    eps: float
    output_gate: bool
    zero_centred_norm: bool
    qk_norm: bool = True  # RMSNorm on each head of q and k before RoPE (MiniMax has none)


class GatedAttention(nn.Module):
    def __init__(self, cfg: AttentionConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        q_out = cfg.heads * cfg.head_dim * (2 if cfg.output_gate else 1)
        self.q_proj = nn.Linear(cfg.hidden, q_out, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.eps, zero_centred=cfg.zero_centred_norm)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.eps, zero_centred=cfg.zero_centred_norm)
        self.rope = cfg.rope
        self._fused: FusedLinears | None = None

    def fuse(self) -> bool:
        """Inference: q, k and v in one matmul (hypic.models.layers.fused)."""
        if self._fused is not None:
            return False
        self._fused = FusedLinears([self.q_proj, self.k_proj, self.v_proj])
        return True

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        c, T = self.cfg, x.shape[0]
        if self._fused is not None:
            q, k_raw, v_raw = self._fused(x)
        else:
            q, k_raw, v_raw = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        gate = None
        if c.output_gate:  # per head: [query | gate]
            q, gate = torch.chunk(q.view(T, c.heads, 2 * c.head_dim), 2, dim=-1)
            gate = gate.reshape(T, -1)
        q, k = q.reshape(T, c.heads, c.head_dim), k_raw.reshape(T, c.kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v_raw.reshape(T, c.kv_heads, c.head_dim)
        o = ctx.attend(self.layer, q, k, v, self.rope, c.head_dim**-0.5).reshape(T, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)
