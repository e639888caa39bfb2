"""The cycle collector's full passes during masks, with and without the vocabulary's tries frozen out
of them (``collector.freeze_long_lived``): a synthetic vocabulary of real size, then masks along
values whose every state is new (a ``set[str]``'s strings, a dict whose keys are counted), each
variant in a fresh process.

    python scripts/gc_pause.py [--vocab 151000] [--states 600]

Prints, per variant, the full (generation 2) collections met, their longest and total time, and the
masks' median, 99th percentile and longest time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(vocab_size: int, states: int, freeze: bool) -> dict:
    import gc

    from structured_mask_cost import synthetic_pieces

    from hypic.engine.collector import freeze_long_lived
    from hypic.engine.structured import JsonConstraint, TokenVocab, compile_schema

    vocab = TokenVocab(synthetic_pieces(vocab_size))
    if freeze:  # as a serving process does once its vocabulary is built (Engine.freeze_collector)
        freeze_long_lived()
    pauses: list[float] = []
    began = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        elif info["generation"] == 2:
            pauses.append((time.perf_counter() - began[0]) * 1e3)

    gc.callbacks.append(timed)
    schemas = [{"type": "array", "items": {"type": "string"}, "uniqueItems": True},
               {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}]
    words = b"alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    masks: list[float] = []
    k = 0
    while len(masks) < states:
        schema = schemas[k % 2]
        text = (b'["' + b'","'.join(words[:4]) + b'"') if k % 2 == 0 else \
            b"{" + b",".join(b'"%s %d":%d' % (w, k, i) for i, w in enumerate(words[:4]))
        c = JsonConstraint(vocab, compile_schema(schema), set())
        for b in text:
            assert c.accept(b)
            t0 = time.perf_counter()
            c.allowed()
            masks.append((time.perf_counter() - t0) * 1e3)
        words = words[1:] + words[:1]
        k += 1
    gc.callbacks.remove(timed)
    masks.sort()
    return {"collections": len(pauses), "longest": max(pauses, default=0.0), "total": sum(pauses),
            "median": statistics.median(masks), "p99": masks[int(0.99 * (len(masks) - 1))], "max": masks[-1],
            "masks": len(masks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151_000)
    ap.add_argument("--states", type=int, default=600)
    ap.add_argument("--variant", choices=["frozen", "unfrozen"], help="(internal: one variant, as JSON)")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run(args.vocab, args.states, args.variant == "frozen")))
        return
    print("| tries | masks | full collections | longest (ms) | all (ms) | mask median / p99 / max (ms) |")
    print("|---|---|---|---|---|---|")
    for variant in ("unfrozen", "frozen"):
        out = subprocess.run([sys.executable, __file__, "--vocab", str(args.vocab), "--states", str(args.states),
                              "--variant", variant], check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {variant} | {r['masks']} | {r['collections']} | {r['longest']:.1f} | {r['total']:.1f} | "
              f"{r['median']:.1f} / {r['p99']:.1f} / {r['max']:.1f} |")


if __name__ == "__main__":
    main()
