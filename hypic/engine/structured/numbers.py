"""JSON numbers for the matcher: the grammar's phases, at most ``MAX_DIGITS`` digits per part (an
exponent ``MAX_EXP_DIGITS``), and
numeric bounds kept while the number is written (``hypic.engine.structured.bounds``)."""

from __future__ import annotations

from decimal import Decimal

from hypic.engine.structured.bounds import feasible
from hypic.engine.structured.frames import DIGITS, POP, Outcome
from hypic.engine.structured.schema import MAX_DIGITS, Num

_NUMBER_ENDS = {"zero", "int", "frac", "exp"}
# an exponent of at most two digits keeps every number finite as a double (1e999 reads as inf, which
# no JSON writer writes back: Python's as Infinity, pydantic's as null)
MAX_EXP_DIGITS = 2


def initial(node: Num) -> tuple:
    """A number frame's first local: a bounded one carries its text so far."""
    return ("start", 0) if node.bounds is None else ("start", 0, "")


def number(node: Num, local: tuple, b: int) -> list[Outcome]:
    if node.bounds is None:
        return _number_phases(node, local, b)
    # bounded: the text so far rides along; a step is kept only if a value within bounds can follow
    phase, digits, text = local
    out = []
    for o in _number_phases(node, (phase, digits), b):
        if o.local is POP:
            if node.bounds.contains(Decimal(text)):
                out.append(o)
        elif o.local[0] not in ("exp0", "esign", "exp"):  # bounded numbers carry no exponent
            grown = text + chr(b)
            int_digits = o.local[1] if o.local[0] == "int" else 1
            if feasible(grown, node.integer, node.bounds, MAX_DIGITS - int_digits):
                out.append(Outcome((*o.local, grown), None, True))
    return out


def _number_phases(node: Num, local: tuple, b: int) -> list[Outcome]:
    """The number's next phase for byte ``b``; where the number so far is whole, its end, the byte
    handed back to what follows — when the byte cannot go on with it, or always for a structural
    tag's whole value (``hand_back``: its end may begin with a digit, ``.`` or ``e``: ``42.``)."""
    out = _continued(node, local, b)
    if local[0] in _NUMBER_ENDS and (node.hand_back or not out):
        out.append(Outcome(POP, None, False))
    return out


def _continued(node: Num, local: tuple, b: int) -> list[Outcome]:
    phase, digits = local
    digit = b in DIGITS
    if phase == "start":
        return [Outcome(("minus", 0), None, True)] if b == ord("-") else _first_digit(b)
    if phase == "minus":
        return _first_digit(b)
    if digit and phase in ("int", "frac0", "frac", "esign", "exp0", "exp"):
        part = "frac" if phase.startswith("frac") else "exp" if phase.startswith("e") else "int"
        count = digits + 1 if phase in ("int", "frac", "exp") else 1
        return [Outcome((part, count), None, True)] if count <= (MAX_EXP_DIGITS if part == "exp" else MAX_DIGITS) \
            else []
    if not node.integer:
        if b == ord(".") and phase in ("zero", "int"):
            return [Outcome(("frac0", 0), None, True)]
        if b in (ord("e"), ord("E")) and phase in ("zero", "int", "frac"):
            return [Outcome(("exp0", 0), None, True)]
        if b in (ord("+"), ord("-")) and phase == "exp0":
            return [Outcome(("esign", 0), None, True)]
    return []


def _first_digit(b: int) -> list[Outcome]:
    if b == ord("0"):
        return [Outcome(("zero", 1), None, True)]
    return [Outcome(("int", 1), None, True)] if b in DIGITS else []


