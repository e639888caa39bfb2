"""A checkpoint config's RoPE, read into a ``RopeSpec``.

Configs name their RoPE in transformers' ``rope_parameters`` (``rope_type``, ``rope_theta``,
``partial_rotary_factor`` and the scaling's own fields) or in the older ``rope_scaling`` (``type``
or ``rope_type``), with ``rope_theta`` and ``partial_rotary_factor`` at the top. Position-independent
caching needs every token's phase to depend on its position alone, so only scalings with fixed
frequencies are served (plain, linear, YaRN); the rest are refused by name rather than served with
wrong phases.
"""

from __future__ import annotations

import math
from typing import Any

from hypic.ops.rope import SCALINGS, RopeScaling, RopeSpec

# "mrope" (Qwen's multimodal RoPE, older configs' name for it): text positions are equal on every
# axis, so its frequencies and phases are plain RoPE's
_PLAIN = ("default", "mrope")

# why each refused kind cannot be cached position-independently, or that it is not implemented
_REFUSED = {
    "dynamic": "its frequencies grow with the sequence's length, so a cached key's phase would differ in every "
               "prompt that holds it",
    "longrope": "it switches frequencies when the sequence passes the original context, so a cached key's phase "
                "would depend on the prompt's length",
}


def _kind(spec: dict[str, Any]) -> str:
    return spec.get("rope_type", spec.get("type", "default"))


def _scaling_spec(c: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The config key and object that ask for scaled frequencies, if one does."""
    found = []
    for key in ("rope_parameters", "rope_scaling"):
        spec = c.get(key)
        if spec is None:
            continue
        if not isinstance(spec, dict):
            raise ValueError(f"config.{key}: expected an object, got {type(spec).__name__}")
        if _kind(spec) not in _PLAIN:
            found.append((key, spec))
    if len(found) == 2 and found[0][1] != found[1][1]:
        raise ValueError(f"config.rope_parameters and config.rope_scaling ask for different scalings "
                         f"({_kind(found[0][1])!r}, {_kind(found[1][1])!r}); keep one")
    return found[0] if found else None


def _number(key: str, spec: dict[str, Any], name: str, default: float | None = None) -> float:
    value = spec.get(name, default)
    if value is None:
        raise ValueError(f"config.{key}.{name}: required for rope_type {_kind(spec)!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"config.{key}.{name}: expected a finite number > 0, got {value!r}")
    return float(value)


def _yarn_attention_factor(key: str, spec: dict[str, Any], factor: float) -> float:
    """YaRN's cos/sin scale: given, or ``0.1·ln(factor) + 1`` (DeepSeek's mscale ratio when a
    config names ``mscale`` and ``mscale_all_dim``)."""
    if spec.get("attention_factor") is not None:
        return _number(key, spec, "attention_factor")

    def m(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    mscale, mscale_all = spec.get("mscale"), spec.get("mscale_all_dim")
    if mscale and mscale_all:
        return m(factor, _number(key, spec, "mscale")) / m(factor, _number(key, spec, "mscale_all_dim"))
    return m(factor)


def rope_scaling(c: dict[str, Any]) -> RopeScaling | None:
    """The config's frequency scaling, None for plain RoPE; a scaling that is not served is a
    ValueError naming it."""
    found = _scaling_spec(c)
    if found is None:
        return None
    key, spec = found
    kind = _kind(spec)
    if kind in _REFUSED:
        raise ValueError(f"config.{key}: rope_type {kind!r} is not supported: {_REFUSED[kind]}; "
                         f"hypic serves {', '.join(_PLAIN + SCALINGS)}")
    if kind not in SCALINGS:
        raise ValueError(f"config.{key}: rope_type {kind!r} is not supported; hypic serves "
                         f"{', '.join(_PLAIN + SCALINGS)}")
    if kind == "linear":
        return RopeScaling("linear", _number(key, spec, "factor"))
    # the pretraining context: a config's top-level field first (Phi-3 keeps it there; transformers
    # lets it win over the scaling's own), then the scaling's, then max_position_embeddings
    original = c.get("original_max_position_embeddings") or spec.get(
        "original_max_position_embeddings", c.get("max_position_embeddings"))
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ValueError(f"config.{key}.original_max_position_embeddings: expected a positive integer, "
                         f"got {original!r}")
    if spec.get("factor") is None and c.get("max_position_embeddings"):
        factor = c["max_position_embeddings"] / original  # DeepSeek-V3's form: the two lengths' ratio
    else:
        factor = _number(key, spec, "factor")
    truncate = spec.get("truncate", True)
    truncate = False if truncate is None else truncate  # transformers reads null as false
    if not isinstance(truncate, bool):
        raise ValueError(f"config.{key}.truncate: expected true or false, got {truncate!r}")
    return RopeScaling("yarn", factor, original_max=original,
                       beta_fast=_number(key, spec, "beta_fast", 32.0) if spec.get("beta_fast") else 32.0,
                       beta_slow=_number(key, spec, "beta_slow", 1.0) if spec.get("beta_slow") else 1.0,
                       truncate=truncate, attention_factor=_yarn_attention_factor(key, spec, factor))


def rope_spec(c: dict[str, Any], rotary_dim: int, default_theta: float) -> RopeSpec:
    """The RoPE of a config whose family has read its rotary dims: θ from ``rope_parameters`` or the
    top level (else the family's default), and the scaling."""
    theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", default_theta))
    return RopeSpec(rotary_dim, float(theta), rope_scaling(c))


def max_positions(c: dict[str, Any], rope: RopeSpec, default: int) -> int:
    """The model's context: ``max_position_embeddings`` (else the family's default), stretched by a
    frequency scaling (Qwen's YaRN recipe adds the scaling and leaves the field at the pretraining
    length)."""
    base = c.get("max_position_embeddings") or default
    return base if rope.scaling is None else max(base, rope.scaling.context(base))
