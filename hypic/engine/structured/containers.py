"""The object and array frames of the structured-output matcher (``matcher``): an object's declared
keys in their declared order, its free keys (``propertyNames`` / a pattern) and their count
(``minProperties`` / ``maxProperties``: distinct where two or more are due, read here); an array's
items, and a ``uniqueItems`` array's values written, each item read here as one not written yet.

A handler reads one byte and answers with ``Outcome``s (``frames``); ``depth`` is the frame's own — a
key or item is begun only if its value can be finished within ``MAX_DEPTH`` (``fits``).
"""

from __future__ import annotations

import bisect
import itertools
import json
from decimal import Decimal

from hypic.engine.structured.bounds import integer_completions
from hypic.engine.structured.frames import END, POP, WS, Outcome
from hypic.engine.structured.numbers import MAX_EXP_DIGITS, number
from hypic.engine.structured.numbers import initial as initial_number
from hypic.engine.structured.schema import (
    MAX_DEPTH,
    MAX_DIGITS,
    Arr,
    Node,
    Num,
    Obj,
    Str,
    Values,
    free_key,
    key_count,
    literal_values,
    needs,
    unique_count,
    unique_items,
)
from hypic.engine.structured.strings import string


def fits(child: Node | None, depth: int) -> bool:
    """Whether ``child``, opened above a frame at ``depth``, can be finished within MAX_DEPTH (as
    ``_feed`` checks when it opens it)."""
    return child is not None and depth + needs(child) <= MAX_DEPTH


def obj_frame(node: Obj, local: tuple, b: int, depth: int) -> list[Outcome]:
    """Locals: ("open",), then (kind, used, …): kinds "k0" (just opened), "k1" (after a comma), "key"
    (a declared key's bytes so far), "name" (a distinct free key, read here), "colon", "val", "after"
    (a value). ``used``: the declared keys written; for free keys their values where they must be
    ``distinct``, else their count where the object is ``counted``, else nothing (so that the states of
    every free-keyed object's values repeat, and share the vocabulary's memo)."""
    kind, used = local[0], (local[1] if len(local) > 1 else frozenset())
    free = not node.props and fits(node.extra, depth)  # free keys, whose values fit here
    if kind == "open":
        counts = node.counted and not node.props and not node.distinct
        return [Outcome(("k0", 0 if counts else frozenset()), None, True)] if b == ord("{") else []
    if kind == "name":
        return _free_name(node, local, b)
    if b in WS and kind in ("k0", "k1", "colon", "val", "after"):
        return [Outcome(local, None, True)]
    if kind in ("k0", "k1"):
        if b == ord("}") and kind == "k0" and _may_close(node, used):
            return [Outcome(POP, None, True)]
        if b != ord('"'):
            return []
        if free:
            if not _room(node, used):
                return []
            if node.distinct:
                return _free_name(node, ("name", used, ("open",) if isinstance(free_key(node), Str) else None, b""), b)
            return [Outcome(("colon", used + 1 if isinstance(used, int) else used, None), free_key(node), False)]
        return [Outcome(("key", used, b""), None, True)] if _open_keys(node, used, depth) else []
    if kind == "key":
        prefix = local[2]
        grown = prefix + bytes([b]) if b != END else None
        keys = _open_keys(node, used, depth)
        out = [Outcome(("colon", used, prefix), None, True)] if b == ord('"') and prefix in keys else []
        if grown is not None and any(k.startswith(grown) for k in keys):
            out.append(Outcome(("key", used, grown), None, True))
        return out
    if kind == "colon":
        return [Outcome(("val", used, local[2]), None, True)] if b == ord(":") else []
    if kind == "val":
        key = local[2]
        value = node.extra if key is None else node.props[key]
        return [] if b == END else [Outcome(("after", used if key is None else used | {key}), value, False)]
    # "after" a value
    if b == ord(","):
        if free:
            more = _room(node, used) and (not node.distinct or _below(len(used), key_count(node)))
        else:
            more = bool(_open_keys(node, used, depth))
        return [Outcome(("k1", used), None, True)] if more else []
    if b == ord("}") and _may_close(node, used):
        return [Outcome(POP, None, True)]
    return []


def _written(used: frozenset | int) -> int:
    return used if isinstance(used, int) else len(used)


def _may_close(node: Obj, used: frozenset | int) -> bool:
    return (not node.required or node.required <= used) and _written(used) >= node.min_props


def _room(node: Obj, used: frozenset | int) -> bool:
    return node.max_props is None or _written(used) < node.max_props


def _below(written: int, count: int | None) -> bool:
    """Whether another distinct value is left after ``written`` of ``count`` (None: endless)."""
    return count is None or written < count


def _free_name(node: Obj, local: tuple, b: int) -> list[Outcome]:
    """A free key that must differ from those written (``Obj.distinct``), read here, its bytes so far
    ``local[3]``: a string's by the string frame's own handler (its local ``local[2]``), refused at its
    closing quote when its value was written; an enum's as one of the values not written yet."""
    _, used, inner, raw = local
    keys = free_key(node)
    if isinstance(keys, Str):
        return [Outcome(("colon", used | {got}, None) if step is POP else ("name", used, step, got), None, True)
                for step, got in _string_read(keys, inner, raw, b, used)]
    if b == END:
        return []
    grown = raw + bytes([b])
    value, more = _unwritten(literal_values(keys), used, grown)
    return [*([] if value is None else [Outcome(("colon", used | {value}, None), None, True)]),
            *([Outcome(("name", used, None, grown), None, True)] if more else [])]


def _string_read(node: Str, inner: tuple, raw: bytes, b: int, written: frozenset) -> list[tuple[object, object]]:
    """A string read by the string frame's own handler (its local ``inner``) with its raw bytes kept
    (the opening quote not among them): (the handler's next local, the bytes so far) while it goes on;
    (POP, its value, escapes read) where it closes on a value not ``written``."""
    out: list[tuple[object, object]] = []
    for o in string(node, inner, b):
        if o.local is not POP:
            out.append((o.local, raw + bytes([b]) if inner != ("open",) else raw))
        elif (value := json.loads(b'"' + raw + b'"')) not in written:
            out.append((POP, value))
    return out


def _unwritten(values: Values, written: frozenset, grown: bytes) -> tuple[int | None, bool]:
    """Of a set of values, the one whose text ``grown`` is, if not written yet (else None), and
    whether ``grown`` begins the text of one not written."""
    texts, value_of, _ = values
    value = value_of.get(grown)
    at = bisect.bisect_right(texts, grown)  # the texts grown begins sort right after it
    while at < len(texts) and texts[at].startswith(grown):
        if value_of[texts[at]] not in written:
            return (None if value in written else value), True
        at += 1
    return (None if value in written else value), False


def _open_keys(node: Obj, used: frozenset, depth: int) -> list[bytes]:
    """The declared keys that may come next, whose values fit here: those after the last one written,
    in declared order, up to the first required one (a required key is never skipped); where the keys
    are counted, only those after which minProperties can still be reached and the required keys
    still fit under maxProperties."""
    last = max((node.order[k] for k in used), default=-1)
    tail = list(itertools.islice(node.props.items(), last + 1, None))
    out = []
    for i, (k, v) in enumerate(tail):
        if fits(v, depth) and (not node.counted or _countable(node, len(used) + 1, tail[i + 1:], depth)):
            out.append(k)
        if k in node.required:
            break
    return out


def _countable(node: Obj, written: int, later: list[tuple[bytes, Node]], depth: int) -> bool:
    """Whether, ``written`` keys in and ``later`` still to come, minProperties and maxProperties can be met."""
    if written + sum(fits(v, depth) for _, v in later) < node.min_props:
        return False
    return node.max_props is None or written + sum(k in node.required for k, _ in later) <= node.max_props


def array_frame(node: Arr, local: tuple, b: int, depth: int) -> list[Outcome]:
    """Locals: ("open",), then (kind, items so far) — kind "a0" (just opened), "next" (after a
    comma), "after" (after an item). A ``uniqueItems`` array's locals also carry the values written
    (``unique_items``), and it reads its items itself — ("item", n, written, the
    item's bytes so far) — as one of the values not written yet: one alternative, not one per value
    (a 250-value enum's item pushed as 250 frames cost 150 ms a mask); a comma only while one is left."""
    kind = local[0]
    if kind == "open":
        return [Outcome(("a0", 0, frozenset()) if node.unique else ("a0", 0), None, True)] if b == ord("[") else []
    if kind in _UNIQUE_READS:
        return _UNIQUE_READS[kind](node, local, b, depth)
    n = local[1]
    if b in WS:
        return [Outcome(local, None, True)]
    room = node.max_items is None or n < node.max_items
    if kind in ("a0", "next"):
        out = [Outcome(POP, None, True)] if kind == "a0" and b == ord("]") and node.min_items == 0 else []
        child = node.prefix[n] if n < len(node.prefix) else node.items
        if b in (END, ord("]")) or not room or child is None:
            return out
        if node.unique:  # the item's reading starts with this byte
            items = unique_items(node)
            kind = _UNIQUE_STARTS[type(items)]
            inner = () if isinstance(items, Values) else (_item_start(items),)
            return out + _UNIQUE_READS[kind](node, (kind, n, local[2], *inner, b""), b, depth)
        return [*out, Outcome(("after", n + 1), child, False)]
    if b == ord(","):  # only if the next item can be finished here
        child = node.prefix[n] if n < len(node.prefix) else node.items
        left = not node.unique or _below(len(local[2]), unique_count(node))
        return [Outcome(("next", *local[1:]), None, True)] if room and left and fits(child, depth) else []
    if b == ord("]") and n >= node.min_items:
        return [Outcome(POP, None, True)]
    return []


def _unique_string(node: Arr, local: tuple, b: int, depth: int) -> list[Outcome]:
    """A unique array's free-string item, read by the string frame's own handler (its local
    ``local[3]``) with its raw bytes ``local[4]`` kept: at the closing quote, its value (escapes
    read) must be none of those written."""
    _, n, written, inner, raw = local
    return [Outcome(("after", n + 1, written | {got}) if step is POP else ("string", n, written, step, got), None, True)
            for step, got in _string_read(unique_items(node), inner, raw, b, written)]


def _unique_number(node: Arr, local: tuple, b: int, depth: int) -> list[Outcome]:
    """A unique array's number item, read by the number frame's handler (its local ``local[3]``) with
    its bytes ``local[4]`` kept: where it ends (the byte handed back, read by the array after it) its
    value — an int, or an exact Decimal: ``1``, ``1.0`` and ``1e0`` are one — must be none of those
    written, and a byte is refused at once when every value the prefix can still become was written
    (an integer's ``0``, ``-0`` or 16th digit; a number's last exponent digit)."""
    _, n, written, inner, raw = local
    item = unique_items(node)
    out = []
    for o in number(item, inner, b):
        if o.local is POP:  # the number ended before b: b is the array's
            value = int(raw) if item.integer else Decimal(raw.decode())
            if value not in written:
                out += array_frame(node, ("after", n + 1, written | {value}), b, depth)
        elif (_unwritten_integer(item, (raw + bytes([b])).decode(), written) if item.integer
              else _unwritten_number(o.local, (raw + bytes([b])).decode(), written)):
            out.append(Outcome(("number", n, written, o.local, raw + bytes([b])), None, True))
    return out


def _unwritten_number(phase: tuple, prefix: str, written: frozenset) -> bool:
    """Whether a number's prefix, in ``phase``, can still become a value not written. Only an
    exponent's, or a fraction at its last digit, can become few values (an exponent has at most
    ``MAX_EXP_DIGITS`` digits): those are tried; any other prefix grows into endless ones."""
    kind, digits = phase[0], phase[1]
    if not written:
        return True
    if kind in ("exp0", "esign"):  # one or two exponent digits to come
        tails = [*"0123456789", *(a + c for a in "0123456789" for c in "0123456789")]
    elif kind == "exp":
        tails = ["", *("0123456789" if digits < MAX_EXP_DIGITS else "")]
    elif kind == "frac" and digits == MAX_DIGITS:  # only an exponent left to write
        tails = ["", *(f"e{k}" for k in range(-10**MAX_EXP_DIGITS + 1, 10**MAX_EXP_DIGITS))]
    else:
        return True
    return any(Decimal(prefix + t) not in written for t in tails)


def _unwritten_integer(item: Num, prefix: str, written: frozenset) -> bool:
    """Whether some integer inside the item's bounds not written yet is spelled ``prefix`` and more
    digits: more of them than of those written (each written one is one of them if it begins so)."""
    spelled = "0" if prefix == "-0" else prefix
    if item.bounds is None and spelled not in ("-", "0") and len(spelled.lstrip("-")) < MAX_DIGITS:
        return True  # it can grow, and ten times more ways with each digit than any array writes
    ahead = sum(1 for w in written if (w == 0 if spelled == "0" else w <= 0 if spelled == "-" else
                                       str(w).startswith(spelled)))
    # none written begins so: the number frame let the prefix through only if one within the bounds follows
    return ahead == 0 or integer_completions(prefix, item.bounds) > ahead


def _unique_item(node: Arr, local: tuple, b: int, depth: int) -> list[Outcome]:
    """A unique array's item, its bytes so far ``local[3]``: a whole value not written yet ends it;
    a prefix of one goes on."""
    if b == END:
        return []
    _, n, written, prefix = local
    grown = prefix + bytes([b])
    value, more = _unwritten(unique_items(node), written, grown)
    return [*([] if value is None else [Outcome(("after", n + 1, written | {value}), None, True)]),
            *([Outcome(("item", n, written, grown), None, True)] if more else [])]


def _item_start(items: Str | Num) -> tuple:
    """The first local of the frame whose handler reads a unique array's string or number."""
    return ("open",) if isinstance(items, Str) else initial_number(items)


# a unique array's item, by what its items are: the local kind reading it (its frame's start: ``_item_start``)
_UNIQUE_STARTS = {Values: "item", Str: "string", Num: "number"}
_UNIQUE_READS = {"item": _unique_item, "string": _unique_string, "number": _unique_number}
