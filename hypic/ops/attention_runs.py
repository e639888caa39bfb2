"""Attention of recompute runs over keys in position order, for many requests in one call (CUDA).

In the combine pass a request's keys are laid out in position order (recomputed rows and cached
bodies), and a query sees the keys at positions ≤ its own. A recompute run's rows are consecutive
positions, and consecutive keys, so a run sees exactly the prefix of its request's keys that ends
at its own last row, causally among its own rows: bottom-right causal attention over that prefix.
Flash attention's varlen kernel computes it for every run of every request in one launch: one
"sequence" per run, its queries the run's rows, its keys starting where its request's keys start
(``cu_keys``; runs of one request share it) and ``seqused_k`` long. No mask is made, key heads are
not widened for GQA, and the keys are read once per run block instead of through a bias per
request (the general path, ``ops.attention.attention`` with ``visible``).

On by default: H200, warm trace calls of 8 (``scripts/trace_costs.py --warm-profile``) 146 → 130 ms
over the general attention with the fused GDN combine on; ``HYPIC_COMBINE_FLASH=0`` for an A/B.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from hypic.ops.attention import flash_varlen_fits


def enabled() -> bool:
    """Read at each call: tests and A/Bs switch it."""
    return os.environ.get("HYPIC_COMBINE_FLASH", "1") == "1"


@dataclass(frozen=True)
class RunsPlan:
    """The runs of one pass, the same for every attention layer (device tensors made once)."""

    cu_rows: Tensor  # [runs + 1] int32: each run's rows in the packed queries
    cu_keys: Tensor  # [runs + 1] int32: where each run's request's keys start (the last: all keys)
    used: Tensor  # [runs] int32: keys each run sees (its request's keys up to its last row)
    max_rows: int
    max_keys: int


def supported(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return enabled() and flash_varlen_fits(q, k, v)


def runs_attention(q: Tensor, k: Tensor, v: Tensor, plan: RunsPlan, scale: float) -> Tensor:
    """q [rows, Hq, D] (runs in order), k/v [keys, Hkv, D] (requests' keys packed) → [rows, Hq, D]."""
    out = torch.ops.aten._flash_attention_forward(q, k, v, plan.cu_rows, plan.cu_keys, plan.max_rows, plan.max_keys,
                                                  0.0, True, False, scale=scale, seqused_k=plan.used)
    return out[0]
