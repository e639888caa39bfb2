"""JSON strings for the matcher, byte by byte: escapes, well-formed UTF-8, lengths, and a pattern's
automaton fed each character once it is decoded (``hypic.engine.structured.regex``)."""

from __future__ import annotations

from hypic.engine.structured.frames import END, HEX, POP, Outcome
from hypic.engine.structured.regex import Window
from hypic.engine.structured.schema import Str


def string(node: Str, local: tuple, b: int) -> list[Outcome]:
    """A string frame reads byte ``b``. Locals: ("open",), ("in", count, need, low, high) — ``need``
    continuation bytes still due, the next one in [low, high] — ("esc", count), ("hex", count, left,
    value): the digits of \\uXXXX read so far."""
    if node.pattern is not None:
        return _pattern_string(node, local, b)
    kind = local[0]
    if kind == "open":
        return [Outcome(_in_string(0), None, True)] if b == ord('"') else []
    count = local[1]
    room = node.max_len is None or count < node.max_len
    # without a maximum, counts past the minimum are all alike: kept equal so states repeat
    grown = count + 1 if node.max_len is not None else min(count + 1, node.min_len)
    if kind == "in":
        need, low, high = local[2], local[3], local[4]
        if need:  # a continuation byte; the first one's range excludes overlong forms, surrogates, > U+10FFFF
            return [Outcome(("in", count, need - 1, 0x80, 0xBF), None, True)] if low <= b <= high else []
        if b == ord('"'):
            return [Outcome(POP, None, True)] if count >= node.min_len else []
        if not room or b == END or b < 0x20:
            return []
        if b == ord("\\"):
            return [Outcome(("esc", count), None, True)]
        if b < 0x80:
            return [Outcome(_in_string(grown), None, True)]
        lead = _lead_bytes(b)
        low, high = _FIRST_CONTINUATION.get(b, (0x80, 0xBF))
        return [Outcome(("in", grown, lead, low, high), None, True)] if lead else []
    if kind == "esc":
        if b in _JSON_ESCAPES:
            return [Outcome(_in_string(grown), None, True)]
        return [Outcome(("hex", count, 4, 0), None, True)] if b == ord("u") else []
    if b not in HEX:  # "hex": the digits of \uXXXX
        return []
    value, left = local[3] * 16 + int(chr(b), 16), local[2] - 1
    if _surrogate(value, left):
        return []
    return [Outcome(_in_string(grown) if left == 0 else ("hex", count, left, value), None, True)]


def _surrogate(value: int, left: int) -> bool:
    """Whether \\uXXXX's digits so far can only end in a UTF-16 surrogate (D800–DFFF). Such escapes
    are refused: a lone one is no character (Python's json reads it, then cannot encode it: a
    tool call holding one failed as a 500), and a pair would be two escapes for one character,
    which minLength, maxLength and a pattern count as one — raw UTF-8 spells every character."""
    return 0xD800 <= value << (4 * left) and (value << (4 * left)) | ((1 << (4 * left)) - 1) <= 0xDFFF


def _in_string(count: int) -> tuple:
    return ("in", count, 0, 0, 0)


def _lead_bytes(b: int) -> int:
    """How many continuation bytes UTF-8's lead byte ``b`` announces; 0: ``b`` leads no character
    (a continuation byte, an overlong form's lead C0/C1, or past U+10FFFF)."""
    return 1 if 0xC2 <= b <= 0xDF else 2 if 0xE0 <= b <= 0xEF else 3 if 0xF0 <= b <= 0xF4 else 0


# UTF-8's lead bytes whose first continuation byte is narrower than 80–BF (RFC 3629)
_FIRST_CONTINUATION = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
_JSON_ESCAPES = {ord('"'): 34, ord("\\"): 92, ord("/"): 47, ord("b"): 8, ord("f"): 12, ord("n"): 10, ord("r"): 13,
                 ord("t"): 9}


def _pattern_string(node: Str, local: tuple, b: int) -> list[Outcome]:
    """A string its pattern must match: characters are decoded (UTF-8, JSON escapes) and fed to the
    pattern's automaton; a character still being decoded is let through only if some character it
    may become keeps the pattern matchable — within minLength and maxLength, counted after that
    character (``Window``: a pattern that can end only too early or too late is refused as soon as
    it is). Locals: ("in", count, states, need, value, low, high)."""
    rx, kind = node.pattern, local[0]
    assert rx is not None
    if kind == "open":
        return [Outcome(("in", 0, rx.start, 0, 0, 0, 0), None, True)] if b == ord('"') else []
    count, states = local[1], local[2]
    room = node.max_len is None or count < node.max_len
    after = _window(node, count + 1)  # the characters the string may still take after the one being read

    # without a maximum, counts past the minimum are all alike (``_window`` reads only how many are
    # still due): kept equal, so states repeat and their masks are memoized
    grown = count + 1 if node.max_len is not None else min(count + 1, node.min_len)

    def char(c: int) -> list[Outcome]:  # a whole character read: the automaton steps
        nxt = rx.step(states, c)
        ok = nxt and rx.finishes(nxt, after)
        return [Outcome(("in", grown, nxt, 0, 0, 0, 0), None, True)] if ok else []

    if kind == "in":
        need, value, low, high = local[3], local[4], local[5], local[6]
        if not need:  # between characters
            if b == ord('"'):
                return [Outcome(POP, None, True)] if count >= node.min_len and rx.accepts(states) else []
            if not room or b == END or b < 0x20:
                return []
            if b == ord("\\"):  # an escape can spell any character of the basic plane but a surrogate
                ok = rx.can_step(states, 0, 0xD7FF, after) or rx.can_step(states, 0xE000, 0xFFFF, after)
                return [Outcome(("esc", count, states), None, True)] if ok else []
        got = utf8_byte(need, value, low, high, b)
        if got is None:
            return []
        if isinstance(got, int):
            return char(got)
        need, value, low, high, lo, hi = got
        if not rx.can_step(states, lo, hi, after):
            return []
        return [Outcome(("in", count, states, need, value, low, high), None, True)]
    if kind == "esc":
        if b in _JSON_ESCAPES:
            return char(_JSON_ESCAPES[b])
        return [Outcome(("hex", count, states, 4, 0), None, True)] if b == ord("u") else []
    if b not in HEX:  # "hex": the digits of \uXXXX, each only if some character it may end in fits
        return []
    value, left = local[4] * 16 + int(chr(b), 16), local[3] - 1
    if _surrogate(value, left):
        return []
    if left == 0:
        return char(value)
    lo = value << (4 * left)
    hi = lo | ((1 << (4 * left)) - 1)
    if not (rx.can_step(states, lo, min(hi, 0xD7FF), after) or rx.can_step(states, max(lo, 0xE000), hi, after)):
        return []
    return [Outcome(("hex", count, states, left, value), None, True)]


def utf8_step(need: int, low: int, high: int, b: int) -> tuple[int, int, int] | None:
    """Well-formed UTF-8 checked a byte at a time, the code points not decoded: from (``need``
    continuation bytes due, the next in [``low``, ``high``]; 0, 0, 0 between characters), the same
    after byte ``b``, or None when ``b`` cannot come here."""
    if need:
        return None if not low <= b <= high else (need - 1, 0x80, 0xBF) if need > 1 else (0, 0, 0)
    if b < 0x80:
        return 0, 0, 0
    lead = _lead_bytes(b)
    return (lead, *_FIRST_CONTINUATION.get(b, (0x80, 0xBF))) if lead else None


def utf8_byte(need: int, value: int, low: int, high: int, b: int) -> int | tuple[int, int, int, int, int, int] | None:
    """UTF-8 read a byte at a time, from a character's decoding so far — ``need`` continuation bytes
    still due, ``value`` its bits, the next byte in [``low``, ``high``] (0, 0, 0, 0 between
    characters). Byte ``b`` gives the whole character's code point; or the decoding after it with
    the code points [lo, hi] it may still become, (need, value, low, high, lo, hi) — its first
    continuation's bounds applied (no overlong forms, surrogates or code points past U+10FFFF);
    or None when it cannot come here."""
    if need:  # a continuation byte
        if not low <= b <= high:
            return None
        value, need = (value << 6) | (b & 0x3F), need - 1
        if need == 0:
            return value
        lo = value << (6 * need)
        return need, value, 0x80, 0xBF, lo, lo | ((1 << (6 * need)) - 1)
    if b < 0x80:
        return b
    need = _lead_bytes(b)
    if not need:
        return None
    value = b & (0x1F if need == 1 else 0x0F if need == 2 else 0x07)
    low, high = _FIRST_CONTINUATION.get(b, (0x80, 0xBF))
    shift = 6 * (need - 1)
    lo = (value << (6 * need)) | ((low & 0x3F) << shift)
    hi = (value << (6 * need)) | ((high & 0x3F) << shift) | ((1 << shift) - 1)
    return need, value, low, high, lo, hi


def _window(node: Str, count: int) -> Window:
    """The lengths a string of ``node`` may still take once ``count`` characters are read."""
    high = None if node.max_len is None else node.max_len - count
    cap = node.min_len if node.max_len is None else node.max_len + 1  # one cap per string: its masks shared
    return Window.between(max(0, node.min_len - count), high, cap) if high is None or high >= 0 else Window(cap, 0)
