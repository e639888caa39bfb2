"""The ablation ladder (DESIGN §6): one engine, five ways to assemble a prompt's state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["full", "prefix", "naive", "transition", "hypic"]
MODES: tuple[str, ...] = ("full", "prefix", "naive", "transition", "hypic")


@dataclass(frozen=True)
class Assembly:
    """How cached segments are put together in the combine pass."""

    use_transition: bool  # compose with T (else the naive sum of states)
    seam: bool  # recompute each cached segment's first w tokens in context
    rerotate: bool  # move RoPE-carrying linear states to their true position
    conv_warmup: bool  # start a recompute run's conv from the preceding segment's tail


ASSEMBLY: dict[str, Assembly] = {
    "naive": Assembly(False, False, False, False),
    "transition": Assembly(True, False, False, False),
    "hypic": Assembly(True, True, True, True),
}


def check_mode(mode: object) -> str:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    return mode  # type: ignore[return-value]
