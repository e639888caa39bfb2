"""Triton kernel for the affine scan of matrix-transition families (CUDA).

One program owns one head, a block of value columns and one chain, and walks the chain: the running
state ``[K, BV]`` stays in registers, each step reads ``T_i`` and ``S_i`` once. Many chains of
different lengths go in one launch (a combine pass's requests: one launch per layer, the chains side
by side on the device — a lone chain fills ``H × V/BV`` programs, 128 for the 9B shape's 32 heads,
of the H200's 132 SMs), and the kernel reads every item where it lies through tables of addresses
(``addresses``), so nothing is stacked. The dot products use three-pass TF32 (``tf32x3``), close to
fp32: T is kept in fp32 precisely so composition adds no error (a bf16 T costs ~4e-3 relative).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hypic.ops.transfer import to_device


# The head count is a runtime value: training runs the kernel over [chunks, sequences × heads],
# which changes with every batch (one binary for all).
@triton.jit(do_not_specialize=["H"])
def _chains_kernel(TP, SP, X, CU, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Chain c holds items CU[c] ≤ i < CU[c+1], item i's T and S [H, K, ·] (fp32, packed) at the
    addresses TP[i] and SP[i]; its prefix states are rows CU[c] + c … CU[c+1] + c of X."""
    i_v, i_h, i_c = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    start, end = tl.load(CU + i_c).to(tl.int64), tl.load(CU + i_c + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    x = tl.zeros([BK, BV], dtype=tl.float32)
    tl.store(X + (((start + i_c) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :], x, mask=m_s)
    for i in range(start, end):
        t_ptr = tl.load(TP + i).to(tl.pointer_type(tl.float32))
        s_ptr = tl.load(SP + i).to(tl.pointer_type(tl.float32))
        b_t = tl.load(t_ptr + (i_h * K + o_k[:, None]) * K + o_k[None, :], mask=m_k[:, None] & m_k[None, :], other=0.0)
        b_s = tl.load(s_ptr + (i_h * K + o_k[:, None]) * V + o_v[None, :], mask=m_s, other=0.0)
        x = tl.dot(b_t, x, input_precision=PRECISION) + b_s
        tl.store(X + (((i + i_c + 1) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :], x, mask=m_s)


def addresses(parts: list[tuple[Tensor, int | None]], device: torch.device) -> tuple[Tensor, list[Tensor]]:
    """Device addresses of chain items, each ``(tensor, i)`` — row i of a stacked tensor — or
    ``(tensor, None)`` — the whole tensor — as one int64 table, and the tensors that hold them: fp32
    and packed, copied once when not (keep them until the kernel has run). The kernel reads the
    items where they lie: nothing is stacked (a call of 8 trace requests stacked ≈ 0.6 GB a layer)."""
    ready: dict[int, Tensor] = {}

    def usable(t: Tensor) -> Tensor:
        if id(t) not in ready:
            ready[id(t)] = (t if t.dtype == torch.float32 and t.is_contiguous() and t.device == device
                            else t.to(device, torch.float32).contiguous())
        return ready[id(t)]

    table = []
    for t, i in parts:
        u = usable(t)
        table.append(u.data_ptr() if i is None else u.data_ptr() + i * u.stride(0) * u.element_size())
    return to_device(table, device, dtype=torch.int64), list(ready.values())


def matrix_chains_at(transitions: Tensor, states: Tensor, cu: Tensor, heads: int, key_dim: int, value_dim: int,
                     precision: str = "tf32x3") -> Tensor:
    """Chains packed end to end, items given by address (``addresses``: T [H, K, K] and S [H, K, V]
    each), ``cu`` [C + 1] item offsets (int, on the device) → prefix states [n + C, H, K, V], chain
    c's at rows cu[c] + c … cu[c + 1] + c (its zero start first)."""
    n, H, K, V = transitions.shape[0], heads, key_dim, value_dim
    C = cu.shape[0] - 1
    out = torch.empty(n + C, H, K, V, dtype=torch.float32, device=cu.device)
    BK = max(16, triton.next_power_of_2(K))
    BV = 32 if BK > 64 else 64
    grid = (triton.cdiv(V, BV), H, C)
    _chains_kernel[grid](transitions, states, out, cu, H=H, K=K, V=V, BK=BK, BV=BV, PRECISION=precision,
                         num_warps=8 if BK > 64 else 4)
    return out


def matrix_chain(transitions: Tensor, states: Tensor, precision: str = "tf32x3") -> Tensor:
    """One chain of stacked items: transitions [n, H, K, K], states [n, H, K, V] → prefix states
    [n + 1, H, K, V] (training's hand-off across chunks, ``chain_grad``)."""
    n, H, K, V = states.shape
    T, held_t = addresses([(transitions, i) for i in range(n)], states.device)
    S, held_s = addresses([(states, i) for i in range(n)], states.device)
    return matrix_chains_at(T, S, to_device([0, n], states.device), H, K, V, precision)
