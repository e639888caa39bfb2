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


def combine_precision() -> str:
    """The fused GDN combine's dots (a body's ``T·x``), Triton's split-precision modes: ``tf32x3`` (three
    TF32 passes, ≈ fp32; the default), ``bf16x3`` (three bf16 passes, ≈ 16-bit mantissa) or ``bf16x6``.
    With the kernel's K-chunks of 16 bf16x3 is only 1.04× faster (docs/benchmarks.md, session 18), so
    the default keeps the closer one. ``HYPIC_COMBINE_PRECISION``, read at each call; Triton's
    interpreter has no bf16 split modes."""
    value = os.environ.get("HYPIC_COMBINE_PRECISION") or "tf32x3"
    if value not in ("tf32x3", "bf16x3", "bf16x6"):
        raise ValueError(f"HYPIC_COMBINE_PRECISION: expected tf32x3, bf16x3 or bf16x6, got {value!r}")
    return value


def kernel_device(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
            and os.environ.get("HYPIC_INTERPRET_KERNELS") == "1")
