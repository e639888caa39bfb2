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
    """Each chunk's map from its entering state S. Batch dims [NC, N, H] lead every field."""

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


def _sequential(loc: _Local, S: Tensor, V: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """States chunk by chunk; S may be widened ([S_in | I]): extra columns see no values, and their
    outputs (returned third) are each output's map from the initial state."""
    extra = S.shape[-1] - V
    outs, maps = [], []
    for j in range(loc.q_eff.shape[0]):
        o = loc.q_eff[j] @ S
        outs.append(o[..., :V] + loc.o0[j])
        if extra:
            maps.append(o[..., V:])
        b = loc.b[j] if not extra else torch.cat([loc.b[j], loc.b.new_zeros(*loc.b.shape[1:-1], extra)], dim=-1)
        S = _apply_a(loc, j, S) + b
    return torch.stack(outs), S, torch.stack(maps) if extra else None


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
    groups = [] if parallel else _by_chunks(lengths.tolist(), chunk_size)
    if len(groups) > 1:
        return _grouped(groups, fam, q, k, v, g, beta, a, b, cu_seqlens, initial_state, scale, with_transition,
                        chunk_size, input_map)
    return _chunked(fam, q, k, v, g, beta, a, b, cu_seqlens, lengths, initial_state, scale, with_transition,
                    chunk_size, parallel, input_map)


WASTE = 1.5  # padded token slots per token past which a call's sequences are split by their chunk counts


def _by_chunks(lengths: list[int], chunk_size: int) -> list[list[int]]:
    """The sequences grouped by how many chunks each spans — only when padding every sequence to the
    longest would leave more than ``WASTE`` slots per token (a cold prefill's 8-token seams beside
    its 250-token bodies: 2.9 slots a token, the call 3× one sequence's cost on a CPU); else []."""
    if len(lengths) < 2:
        return []
    spans = [max(1, -(-n // chunk_size)) for n in lengths]
    if max(spans) * chunk_size * len(lengths) <= WASTE * max(1, sum(lengths)):
        return []
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(spans):
        groups.setdefault(n, []).append(i)
    return list(groups.values())


def _grouped(groups: list[list[int]], fam: Family, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None,
             beta: Tensor | None, a: Tensor | None, b: Tensor | None, cu_seqlens: Tensor, initial_state: Tensor | None,
             scale: float, with_transition: bool, chunk_size: int, input_map: bool) -> ChunkResult:
    """One chunked pass per group of sequences (``_by_chunks``), each padded to its own longest; the
    outputs, states and transitions put back in the call's order. Every sequence is independent, so
    the results are the ungrouped call's."""
    cu = cu_seqlens.cpu().tolist()
    o = final = T = maps = None
    for members in groups:
        rows = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in members]).to(k.device)
        sub_lengths = torch.tensor([cu[i + 1] - cu[i] for i in members])
        sub_cu = torch.cat([sub_lengths.new_zeros(1), sub_lengths.cumsum(0)]).to(cu_seqlens.device)

        def pick(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.index_select(0, rows)

        init = None if initial_state is None else initial_state[members]
        part = _chunked(fam, pick(q), pick(k), pick(v), pick(g), pick(beta), pick(a), pick(b), sub_cu, sub_lengths,
                        init, scale, with_transition, chunk_size, False, input_map)
        if o is None:  # allocated once the first part says the dtypes
            o = part.o.new_empty(v.shape[0], *part.o.shape[1:])
            final = part.final_state.new_empty(len(cu) - 1, *part.final_state.shape[1:])
            T = None if part.transition is None else part.transition.new_empty(len(cu) - 1, *part.transition.shape[1:])
            maps = None if part.input_map is None else part.input_map.new_empty(v.shape[0], *part.input_map.shape[1:])
        at = torch.tensor(members, device=part.final_state.device)
        o.index_copy_(0, rows, part.o)
        final.index_copy_(0, at, part.final_state)
        if T is not None:
            T.index_copy_(0, at, part.transition)
        if maps is not None:
            maps.index_copy_(0, rows, part.input_map)
    assert o is not None and final is not None
    return ChunkResult(o, final, T, maps)


def _chunked(fam: Family, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None,
             a: Tensor | None, b: Tensor | None, cu_seqlens: Tensor, lengths: Tensor, initial_state: Tensor | None,
             scale: float, with_transition: bool, chunk_size: int, parallel: bool,
             input_map: bool = False) -> ChunkResult:
    ct = torch.float64 if k.dtype == torch.float64 else torch.float32
    HV, K, V = v.shape[1], k.shape[2], v.shape[2]
    longest = int(lengths.max()) if len(lengths) else 1
    # Short runs (seams, decode steps) would be mostly padding in a 64-token chunk.
    chunk_size = min(chunk_size, max(16, 1 << (longest - 1).bit_length()))
    p = _packing(cu_seqlens, chunk_size, k.device)

    def pad(x: Tensor | None) -> Tensor | None:
        return None if x is None else _pad(x.to(ct), p, chunk_size)

    gp = pad(g if g is None or g.dim() == 3 else g[..., None])  # [NC, N, HV, C, 1 or K]
    loc = _local(fam, pad(expand_heads(q, HV)), pad(expand_heads(k, HV)), pad(v), gp, pad(beta), pad(a), pad(b))
    loc = loc._replace(q_eff=loc.q_eff * scale, o0=loc.o0 * scale)
    S = torch.zeros(p.num_seqs, HV, K, V, dtype=ct, device=k.device) if initial_state is None else initial_state.to(ct)
    out_dtype = ct if input_map else v.dtype
    if parallel:
        o, final, T, maps = _scan(loc, S, with_transition)
    else:
        if with_transition:  # [S_in | I]: the extra columns come out as T
            S = torch.cat([S, torch.eye(K, dtype=ct, device=k.device).expand(p.num_seqs, HV, K, K)], dim=-1)
        o, final, maps = _sequential(loc, S, V)
        final, T = final[..., :V], final[..., V:] if with_transition else None
    return ChunkResult(_unpad(o, p).to(out_dtype), final, T, _unpad(maps, p) if input_map else None)
