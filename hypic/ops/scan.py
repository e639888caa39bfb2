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


def prefix_states(family: str, transitions: Tensor | None, states: Tensor, *, naive: bool = False) -> Tensor:
    """transitions: None | Σg [n, H] | Σg [n, H, K] | T [n, H, K, K]; states [n, H, K, V] → [n + 1, H, K, V]."""
    fam = get_family(family)
    n = states.shape[0]
    if fam.transition == "matrix" and not naive and kernel_device(states.device) and n > 1:
        from hypic.ops.triton_chain import matrix_chain

        return matrix_chain(transitions, states)
    return chain_loop(fam.transition, transitions, states, naive)


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
