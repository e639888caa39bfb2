"""Rotary position embedding (neox layout, partial) and re-rotation by a position offset.

Rotations compose, ``R(a)·R(b) = R(a + b)``, so a key cached at canonical positions moves to any
new position by rotating it again by the offset. That is how cached full-attention keys are placed
(they are stored before RoPE) and how linear states with RoPE inside are re-rotated.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor

from hypic.ops.transfer import keep

# cos/sin tables of recently used position tensors. A forward ropes q and k of every attention
# layer at the same positions, so the tables are made once per forward instead of twice per layer
# (six host ops each). Keyed by the tensor's identity and version; the weak reference proves the
# tensor is still the one the tables were made for (an id can be reused after it is freed).
_TABLES: dict[tuple, tuple[weakref.ref, Tensor, Tensor]] = {}
_TABLES_LOCK = threading.Lock()
_TABLES_MAX = 16


def _check(rotary_dim: int, dim_size: int) -> None:
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > dim_size:
        raise ValueError(f"rotary_dim: must be even and in (0, {dim_size}], got {rotary_dim}")


def rope_cos_sin(positions: Tensor, *, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin: [T, rotary_dim // 2] for integer positions [T] (angles in fp32, fp64 for fp64)."""
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device).to(ct) / rotary_dim
    inv_freq = 1.0 / (theta**exponent)  # [R/2]
    angles = positions.to(ct)[:, None] * inv_freq[None, :]  # [T, R/2]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> Tensor:
    """Rotate the last dim of x by (cos, sin) broadcast against x[..., :rotary_dim // 2]."""
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def apply_rope(x: Tensor, positions: Tensor, *, rotary_dim: int, theta: float) -> Tensor:
    """x: [T, H, D] at integer positions [T]; rotates dims [0, rotary_dim) (neox rotate-half)."""
    _check(rotary_dim, x.shape[-1])
    if positions.shape != (x.shape[0],):
        raise ValueError(f"positions: expected shape [{x.shape[0]}], got {list(positions.shape)}")
    cos, sin = _tables(positions, rotary_dim, theta, x.dtype)
    return _rotate(x, cos[:, None, :], sin[:, None, :], rotary_dim)


def _tables(positions: Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    key = (id(positions), positions._version, rotary_dim, theta, dtype)
    with _TABLES_LOCK:
        hit = _TABLES.get(key)
    if hit is not None and hit[0]() is positions:
        keep(hit[1:])  # a graph captured now reads these tables at every replay
        return hit[1], hit[2]
    cos, sin = rope_cos_sin(positions, rotary_dim=rotary_dim, theta=theta, dtype=dtype)
    keep((cos, sin))
    with _TABLES_LOCK:
        _TABLES[key] = (weakref.ref(positions), cos, sin)
        while len(_TABLES) > _TABLES_MAX:
            del _TABLES[next(iter(_TABLES))]
    return cos, sin


def rotate_key_axis(x: Tensor, delta: int, *, rotary_dim: int, theta: float, dim: int = -1) -> Tensor:
    """Apply R(delta) to the vectors that lie along ``dim`` of x (e.g. dim=-2 of a K-first state)."""
    _check(rotary_dim, x.shape[dim])
    moved = x.movedim(dim, -1)
    pos = torch.tensor([delta], device=x.device)
    cos, sin = rope_cos_sin(pos, rotary_dim=rotary_dim, theta=theta, dtype=x.dtype)
    return _rotate(moved, cos[0], sin[0], rotary_dim).movedim(-1, dim)
