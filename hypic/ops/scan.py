"""The affine scan: the state entering every item of a chain of spans.

Given summaries ``(T_i, S_i)`` of consecutive spans, ``X_0 = 0`` and ``X_{i+1} = T_i·X_i + S_i``
(``X_i + S_i`` for the naive sum). The combine pass needs every ``X_i``: the state each recompute
run starts from. The chain is sequential but tiny per step, so on the GPU one Triton program per
(head, value block) walks it with the state in registers (``triton_chain``) instead of one launch
per span; elsewhere a plain loop.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hypic.ops.family import get_family
from hypic.ops.kernels import kernel_device
from hypic.ops.transfer import to_device

Item = tuple[Tensor, int | None]  # a chain item's tensor: row i of a stacked tensor, or (None) the whole tensor


def rows(stacked: Tensor | None) -> list[Item] | None:
    """Every row of a stacked tensor as chain items."""
    return None if stacked is None else [(stacked, i) for i in range(stacked.shape[0])]


def prefix_states(family: str, transitions: Tensor | None, states: Tensor, *, naive: bool = False) -> Tensor:
    """transitions: None | Σg [n, H] | Σg [n, H, K] | T [n, H, K, K]; states [n, H, K, V] → [n + 1, H, K, V]."""
    n = states.shape[0]
    if n == 0:
        return states.new_zeros(1, *states.shape[1:])
    return prefix_states_many(family, rows(transitions), rows(states), [0, n], naive=naive)


def prefix_states_many(family: str, transitions: list[Item] | None, states: list[Item], cu: list[int], *,
                       naive: bool = False, cu_device: Tensor | None = None) -> Tensor:
    """Many chains packed end to end (items ``cu[c] ≤ i < cu[c + 1]`` form chain c; ``transitions``
    None for families without one): every chain's prefix states, packed the same way —
    [n + C, H, K, V], chain c's at rows cu[c] + c … cu[c + 1] + c. On the GPU, with matrix
    transitions, one launch walks every chain side by side and reads each item where it lies
    (``triton_chain``: nothing stacked); elsewhere the items are stacked and each chain looped
    (``cu_device``: ``cu`` already on the device)."""
    fam = get_family(family)
    device = states[0][0].device
    if fam.transition == "matrix" and not naive and kernel_device(device):
        from hypic.ops.triton_chain import addresses, matrix_chains_at

        T, held_t = addresses(transitions, device)
        S, held_s = addresses(states, device)
        X = matrix_chains_at(T, S, to_device(cu, device) if cu_device is None else cu_device,
                             *states[0][0].shape[-3:])
        del held_t, held_s  # queued on this stream: freed memory is reused only after the kernel
        return X
    return chains_loop(fam.transition, transitions, states, cu, naive)


def chains_loop(transition: str, transitions: list[Item] | None, states: list[Item], cu: list[int],
                naive: bool = False) -> Tensor:
    """``prefix_states_many`` chain by chain, on stacked items (the CPU path and the reference)."""
    S = torch.stack([t if i is None else t[i] for t, i in states])
    T = None if transitions is None else torch.stack([t if i is None else t[i] for t, i in transitions])
    return torch.cat([chain_loop(transition, None if T is None else T[a:b], S[a:b], naive)
                      for a, b in zip(cu[:-1], cu[1:], strict=True)])


def chain_loop(transition: str, transitions: Tensor | None, states: Tensor, naive: bool = False) -> Tensor:
    """The scan step by step (any device, differentiable): the CPU path and the reference."""
    n = states.shape[0]
    out = states.new_zeros(n + 1, *states.shape[1:])
    x = out[0]
    for i in range(n):
        if naive or transition == "none":
            x = x + states[i]
        elif transition == "scalar":
            x = transitions[i].exp()[:, None, None] * x + states[i]
        elif transition == "diagonal":
            x = transitions[i].exp()[:, :, None] * x + states[i]
        else:
            x = torch.baddbmm(states[i], transitions[i], x)
        out[i + 1] = x
    return out
