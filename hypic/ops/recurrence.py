"""The linear-state algebra: a span of tokens acts on a layer's state as an affine map.

``S_out = T·S_in + S``: ``T`` is the product of the span's transitions ``A_t`` and ``S`` is the
state the span builds from zero. Composition ``(T2, S2)∘(T1, S1) = (T2·T1, T2·S1 + S2)`` is a
monoid, so cached segments combine exactly in constant time per segment. ``run`` is the
token-by-token reference every kernel is tested against (it computes in the input dtype, so fp64
inputs give an fp64 reference).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from hypic.ops.family import Family, check_inputs, check_state, expand_heads, get_family
from hypic.ops.rope import RopeSpec, rotate_key_axis


class RunOutput(NamedTuple):
    o: Tensor  # [L, HV, V]
    final_state: Tensor  # [HV, K, V]


class Summary(NamedTuple):
    """The affine map of a span. Leading batch dims are allowed on both fields.

    transition: None (linear), Σg [.., H] (scalar), Σg [.., H, K] (gla), or T [.., H, K, K].
    state: S(span | S_in = 0), [.., H, K, V].
    """

    transition: Tensor | None
    state: Tensor


def transition_step(family: Family, x: Tensor, k: Tensor, g: Tensor | None, beta: Tensor | None,
                    a: Tensor | None, b: Tensor | None) -> Tensor:
    """``A_t·x`` for one token, x: [..., H, K, N] (a state or a running transition). Inputs per token,
    with the same leading dimensions (a decode step: one token of each of N sequences)."""
    if family.gate == "head":
        decay = g.exp()[..., None, None]  # [..., H, 1, 1]
    elif family.gate == "key":
        decay = g.exp()[..., None]  # [..., H, K, 1]
    else:
        decay = None
    if family.lowrank:  # (Diag(e^g) + b aᵀ)·x
        return decay * x + b[..., None] * torch.einsum("...hk,...hkn->...hn", a, x)[..., None, :]
    if decay is not None:
        x = decay * x
    if family.beta:  # (I − β k kᵀ)·x, applied after the decay (gdn, kda)
        x = x - (beta[..., None, None] * k[..., None]) * torch.einsum("...hk,...hkn->...hn", k, x)[..., None, :]
    return x


def _token(t: int, x: Tensor | None) -> Tensor | None:
    return None if x is None else x[t]


def run(family: str, q: Tensor, k: Tensor, v: Tensor, *, g: Tensor | None = None, beta: Tensor | None = None,
        a: Tensor | None = None, b: Tensor | None = None, initial_state: Tensor | None = None,
        scale: float | None = None) -> RunOutput:
    """Token-by-token reference: ``S_t = A_t·S_{t-1} + w_t·k_t·v_tᵀ``, ``o_t = scale·S_tᵀq_t``."""
    fam = get_family(family)
    dims = check_inputs(fam, q, k, v, g, beta, a, b)
    check_state("initial_state", initial_state, dims, k.dtype)
    q, k = expand_heads(q, dims.value_heads), expand_heads(k, dims.value_heads)
    scale = dims.key_dim**-0.5 if scale is None else scale
    S = k.new_zeros(dims.value_heads, dims.key_dim, dims.value_dim) if initial_state is None else initial_state.clone()
    outs = []
    for t in range(dims.length):
        S = transition_step(fam, S, k[t], _token(t, g), _token(t, beta), _token(t, a), _token(t, b))
        write = v[t] if not fam.beta else beta[t][:, None] * v[t]  # [H, V]
        S = S + k[t][:, :, None] * write[:, None, :]
        outs.append(scale * torch.einsum("hkv,hk->hv", S, q[t]))
    o = torch.stack(outs) if outs else v.new_zeros(0, dims.value_heads, dims.value_dim)
    return RunOutput(o, S)


def summarize(family: str, k: Tensor, v: Tensor, *, g: Tensor | None = None, beta: Tensor | None = None,
              a: Tensor | None = None, b: Tensor | None = None) -> Summary:
    """The span's ``(T, S)`` by the reference loop; T in the cheapest exact form of the family."""
    fam = get_family(family)
    dims = check_inputs(fam, None, k, v, g, beta, a, b)
    S = run(fam.name, k, k, v, g=g, beta=beta, a=a, b=b).final_state  # q is irrelevant to the state
    if fam.transition == "none":
        return Summary(None, S)
    if fam.transition in ("scalar", "diagonal"):
        return Summary(g.sum(0), S)
    kx = expand_heads(k, dims.value_heads)
    T = torch.eye(dims.key_dim, dtype=k.dtype, device=k.device).expand(dims.value_heads, -1, -1).clone()
    for t in range(dims.length):
        T = transition_step(fam, T, kx[t], _token(t, g), _token(t, beta), _token(t, a), _token(t, b))
    return Summary(T, S)


def _check_summary(fam: Family, s: Summary, name: str) -> None:
    if not isinstance(s, Summary):
        raise ValueError(f"{name}: expected a Summary, got {type(s).__name__}")
    S, T = s.state, s.transition
    if not isinstance(S, Tensor) or S.dim() < 3:
        raise ValueError(f"{name}.state: expected a tensor [.., H, K, V], got {getattr(S, 'shape', None)}")
    lead, (H, K, _) = S.shape[:-3], S.shape[-3:]
    want = {"none": None, "scalar": (*lead, H), "diagonal": (*lead, H, K), "matrix": (*lead, H, K, K)}[fam.transition]
    if want is None:
        if T is not None:
            raise ValueError(f"{name}.transition: family {fam.name!r} stores no transition; got a tensor")
        return
    if not isinstance(T, Tensor) or tuple(T.shape) != want:
        raise ValueError(f"{name}.transition: family {fam.name!r} expects shape {list(want)}, "
                         f"got {getattr(T, 'shape', None)}")


def _apply_transition(fam: Family, T: Tensor | None, x: Tensor) -> Tensor:
    """T·x for x [.., H, K, N]."""
    if fam.transition == "none":
        return x
    if fam.transition == "scalar":
        return T.exp()[..., None, None] * x
    if fam.transition == "diagonal":
        return T.exp()[..., None] * x
    return T @ x


def apply(family: str, summary: Summary, S_in: Tensor) -> Tensor:
    """``S_out = T·S_in + S``."""
    fam = get_family(family)
    _check_summary(fam, summary, "summary")
    if not isinstance(S_in, Tensor) or S_in.shape[-3:] != summary.state.shape[-3:]:
        raise ValueError(f"S_in: expected [.., H, K, V] = {list(summary.state.shape[-3:])}, "
                         f"got {getattr(S_in, 'shape', None)}")
    if S_in.dtype != summary.state.dtype:
        raise ValueError(f"S_in: dtype {S_in.dtype} does not match the summary's {summary.state.dtype}")
    return _apply_transition(fam, summary.transition, S_in) + summary.state


def compose(family: str, first: Summary, second: Summary) -> Summary:
    """The summary of ``first`` followed by ``second``: ``(T2·T1, T2·S1 + S2)``."""
    fam = get_family(family)
    _check_summary(fam, first, "first")
    _check_summary(fam, second, "second")
    state = apply(fam.name, second, first.state)
    if fam.transition == "none":
        return Summary(None, state)
    if fam.transition in ("scalar", "diagonal"):
        return Summary(first.transition + second.transition, state)
    return Summary(second.transition @ first.transition, state)


def identity(family: str, heads: int, key_dim: int, value_dim: int, *, dtype: torch.dtype = torch.float32,
             device: torch.device | str | None = None) -> Summary:
    """The empty span: ``(I, 0)``."""
    fam = get_family(family)
    state = torch.zeros(heads, key_dim, value_dim, dtype=dtype, device=device)
    T = {
        "none": None,
        "scalar": torch.zeros(heads, dtype=dtype, device=device),
        "diagonal": torch.zeros(heads, key_dim, dtype=dtype, device=device),
        "matrix": torch.eye(key_dim, dtype=dtype, device=device).expand(heads, -1, -1).clone(),
    }[fam.transition]
    return Summary(T, state)


ROTATION_EXACT = ("linear", "scalar", "deltanet", "gdn")


def rerotate(family: str, summary: Summary, delta: int, rope: RopeSpec) -> Summary:
    """Move a span whose keys carry RoPE by ``delta`` positions: ``S ← R(δ)·S``, ``T ← R(δ)·T·R(δ)ᵀ``.

    Exact when every ``A_t`` commutes with the rotation after conjugation, i.e. the decay is the same
    on both channels of a rotated pair: linear, scalar, deltanet and gdn. A per-channel decay (gla,
    kda, dplr) does not commute with R, so those families are refused.
    """
    fam = get_family(family)
    if fam.name not in ROTATION_EXACT:
        raise ValueError(f"family: rerotate is exact only for {ROTATION_EXACT}, not {fam.name!r} "
                         "(a per-channel decay does not commute with the rotation)")
    _check_summary(fam, summary, "summary")
    state = rotate_key_axis(summary.state, delta, rope, dim=-2)
    T = summary.transition
    if fam.transition == "matrix":  # R·T·Rᵀ: rotate rows, then columns
        T = rotate_key_axis(rotate_key_axis(T, delta, rope, dim=-2), delta, rope, dim=-1)
    return Summary(T, state)
