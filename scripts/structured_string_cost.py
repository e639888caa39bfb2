"""What a structured-output step costs on the host inside strings with a length bound or a pattern
(pydantic's ``max_length``, ``HttpUrl``, free-text patterns): the allowed-token mask of each of the
first tokens of a string, at a real model's vocabulary size (the synthetic vocabulary of
``structured_mask_cost.py``). Each package named is run in a process of its own, one after the
other, so an older checkout can be put beside this one:

    python scripts/structured_string_cost.py [--vocab 150000] [--tokens 8] [--package old=/path/to/checkout]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

SCHEMAS = [
    ("plain", {"type": "string"}),
    ("maxLength 200", {"type": "string", "maxLength": 200}),
    ("pattern ^[a-z ]+$", {"type": "string", "pattern": "^[a-z ]+$"}),
    ("pattern ^.*$", {"type": "string", "pattern": "^.*$"}),
    ("format uri", {"type": "string", "format": "uri"}),
    ("HttpUrl (uri, 1–2083)", {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083}),
]
PREFIX = {"format uri": '"http://ex/', "HttpUrl (uri, 1–2083)": '"http://ex/'}
STEP = "abc"  # the token read after each mask: inside every loop above

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from packages import add_package_args, child_done, run_packages  # noqa: E402


def measure(vocab_size: int, tokens: int) -> dict[str, list[float]]:
    from structured_mask_cost import synthetic_pieces

    from hypic.engine.structured import JsonConstraint, TokenVocab, compile_schema

    pieces = synthetic_pieces(vocab_size)
    for extra in (b"abc", b"ht", b"tp", b"ex", b"://", b'"'):
        if extra not in pieces.values():
            pieces[len(pieces)] = extra
    vocab = TokenVocab(pieces)
    ids = {data: i for i, data in vocab.pieces.items()}
    out = {}
    for name, schema in SCHEMAS:
        c = JsonConstraint(vocab, compile_schema(schema), set())
        text = PREFIX.get(name, '"').encode()
        for data in (text[:1], *([b"ht", b"tp", b"://", b"ex", b"/"] if len(text) > 1 else [])):
            assert c.accept(ids[data]), (name, data)
        times = []
        for _ in range(tokens):
            t0 = time.perf_counter()
            c.allowed()
            times.append(1e3 * (time.perf_counter() - t0))
            assert c.accept(ids[STEP.encode()]), name
        out[name] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=150_000)
    ap.add_argument("--tokens", type=int, default=8)
    add_package_args(ap)
    args = ap.parse_args()
    if child_done(args, lambda: measure(args.vocab, args.tokens)):
        return
    runs = run_packages(__file__, ["--vocab", str(args.vocab), "--tokens", str(args.tokens)], args.package)
    labels = list(runs)
    print(f"vocabulary of ≈{args.vocab} tokens; per string, the mask of each of its first {args.tokens} tokens "
          "(ms): the first, and the median of the rest")
    print("| string | " + " | ".join(f"{lab}: first | {lab}: median after" for lab in labels) + " |")
    print("|---|" + "---|---|" * len(labels))
    for name, _ in SCHEMAS:
        cells = []
        for lab in labels:
            t = runs[lab][name]
            cells += [f"{t[0]:.1f}", f"{statistics.median(t[1:]):.1f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
