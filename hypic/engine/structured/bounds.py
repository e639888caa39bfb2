"""Numeric bounds (``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``) and
``multipleOf`` enforced while a number is written: a prefix is let through only if some way of
finishing it lands inside, on a multiple.

A number's prefix without an exponent (bounded numbers are written without one) reaches an interval
of values: ``12`` with up to K more integer digits reaches [12·10ᵏ, 13·10ᵏ) for each k ≤ K (integers:
[12·10ᵏ, 13·10ᵏ − 1]); ``0`` reaches [0, 1); ``12.3`` reaches [12.3, 12.4); a ``-`` mirrors all of it.
The prefix is feasible when one of its intervals meets the bounds. Exact arithmetic (``Decimal``):
the bounds are compared as written, not as floats. With a ``step`` (``multipleOf``) the interval
must also hold a multiple of it: counted in the units every value lies on (integers, or ``GRID``
steps), the multiples are those of one whole number of units, and the first of them at or past an
interval's start either lies within it or none does.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, getcontext
from fractions import Fraction

getcontext().prec = 80  # far past any number MAX_DIGITS lets through: sums and products stay exact
MAX_DIGITS = 16  # per part of a number (the matcher's bound): a fraction ends by its 16th digit ...
GRID = Decimal(1).scaleb(-MAX_DIGITS)  # ... so a number without an exponent is a multiple of this


@dataclass(frozen=True)
class Bounds:
    low: Decimal | None
    high: Decimal | None
    low_open: bool = False  # exclusiveMinimum
    high_open: bool = False  # exclusiveMaximum
    step: Decimal | None = None  # multipleOf (positive, at most MAX_DIGITS fraction digits: on GRID)

    def contains(self, x: Decimal) -> bool:
        if self.low is not None and (x < self.low or (self.low_open and x == self.low)):
            return False
        if self.step is not None and x % self.step != 0:
            return False
        return self.high is None or not (x > self.high or (self.high_open and x == self.high))

    def mirrored(self) -> Bounds:
        """The bounds on −x (a multiple's negation is one too)."""
        return Bounds(None if self.high is None else -self.high, None if self.low is None else -self.low,
                      self.high_open, self.low_open, self.step)

    def meets(self, a: Decimal, b: Decimal, integer: bool) -> bool:
        """Whether [a, b) — integers: [a, b] — holds a value inside the bounds that can be written:
        an integer, or a number on ``GRID`` (at most MAX_DIGITS fraction digits; ``a`` and ``b`` on
        it). Numbers are integers counted in grid steps: (0, 1e-17] holds no writable number. With a
        step, the value is a multiple of it: of its numerator for integers (``multipleOf: 2.5`` →
        the integers that are multiples of 5), of its grid steps for numbers."""
        if integer:
            every = None if self.step is None else Decimal(Fraction(self.step).numerator)
            return self._integers_meet(a, b, every)
        every = None if self.step is None else self.step / GRID
        return self.scaled(1 / GRID)._integers_meet(a / GRID, b / GRID - 1, every)

    def scaled(self, k: Decimal) -> Bounds:
        """The bounds on k·x (the step, which ``meets`` passes in the scaled units itself, dropped)."""
        return Bounds(None if self.low is None else self.low * k, None if self.high is None else self.high * k,
                      self.low_open, self.high_open)

    def integers_in(self, lo: int, hi: int) -> int:
        """How many integers in [lo, hi] lie inside the bounds, on a multiple of the step (an integer
        is a multiple of 2.5 when it is one of 5: the step's numerator)."""
        first, last = self._clamped(Decimal(lo), Decimal(hi))
        every = 1 if self.step is None else Fraction(self.step).numerator
        return max(0, int(last) // every - (int(first) - 1) // every)

    def _clamped(self, lo: Decimal, hi: Decimal) -> tuple[Decimal, Decimal]:
        """[lo, hi] (integral ends) cut to the integers inside the bounds."""
        if self.low is not None:
            first = self.low.to_integral_value(rounding="ROUND_CEILING")
            lo = max(lo, first + 1 if self.low_open and first == self.low else first)
        if self.high is not None:
            last = self.high.to_integral_value(rounding="ROUND_FLOOR")
            hi = min(hi, last - 1 if self.high_open and last == self.high else last)
        return lo, hi

    def _integers_meet(self, lo: Decimal, hi: Decimal, every: Decimal | None = None) -> bool:
        """Whether an integer in [lo, hi] — a multiple of ``every`` (a whole number) — lies inside the bounds."""
        lo, hi = self._clamped(lo, hi)
        if every is not None:
            lo = (lo / every).to_integral_value(rounding="ROUND_CEILING") * every
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


UNBOUNDED = Bounds(None, None)


def integer_completions(prefix: str, bounds: Bounds | None) -> int:
    """How many integers of at most MAX_DIGITS digits inside ``bounds`` are written as ``prefix`` and
    more digits (``0`` and ``-0``: zero alone; ``-``: every negative one and zero, as ``-0``; nothing: all)."""
    bounds = bounds or UNBOUNDED
    top = 10**MAX_DIGITS - 1
    if prefix == "":
        return bounds.integers_in(-top, top)
    if prefix in ("0", "-0"):
        return bounds.integers_in(0, 0)
    if prefix.startswith("-"):
        mirrored = bounds.mirrored()
        return mirrored.integers_in(0, top) if prefix == "-" else integer_completions(prefix[1:], mirrored)
    head = int(prefix)
    return sum(bounds.integers_in(head * 10**k, (head + 1) * 10**k - 1) for k in range(MAX_DIGITS - len(prefix) + 1))
