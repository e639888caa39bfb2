"""What a structured-output step costs on the host: the allowed-token mask of ``TokenVocab`` at a
real model's vocabulary size (a synthetic byte-level vocabulary: the 256 bytes plus word pieces,
punctuation runs and multi-byte characters), with and without the plain-token shortcut inside free
strings, memo cold (every state new) and warm (the same draws again).

    python scripts/structured_mask_cost.py [--vocab 151000] [--steps 300] [--grammar | --lark]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from hypic.engine.structured import JsonConstraint, TokenVocab, compile_grammar, compile_schema
from hypic.engine.structured import vocab as vocab_module

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "summary": {"type": "string"}, "year": {"type": "integer"},
    "authors": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "score": {"type": "number"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
    "required": ["title", "summary", "year", "authors"]}


def synthetic_pieces(n: int, seed: int = 0) -> dict[int, bytes]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    pieces = {i: bytes([i]) for i in range(256)}
    seen = set(pieces.values())
    while len(pieces) < n:
        r = rng.random()
        if r < 0.75:  # a word piece, often with its leading space
            word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
            text = (" " if rng.random() < 0.6 else "") + word
        elif r < 0.9:  # punctuation and digits, as code and JSON tokenize
            text = "".join(rng.choice('{}[]":,. 0123456789\\-_/') for _ in range(rng.randint(2, 4)))
        else:  # other scripts
            text = "".join(chr(rng.randint(0x400, 0x9FFF)) for _ in range(rng.randint(1, 3)))
        data = text.encode()
        if data not in seen:
            seen.add(data)
            pieces[len(pieces)] = data
    return pieces


# a GBNF grammar (``--grammar``): free-text lines, then a JSON-ish record — a state inside a line's
# ``[^\n]+`` allows nearly every token, as a JSON string does, without the free-string shortcut
GRAMMAR = r"""
root   ::= line{1,3} record
line   ::= "- " [^\n]+ "\n"
record ::= "{" "\"name\": \"" [^"\\]* "\", \"n\": " [0-9]{1,6} "}"
"""

# the same language in Lark's notation (``--lark``): its loops are regexes, read as grammar frames
LARK = r"""
start: line~1..3 record
line: "- " /[^\n]+/ "\n"
record: "{\"name\": \"" /[^"\\]*/ "\", \"n\": " /[0-9]{1,6}/ "}"
"""


def run(vocab: TokenVocab, steps: int, seed: int, grammar: str | None = None) -> tuple[list[float], int]:
    """ms per step for ``steps`` tokens drawn at random under the mask (restarting at each end);
    tokens holding a closing byte weigh 3 000 times more, so that values end."""
    rng = random.Random(seed)
    node = compile_grammar(grammar) if grammar else compile_schema(SCHEMA)
    c = JsonConstraint(vocab, node, set())
    times, values = [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        ids = c.allowed()
        times.append((time.perf_counter() - t0) * 1e3)
        pick = ids.tolist()
        # a grammar's lines end at a newline (favoured far above all: quotes are text inside a line)
        weights = [1.0 + 3000.0 * sum(b in (b'"}' if grammar else b'"]},') for b in vocab.pieces[i])
                   + (1e6 * (b"\n" in vocab.pieces[i]) if grammar else 0.0) for i in pick]
        c.accept(rng.choices(pick, weights)[0])
        if c.finished:
            values += 1
            c = JsonConstraint(vocab, node, set())
    return times, values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151_000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--grammar", action="store_true", help="a GBNF grammar's masks (GRAMMAR) instead of a schema's")
    ap.add_argument("--lark", action="store_true", help="the same grammar in Lark's notation (LARK)")
    args = ap.parse_args()
    grammar = LARK if args.lark else GRAMMAR if args.grammar else None
    pieces = synthetic_pieces(args.vocab)
    t0 = time.perf_counter()
    vocab = TokenVocab(pieces)
    build = time.perf_counter() - t0
    print(f"vocabulary of {len(pieces)} tokens, {len(vocab.plain.ids)} plain; trie built in {build:.2f} s")
    print("| shortcut | memo | steps | values ended | states walked | p50 (ms) | p90 (ms) | max (ms) | "
          "walked states: mean (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    real = vocab_module.free_string_room
    for shortcut in (True,) if grammar else (True, False):
        vocab_module.free_string_room = real if shortcut else (lambda state: None)
        vocab.clear_memo()
        for memo in ("cold", "warm"):
            before = vocab.memo_misses
            times, values = run(vocab, args.steps, seed=1, grammar=grammar)
            walked = vocab.memo_misses - before
            q = statistics.quantiles(times, n=10)
            slow = sorted(times)[-walked:] if walked else [0.0]  # a walk costs far more than a memo hit
            print(f"| {'on' if shortcut else 'off'} | {memo} | {len(times)} | {values} | {walked} "
                  f"| {statistics.median(times):.2f} | {q[8]:.2f} | {max(times):.1f} | {statistics.mean(slow):.1f} |")
    vocab_module.free_string_room = real


if __name__ == "__main__":
    main()
