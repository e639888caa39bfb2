"""What a frame's handler answers, shared by the matcher and its string and number handlers."""

from __future__ import annotations

from typing import NamedTuple

from hypic.engine.structured.schema import Node

END = 256  # the byte after the text
POP = "pop"
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
WS = frozenset(b" ")  # between tokens; JSON's other whitespace (tab, newline, return) is never needed
UNBOUNDED = 1 << 30  # a free string's room with no maxLength (and free strings' distinct count)


class Outcome(NamedTuple):
    local: object  # the frame's next local state, or POP
    child: Node | None  # pushed above the frame
    consumed: bool
