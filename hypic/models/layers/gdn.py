"""Gated DeltaNet mixer (Qwen3.5 and Qwen3-Next linear-attention layers).

``[q|k|v] = silu(conv(proj(x)))`` with a width-W causal conv, l2-normalised q/k, ``β = σ(b)``,
``g = −exp(A_log)·softplus(a + dt_bias)``, then the gated delta rule; the output is normalised per
head, gated by ``silu(z)`` and projected back. Qwen3-Next interleaves its projections per key-head
group (``in_proj_qkvz``, ``in_proj_ba``); Qwen3.5 keeps them apart.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hypic.models.context import ForwardContext, linear_run
from hypic.models.layers.fused import FusedLinears
from hypic.models.layers.norm import GatedRMSNorm, fused


@dataclass(frozen=True)
class GDNConfig:
    hidden: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_width: int
    eps: float
    interleaved: bool  # Qwen3-Next's fused, per-group-interleaved projections


@functools.cache
def _l2_weight(dim: int, device: torch.device) -> Tensor:  # made once, not per call
    return torch.full((dim,), dim**-0.5, device=device)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(Σx² + eps) over the last dim, computed in fp32, returned in x's dtype."""
    if fused(x):  # the RMS-norm kernel: x·rsqrt(Σx² + eps) = x·rsqrt(mean(x²) + eps/D) / sqrt(D)
        from hypic.ops.triton_norm import rms_norm

        D = x.shape[-1]
        return rms_norm(x, _l2_weight(D, x.device), eps / D)
    return _l2norm_torch(x, eps)


def _l2norm_torch(x: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: GDNConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        kd, vd = cfg.key_heads * cfg.key_dim, cfg.value_heads * cfg.value_dim
        self.conv_dim = 2 * kd + vd
        if cfg.interleaved:
            self.in_proj_qkvz = nn.Linear(cfg.hidden, 2 * kd + 2 * vd, bias=False)
            self.in_proj_ba = nn.Linear(cfg.hidden, 2 * cfg.value_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(cfg.hidden, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(cfg.hidden, vd, bias=False)
            self.in_proj_b = nn.Linear(cfg.hidden, cfg.value_heads, bias=False)
            self.in_proj_a = nn.Linear(cfg.hidden, cfg.value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.conv_width, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(cfg.value_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.value_heads))
        self.norm = GatedRMSNorm(cfg.value_dim, cfg.eps)
        self.out_proj = nn.Linear(vd, cfg.hidden, bias=False)
        self._fused: FusedLinears | None = None

    def fuse(self) -> bool:
        """Inference: qkv, z, b and a in one matmul (hypic.models.layers.fused)."""
        if self.cfg.interleaved or self._fused is not None:
            return False
        self._fused = FusedLinears([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        return True

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """mixed [T, 2·kd + vd] (q|k|v, pre-conv), z [T, HV, V], b, a [T, HV]."""
        c, T = self.cfg, x.shape[0]
        if self._fused is not None:
            mixed, z, b, a = self._fused(x)
            return mixed, z.reshape(T, c.value_heads, c.value_dim), b, a
        if not c.interleaved:
            z = self.in_proj_z(x).view(T, c.value_heads, c.value_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = c.value_heads // c.key_heads  # value heads per key-head group
        qkvz = self.in_proj_qkvz(x).view(T, c.key_heads, 2 * c.key_dim + 2 * r * c.value_dim)
        q, k, v, z = torch.split(qkvz, [c.key_dim, c.key_dim, r * c.value_dim, r * c.value_dim], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(T, c.key_heads, 2 * r), [r, r], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return mixed, z.reshape(T, c.value_heads, c.value_dim), b.reshape(T, -1), a.reshape(T, -1)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        c, T = self.cfg, x.shape[0]
        mixed, z, b, a = self._project(x)
        conv = ctx.conv(self.layer, mixed, self.conv1d.weight[:, 0])
        kd = c.key_heads * c.key_dim
        q, k, v = torch.split(conv, [kd, kd, c.value_heads * c.value_dim], dim=-1)
        q = l2norm(q.view(T, c.key_heads, c.key_dim))
        k = l2norm(k.view(T, c.key_heads, c.key_dim))
        v = v.reshape(T, c.value_heads, c.value_dim)
        if fused(a):  # inference on CUDA: one launch for both gates
            from hypic.ops.triton_gates import gdn_gates

            g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        else:
            beta = torch.sigmoid(b.float())
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

        o = ctx.linear(self.layer, "gdn", linear_run("gdn", q, k, v, g=g, beta=beta), None)  # [T, HV, V]
        o = self.norm(o, z).reshape(T, -1)
        return self.out_proj(o)
