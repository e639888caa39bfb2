"""The linear-attention families hypic knows, and validation of their inputs.

Every family updates a per-head state ``S_t = A_t·S_{t-1} + k_t·u_tᵀ`` (K-first, ``S: [H, K, V]``).
What differs is the transition ``A_t`` (and so the cheapest exact form of a span's product ``T``)
and which gates a token carries. This module is the single table of those differences, so the
reference loop, the chunked kernels and the GPU path all agree on names, shapes and meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

TransitionForm = Literal["none", "scalar", "diagonal", "matrix"]


@dataclass(frozen=True)
class Family:
    name: str
    gate: Literal["none", "head", "key"]  # g: absent, [L, H], or [L, H, K] (natural-log decay)
    beta: bool  # delta rule: writes β·k·(v − Sᵀk) instead of k·vᵀ
    lowrank: bool  # DPLR: A_t carries an extra b·aᵀ term
    transition: TransitionForm  # how T is stored: nothing, Σg [H], Σg [H, K], or K×K per head


FAMILIES: dict[str, Family] = {
    "linear": Family("linear", "none", False, False, "none"),
    "scalar": Family("scalar", "head", False, False, "scalar"),
    "gla": Family("gla", "key", False, False, "diagonal"),
    "deltanet": Family("deltanet", "none", True, False, "matrix"),
    "gdn": Family("gdn", "head", True, False, "matrix"),
    "kda": Family("kda", "key", True, False, "matrix"),
    "dplr": Family("dplr", "key", False, True, "matrix"),
}


def get_family(family: str | Family) -> Family:
    if isinstance(family, Family):
        return family
    if not isinstance(family, str) or family not in FAMILIES:
        raise ValueError(f"family: unknown linear-attention family {family!r}; expected one of {sorted(FAMILIES)}")
    return FAMILIES[family]


def _check_tensor(name: str, x: object, shape: tuple[int | None, ...], dtype: torch.dtype | None) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    want = "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"
    if x.dim() != len(shape) or any(d is not None and d != s for d, s in zip(shape, x.shape, strict=False)):
        raise ValueError(f"{name}: expected shape {want}, got {list(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name}: dtype {x.dtype} does not match k's dtype {dtype}")
    return x


@dataclass(frozen=True)
class Dims:
    """Sizes of one call: L tokens, H q/k heads, HV value heads (HV % H == 0: grouped values), K, V."""

    length: int
    heads: int
    value_heads: int
    key_dim: int
    value_dim: int


def _gate_dtype(k: Tensor) -> torch.dtype | None:
    """Gates may be fp32 while q/k/v are bf16: models compute decays in fp32 (an exp of a bf16
    log-decay loses the precision the state needs)."""
    return k.dtype if k.dtype in (torch.float32, torch.float64) else None


def check_inputs(
    family: Family,
    q: Tensor | None,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    a: Tensor | None,
    b: Tensor | None,
) -> Dims:
    """Validate token inputs of ``family``; raise ValueError naming the argument that is wrong."""
    if not isinstance(k, Tensor) or k.dim() != 3:
        raise ValueError(f"k: expected a tensor of shape [L, H, K], got {getattr(k, 'shape', type(k).__name__)}")
    if not k.is_floating_point():
        raise ValueError(f"k: expected a floating-point tensor, got {k.dtype}")
    L, H, K = k.shape
    if not isinstance(v, Tensor) or v.dim() != 3 or v.shape[0] != L:
        raise ValueError(f"v: expected shape [{L}, HV, V] to match k {list(k.shape)}, got {getattr(v, 'shape', None)}")
    HV, V = v.shape[1], v.shape[2]
    if HV % H != 0:
        raise ValueError(f"v: value heads ({HV}) must be a multiple of key heads ({H})")
    _check_tensor("v", v, (L, HV, V), k.dtype)
    if q is not None:
        _check_tensor("q", q, (L, H, K), k.dtype)
    if family.gate == "none":
        if g is not None:
            raise ValueError(f"g: family {family.name!r} has no gate; pass g=None")
    elif g is None:
        raise ValueError(f"g: family {family.name!r} needs a gate g (log decay)")
    else:
        _check_tensor("g", g, (L, HV) if family.gate == "head" else (L, HV, K), _gate_dtype(k))
        if g.dtype not in (k.dtype, torch.float32, torch.float64):
            raise ValueError(f"g: dtype {g.dtype} must be fp32 or the dtype of k ({k.dtype})")
    if family.beta:
        if beta is None:
            raise ValueError(f"beta: family {family.name!r} needs beta of shape [L, HV]")
        _check_tensor("beta", beta, (L, HV), _gate_dtype(k))
        if beta.dtype not in (k.dtype, torch.float32, torch.float64):
            raise ValueError(f"beta: dtype {beta.dtype} must be fp32 or the dtype of k ({k.dtype})")
    elif beta is not None:
        raise ValueError(f"beta: family {family.name!r} takes no beta")
    if family.lowrank:
        for name, x in (("a", a), ("b", b)):
            if x is None:
                raise ValueError(f"{name}: family {family.name!r} needs {name} of shape [L, HV, K]")
            _check_tensor(name, x, (L, HV, K), k.dtype)
    elif a is not None or b is not None:
        raise ValueError(f"{'a' if a is not None else 'b'}: family {family.name!r} takes no a/b")
    return Dims(L, H, HV, K, V)


def check_state(name: str, state: Tensor | None, dims: Dims, dtype: torch.dtype, batch: int | None = None) -> None:
    if state is None:
        return
    shape = (dims.value_heads, dims.key_dim, dims.value_dim)
    _check_tensor(name, state, shape if batch is None else (batch, *shape), dtype)


def expand_heads(x: Tensor, value_heads: int) -> Tensor:
    """Repeat q/k heads for grouped values: value head i reads key head i // (HV // H)."""
    groups = value_heads // x.shape[1]
    return x if groups == 1 else repeat_heads(x, groups)


def repeat_heads(x: Tensor, groups: int, dim: int = 1) -> Tensor:
    """``x.repeat_interleave(groups, dim)`` without its device sync (it reads the output size back
    from the GPU): a broadcast view, then one copy."""
    shape = list(x.shape)
    view = x.unsqueeze(dim + 1).expand(*shape[:dim + 1], groups, *shape[dim + 1:])
    return view.reshape(*shape[:dim], shape[dim] * groups, *shape[dim + 1:])
