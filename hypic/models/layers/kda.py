"""Kimi Delta Attention mixer (Kimi-Linear's linear-attention layers).

Like Gated DeltaNet, but the decay is per key channel, not per head, so the recurrence runs in the
``kda`` family: ``q, k, v = silu(conv(proj(x)))`` with three width-W causal convs, l2-normalised
q/k, ``β = σ(b_proj(x))``, ``g = −exp(A_log)·softplus(f_b(f_a(x)) + dt_bias)`` per channel, then the
gated delta rule; the output is normalised per head, gated by ``σ(g_b(g_a(x)))`` (a low-rank sigmoid
gate) and projected back.

The checkpoint keeps three separate convs (``q_conv1d``, ``k_conv1d``, ``v_conv1d``); a depthwise
conv is per channel, so they run as one conv over the concatenated raw projections, which keeps one
conv tail per layer for the context to carry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hypic.models.context import ForwardContext, linear_run
from hypic.models.layers.gdn import l2norm
from hypic.models.layers.norm import GatedRMSNorm


@dataclass(frozen=True)
class KDAConfig:
    hidden: int
    heads: int  # q, k and v share the head count
    head_dim: int  # K = V; also the rank of the low-rank gate projections
    conv_width: int
    eps: float  # the output norm's


class KimiDeltaAttention(nn.Module):
    KEEP_FP32 = ("dt_bias",)  # as transformers keeps it: added to the fp32 decay logits (``HybridLM.cast``)

    def __init__(self, cfg: KDAConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        dim = cfg.heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, dim, bias=False)
        self.q_conv1d = nn.Conv1d(dim, dim, cfg.conv_width, groups=dim, bias=False)
        self.k_conv1d = nn.Conv1d(dim, dim, cfg.conv_width, groups=dim, bias=False)
        self.v_conv1d = nn.Conv1d(dim, dim, cfg.conv_width, groups=dim, bias=False)
        self.f_a_proj = nn.Linear(cfg.hidden, cfg.head_dim, bias=False)
        self.f_b_proj = nn.Linear(cfg.head_dim, dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(1, 1, cfg.heads, 1))  # the checkpoint's shape
        self.dt_bias = nn.Parameter(torch.zeros(dim))
        self.b_proj = nn.Linear(cfg.hidden, cfg.heads, bias=False)
        self.g_a_proj = nn.Linear(cfg.hidden, cfg.head_dim, bias=False)
        self.g_b_proj = nn.Linear(cfg.head_dim, dim, bias=False)
        self.o_norm = GatedRMSNorm(cfg.head_dim, cfg.eps, activation="sigmoid")
        self.o_proj = nn.Linear(dim, cfg.hidden, bias=False)

    def decay(self, x: Tensor) -> Tensor:
        """Per-channel natural-log decay g [T, H, K], fp32."""
        c = self.cfg
        a = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        return -self.A_log.float().view(c.heads, 1).exp() * F.softplus(a.view(-1, c.heads, c.head_dim))

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        c, T = self.cfg, x.shape[0]
        raw = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, 3·H·K]
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]  # [3·H·K, W]
        q, k, v = ctx.conv(self.layer, raw, weight).view(T, 3, c.heads, c.head_dim).unbind(1)  # each [T, H, K]
        q, k = l2norm(q), l2norm(k)
        beta = torch.sigmoid(self.b_proj(x).float())  # [T, H]
        g = self.decay(x)

        o = ctx.linear(self.layer, "kda", linear_run("kda", q, k, v, g=g, beta=beta), None)  # [T, H, K]
        gate = self.g_b_proj(self.g_a_proj(x)).view(T, c.heads, c.head_dim)
        return self.o_proj(self.o_norm(o, gate).reshape(T, -1))
