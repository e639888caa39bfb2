"""Chunked linear attention in plain PyTorch: the CPU backend of ``hypic.ops.linear`` and the
differentiable path that trains the bundled model.

Sequences are packed varlen (``cu_seqlens``) and padded to whole chunks; padding tokens carry
``k = v = g = β = a = b = 0``, whose transition is the identity, so they change nothing. Every
chunk is first solved on its own, all chunks at once: given the state ``S`` entering it, its
outputs are ``o = Q̃·S + O₀`` and its exit state is ``A·S + B`` with
``A·S = Γ ⊙ S + K̃ᵀ(W̃·S)`` (a decay plus a rank-C correction from the delta rule / DPLR solve).
The states entering the chunks then follow either

- sequentially (inference: two small matmuls per chunk; with ``with_transition`` the state is
  widened to ``[S_in | I]`` so the extra columns come out as the span's ``T``), or
- by a parallel prefix scan over the chunks' affine maps (training: ``log₂`` steps of batched
  matmuls instead of a Python loop per chunk; ``T`` is the scan's total ``A``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from hypic.ops.chain_grad import affine_chain
from hypic.ops.family import Family, expand_heads
from hypic.ops.transfer import device_cache, to_device


class ChunkResult(NamedTuple):
    o: Tensor  # [T, HV, V] in the input dtype (fp32 or fp64 with ``input_map``: rounded once restarted)
    final_state: Tensor  # [N, HV, K, V] fp32 (fp64 for fp64 inputs)
    transition: Tensor | None  # [N, HV, K, K] when asked for
    input_map: Tensor | None = None  # [T, HV, K] when asked for: o_t moves by input_map_t · ΔS_in


class _Packing(NamedTuple):
    seq: Tensor  # [T] sequence of each token
    chunk: Tensor  # [T] chunk of each token within its sequence
    pos: Tensor  # [T] position within the chunk
    num_seqs: int
    num_chunks: int


class _Local(NamedTuple):
    """Each chunk's map from its entering state S. Batch dims lead every field: [NC, N, H] (the scan's
    padded layout) or [R, H] (``_Flat`` rows)."""

    q_eff: Tensor  # [.., C, K]: o = q_eff·S + o0
    o0: Tensor  # [.., C, V]
    decay: Tensor | None  # [.., K, 1]: Γ over the chunk (None: no decay)
    k_eff: Tensor | None  # [.., C', K]: A·S = Γ⊙S + k_effᵀ(w_eff·S)
    w_eff: Tensor | None  # [.., C', K]
    b: Tensor  # [.., K, V]: the exit state from S = 0


def _packing(cu_seqlens: Tensor, chunk_size: int, device: torch.device) -> _Packing:
    return _packing_for(tuple(cu_seqlens.tolist()), chunk_size, device)


@device_cache(maxsize=16)
def _packing_for(cu_key: tuple[int, ...], chunk_size: int, device: torch.device) -> _Packing:
    """Index tensors already on ``device``, made once per layout: every layer of a forward (and its
    backward) shares them, and a host→device copy from pageable memory would stall the host."""
    cu = torch.tensor(cu_key, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    offset = torch.arange(cu_key[-1]) - cu[:-1][seq]
    num_chunks = max(1, int((lengths.max() + chunk_size - 1) // chunk_size) if len(lengths) else 1)
    idx = to_device(torch.stack([seq, offset // chunk_size, offset % chunk_size]), device)
    return _Packing(idx[0], idx[1], idx[2], len(lengths), num_chunks)


def _pad(x: Tensor, p: _Packing, chunk_size: int) -> Tensor:
    """[T, H, ...] packed → [NC, N, H, C, ...] zero-padded, head-major inside a chunk."""
    out = x.new_zeros(p.num_seqs, p.num_chunks, chunk_size, *x.shape[1:])
    out[p.seq, p.chunk, p.pos] = x
    return out.transpose(2, 3).transpose(0, 1)


def _unpad(x: Tensor, p: _Packing) -> Tensor:
    """[NC, N, H, C, V] → [T, H, V]."""
    x = x.transpose(0, 1).transpose(2, 3)  # [N, NC, C, H, V]
    return x[p.seq, p.chunk, p.pos]


class _Flat(NamedTuple):
    """The sequential path's layout: every sequence's chunks as rows of one batch, chunk-major —
    step c's rows are chunk c of the sequences that reach it, which (sequences sorted by how many
    chunks they span, most first) are the first ``active[c]`` of the sorted batch. No sequence is
    padded past its own last chunk, and one call serves sequences of any mix of lengths."""

    row: Tensor  # [T] each token's row
    pos: Tensor  # [T] its position in the chunk
    order: Tensor  # [N] the sequences, most chunks first (stable)
    back: Tensor  # [N] where each sequence went in ``order``
    active: tuple[int, ...]  # per chunk step, the sequences still running
    num_rows: int


def _flat(cu_seqlens: Tensor, chunk_size: int, device: torch.device) -> _Flat:
    return _flat_for(tuple(cu_seqlens.tolist()), chunk_size, device)


@device_cache(maxsize=16)
def _flat_for(cu_key: tuple[int, ...], chunk_size: int, device: torch.device) -> _Flat:
    lengths = [b - a for a, b in zip(cu_key, cu_key[1:], strict=False)]
    spans = [max(1, -(-n // chunk_size)) for n in lengths]  # an empty sequence: one chunk of padding (identity)
    order = sorted(range(len(lengths)), key=lambda i: -spans[i])
    rank = [0] * len(lengths)
    for r, i in enumerate(order):
        rank[i] = r
    active = tuple(sum(1 for n in spans if n > c) for c in range(max(spans, default=1)))
    start = [0]
    for n in active:
        start.append(start[-1] + n)
    cu = torch.tensor(cu_key, dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    offset = torch.arange(cu_key[-1]) - cu[:-1][seq]
    chunk = offset // chunk_size
    row = torch.tensor(start, dtype=torch.long)[chunk] + torch.tensor(rank, dtype=torch.long)[seq]
    idx = to_device(torch.stack([row, offset % chunk_size]), device)
    return _Flat(idx[0], idx[1], to_device(torch.tensor(order, dtype=torch.long), device),
                 to_device(torch.tensor(rank, dtype=torch.long), device), active, start[-1])


def _pad_flat(x: Tensor, f: _Flat, chunk_size: int) -> Tensor:
    """[T, H, ...] packed → [R, H, C, ...] zero-padded rows (``_Flat``)."""
    out = x.new_zeros(f.num_rows, chunk_size, *x.shape[1:])
    out[f.row, f.pos] = x
    return out.transpose(1, 2)


def _pair(x: Tensor, y: Tensor, gx: Tensor | None, gy: Tensor | None, strict: bool) -> Tensor:
    """P[t, j] = Σ_k x_t,k · y_j,k · exp(gx_t,k − gy_j,k) for j < t (strict) or j ≤ t. [.., C, C]."""
    C = x.shape[-2]
    mask = torch.ones(C, C, dtype=torch.bool, device=x.device).tril(-1 if strict else 0)
    if gx is None:
        return (x @ y.transpose(-1, -2)) * mask
    if gx.shape[-1] == 1:  # one decay per head
        diff = gx - gy.transpose(-1, -2)  # [.., C, C]
        return (x @ y.transpose(-1, -2)) * diff.masked_fill(~mask, float("-inf")).exp()
    diff = gx[..., :, None, :] - gy[..., None, :, :]  # [.., C, C, K]
    decay = diff.masked_fill(~mask[..., None], float("-inf")).exp()
    return torch.einsum("...tk,...jk,...tjk->...tj", x, y, decay)


def _solve(lower: Tensor, rhs: Tensor, sign: float) -> Tensor:
    """(I + sign·lower)⁻¹·rhs for a strictly lower-triangular ``lower``."""
    eye = torch.eye(lower.shape[-1], dtype=lower.dtype, device=lower.device)
    return torch.linalg.solve_triangular(eye + sign * lower, rhs, upper=False, unitriangular=True)


def _local(fam: Family, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None, a: Tensor | None,
           b: Tensor | None) -> _Local:
    G = None if g is None else g.cumsum(-2)  # [.., C, 1 or K]
    head = 1.0 if G is None else G.exp()  # Γ_t: decay from the chunk start through t
    tail = 1.0 if G is None else (G[..., -1:, :] - G).exp()  # decay from after t to the chunk end
    decay = None if G is None else G[..., -1, :].exp()[..., :, None].expand(*G.shape[:-2], k.shape[-1], 1)
    qh = q * head
    if fam.lowrank:  # w = W0 + Wm·S with (I − Lab)·w = (aΓx)·S + Lak·v
        gx = G - g  # exclusive: decay through t−1, what a_tᵀ·S_{t−1} sees
        rhs = torch.cat([_pair(a, k, gx, G, True) @ v, a * gx.exp()], dim=-1)
        w = _solve(_pair(a, b, gx, G, True), rhs, -1.0)
        w0, wm = w[..., : v.shape[-1]], w[..., v.shape[-1]:]
        pqb = _pair(q, b, G, G, False)
        return _Local(qh + pqb @ wm, pqb @ w0 + _pair(q, k, G, G, False) @ v, decay, b * tail, wm,
                      (b * tail).transpose(-1, -2) @ w0 + (k * tail).transpose(-1, -2) @ v)
    aqk = _pair(q, k, G, G, False)
    if not fam.beta:
        return _Local(qh, aqk @ v, decay, None, None, (k * tail).transpose(-1, -2) @ v)
    bt = beta[..., None]  # (I + L)·U = β·(v − (Γk)·S), L[t, j] = β_t k_tᵀ(Γ_t/Γ_j)k_j: U = U0 − Wm·S
    sol = _solve(_pair(k * bt, k, G, G, True), torch.cat([bt * v, bt * k * head], dim=-1), 1.0)
    u0, wm = sol[..., : v.shape[-1]], sol[..., v.shape[-1]:]
    kt = k * tail
    return _Local(qh - aqk @ wm, aqk @ u0, decay, kt, -wm, kt.transpose(-1, -2) @ u0)


def _apply_a(loc: _Local, j: int | slice, S: Tensor) -> Tensor:
    out = S if loc.decay is None else loc.decay[j] * S
    if loc.k_eff is not None:
        out = out + loc.k_eff[j].transpose(-1, -2) @ (loc.w_eff[j] @ S)
    return out


def _sequential(loc: _Local, S: Tensor, V: int, active: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor | None]:
    """States chunk by chunk over ``_Flat`` rows (step c: the first ``active[c]`` sequences of S);
    S may be widened ([S_in | I]): extra columns see no values, and their outputs (returned third)
    are each output's map from the initial state."""
    extra = S.shape[-1] - V
    outs, maps = [], []
    r = 0
    for n in active:
        rows, r = slice(r, r + n), r + n
        now = S[:n]
        o = loc.q_eff[rows] @ now
        outs.append(o[..., :V] + loc.o0[rows])
        if extra:
            maps.append(o[..., V:])
        b = loc.b[rows] if not extra else torch.cat([loc.b[rows], loc.b.new_zeros(*loc.b[rows].shape[:-1], extra)],
                                                    dim=-1)
        now = _apply_a(loc, rows, now) + b
        S = now if n == S.shape[0] else torch.cat([now, S[n:]])  # the finished ones keep their final states
    return torch.cat(outs), S, torch.cat(maps) if extra else None


def _scan(loc: _Local, S_in: Tensor, with_transition: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The state entering every chunk by the differentiable affine chain over chunks (one kernel
    launch forward and one backward on CUDA): returns outputs, final state, the total transition
    and the outputs' map from the initial state (the last two from the same chain, values ``[b | 0]``
    from ``[S_in | I]``)."""
    NC, K, V = loc.b.shape[0], loc.b.shape[-2], loc.b.shape[-1]
    batch = loc.b.shape[1:-2]  # [N, H]
    eye = torch.eye(K, dtype=loc.b.dtype, device=loc.b.device)
    A = eye if loc.decay is None else loc.decay * eye
    A = A.expand(*loc.b.shape[:-2], K, K)
    if loc.k_eff is not None:
        A = A + loc.k_eff.transpose(-1, -2) @ loc.w_eff
    B, first = loc.b, S_in
    if with_transition:
        B = torch.cat([B, B.new_zeros(*B.shape[:-1], K)], dim=-1)
        first = torch.cat([S_in, eye.expand(*S_in.shape[:-1], K)], dim=-1)
    # element 0 brings S_in (its transition meets X_0 = 0), element c + 1 is chunk c
    M = first[None].new_zeros(1, *batch, K, K)
    X = affine_chain(torch.cat([M, A]).flatten(1, len(batch)), torch.cat([first[None], B]).flatten(1, len(batch)))
    X = X.unflatten(1, batch)  # X[c + 1]: the state entering chunk c; X[NC + 1]: the final state
    o = loc.q_eff @ X[1:NC + 1]
    final = X[NC + 1]
    if not with_transition:
        return o + loc.o0, final, None, None
    return o[..., :V] + loc.o0, final[..., :V], final[..., V:], o[..., V:]


def chunk_linear_attention(fam: Family, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None,
                           a: Tensor | None, b: Tensor | None, cu_seqlens: Tensor, initial_state: Tensor | None,
                           scale: float, with_transition: bool, chunk_size: int = 64,
                           parallel: bool | None = None, input_map: bool = False) -> ChunkResult:
    """Inputs packed ``[T, H(V), ...]``; initial_state ``[N, HV, K, V]``. ``parallel`` (default:
    whenever autograd records) propagates states by the prefix scan. ``input_map`` (implies
    ``with_transition``): also each output's map from its sequence's initial state, ``[T, HV, K]``
    (``o_t`` moves by ``input_map_t · ΔS_in``), and ``o`` left in fp32 (fp64) to be rounded once
    after the move (``hypic.ops.linear.restart``)."""
    with_transition = with_transition or input_map
    if parallel is None:
        parallel = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, a, b))
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).cpu()
    return _chunked(fam, q, k, v, g, beta, a, b, cu_seqlens, lengths, initial_state, scale, with_transition,
                    chunk_size, parallel, input_map)


def _chunked(fam: Family, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None,
             a: Tensor | None, b: Tensor | None, cu_seqlens: Tensor, lengths: Tensor, initial_state: Tensor | None,
             scale: float, with_transition: bool, chunk_size: int, parallel: bool,
             input_map: bool = False) -> ChunkResult:
    ct = torch.float64 if k.dtype == torch.float64 else torch.float32
    HV, K, V = v.shape[1], k.shape[2], v.shape[2]
    longest = int(lengths.max()) if len(lengths) else 1
    # Short runs (seams, decode steps) would be mostly padding in a 64-token chunk.
    chunk_size = min(chunk_size, max(16, 1 << (longest - 1).bit_length()))
    # the scan runs over padded [NC, N] chunks; the loop over flat rows, no sequence padded past its end
    p = _packing(cu_seqlens, chunk_size, k.device) if parallel else _flat(cu_seqlens, chunk_size, k.device)

    def pad(x: Tensor | None) -> Tensor | None:
        if x is None:
            return None
        return _pad(x.to(ct), p, chunk_size) if parallel else _pad_flat(x.to(ct), p, chunk_size)

    gp = pad(g if g is None or g.dim() == 3 else g[..., None])  # [NC, N, HV, C, 1 or K] / [R, HV, C, 1 or K]
    loc = _local(fam, pad(expand_heads(q, HV)), pad(expand_heads(k, HV)), pad(v), gp, pad(beta), pad(a), pad(b))
    loc = loc._replace(q_eff=loc.q_eff * scale, o0=loc.o0 * scale)
    N = len(lengths)
    S = torch.zeros(N, HV, K, V, dtype=ct, device=k.device) if initial_state is None else initial_state.to(ct)
    out_dtype = ct if input_map else v.dtype
    if parallel:
        o, final, T, maps = _scan(loc, S, with_transition)
        return ChunkResult(_unpad(o, p).to(out_dtype), final, T, _unpad(maps, p) if input_map else None)
    S = S.index_select(0, p.order)
    if with_transition:  # [S_in | I]: the extra columns come out as T
        S = torch.cat([S, torch.eye(K, dtype=ct, device=k.device).expand(N, HV, K, K)], dim=-1)
    o, final, maps = _sequential(loc, S, V, p.active)
    final = final.index_select(0, p.back)  # back in the call's order
    final, T = final[..., :V], final[..., V:] if with_transition else None

    def unpad(x: Tensor) -> Tensor:  # [R, HV, C, V] → [T, HV, V]
        return x.transpose(1, 2)[p.row, p.pos]

    return ChunkResult(unpad(o).to(out_dtype), final, T, unpad(maps) if input_map else None)
