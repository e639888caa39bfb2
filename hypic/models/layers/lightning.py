"""Lightning attention mixers: Ring-linear's (``BailingMoeLinearV2``) and MiniMax-Text-01 / M1's.

A scalar-decay linear attention: ``S_t = γ_h·S_{t−1} + k_t v_tᵀ``, ``o_t = d^-½·S_tᵀ q_t`` with a fixed
per-head decay ``γ_h = exp(−slope_h·layer_factor)`` (ALiBi slopes; no data-dependent gate, no conv, no
β). q and k are RMS-normed per head and then partially roped *before* they enter the state, so the
state carries positions: the layer hands its ``RopeSpec`` to the context, which is what lets a cached
state be re-rotated to new positions (the scalar decay commutes with the rotation). The output is
RMS-normed in ``group_norm_size`` groups over all heads, gated by ``sigmoid(g_proj(x))`` and projected.
Linear layers are multi-head: ``num_key_value_heads`` applies to the full-attention layers only.

MiniMax's layer (``MiniMaxLightningAttention``) is the same recurrence with less around it: SiLU on
the fused projection, no q/k norms, no RoPE (its state is position-free), no ``d^-½`` scale, one
RMSNorm over all heads, and its own layer factor in the decay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hypic.models.context import ForwardContext, RopeSpec, linear_run
from hypic.models.layers.norm import RMSNorm, rms


@dataclass(frozen=True)
class LightningConfig:
    hidden: int
    heads: int
    head_dim: int
    rope: RopeSpec  # inside the linear layer: the state carries position phase
    eps: float
    norm_groups: int  # group_norm_size: RMSNorm groups over the heads·head_dim output
    layers: int  # num_hidden_layers: the decay depends on depth


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi base slopes ``2^(−8(h+1)/H)``; a head count that is not a power of two takes the slopes
    of the power below and every other slope of the power above (as ALiBi does)."""
    if math.log2(heads).is_integer():
        return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]
    below = 2 ** math.floor(math.log2(heads))
    return alibi_slopes(below) + alibi_slopes(2 * below)[0::2][: heads - below]


def layer_decay(heads: int, layer: int, layers: int) -> list[float]:
    """Per-head natural-log decay ``g_h = −slope_h · (1 − (l − 1)/(L − 1) + 1e−5)`` of layer l (0-based).

    Ports disagree on the layer factor: the HF remote code (``modeling_bailing_moe_linear_v2.py``, as
    quoted by the sgl-jax and Megatron ports that match it) uses the unclamped ``l − 1`` with a
    0-based l, so layer 0 gets ``1 + 1/(L − 1)``; mlx-lm clamps ``max(0, l − 1)`` and SGLang's lightning
    backend uses ``l``. We follow the HF remote code: it ships with the checkpoints, and a training
    port reported its loss recovering only after switching to it.
    """
    factor = 1.0 - (layer - 1) / max(layers - 1, 1) + 1e-5
    return [-s * factor for s in alibi_slopes(heads)]


def minimax_layer_decay(heads: int, layer: int, layers: int, *, geometric: bool = True) -> list[float]:
    """MiniMax's per-head decay ``g_h = −slope_h · (1 − l/(L − 1 + 1e−5) + 1e−5)`` of layer l (0-based),
    as transformers' ``MiniMaxLightningAttention`` and the remote code build it: l, not l − 1, so the
    first layer decays by the bare slope and the last by almost nothing. The slopes agree for a power
    of two heads (the checkpoints' 64); otherwise transformers keeps the geometric ``2^(−8(h+1)/H)``
    (``geometric``) and the remote code ALiBi's interleaving (``alibi_slopes``)."""
    factor = 1.0 - layer / (layers - 1 + 1e-5) + 1e-5
    slopes = [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)] if geometric else alibi_slopes(heads)
    return [-s * factor for s in slopes]


class GroupRMSNorm(nn.Module):
    """RMSNorm over ``groups`` contiguous channel groups of the flattened heads, one weight per channel."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__()
        if dim % groups:
            raise ValueError(f"group_norm_size: {groups} does not divide the {dim} output channels")
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        grouped = rms(x.view(*x.shape[:-1], self.groups, -1), self.eps)  # [T, G, dim / G] fp32
        return (grouped.view(x.shape) * self.weight.float()).to(x.dtype)


class ScalarDecayMixer(nn.Module):
    """A mixer whose linear layer decays by a fixed per-head ``decay`` (natural log per token)."""

    def __init__(self, decay: list[float]) -> None:
        super().__init__()
        self.decay = decay
        # A plain list, not a buffer: the loader builds on the meta device and to_empty() would leave
        # a buffer uninitialised; the tensor is made once per device on first use.
        self._decay_tensor: Tensor | None = None

    def _decay_on(self, device: torch.device) -> Tensor:
        if self._decay_tensor is None or self._decay_tensor.device != device:
            self._decay_tensor = torch.tensor(self.decay, dtype=torch.float32, device=device)  # [H]
        return self._decay_tensor

    def gates(self, tokens: int, device: torch.device) -> Tensor:
        """g [T, H]: every token decays the state by the same per-head factor."""
        return self._decay_on(device).expand(tokens, len(self.decay)).contiguous()


class LightningAttention(ScalarDecayMixer):
    def __init__(self, cfg: LightningConfig, layer: int) -> None:
        super().__init__(layer_decay(cfg.heads, layer, cfg.layers))
        self.cfg, self.layer = cfg, layer
        inner = cfg.heads * cfg.head_dim
        self.query_key_value = nn.Linear(cfg.hidden, 3 * inner, bias=False)
        self.query_layernorm = RMSNorm(cfg.head_dim, cfg.eps)
        self.key_layernorm = RMSNorm(cfg.head_dim, cfg.eps)
        self.g_proj = nn.Linear(cfg.hidden, inner, bias=False)
        self.g_norm = GroupRMSNorm(inner, cfg.norm_groups, cfg.eps)
        self.dense = nn.Linear(inner, cfg.hidden, bias=False)
        self.rope = cfg.rope

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        c, T = self.cfg, x.shape[0]
        qkv = self.query_key_value(x).view(T, 3 * c.heads, c.head_dim)
        q, k, v = torch.split(qkv, c.heads, dim=1)  # each [T, H, d]
        q = self.rope(self.query_layernorm(q), ctx.positions)
        k = self.rope(self.key_layernorm(k), ctx.positions)
        run = linear_run("scalar", q, k, v, g=self.gates(T, x.device), scale=c.head_dim**-0.5)
        o = ctx.linear(self.layer, "scalar", run, self.rope).reshape(T, -1)  # [T, H·d]
        o = self.g_norm(o) * torch.sigmoid(self.g_proj(x))
        return self.dense(o)


class MiniMaxLightningAttention(ScalarDecayMixer):
    """``q, k, v = SiLU(qkv_proj(x))``, laid out per head as ``[q | k | v]``; ``S_t = γ_h·S_{t−1} + k_t
    v_tᵀ``, ``o_t = S_tᵀ q_t`` (unscaled); ``out_proj(sigmoid(output_gate(x)) ⊙ RMSNorm(o))``."""

    NORM_EPS = 1e-6  # the output norm's: transformers and the remote code leave it at the default

    def __init__(self, hidden: int, heads: int, head_dim: int, layer: int, layers: int, *,
                 geometric: bool = True) -> None:
        super().__init__(minimax_layer_decay(heads, layer, layers, geometric=geometric))
        self.heads, self.head_dim, self.layer = heads, head_dim, layer
        inner = heads * head_dim
        self.qkv_proj = nn.Linear(hidden, 3 * inner, bias=False)
        self.output_gate = nn.Linear(hidden, inner, bias=False)
        self.norm = GroupRMSNorm(inner, 1, self.NORM_EPS)
        self.out_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        T = x.shape[0]
        qkv = F.silu(self.qkv_proj(x)).view(T, self.heads, 3 * self.head_dim)
        q, k, v = (t.contiguous() for t in qkv.split(self.head_dim, dim=-1))  # each [T, H, d]
        run = linear_run("scalar", q, k, v, g=self.gates(T, x.device), scale=1.0)
        o = ctx.linear(self.layer, "scalar", run, None).reshape(T, -1)  # no RoPE: a position-free state
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * self.norm(o))
