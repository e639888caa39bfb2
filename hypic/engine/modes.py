"""The ablation ladder (DESIGN §6): one engine, six ways to assemble a prompt's state.

``addition`` is the published system's straw man (its ``addition`` mode): states summed like
``naive``, and cached keys left with the RoPE phase of their standalone prefill (positions from 0
in every segment) instead of being roped at their true positions. ``naive`` keeps the RoPE fix,
so it isolates what dropping T costs; ``addition`` shows what a cache that fixes nothing costs.
``zero_state`` is the floor under both: every linear-layer run starts from a zero state, so the
documents reach the query only through the attention layers' cached keys and values. Its distance
from ``full`` is what the linear layers carry across segments: a mode that keeps part of it (the
naive sum) loses less, only one whose state misleads the model could lose more (docs/quality.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["full", "prefix", "zero_state", "addition", "naive", "transition", "hypic"]
MODES: tuple[str, ...] = ("full", "prefix", "zero_state", "addition", "naive", "transition", "hypic")


@dataclass(frozen=True)
class Assembly:
    """How cached segments are put together in the combine pass."""

    use_transition: bool  # compose with T (else the naive sum of states)
    seam: bool  # recompute each cached segment's first w tokens in context
    rerotate: bool  # move RoPE-carrying linear states to their true position
    conv_warmup: bool  # start a recompute run's conv from the preceding segment's tail
    rope_fix: bool = True  # rope cached keys at their true positions (else at their standalone ones)
    carry_state: bool = True  # linear states flow into later runs (else every run starts from zero)


ASSEMBLY: dict[str, Assembly] = {
    "zero_state": Assembly(False, False, False, False, carry_state=False),
    "addition": Assembly(False, False, False, False, rope_fix=False),
    "naive": Assembly(False, False, False, False),
    "transition": Assembly(True, False, False, False),
    "hypic": Assembly(True, True, True, True),
}


def check_mode(mode: object) -> str:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    return mode  # type: ignore[return-value]
