"""What a frame's handler answers, shared by the matcher and its string and number handlers."""

from __future__ import annotations

from typing import NamedTuple

from hypic.engine.structured.schema import Node

END = 256  # the byte after the text
POP = "pop"
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")


class Outcome(NamedTuple):
    local: object  # the frame's next local state, or POP
    child: Node | None  # pushed above the frame
    consumed: bool
