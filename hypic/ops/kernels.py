"""Where hypic's Triton kernels (its own and flash-linear-attention's) run.

On CUDA, always. On CPU, only under Triton's interpreter and only when asked
(``TRITON_INTERPRET=1 HYPIC_INTERPRET_KERNELS=1``): then every kernel-choosing site takes its GPU
branch with CPU tensors, so the GPU code path — kernels, launch glue, layouts — can be tested end
to end without a GPU (``tests/ops/test_triton_interpret.py``). Read at each call: tests switch it.
"""

from __future__ import annotations

import os

import torch

# GDN runs of up to this many tokens take fla's recurrent kernel (``linear_fla.gdn_short_runs``);
# 0 sends every run through the chunked kernels (an A/B switch: ``hypic bench ttft --ab``).
RECURRENT_MAX = int(os.environ.get("HYPIC_RECURRENT_MAX", "64"))


def fused_combine() -> bool:
    """A GDN layer's combine pass in one kernel (``ops.triton_gdn_combine``) where it applies.
    On by default (H200, warm trace calls of 8: 224 → 146 ms; docs/benchmarks.md); ``HYPIC_FUSED_COMBINE=0``
    turns it off for an A/B. Read at each call."""
    return os.environ.get("HYPIC_FUSED_COMBINE", "1") == "1"


def combine_precision(device: torch.device) -> str:
    """The fused GDN combine's dots (a body's ``T·x``), Triton's split-precision modes: ``bf16x3`` (three
    bf16 tensor-core passes, ≈ 16-bit mantissa; the default on a GPU: 1.22–1.29× the kernel of tf32x3,
    2.8e-6 relative from it, docs/benchmarks.md), ``tf32x3`` (≈ fp32; the default in Triton's
    interpreter, which has no bf16 split modes) or ``bf16x6``. ``HYPIC_COMBINE_PRECISION``, read at each
    call, overrides the default."""
    value = os.environ.get("HYPIC_COMBINE_PRECISION") or ("bf16x3" if device.type == "cuda" else "tf32x3")
    if value not in ("tf32x3", "bf16x3", "bf16x6"):
        raise ValueError(f"HYPIC_COMBINE_PRECISION: expected tf32x3, bf16x3 or bf16x6, got {value!r}")
    return value


def kernel_device(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
            and os.environ.get("HYPIC_INTERPRET_KERNELS") == "1")
