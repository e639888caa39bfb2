"""What scoring a harness's batch of prompts costs (``echo`` + ``logprobs``: lm-eval's
loglikelihood requests), one prompt per forward against packed together (``hypic.engine.scoring``).

A batch of ``--batch`` prompts of ``--min-tokens``…``--max-tokens`` random tokens (lm-eval's
multiple-choice contexts are a few hundred tokens) is scored both ways on one engine, alternated,
medians of ``--reps``; a warm-up pass first. Then the whole of lm-eval's request (``max_tokens: 1``)
two ways: packed scoring and then a prefill for the one token (``hypic`` mode, one segment: full's
token; how the server answered until session 38), against packed scoring that also gives each
prompt's last-row logits, the token drawn from them (``Engine.score(first=…)`` →
``Engine.start(first_logits=…)``: how it answers now); their greedy tokens are compared. Last, a
multiple-choice batch (``--choices`` options per context, each a continuation of 1–8 tokens: how a
harness sends MMLU-like questions) scored packed with each shared context once (now) against with
every prompt whole (``SHARED_MIN`` out of reach).
Both ways give the same scores (``tests/engine/test_scoring.py``); the script reports the largest
difference, beside that between the one-per-forward scores and the same cut into 100-token pieces (not the kernels' 64-token chunks) (two
ways exact in exact arithmetic: what the dtype alone makes of them).

    python3 scripts/echo_scoring.py [--batches 1,8,32,64] [--shape qwen3.5-9b] [--device cuda] [--reps 3]
"""

import argparse
import random
import statistics
import time
from unittest.mock import patch

import torch

from hypic.bench.shapes import SHAPES
from hypic.engine import scoring
from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams
from hypic.engine.scoring import score_prompts
from hypic.models.random_init import random_model


def _largest(a: list, b: list) -> float:
    """The largest difference of a token's log-probability between two scorings of the same prompts."""
    return max(abs(x[t] - y[t]) for pa, pb in zip(a, b, strict=True)
               for x, y in zip(pa[1:], pb[1:], strict=True) for t in x if t in y)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--min-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--top", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shape", default="qwen3.5-9b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--choices", type=int, default=4)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    engine = Engine(random_model(SHAPES[args.shape], device=args.device,
                                 dtype=torch.bfloat16 if cuda else torch.float32))
    vocab, rng = engine.model.vocab_size, random.Random(0)

    def batch(n: int) -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(rng.randint(args.min_tokens, args.max_tokens))]
                for _ in range(n)]

    def timed(fn) -> tuple[float, object]:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    def one_by_one(prompts):
        return [score_prompts(engine.model, engine.device, [p], [args.top], lock=engine._lock)[0] for p in prompts]

    def in_pieces(prompts):  # the same math cut otherwise: the dtype's own disagreement (noise floor)
        with patch.object(scoring, "PIECE", 100):
            return one_by_one(prompts)

    def packed(prompts):
        return score_prompts(engine.model, engine.device, prompts, [args.top] * len(prompts), lock=engine._lock)

    one = SamplingParams(max_tokens=1, temperature=0, logprobs=1)

    def prefilled(prompts):  # scored, then a prefill for the token
        packed(prompts)
        segmented = [[p] for p in prompts]
        return [r.output.token_ids[0] for r in engine.start(segmented, [one] * len(prompts), mode="hypic")]

    def drawn(prompts):  # scored with the last rows' logits, the token drawn from them
        segmented = [[p] for p in prompts]
        scored = engine.score(segmented, args.top, first=[True] * len(prompts))
        runs = engine.start(segmented, [one] * len(prompts), first_logits=scored.first_logits)
        return [r.output.token_ids[0] for r in runs]

    for n in (8, 64):  # warm-up: kernels for every shape the arms meet
        w = batch(n)
        one_by_one(w), packed(w), prefilled(batch(n)), drawn(batch(n))
    rows = []
    for n in [int(b) for b in args.batches.split(",")]:
        times: dict[str, list[float]] = {"one": [], "packed": [], "prefilled": [], "drawn": []}
        worst = floor = 0.0
        same = 0
        for _ in range(args.reps):
            prompts = batch(n)
            t1, a = timed(lambda: one_by_one(prompts))
            t2, b = timed(lambda: packed(prompts))
            fresh = batch(n)  # new prompts: lm-eval's are
            t3, x = timed(lambda: prefilled(fresh))
            t4, y = timed(lambda: drawn(fresh))
            same += sum(p == q for p, q in zip(x, y, strict=True))
            worst = max(worst, _largest(a, b))
            floor = max(floor, _largest(a, in_pieces(prompts)))
            for k, t in (("one", t1), ("packed", t2), ("prefilled", t3), ("drawn", t4)):
                times[k].append(t)
        tokens = sum(len(p) for p in prompts)
        one_ms, pk, pre, dr = (statistics.median(times[k]) * 1e3 for k in ("one", "packed", "prefilled", "drawn"))
        rows.append((n, tokens, one_ms, pk, pre, dr, f"{same}/{n * args.reps}", worst, floor))
    print(f"shape {args.shape}, {args.device}, prompts of {args.min_tokens}-{args.max_tokens} tokens, "
          f"top {args.top}, medians of {args.reps}")
    print("| prompts | tokens (last rep) | one per forward ms | packed ms | ratio | max_tokens 1: scored, then "
          "prefilled ms | token drawn from the scoring ms | ratio | same token | largest score difference, packed "
          "| the same, cut in 100-token pieces |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, tokens, one_ms, pk, pre, dr, same, worst, floor in rows:
        print(f"| {n} | {tokens} | {one_ms:.1f} | {pk:.1f} | {one_ms / pk:.2f}× | {pre:.1f} | {dr:.1f} "
              f"| {pre / dr:.2f}× | {same} | {worst:.1e} | {floor:.1e} |")

    def questions(n: int) -> list[list[int]]:  # n prompts: n / choices contexts, each with its options
        out = []
        for ctx in batch(max(1, n // args.choices)):
            out += [ctx + [rng.randrange(vocab) for _ in range(rng.randint(1, 8))] for _ in range(args.choices)]
        return out

    def whole(prompts):  # no prefix shared: every prompt through the model whole
        with patch.object(scoring, "SHARED_MIN", 1 << 30):
            return packed(prompts)

    whole(questions(16)), packed(questions(16))
    shared_rows = []
    for n in [int(b) for b in args.batches.split(",") if int(b) >= args.choices]:
        t_whole, t_shared, worst = [], [], 0.0
        for _ in range(args.reps):
            prompts = questions(n)
            t1, a = timed(lambda: whole(prompts))
            t2, b = timed(lambda: packed(prompts))
            t_whole.append(t1)
            t_shared.append(t2)
            worst = max(worst, _largest(a, b))
        wh, sh = statistics.median(t_whole) * 1e3, statistics.median(t_shared) * 1e3
        shared_rows.append((n, sum(len(p) for p in prompts), wh, sh, worst))
    print(f"multiple choice: {args.choices} options a context (continuations of 1-8 tokens)")
    print("| prompts | tokens (last rep) | every prompt whole ms | each context once ms | ratio "
          "| largest score difference |")
    print("|---|---|---|---|---|---|")
    for n, tokens, wh, sh, worst in shared_rows:
        print(f"| {n} | {tokens} | {wh:.1f} | {sh:.1f} | {wh / sh:.2f}× | {worst:.1e} |")


if __name__ == "__main__":
    main()
