"""Rotary position embedding (neox layout, partial) and re-rotation by a position offset.

Rotations compose, ``R(a)·R(b) = R(a + b)``, so a key cached at canonical positions moves to any
new position by rotating it again by the offset. That is how cached full-attention keys are placed
(they are stored before RoPE) and how linear states with RoPE inside are re-rotated.

Frequency scaling (linear interpolation, YaRN) keeps this: it only changes the fixed frequencies,
and YaRN's attention factor scales cos and sin of a layer's own q and k (as transformers does), never
a re-rotation. Scalings whose frequencies depend on the prompt's length (dynamic NTK, LongRoPE)
would give a cached key a different phase in every prompt that holds it; ``hypic.models.rope_config``
refuses them.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass

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

SCALINGS = ("linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """Fixed rescaled frequencies. ``linear``: every frequency divided by ``factor`` (position
    interpolation). ``yarn``: frequencies that turn fewer than ``beta_slow`` times over the
    pretraining context ``original_max`` are divided by ``factor``, those turning more than
    ``beta_fast`` times are kept, a linear ramp between (over the rotary pair index); cos and sin are
    multiplied by ``attention_factor``."""

    kind: str
    factor: float
    original_max: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # the ramp's ends rounded outwards to whole pair indices
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in SCALINGS:
            raise ValueError(f"rope scaling: kind must be one of {SCALINGS}, got {self.kind!r}")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"rope scaling: factor must be a finite number > 0, got {self.factor}")
        if not (math.isfinite(self.attention_factor) and self.attention_factor > 0):
            raise ValueError(f"rope scaling: attention_factor must be a finite number > 0, got {self.attention_factor}")
        if self.kind == "yarn":
            if self.original_max <= 0:
                raise ValueError(f"rope scaling: yarn needs original_max_position_embeddings > 0, "
                             f"got {self.original_max}")
            if not (math.isfinite(self.beta_fast) and math.isfinite(self.beta_slow) and self.beta_fast > 0
                    and self.beta_slow > 0):
                raise ValueError(f"rope scaling: beta_fast and beta_slow must be finite numbers > 0, "
                                 f"got {self.beta_fast} and {self.beta_slow}")

    def context(self, max_positions: int) -> int:
        """The context the scaled frequencies serve (vLLM's reading): YaRN stretches the pretraining
        context by ``factor``, linear scaling the config's own."""
        return int((self.original_max if self.kind == "yarn" else max_positions) * self.factor)

    def ramp(self, rotary_dim: int, theta: float) -> tuple[float, float]:
        """YaRN's pair-index range [low, high] over which frequencies go from kept to divided."""

        def pair_turning(turns: float) -> float:  # the pair index whose wavelength fits `turns` times
            return rotary_dim * math.log(self.original_max / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = pair_turning(self.beta_fast), pair_turning(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, rotary_dim - 1)


@dataclass(frozen=True)
class RopeSpec:
    """One layer's RoPE: the first ``rotary_dim`` dims of each head rotated at frequencies
    ``theta^(−2i/rotary_dim)``, rescaled by ``scaling`` when a config asks for it."""

    rotary_dim: int
    theta: float
    scaling: RopeScaling | None = None

    @property
    def attention_factor(self) -> float:
        return 1.0 if self.scaling is None else self.scaling.attention_factor

    def inv_freq(self, dtype: torch.dtype, device: torch.device | str | None = None) -> Tensor:
        """[rotary_dim // 2] angular frequencies, computed in ``dtype`` (fp32 angles as transformers
        computes them; fp64 for the fp64 references)."""
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).to(dtype) / self.rotary_dim
        base = 1.0 / (self.theta**exponent)
        sc = self.scaling
        if sc is None:
            return base
        if sc.kind == "linear":
            return base / sc.factor
        low, high = sc.ramp(self.rotary_dim, self.theta)
        high = high if high != low else high + 1e-3  # one pair: a step, not a division by zero
        pair = torch.arange(self.rotary_dim // 2, dtype=dtype, device=device)
        divided = ((pair - low) / (high - low)).clamp(0, 1)  # 0: kept (fast), 1: divided (slow)
        return base / sc.factor * divided + base * (1 - divided)

    def __call__(self, x: Tensor, positions: Tensor) -> Tensor:
        return apply_rope(x, positions, self)


def _check(rotary_dim: int, dim_size: int) -> None:
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > dim_size:
        raise ValueError(f"rotary_dim: must be even and in (0, {dim_size}], got {rotary_dim}")


def rope_cos_sin(positions: Tensor, rope: RopeSpec, dtype: torch.dtype, *,
                 scaled: bool = True) -> tuple[Tensor, Tensor]:
    """cos, sin: [T, rotary_dim // 2] for integer positions [T] (angles in fp32, fp64 for fp64),
    times the attention factor when ``scaled`` (a pure rotation is not)."""
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    angles = positions.to(ct)[:, None] * rope.inv_freq(ct, positions.device)[None, :]  # [T, R/2]
    cos, sin = angles.cos(), angles.sin()
    if scaled and rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    return cos.to(dtype), sin.to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> Tensor:
    """Rotate the last dim of x by (cos, sin) broadcast against x[..., :rotary_dim // 2]."""
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def apply_rope(x: Tensor, positions: Tensor, rope: RopeSpec) -> Tensor:
    """x: [T, H, D] at integer positions [T]; rotates dims [0, rotary_dim) (neox rotate-half) and
    scales them by the attention factor."""
    _check(rope.rotary_dim, x.shape[-1])
    if positions.shape != (x.shape[0],):
        raise ValueError(f"positions: expected shape [{x.shape[0]}], got {list(positions.shape)}")
    cos, sin = _tables(positions, rope, x.dtype)
    return _rotate(x, cos[:, None, :], sin[:, None, :], rope.rotary_dim)


def _tables(positions: Tensor, rope: RopeSpec, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    key = (id(positions), positions._version, rope, dtype)
    with _TABLES_LOCK:
        hit = _TABLES.get(key)
    if hit is not None and hit[0]() is positions:
        keep(hit[1:])  # a graph captured now reads these tables at every replay
        return hit[1], hit[2]
    cos, sin = rope_cos_sin(positions, rope, dtype)
    keep((cos, sin))
    with _TABLES_LOCK:
        _TABLES[key] = (weakref.ref(positions), cos, sin)
        while len(_TABLES) > _TABLES_MAX:
            del _TABLES[next(iter(_TABLES))]
    return cos, sin


def rotate_key_axis(x: Tensor, delta: int, rope: RopeSpec, *, dim: int = -1) -> Tensor:
    """Apply the pure rotation R(delta) (no attention factor) to the vectors that lie along ``dim``
    of x (e.g. dim=-2 of a K-first state)."""
    _check(rope.rotary_dim, x.shape[dim])
    moved = x.movedim(dim, -1)
    pos = torch.full((1,), delta, device=x.device)  # filled there: no host → device copy (a stall on CUDA)
    cos, sin = rope_cos_sin(pos, rope, x.dtype, scaled=False)
    return _rotate(moved, cos[0], sin[0], rope.rotary_dim).movedim(-1, dim)
