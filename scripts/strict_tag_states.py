"""What each new state of a strict tool's structural tag costs: the allowed-token mask along one
call, in the Hermes style (``<tool_call>{"name": …, "arguments": …}</tool_call>``) and in Kimi's
(special tokens), at a real vocabulary's size (``structured_mask_cost.synthetic_pieces``, plus 256
special tokens as Kimi's tokenizer reserves), in a fresh process (every state new, every cache cold).

    python scripts/strict_tag_states.py [--vocab 163840] [--style hermes|kimi]

The first mask is made off the serving loop (``Engine.warm_constraints``); every later new state is
made in it, while every running request waits. Prints one row per state: what was just written,
the mask's time and its size.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_mask_cost import synthetic_pieces  # noqa: E402

KIMI = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}]
# what the answer writes, piece by piece: text (each byte its own token) or a special token by name
PATHS = {
    "hermes": [b"Sure", b".", b" ", b"<tool_call>", b'\n{"name": "get_weather", "arguments": ', b"{", b'"city":"',
               b"Oslo", b'","days":', b"2", b"}", b"}\n</tool_call>", b" ok"],
    "kimi": [b"Sure", b".", KIMI[0], KIMI[2], b"functions.get_weather:", b"0", KIMI[3], b"{", b'"city":"', b"Oslo",
             b'","days":', b"2", b"}", KIMI[4], KIMI[1], b" ok"],
}


def main() -> None:
    from hypic.engine.structured import JsonConstraint, TokenVocab, compile_tags
    from hypic.server.tools import strict_calls

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=163_840)
    ap.add_argument("--style", choices=sorted(PATHS), default="hermes")
    args = ap.parse_args()
    pieces = synthetic_pieces(args.vocab)
    names = KIMI + [f"<|reserved_token_{k}|>" for k in range(256 - len(KIMI))]
    ids = {t: args.vocab + k for k, t in enumerate(names)}
    marks = None
    if args.style == "kimi":
        from hypic.engine.structured.tags import token_mark  # (the mark-reading tree only)
        marks = {i: (token_mark(t, "t"), token_mark(i, "t")) for t, i in ids.items()}
    vocab = TokenVocab(pieces, marks) if marks else TokenVocab(pieces)
    c = JsonConstraint(vocab, compile_tags(strict_calls(TOOLS, args.style)), set())
    print(f"| {args.style}: written so far | mask (ms) | allowed |")
    print("|---|---|---|")
    total = 0.0
    for k, piece in enumerate([None, *PATHS[args.style]]):
        if isinstance(piece, str):
            assert c.accept(ids[piece]), piece
        elif piece is not None:
            for b in piece:
                assert c.accept(b), piece
        t0 = time.perf_counter()
        n = len(c.allowed())
        ms = (time.perf_counter() - t0) * 1e3
        total += ms * (k > 0)
        print(f"| {'(start: off the loop)' if piece is None else repr(piece)} | {ms:.1f} | {n} |")
    print(f"| every later state (in the loop) | {total:.1f} | |")


if __name__ == "__main__":
    main()
