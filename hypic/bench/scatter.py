"""Cold TTFT with the cold segments scattered over several devices (``hypic bench scatter``).

Every request is cold (a fresh store each time): the documents are prefilled standalone, then the
combine pass runs. Rows, measured round-robin per prompt so host and device noise hit them alike:

- ``one device``: the engine alone (its one-forward cold request: prefill and combine fused);
- ``scatter, lpt`` and ``scatter, round_robin``: the same engine with its cold workers, routing
  the documents by each policy.

Two prompt sets: ``uniform`` (every document the same length, where both policies agree) and
``skewed`` (a fixed mix of short and long documents, where LPT's balance shows). Each row's
first-token logits are compared with the one-device row's on the same prompt: scattering moves
work, not numbers, so they must agree to the dtype's rounding. Under the table, each scatter row's
last request as a timeline: what each device computed, when, and when its entries had arrived.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch

from hypic.engine.engine import Engine
from hypic.parallel.router import assign, makespan

SKEWED_LENGTHS = (4096, 2048, 1024, 512, 256, 128)  # drawn with weights 1, 2, 4, 8, 8, 8
KINDS = ("uniform", "skewed")  # the prompt sets
HEAD_TOKENS, QUERY_TOKENS = 512, 64  # each prompt's head and query


def prompts(kind: str, docs: int, doc_tokens: int, vocab: int, count: int, seed: int = 0,
            head: int = HEAD_TOKENS, query: int = QUERY_TOKENS) -> list[list[list[int]]]:
    """``count`` prompts of fresh documents: ``uniform`` ones of ``doc_tokens`` each, or ``skewed``
    lengths from SKEWED_LENGTHS (scaled by doc_tokens / 1024), the same length list every prompt."""
    rng = random.Random(seed)
    if kind == "uniform":
        lengths = [doc_tokens] * docs
    elif kind == "skewed":
        pick = random.Random(seed + 1).choices(SKEWED_LENGTHS, weights=(1, 2, 4, 8, 8, 8), k=docs)
        lengths = [max(8, n * doc_tokens // 1024) for n in pick]
    else:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    return [[tokens(head), *[tokens(n) for n in lengths], tokens(query)] for _ in range(count)]


def _cold(engine: Engine, prompt: list[list[int]]) -> tuple[float, torch.Tensor]:
    engine.store.clear()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    t0 = time.perf_counter()
    logits, metrics = engine.prefill_logits([prompt], mode="hypic")
    logits = logits.float().cpu()  # the first token's logits on the host: the request's TTFT
    assert metrics[0].segment_hits == 0, "a cold row must miss every document"
    return time.perf_counter() - t0, logits[0]


def timeline(pool_timeline: dict, ttft: float) -> str:
    """One scattered request's timeline, in ms from the moment the shares were sent."""
    t = pool_timeline
    local = t.get("local", {"documents": 0, "tokens": 0})
    parts = [f"engine's device {local['documents']} docs / {local['tokens']} tokens"]
    if "local_events" in t:
        start, end = t["local_events"]
        parts[-1] += f", device time {start.elapsed_time(end):.0f}"
    for rank, w in sorted(t["workers"].items()):
        computed, done = 1000 * (w["computed"] - w["started"]), 1000 * (w["computed"] - t["sent"])
        parts.append(f"worker {rank} {w['documents']} docs / {w['tokens']} tokens, computed {computed:.0f} "
                     f"(done at +{done:.0f}), {w['bytes'] / 2**30:.2f} GiB; the engine heard of it at "
                     f"+{1000 * (w['answered'] - t['sent']):.0f}")
    return "; ".join(parts) + f"; TTFT {1000 * ttft:.0f}; routed with handicap (tokens) {t.get('handicap')}"


def run(engine: Engine, kind: str, docs: int = 32, doc_tokens: int = 1024, reps: int = 5,
        seed: int = 0) -> dict[str, object]:
    """p50 cold TTFT (s) per row, with min/max, the largest logit difference from one device, and
    each policy's planned makespan (tokens on the busiest device) for the prompt set."""
    if engine.pool is None:
        raise ValueError("the engine has no cold workers (cold_workers=…)")
    pool = engine.pool
    batch = prompts(kind, docs, doc_tokens, engine.model.vocab_size, reps + 1, seed)
    rows: dict[str, str | None] = {  # row → routing policy; None: the engine alone
        "one device": None, "scatter, lpt": "lpt", "scatter, round_robin": "round_robin"}
    times: dict[str, list[float]] = {r: [] for r in rows}
    diff: dict[str, float] = {r: 0.0 for r in rows}
    lines: dict[str, str] = {}
    for i, prompt in enumerate(batch):
        ref = None
        for row, how in rows.items():
            if pool.closed:  # a worker was lost during the run: every later row would be one device's
                raise RuntimeError("bench scatter: the cold pool closed during the run (a worker was lost)")
            engine.pool = None if how is None else pool
            if how is not None:
                pool.policy = how
                pool.timeline = {}  # this call's, or none when the router kept every miss on one device
            t, logits = _cold(engine, prompt)
            ref = logits if ref is None else ref
            diff[row] = max(diff[row], (logits - ref).abs().max().item())
            if i:  # prompt 0 warms kernels and links up
                times[row].append(t)
            if how is not None and i == len(batch) - 1:
                lines[row] = timeline(pool.timeline, t) if pool.timeline else "not scattered (all on one device)"
        print(f"scatter {kind} prompt {i}: " + ", ".join(f"{r} {1000 * v[-1]:.1f} ms" for r, v in times.items() if v),
              file=sys.stderr, flush=True)
    engine.pool, pool.policy = pool, "lpt"
    lengths = [len(d) for d in batch[0][:-1]]  # every cached segment: the head and the documents
    res: dict[str, object] = {"kind": kind, "workers": pool.workers, "tokens": sum(len(s) for s in batch[0]),
                              "doc_lengths": lengths, "timelines": lines}
    for row, values in times.items():
        res[row] = (statistics.median(values), min(values), max(values), diff[row])
    for policy in ("lpt", "round_robin"):  # as routed at the end (LPT with the handicap learned by then)
        owner = assign(lengths, pool.workers, policy, pool.handicap if policy == "lpt" else None)
        res[f"makespan_{policy}"] = makespan(lengths, owner, pool.workers)
    return res


def report(results: list[dict[str, object]], title: str) -> str:
    lines = [f"### {title}", "",
             "| prompts | row | cold TTFT p50 (ms) | min–max (ms) | speed-up | max Δ logit vs one device |",
             "|---|---|---|---|---|---|"]
    for res in results:
        one = res["one device"][0]  # type: ignore[index]
        for row in ("one device", "scatter, lpt", "scatter, round_robin"):
            p50, lo, hi, d = res[row]  # type: ignore[misc]
            lines.append(f"| {res['kind']} | {row} | {1000 * p50:.1f} | {1000 * lo:.1f}–{1000 * hi:.1f} | "
                         f"{one / p50:.2f}× | {d:.2e} |")
    lines.append("")
    for res in results:
        lengths: list[int] = res["doc_lengths"]  # type: ignore[assignment]
        lines.append(f"{res['kind']}: {res['tokens']} prompt tokens, {len(lengths)} cached segments (the head and "
                     f"documents, {min(lengths)}–{max(lengths)} tokens), {res['workers']} devices; tokens on the "
                     f"busiest device: lpt {res['makespan_lpt']}, round_robin {res['makespan_round_robin']}")
        for row, line in res["timelines"].items():  # type: ignore[attr-defined]
            lines.append(f"- {res['kind']}, {row}, last prompt (ms): {line}")
    return "\n".join(lines)
