"""Chunked linear attention in plain PyTorch: the CPU backend of ``hypic.ops.linear``.

Sequences are packed varlen (``cu_seqlens``) and padded to whole chunks; padding tokens carry
``k = v = g = β = a = b = 0``, whose transition is the identity, so they change nothing. Chunk j
of every sequence is processed together: intra-chunk terms in closed form (a unit-triangular
solve for the delta rule and DPLR), the state carried across chunks. With ``output_summary`` the
state is widened to ``[S_in | I]`` and the values to ``[v | 0]``: every value column evolves on
its own, so the extra K columns come out as the span's ``T`` in the same pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from hypic.ops.family import Family, expand_heads


class ChunkResult(NamedTuple):
    o: Tensor  # [T, HV, V] in the input dtype
    final_state: Tensor  # [N, HV, K, V(+K with transition)] fp32 (fp64 for fp64 inputs)


class _Packing(NamedTuple):
    seq: Tensor  # [T] sequence of each token
    chunk: Tensor  # [T] chunk of each token within its sequence
    pos: Tensor  # [T] position within the chunk
    num_seqs: int
    num_chunks: int


def _packing(cu_seqlens: Tensor, total: int, chunk_size: int) -> _Packing:
    cu = cu_seqlens.to(torch.long).cpu()
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    offset = torch.arange(total) - cu[:-1][seq]
    num_chunks = max(1, int((lengths.max() + chunk_size - 1) // chunk_size) if len(lengths) else 1)
    return _Packing(seq, offset // chunk_size, offset % chunk_size, len(lengths), num_chunks)


def _pad(x: Tensor, p: _Packing, chunk_size: int) -> Tensor:
    """[T, H, ...] packed → [NC, N, H, C, ...] zero-padded, head-major inside a chunk."""
    out = x.new_zeros(p.num_seqs, p.num_chunks, chunk_size, *x.shape[1:])
    dev = x.device
    out[p.seq.to(dev), p.chunk.to(dev), p.pos.to(dev)] = x
    return out.transpose(2, 3).transpose(0, 1)


def _unpad(x: Tensor, p: _Packing) -> Tensor:
    """[NC, N, H, C, V] → [T, H, V]."""
    x = x.transpose(0, 1).transpose(2, 3)  # [N, NC, C, H, V]
    dev = x.device
    return x[p.seq.to(dev), p.chunk.to(dev), p.pos.to(dev)]


def _pair(x: Tensor, y: Tensor, gx: Tensor | None, gy: Tensor | None, strict: bool) -> Tensor:
    """P[t, j] = Σ_k x_t,k · y_j,k · exp(gx_t,k − gy_j,k) for j < t (strict) or j ≤ t. [N, H, C, C]."""
    C = x.shape[-2]
    mask = torch.ones(C, C, dtype=torch.bool, device=x.device).tril(-1 if strict else 0)
    if gx is None:
        return (x @ y.transpose(-1, -2)) * mask
    if gx.shape[-1] == 1:  # one decay per head
        diff = gx - gy.transpose(-1, -2)  # [N, H, C, C]
        return (x @ y.transpose(-1, -2)) * diff.masked_fill(~mask, float("-inf")).exp()
    diff = gx[..., :, None, :] - gy[..., None, :, :]  # [N, H, C, C, K]
    decay = diff.masked_fill(~mask[..., None], float("-inf")).exp()
    return torch.einsum("nhtk,nhjk,nhtjk->nhtj", x, y, decay)


def chunk_linear_attention(fam: Family, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None,
                           a: Tensor | None, b: Tensor | None, cu_seqlens: Tensor, initial_state: Tensor | None,
                           scale: float, with_transition: bool, chunk_size: int = 64) -> ChunkResult:
    """Inputs packed ``[T, H(V), ...]``; initial_state ``[N, HV, K, V]``. See module docstring."""
    ct = torch.float64 if k.dtype == torch.float64 else torch.float32
    HV, K, V = v.shape[1], k.shape[2], v.shape[2]
    p = _packing(cu_seqlens, k.shape[0], chunk_size)
    C, dev = chunk_size, k.device

    def pad(x: Tensor | None) -> Tensor | None:
        return None if x is None else _pad(x.to(ct), p, C)

    qp, kp = pad(expand_heads(q, HV)), pad(expand_heads(k, HV))
    vp, betap, ap, bp = pad(v), pad(beta), pad(a), pad(b)
    gp = pad(g if g is None or g.dim() == 3 else g[..., None])  # [NC, N, HV, C, 1 or K]
    S = torch.zeros(p.num_seqs, HV, K, V, dtype=ct, device=dev) if initial_state is None else initial_state.to(ct)
    if with_transition:  # [S_in | I], [v | 0]
        eye = torch.eye(K, dtype=ct, device=dev).expand(p.num_seqs, HV, K, K)
        S = torch.cat([S, eye], dim=-1)
        vp = torch.cat([vp, vp.new_zeros(*vp.shape[:-1], K)], dim=-1)
    outs = []
    for j in range(p.num_chunks):
        qj, kj, vj = qp[j], kp[j], vp[j]
        G = None if gp is None else gp[j].cumsum(-2)  # [N, HV, C, 1 or K]
        head = 1.0 if G is None else G.exp()  # Γ_t: decay from the chunk start through t
        tail = 1.0 if G is None else (G[..., -1:, :] - G).exp()  # decay from after t to the chunk end
        qh = qj * head
        if fam.lowrank:
            gx = G - gp[j]  # exclusive: decay through t−1, what a_tᵀ·S_{t−1} sees
            rhs = (ap[j] * gx.exp()) @ S + _pair(ap[j], kj, gx, G, True) @ vj
            eye_c = torch.eye(C, dtype=ct, device=dev)
            w = torch.linalg.solve_triangular(eye_c - _pair(ap[j], bp[j], gx, G, True), rhs, upper=False,
                                              unitriangular=True)
            o = qh @ S + _pair(qj, bp[j], G, G, False) @ w + _pair(qj, kj, G, G, False) @ vj
            write_k, write_v = torch.cat([bp[j], kj], dim=-2), torch.cat([w, vj], dim=-2)
            tail = tail if G is None else torch.cat([tail, tail], dim=-2)
        else:
            if fam.beta:  # (I + L)·U = β·(v − (Γk)·S_0), L[t, j] = β_t k_tᵀ(Γ_t/Γ_j)k_j
                bt = betap[j][..., None]
                eye_c = torch.eye(C, dtype=ct, device=dev)
                lower = _pair(kj * bt, kj, G, G, True)
                u = torch.linalg.solve_triangular(eye_c + lower, bt * (vj - (kj * head) @ S), upper=False,
                                                  unitriangular=True)
            else:
                u = vj
            o = qh @ S + _pair(qj, kj, G, G, False) @ u
            write_k, write_v = kj, u
        outs.append(scale * o)
        if G is not None:
            S = S * G[..., -1, :].exp()[..., :, None]  # Γ_C on the key axis
        S = S + (write_k * tail).transpose(-1, -2) @ write_v
    o = _unpad(torch.stack(outs)[..., :V], p).to(v.dtype)
    return ChunkResult(o, S)
