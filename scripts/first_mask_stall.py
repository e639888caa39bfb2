"""What a new constraint's first mask costs the other requests: the serving loop's longest gap
between decode steps while a request with a constraint never seen before arrives, the mask made
in the loop itself (before ``Engine.warm_constraints``) against made on the request's own thread
(the server now calls it there; the loop finds it memoized).

A stand-in loop on one thread asks for a memoized mask every millisecond (a decode step of the
requests already running), at a real model's vocabulary size (``structured_mask_cost``'s synthetic
151 000 tokens); the new constraint is a strict function's structural tag (free text until
``<tool_call>``, the arguments held to a schema) or a plain schema.

    python scripts/first_mask_stall.py [--vocab 151000] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from structured_mask_cost import synthetic_pieces  # noqa: E402

from hypic.engine.structured import JsonConstraint, TokenVocab, compile_schema, compile_tags  # noqa: E402


def constraint(kind: str, k: int) -> object:
    """A constraint never seen before (``k`` in its text): a strict tool's tag, or a schema."""
    schema = {"type": "object", "properties": {f"city{k}": {"type": "string"}, "days": {"type": "integer"}},
              "required": [f"city{k}"]}
    if kind == "schema":
        return compile_schema(schema)
    tag = {"type": "tag", "begin": f'<tool_call>\n{{"name": "weather{k}", "arguments": ',
           "content": {"type": "json_schema", "json_schema": schema}, "end": "}\n</tool_call>"}
    return compile_tags({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"],
                                                               "tags": [tag]}})


def longest_gap(vocab: TokenVocab, running: JsonConstraint, new: object, ahead: bool) -> tuple[float, float]:
    """(the loop's longest gap between steps, the first mask's own time) in ms while ``new`` arrives."""
    gaps, done, made = [], threading.Event(), []

    def first_mask() -> None:
        t0 = time.perf_counter()
        JsonConstraint(vocab, new, set()).allowed()
        made.append((time.perf_counter() - t0) * 1e3)

    if ahead:  # on the request's thread, as the server now does
        threading.Thread(target=lambda: (first_mask(), done.set())).start()
    last = time.perf_counter()
    for step in range(100_000):
        if not ahead and step == 5:  # in the loop: the step that starts the new request makes it
            first_mask()
            done.set()
        running.allowed()  # the running requests' step: a memoized mask
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append((now - last) * 1e3)
        last = now
        if done.is_set() and step > 10:
            break
    return max(gaps), made[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151_000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    vocab = TokenVocab(synthetic_pieces(args.vocab))
    running = JsonConstraint(vocab, constraint("schema", -1), set())
    running.allowed()
    print(f"vocabulary of {args.vocab} tokens; the loop steps every 1 ms; median of {args.reps} new constraints each")
    print("| new constraint | first mask made | first mask (ms) | loop's longest gap (ms) |")
    print("|---|---|---|---|")
    k = 0
    for kind in ("tool tag", "schema"):
        for ahead in (False, True):
            gaps, costs = [], []
            for _ in range(args.reps):
                k += 1
                gap, cost = longest_gap(vocab, running, constraint("schema" if kind == "schema" else "tag", k), ahead)
                gaps.append(gap)
                costs.append(cost)
            where = "on the request's thread" if ahead else "in the loop"
            print(f"| {kind} | {where} | {statistics.median(costs):.1f} | {statistics.median(gaps):.1f} |")


if __name__ == "__main__":
    main()
