"""What a ``uniqueItems`` array of enum values costs a mask, against the same array without it:
the states along two items of an array of N three-letter codes (``["AAA","AAB",…``), at a real
vocabulary's size (``structured_mask_cost.synthetic_pieces``), each state new (memo cold).

    python scripts/unique_items_cost.py [--vocab 151000] [--values 20,250,1000]

and the same for free strings (``set[str]``) and integers (``set[int]``, ``set[conint(ge=0, le=10**5)]``),
each byte a state, and for a dict whose free keys are counted (``minProperties: 2``).

Every state of a unique array is new per set of values written, so each is walked, in the serving
loop: what matters is the cost of one walk.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_mask_cost import synthetic_pieces  # noqa: E402


def masks(vocab, schema: dict, pieces: list[bytes]) -> list[float]:
    """ms of each mask along a value of ``schema``, one after each piece (its bytes, one token each)."""
    from hypic.engine.structured import JsonConstraint, compile_schema

    c = JsonConstraint(vocab, compile_schema(schema), set())
    times = []
    for piece in pieces:
        for b in piece:  # (the synthetic vocabulary's first 256 tokens are the bytes)
            assert c.accept(b), piece
        t0 = time.perf_counter()
        c.allowed()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    from hypic.engine.collector import freeze_long_lived
    from hypic.engine.structured import TokenVocab

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151_000)
    ap.add_argument("--values", default="20,250,1000")
    args = ap.parse_args()
    vocab = TokenVocab(synthetic_pieces(args.vocab))
    freeze_long_lived()  # as a serving process does: no cycle collector's full pass in a row's times
    rows = []
    for n in map(int, args.values.split(",")):
        codes = ["".join(p) for p in itertools.islice(itertools.product("ABCDEFGHIJKLMNOPQRSTUVWXYZ", repeat=3), n)]
        rows.append((str(n), {"enum": codes}, [b"[", b'"', codes[0][:1].encode(), codes[0][1:].encode(), b'"', b",",
                                               b'"', codes[1].encode(), b'"', b",", b'"']))
    # free strings (pydantic's set[str]) and unbounded integers (set[int]): in a unique array each byte
    # of an item is a new state
    rows.append(("strings", {"type": "string"}, [bytes([b]) for b in b'["alpha beta","gamma delta"']))
    rows.append(("integers", {"type": "integer"}, [bytes([b]) for b in b"[12345,678,90123,4"]))
    # bounded ones (set[conint(ge=0, le=10**5)]): each prefix's unwritten completions counted, per byte walked
    rows.append(("bounded integers", {"type": "integer", "minimum": 0, "maximum": 10**5},
                 [bytes([b]) for b in b"[12345,678,90123,4"]))
    print("| values | uniqueItems | states | max mask (ms) | all masks (ms) |")
    print("|---|---|---|---|---|")
    for label, items, pieces in rows:
        for unique in (False, True):
            times = masks(vocab, {"type": "array", "items": items, "uniqueItems": unique}, pieces)
            print(f"| {label} | {'yes' if unique else 'no'} | {len(times)} | {max(times):.1f} | {sum(times):.1f} |")
    # a dict whose keys are counted (dict[str, int] with min_length=2: keys written once each, so the
    # object carries them and every state inside it is new) against the plain dict
    pieces = [bytes([b]) for b in b'{"alpha beta":12,"gamma":345,"delta":6']
    for label, extra in (("dict[str, int]", {}), ("dict[str, int], minProperties 2", {"minProperties": 2})):
        times = masks(vocab, {"type": "object", "additionalProperties": {"type": "integer"}, **extra}, pieces)
        print(f"| {label} | — | {len(times)} | {max(times):.1f} | {sum(times):.1f} |")


if __name__ == "__main__":
    main()
