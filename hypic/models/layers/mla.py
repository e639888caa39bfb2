"""Multi-head latent attention without RoPE (Kimi-Linear's full-attention layers).

DeepSeek-style MLA: keys and values come from a normed low-rank latent (``kv_b_proj``) plus a
shared slice (``k_rot``, one per token, given to every head). Kimi-Linear applies no rotary at all
(NoPE; positions enter through the KDA layers), so the "rope" slice is just an unrotated shared key
part. The layer expands the latent into per-head keys ``[k_nope | k_rot]`` and values and hands
them to the context like any other attention, so caching and the combine pass need nothing new.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hypic.models.context import ForwardContext
from hypic.models.layers.norm import RMSNorm


@dataclass(frozen=True)
class MLAConfig:
    hidden: int
    heads: int
    q_lora_rank: int | None  # None: a direct q_proj
    kv_lora_rank: int
    nope_dim: int  # per-head key part from the latent
    rope_dim: int  # the shared key part (unrotated here)
    v_dim: int
    bias: bool  # attention_bias: on the down-projections and o_proj
    latent_eps: float = 1e-6  # the latent norms' (not rms_norm_eps)


class LatentAttention(nn.Module):
    def __init__(self, cfg: MLAConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        q_dim = cfg.heads * (cfg.nope_dim + cfg.rope_dim)
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden, q_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden, cfg.q_lora_rank, bias=cfg.bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden, cfg.kv_lora_rank + cfg.rope_dim, bias=cfg.bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.latent_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, cfg.heads * (cfg.nope_dim + cfg.v_dim), bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.v_dim, cfg.hidden, bias=cfg.bias)

    def query(self, x: Tensor) -> Tensor:
        if self.cfg.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        c, T = self.cfg, x.shape[0]
        q = self.query(x).view(T, c.heads, c.nope_dim + c.rope_dim)
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [c.kv_lora_rank, c.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(T, c.heads, c.nope_dim + c.v_dim)
        k_nope, v = torch.split(kv, [c.nope_dim, c.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot[:, None].expand(T, c.heads, c.rope_dim)], dim=-1)  # [T, H, nope + rope]
        o = ctx.attend(self.layer, q, k, v.contiguous(), None, (c.nope_dim + c.rope_dim) ** -0.5)  # [T, H, v_dim]
        return self.o_proj(o.reshape(T, -1))
