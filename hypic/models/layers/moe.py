"""Mixture of experts with optional shared experts, and the routers the hybrid families use.

Tokens are sorted by expert and every expert runs one matmul over its rows (``torch._grouped_mm``
when the dtype allows, else one matmul per expert): no Python loop over tokens. Routers:

- ``softmax`` (Qwen3-Next, Qwen3.5-MoE): softmax over all experts, top-k, optional renormalisation;
  the shared expert is scaled by ``sigmoid(shared_expert_gate(x))``.
- ``sigmoid`` (Kimi-Linear, Ring-linear; DeepSeek-V3 style): sigmoid scores, a selection bias
  (``e_score_correction_bias``) and group-limited top-k choose the experts; the unbiased scores,
  optionally renormalised, times ``routed_scaling_factor`` weight them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hypic.models.layers.fp8 import ALIGN, FP8, grouped_fp8, quantize_rows
from hypic.models.layers.mlp import SwiGLU

_MIXTRAL_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_MIXTRAL_NAME = re.compile(r"\.experts\.(\d+)\.(w[123])\.")


def mixtral_names(name: str) -> str:
    """Mixtral-style checkpoint names (the block ``block_sparse_moe``, experts' ``w1`` gate, ``w3`` up,
    ``w2`` down: Kimi-Linear, MiniMax) → this module's."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _MIXTRAL_NAME.sub(lambda m: f".experts.{m[1]}.{_MIXTRAL_EXPERT[m[2]]}.", name)


@dataclass(frozen=True)
class MoEConfig:
    hidden: int
    experts: int
    top_k: int
    intermediate: int
    router: Literal["softmax", "sigmoid"]
    renormalize: bool = True
    shared_intermediate: int = 0  # 0: no shared expert
    shared_gate: bool = False  # Qwen: sigmoid-gated shared expert
    scaling: float = 1.0  # routed_scaling_factor
    groups: int = 1  # n_group
    top_groups: int = 1  # topk_group
    selection_bias: bool = False  # e_score_correction_bias
    dropped_group_score: float = 0.0  # what unchosen groups' experts score: 0 (DeepSeek-V3), −inf (Bailing)


class Router(nn.Module):
    # kept in fp32 whatever the serving dtype (``HybridLM.cast``): expert choices are near ties often
    # enough that rounding the weights and the selection bias to bf16 changed them (transformers
    # keeps Kimi's in fp32; the checkpoints store the bias in fp32)
    KEEP_FP32 = ("weight", "e_score_correction_bias")

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.hidden))
        if cfg.selection_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(weights [T, k] fp32, experts [T, k])."""
        c = self.cfg
        logits = F.linear(x.float(), self.weight.float())
        if c.router == "softmax":
            probs = logits.softmax(-1)
            weights, experts = probs.topk(c.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float() if c.selection_bias else scores
            if c.groups > 1:
                grouped = choice.view(-1, c.groups, c.experts // c.groups)
                group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [T, groups]
                keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(c.top_groups, -1).indices, 1.0)
                choice = choice.masked_fill(~keep.bool().repeat_interleave(c.experts // c.groups, 1),
                                            c.dropped_group_score)
            experts = choice.topk(c.top_k, dim=-1).indices
            weights = scores.gather(1, experts)
        if c.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if c.router == "sigmoid" else 0.0))
        return weights * c.scaling, experts


class Experts(nn.Module):
    """Stacked expert weights ``[E, I, D]`` / ``[E, D, I]``; checkpoints' per-expert tensors load
    into their slice (``experts.{e}.gate_proj.weight`` → ``experts.gate_proj[e]``)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(cfg.experts, cfg.intermediate, cfg.hidden))
        self.up_proj = nn.Parameter(torch.empty(cfg.experts, cfg.intermediate, cfg.hidden))
        self.down_proj = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.intermediate))

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

    def quantizable(self) -> bool:
        """Whether the experts can be held in 8 bits: both matrix sizes multiples of 16, as the
        GPU's grouped fp8 GEMM needs (hypic.models.layers.fp8.ALIGN)."""
        experts, intermediate, hidden = self.gate_proj.shape
        return intermediate % ALIGN == 0 and hidden % ALIGN == 0

    def hold_in_fp8(self) -> None:
        """Each expert's weights as e4m3 with one fp32 scale per row (``<proj>_scale [E, rows]``,
        hypic.models.layers.fp8). On the meta device, before the weights are loaded."""
        for name in self.PROJECTIONS:
            w = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty(w.shape, dtype=FP8, device=w.device), requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(torch.empty(w.shape[:2], device=w.device), requires_grad=False))

    def forward(self, x: Tensor, rows: Tensor, counts: Tensor) -> Tensor:
        """``x``'s ``rows`` (a gather: rows sorted by expert, a token once per expert it chose)
        through their experts; counts [E] rows per expert."""
        if self.gate_proj.dtype == FP8:  # each token quantized once, before the k-fold gather
            q, t = quantize_rows(x)
            q, t = q[rows], t[rows]
            gate = grouped_fp8(q, t, self.gate_proj, self.gate_proj_scale, counts, x.dtype)
            up = grouped_fp8(q, t, self.up_proj, self.up_proj_scale, counts, x.dtype)
            h, s = quantize_rows(F.silu(gate) * up)
            return grouped_fp8(h, s, self.down_proj, self.down_proj_scale, counts, x.dtype)
        x = x[rows]
        if x.dtype in (torch.float32, torch.bfloat16) and hasattr(torch, "_grouped_mm") and (
                x.device.type == "cuda" or x.dtype == torch.float32):
            offs = counts.cumsum(0).to(torch.int32)
            gate = torch._grouped_mm(x, self.gate_proj.transpose(1, 2), offs=offs)
            up = torch._grouped_mm(x, self.up_proj.transpose(1, 2), offs=offs)
            return torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)
        out, start = torch.empty_like(x), 0
        for e, n in enumerate(counts.tolist()):
            if n:
                rows = slice(start, start + n)
                h = F.silu(x[rows] @ self.gate_proj[e].T) * (x[rows] @ self.up_proj[e].T)
                out[rows] = h @ self.down_proj[e].T
            start += n
        return out


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        if cfg.shared_intermediate:
            self.shared_expert = SwiGLU(cfg.hidden, cfg.shared_intermediate)
            if cfg.shared_gate:
                self.shared_expert_gate = nn.Linear(cfg.hidden, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        T, k = x.shape[0], self.cfg.top_k
        weights, experts = self.gate(x)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        # counts by scatter, not bincount: bincount sizes its output on the host (a device sync)
        counts = torch.zeros(self.cfg.experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        out = torch.empty(T * k, x.shape[1], dtype=x.dtype, device=x.device)
        out[order] = self.experts(x, order // k, counts)  # back to (token, choice) order
        y = (out.view(T, k, -1).float() * weights[..., None]).sum(1).to(x.dtype)  # no atomics: deterministic
        if self.cfg.shared_intermediate:
            shared = self.shared_expert(x)
            if self.cfg.shared_gate:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x))
            y = y + shared
        return y
