"""What a structured-output step costs on the host: the allowed-token mask of ``TokenVocab`` at a
real model's vocabulary size (a synthetic byte-level vocabulary: the 256 bytes plus word pieces,
punctuation runs and multi-byte characters), with and without the plain-token shortcut inside free
strings, memo cold (every state new) and warm (the same draws again).

    python scripts/structured_mask_cost.py [--vocab 151000] [--steps 300] [--grammar | --lark]
    python scripts/structured_mask_cost.py --marks 256 [--vocab 163840]

``--marks N``: the same vocabulary with and without N special tokens spelled by their marks (Kimi's
tokenizer has 256 reserved ones; token-level structural-tag formats name them), side by side: the
schema's cold walk, and a strict Kimi call tag's masks (token-level free text, then inside a call).
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


def marks_cost(size: int, n: int, steps: int) -> None:
    """Masks with and without ``n`` special tokens' marks: the schema's draws (cold memo), and the
    first masks of a strict Kimi tag (free text, then each state after a drawn marker)."""
    from hypic.engine.structured import compile_tags
    from hypic.engine.structured.tags import token_mark
    from hypic.server.tools import strict_calls

    pieces = synthetic_pieces(size)
    names = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
             "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
    names += [f"<|reserved_token_{k}|>" for k in range(n - len(names))]
    marks = {size + k: (token_mark(t, "t"), token_mark(size + k, "t")) for k, t in enumerate(names)}
    tools = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}}]
    tag = compile_tags(strict_calls(tools, "kimi"))
    # the tag's marker tokens in order, and text between them: the states a call walks through
    path = [names[0], names[2], b"functions.get_weather:0", names[3], b'{"city":"Oslo","days":2}', names[4], names[1]]
    print(f"| vocabulary | marks | schema: steps | schema cold: mean (ms) | Kimi tag: first mask (ms) | "
          f"Kimi tag: a call, {len(path)} pieces (ms) |")
    print("|---|---|---|---|---|---|")
    for with_marks in (False, True, False, True):  # twice each, alternating: the first pays one-off caches
        vocab = TokenVocab(pieces, marks if with_marks else None)
        times, _ = run(vocab, steps, seed=1)
        by_text = {t: i for i, (m, _) in marks.items() for t in [m[1:-1].decode()]}
        c = JsonConstraint(vocab, tag, set())
        t0 = time.perf_counter()
        c.allowed()
        first = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        for piece in path if with_marks else ():
            if isinstance(piece, str):
                assert c.accept(by_text[piece]), piece
            else:
                for b in piece:  # text one byte token at a time
                    assert c.accept(b), piece
            c.allowed()
        walk = (time.perf_counter() - t0) * 1e3
        print(f"| {len(pieces)} | {len(marks) if with_marks else 0} | {len(times)} | {statistics.mean(times):.2f} | "
              f"{first:.1f} | {walk:.1f} |" if with_marks else
              f"| {len(pieces)} | 0 | {len(times)} | {statistics.mean(times):.2f} | {first:.1f} | — |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151_000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--grammar", action="store_true", help="a GBNF grammar's masks (GRAMMAR) instead of a schema's")
    ap.add_argument("--lark", action="store_true", help="the same grammar in Lark's notation (LARK)")
    ap.add_argument("--marks", type=int, default=0, help="special tokens spelled by marks, with and without")
    args = ap.parse_args()
    if args.marks:
        marks_cost(args.vocab, args.marks, args.steps)
        return
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
