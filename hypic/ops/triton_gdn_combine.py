"""The combine pass of a GDN layer in one Triton launch (CUDA): no dense transition per recompute run.

The general path (``engine.combine.CombineContext.linear``) runs the recompute runs twice: once from
zero with an identity block appended to the state, which yields each run's transition ``T`` [K, K]
(≈ 0.6 GB of state in and out per layer for a call of 8 trace requests at the 9B shape), then the
affine scan over runs and cached bodies gives every run's incoming state, then the runs again from
those states for their outputs. Measured on the H200 (docs/benchmarks.md, "Where a warm call's time
goes"): half of a warm call's device time.

Here one program per (value block, value head, request) walks the request's items in position
order with its state's ``BV`` columns in registers: a cached body applies its summary
(``x ← T·x + S``, split-precision dots — ``kernels.combine_precision`` —, T and S read in place
through a table of pointers — no stacking), a recompute run steps the gated delta rule token by
token from the state it finds, writing each token's output. The state after the request's last
run is its decode state. The runs' own summaries are never formed, so this path serves only
passes that build no entries from their runs (no in-context segments).

Launch shape (``scripts/gdn_combine_bench.py``, H200, a trace-shaped call of 8 at the 9B heads, 24
layers): the first version held the state key-major in 8 warps with value blocks of 32 — 75.9 ms,
its whole T tile in registers leaving one program per SM. Value-major in 2 warps, value blocks of
32, T in K-chunks: 44.0 ms. The bodies' T·x dominates what is left (runs alone: 13.9 ms). Chunks of
16 rather than 32 cut the register spills (tf32x3: 110 → 12; bf16x3: 24 → 0): 43.8 → 34.1 ms
with tf32x3. The kernel is latency-bound (12.5% occupancy, limited by registers; ncu, session 18).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hypic.ops.transfer import to_device

BODY, RUN = 1, 0  # item kinds in the schedule


@triton.jit
def _gdn_combine_kernel(Q, Kx, Vx, G, B, TP, SP, ITEMS, CU, O, XF, scale, sq, sk, sv,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, BJ: tl.constexpr, PRECISION: tl.constexpr):
    # The state held value-major, x[v, k] = state[k, v]: both reductions of a token step run along
    # k, inside one warp (no shared-memory round trip per token), and the state is BV × K registers,
    # so many programs fit on an SM. A body's T·x is a dot in K-chunks of BJ through the program's
    # slice of XF (its final-state output, free until the end), so T never sits whole in registers.
    i_v, i_hv, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)  # the key head this value head reads
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_j = tl.arange(0, BJ)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_v[:, None] & m_k[None, :]
    x = tl.zeros([BV, BK], dtype=tl.float32)
    xf = XF + (i_c.to(tl.int64) * HV + i_hv) * K * V  # this program's scratch: x[v, k] at xf + k·V + v
    start, end = tl.load(CU + i_c), tl.load(CU + i_c + 1)
    for j in range(start, end):
        kind = tl.load(ITEMS + 3 * j)
        a = tl.load(ITEMS + 3 * j + 1).to(tl.int64)
        b = tl.load(ITEMS + 3 * j + 2).to(tl.int64)
        if kind == 1:  # a cached body: x ← x·Tᵀ + Sᵀ
            t_ptr = tl.load(TP + a).to(tl.pointer_type(tl.float32)) + i_hv * K * K
            s_ptr = tl.load(SP + a).to(tl.pointer_type(tl.float32)) + i_hv * K * V
            tl.debug_barrier()
            tl.store(xf + o_k[None, :] * V + o_v[:, None], x, mask=m_s)
            tl.debug_barrier()
            acc = tl.load(s_ptr + o_k[None, :] * V + o_v[:, None], mask=m_s, other=0.0)
            for jc in range(0, BK, BJ):
                m_j = (jc + o_j) < K
                b_x = tl.load(xf + (jc + o_j)[None, :] * V + o_v[:, None], mask=m_v[:, None] & m_j[None, :],
                              other=0.0)  # x[:, jc : jc + BJ]
                b_t = tl.load(t_ptr + o_k[None, :] * K + (jc + o_j)[:, None], mask=m_j[:, None] & m_k[None, :],
                              other=0.0)  # Tᵀ[jc : jc + BJ, :]
                acc += tl.dot(b_x, b_t, input_precision=PRECISION)
            x = acc
        else:  # recompute rows a … b − 1, token by token from x
            for t in range(a, b):
                b_q = tl.load(Q + t * sq + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_k = tl.load(Kx + t * sk + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_v = tl.load(Vx + t * sv + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
                b_g = tl.load(G + t * HV + i_hv).to(tl.float32)
                b_b = tl.load(B + t * HV + i_hv).to(tl.float32)
                x = x * tl.exp(b_g)
                kx = tl.sum(x * b_k[None, :], axis=1)  # (xᵀ k)[v]
                x = x + b_b * (b_v - kx)[:, None] * b_k[None, :]
                o = tl.sum(x * b_q[None, :], axis=1) * scale
                tl.store(O + (t * HV + i_hv) * V + o_v, o.to(O.dtype.element_ty), mask=m_v)
    tl.debug_barrier()
    tl.store(xf + o_k[None, :] * V + o_v[:, None], x, mask=m_s)


def schedule(requests: list[list[tuple[int, int, int]]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Per request its items in position order, each ``(RUN, first row, end row)`` or ``(BODY,
    index into the body tables, 0)`` → (items [n, 3] int32, offsets [requests + 1] int32) on
    ``device``: built once per pass, the same for every layer."""
    flat = [x for items in requests for item in items for x in item]
    cu = [0]
    for items in requests:
        cu.append(cu[-1] + len(items))
    # cu starts on a 16-byte boundary whatever the item count: Triton compiles a kernel anew for a
    # pointer argument that is not 16-byte aligned, so an unaligned cu cost a compile (≈ 0.7 s on the
    # H200) in the middle of some request, after the server's warm-up had compiled the aligned case
    pad = -len(flat) % 4
    both = to_device(flat + [0] * pad + cu, device, dtype=torch.int32)
    return both[:len(flat)].view(-1, 3), both[len(flat) + pad:]


def gdn_combine(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                transitions: Tensor, states: Tensor, items: Tensor, cu: Tensor,
                precision: str = "tf32x3", block_v: int = 32, warps: int = 2, body_chunk: int = 16,
                **launch: int) -> tuple[Tensor, Tensor]:
    """q, k [R, H, K], v [R, HV, V] (rows may be strided, heads and dims packed), g, beta [R, HV];
    ``transitions``/``states``: the bodies' address tables (``triton_chain.addresses``); ``items``/``cu``: the
    schedule. → outputs [R, HV, V] in v's dtype, and each request's state after its last run
    [requests, HV, K, V] fp32. ``body_chunk``: the K-chunk of a body's T·x (a power of two ≥ 16);
    ``launch``: Triton launch options to try (``num_stages``, ``maxnreg``)."""
    R, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
            raise ValueError(f"gdn_combine: {name}'s heads and dims must be packed within a row")
    C = cu.shape[0] - 1
    out = torch.empty(R, HV, V, dtype=v.dtype, device=v.device)
    final = torch.empty(C, HV, K, V, dtype=torch.float32, device=v.device)  # every program writes its slice
    BK = max(16, triton.next_power_of_2(K))
    _gdn_combine_kernel[(triton.cdiv(V, block_v), HV, C)](
        q, k, v, g.float().contiguous(), beta.float().contiguous(), transitions, states, items, cu, out, final, scale,
        q.stride(0), k.stride(0), v.stride(0), H=H, HV=HV, K=K, V=V, BK=BK, BV=block_v, BJ=body_chunk,
        PRECISION=precision, num_warps=warps, **launch)
    return out, final
