"""The affine chain with a gradient: ``X_0 = 0, X_{i+1} = A_i·X_i + S_i`` for training.

Training's chunked linear attention carries the state across chunks with this chain. Its
backward is the same chain run in reverse with transposed matrices —
``G_n = dX_n, G_i = dX_i + A_iᵀ·G_{i+1}`` — after which ``dS_i = G_{i+1}`` and
``dA_i = G_{i+1}·X_iᵀ`` (one batched matmul). So forward and backward are one launch each of the
scan kernel on CUDA (``triton_chain``), where a Hillis–Steele scan issued ≈ 30 host ops per
doubling level and layer (a training step is host-bound: docs/training.md); elsewhere a loop.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hypic.ops.kernels import kernel_device
from hypic.ops.scan import chain_loop


def _chain(A: Tensor, S: Tensor) -> Tensor:
    """A [n, M, K, K], S [n, M, K, V] (fp32) → X [n + 1, M, K, V] with X_0 = 0."""
    if kernel_device(S.device) and len(S) and S.dtype == torch.float32:  # fp64 references keep the loop
        from hypic.ops.triton_chain import matrix_chain

        return matrix_chain(A, S)
    return chain_loop("matrix", A, S)


class _Chain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A: Tensor, S: Tensor) -> Tensor:
        X = _chain(A, S)
        ctx.save_for_backward(A, X)
        return X

    @staticmethod
    def backward(ctx, dX: Tensor) -> tuple[Tensor, Tensor]:
        A, X = ctx.saved_tensors
        # reversed: element 0 brings G_n = dX_n (its transition meets X_0 = 0), element j + 1 is
        # (A_{n−1−j}ᵀ, dX_{n−1−j}); output j + 1 is then G_{n−j}
        At = A.flip(0).transpose(-1, -2)
        out = _chain(torch.cat([torch.zeros_like(At[:1]), At]), dX.flip(0).contiguous())
        G = out[1:].flip(0)  # G_0 … G_n
        return G[1:] @ X[:-1].transpose(-1, -2), G[1:]


def affine_chain(A: Tensor, S: Tensor) -> Tensor:
    """``X_0 = 0, X_{i+1} = A_i·X_i + S_i``: A [n, M, K, K], S [n, M, K, V] fp32 → X [n + 1, M, K, V],
    differentiable in A and S."""
    K = S.shape[-2] if S.dim() == 4 else -1
    if A.dim() != 4 or S.dim() != 4 or A.shape[:2] != S.shape[:2] or A.shape[-2:] != (K, K):
        raise ValueError(f"affine_chain: expected A [n, M, K, K] and S [n, M, K, V], got {list(A.shape)}, "
                         f"{list(S.shape)}")
    return _Chain.apply(A.contiguous(), S.contiguous())
