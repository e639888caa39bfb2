"""Triton RMS norms for inference on CUDA: plain ``w·x̂`` and gated ``w·x̂·act(z)``, one read and
one write per element, all arithmetic in fp32.

Why not flash-linear-attention's fused norms: for feature sizes ≤ 512 (head norms, the GDN output
norm, a small model's hidden norm) their kernels autotune on ``ceil(rows / 2048)``, so every new
row-count bucket — every new request length in a server, every batch of the quality runner — pays a
fresh autotune of several configurations (seconds each). These kernels take one fixed launch
configuration derived from the feature size alone: a tile of ``BT`` rows × ``BD`` columns of about
8k elements, so nothing is tuned at run time and any row count is served by the same binary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

GATES = {None: 0, "silu": 1, "sigmoid": 2}


@triton.jit(do_not_specialize=["rows"])  # one binary for every row count (no 1 / %16 variants)
def _rms_norm_kernel(X, W, Z, Y, rows, eps, w_offset, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                     GATE: tl.constexpr):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m = (o_t[:, None] < rows) & m_d[None, :]
    at = o_t[:, None].to(tl.int64) * D + o_d[None, :]
    x = tl.load(X + at, mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(W + o_d, mask=m_d, other=0.0).to(tl.float32) + w_offset
    y = x * r[:, None] * w[None, :]
    if GATE == 1:
        z = tl.load(Z + at, mask=m, other=0.0).to(tl.float32)
        y = y * z * tl.sigmoid(z)
    elif GATE == 2:
        z = tl.load(Z + at, mask=m, other=0.0).to(tl.float32)
        y = y * tl.sigmoid(z)
    tl.store(Y + at, y.to(Y.dtype.element_ty), mask=m)


def rms_norm(x: Tensor, weight: Tensor, eps: float, gate: Tensor | None = None,
             activation: str | None = None, *, weight_offset: float = 0.0) -> Tensor:
    """x [..., D] → same shape and dtype: ``(weight + weight_offset) · x / sqrt(mean(x²) + eps)``,
    times ``act(gate)`` when a gate is given (``activation`` "silu" or "sigmoid"). The offset is
    applied in the kernel (a zero-centred norm's ``1 + w``: no host op per call for it)."""
    if (gate is None) != (activation is None):
        raise ValueError("rms_norm: a gate needs an activation and an activation needs a gate")
    if activation not in GATES:
        raise ValueError(f"rms_norm: activation must be one of {[a for a in GATES if a]}, got {activation!r}")
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm: weight must have shape ({D},), got {tuple(weight.shape)}")
    x2 = x.reshape(-1, D).contiguous()
    z2 = gate.reshape(-1, D).contiguous() if gate is not None else x2
    y = torch.empty_like(x2)
    rows = x2.shape[0]
    if rows == 0:
        return y.view(x.shape)
    BD = triton.next_power_of_2(D)
    BT = max(1, min(64, 8192 // BD))
    warps = 8 if BD >= 2048 else 4
    _rms_norm_kernel[(triton.cdiv(rows, BT),)](x2, weight.contiguous(), z2, y, rows, eps, float(weight_offset),
                                              D=D, BD=BD, BT=BT, GATE=GATES[activation], num_warps=warps)
    return y.view(x.shape)
