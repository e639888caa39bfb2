"""Numeric bounds (``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``) enforced
while a number is written: a prefix is let through only if some way of finishing it lands inside.

A number's prefix without an exponent (bounded numbers are written without one) reaches an interval
of values: ``12`` with up to K more integer digits reaches [12·10ᵏ, 13·10ᵏ) for each k ≤ K (integers:
[12·10ᵏ, 13·10ᵏ − 1]); ``0`` reaches [0, 1); ``12.3`` reaches [12.3, 12.4); a ``-`` mirrors all of it.
The prefix is feasible when one of its intervals meets the bounds. Exact arithmetic (``Decimal``):
the bounds are compared as written, not as floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, getcontext

getcontext().prec = 80  # far past any number MAX_DIGITS lets through: sums and products stay exact
MAX_DIGITS = 16  # per part of a number (the matcher's bound): a fraction ends by its 16th digit ...
GRID = Decimal(1).scaleb(-MAX_DIGITS)  # ... so a number without an exponent is a multiple of this


@dataclass(frozen=True)
class Bounds:
    low: Decimal | None
    high: Decimal | None
    low_open: bool = False  # exclusiveMinimum
    high_open: bool = False  # exclusiveMaximum

    def contains(self, x: Decimal) -> bool:
        if self.low is not None and (x < self.low or (self.low_open and x == self.low)):
            return False
        return self.high is None or not (x > self.high or (self.high_open and x == self.high))

    def mirrored(self) -> Bounds:
        """The bounds on −x."""
        return Bounds(None if self.high is None else -self.high, None if self.low is None else -self.low,
                      self.high_open, self.low_open)

    def meets(self, a: Decimal, b: Decimal, integer: bool) -> bool:
        """Whether [a, b) — integers: [a, b] — holds a value inside the bounds that can be written:
        an integer, or a number on ``GRID`` (at most MAX_DIGITS fraction digits; ``a`` and ``b`` on
        it). Numbers are integers counted in grid steps: (0, 1e-17] holds no writable number."""
        if integer:
            return self._integers_meet(a, b)
        return self.scaled(1 / GRID)._integers_meet(a / GRID, b / GRID - 1)

    def scaled(self, k: Decimal) -> Bounds:
        return Bounds(None if self.low is None else self.low * k, None if self.high is None else self.high * k,
                      self.low_open, self.high_open)

    def _integers_meet(self, lo: Decimal, hi: Decimal) -> bool:
        """Whether an integer in [lo, hi] lies inside the bounds."""
        if self.low is not None:
            first = self.low.to_integral_value(rounding="ROUND_CEILING")
            lo = max(lo, first + 1 if self.low_open and first == self.low else first)
        if self.high is not None:
            last = self.high.to_integral_value(rounding="ROUND_FLOOR")
            hi = min(hi, last - 1 if self.high_open and last == self.high else last)
        return lo <= hi


def feasible(prefix: str, integer: bool, bounds: Bounds, digits_left: int) -> bool:
    """Whether a number's prefix (no exponent) can be finished inside ``bounds`` with at most
    ``digits_left`` more integer digits."""
    if prefix == "-":
        return _any(integer, bounds.mirrored(), digits_left)
    if prefix.startswith("-"):
        return feasible(prefix[1:], integer, bounds.mirrored(), digits_left)
    if prefix == "":
        return _any(integer, bounds, digits_left) or _any(integer, bounds.mirrored(), digits_left)
    whole, dot, frac = prefix.partition(".")
    if dot:  # in the fraction: [whole.frac, whole.frac + one unit of the last digit)
        start = Decimal(f"{whole}.{frac}") if frac else Decimal(whole)
        return bounds.meets(start, start + Decimal(1).scaleb(-len(frac)), integer)
    value = Decimal(whole)
    if whole == "0":  # no more integer digits after a leading zero
        return bounds.meets(value, value if integer else value + 1, integer)
    for k in range(digits_left + 1):
        scale = Decimal(10) ** k
        a = value * scale
        if bounds.meets(a, a + scale - 1 if integer else a + scale, integer):
            return True
    return False


def _any(integer: bool, bounds: Bounds, digits_left: int) -> bool:
    """Whether some non-negative number of at most ``digits_left`` + 1 integer digits fits."""
    top = Decimal(10) ** (digits_left + 1)
    return bounds.meets(Decimal(0), top - 1 if integer else top, integer)
