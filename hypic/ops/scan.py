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


def prefix_states(family: str, transitions: Tensor | None, states: Tensor, *, naive: bool = False) -> Tensor:
    """transitions: None | Σg [n, H] | Σg [n, H, K] | T [n, H, K, K]; states [n, H, K, V] → [n + 1, H, K, V]."""
    fam = get_family(family)
    n = states.shape[0]
    if fam.transition == "matrix" and not naive and kernel_device(states.device) and n > 1:
        from hypic.ops.triton_chain import matrix_chain

        return matrix_chain(transitions, states)
    return chain_loop(fam.transition, transitions, states, naive)


def prefix_states_many(family: str, transitions: Tensor | None, states: Tensor, cu: list[int], *,
                       naive: bool = False, cu_device: Tensor | None = None) -> Tensor:
    """Many chains packed end to end (items ``cu[c] ≤ i < cu[c + 1]`` form chain c): every chain's
    prefix states, packed the same way — [n + C, H, K, V], chain c's at rows cu[c] + c … cu[c + 1] + c.
    On the GPU one launch walks them all side by side (``cu_device``: ``cu`` already on the device)."""
    fam = get_family(family)
    if fam.transition == "matrix" and not naive and kernel_device(states.device) and states.shape[0] > 0:
        from hypic.ops.triton_chain import matrix_chains

        if cu_device is None:
            cu_device = to_device(cu, states.device)
        return matrix_chains(transitions, states, cu_device)
    return chains_loop(fam.transition, transitions, states, cu, naive)


def chains_loop(transition: str, transitions: Tensor | None, states: Tensor, cu: list[int],
                naive: bool = False) -> Tensor:
    """``prefix_states_many`` chain by chain (the CPU path and the reference)."""
    return torch.cat([chain_loop(transition, None if transitions is None else transitions[a:b], states[a:b], naive)
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
