"""Serving a RAG trace: TTFT under load, and the highest arrival rate each mode sustains within a
TTFT SLO (``hypic bench trace``).

The published system's serving claim is of this kind: on a production RAG trace, under a 1-second
TTFT SLO, 1.66× the sustainable QPS of a prefix cache. The trace here is ``hypic.eval.trace``: a
document pool with Zipf popularity, Poisson arrivals, a varied number of documents per request in
retrieval order. Requests go through the serving loop (``engine.scheduler.Scheduler``, what
``hypic serve`` runs: waiting requests prefilled together, decode batched across requests) in real
time, in this process or in a running ``hypic serve`` over HTTP (``trace_targets``). Each is
submitted at its arrival, and its TTFT runs from the arrival to its first token, so time spent
queueing behind other requests counts, as it does for a client.

Per mode the caches start empty; a warm-up block of requests runs back to back, unmeasured (the
state of a server that has been up a while; kernels compiled). Then one block of new requests
per rate of the grid, ascending: the cache keeps the history a server would have, and every mode
meets the same requests at the same rate. A rate is sustained when its block's p90 TTFT is within
the SLO and no request failed; the first rate that is not ends the mode's sweep (past capacity the
queue only grows). The sustainable rate is the highest grid rate sustained, so the grid's step is
the resolution of every ratio quoted from it.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from hypic.bench.trace_targets import Moves, Outcome
from hypic.eval.metrics import best_score
from hypic.eval.trace import Trace, generate_trace

QUANTILE = 0.9  # the SLO is on this quantile of a block's TTFT


@dataclass(frozen=True)
class TraceLoad:
    """The load of a sweep; each field is ``hypic bench trace``'s option of that name (``slo_s``:
    ``--slo-ms`` in seconds), and a bad value is refused naming the option, before any model is built."""
    requests: int = 64  # per rate of the grid
    warm: int = 64  # the unmeasured warm-up block
    pool: int = 256  # documents in the trace's pool
    zipf: float = 1.0
    num_docs: tuple[int, int] = (4, 32)
    doc_tokens: tuple[int, int] = (64, 512)
    max_tokens: int = 16  # decoded per request: decode steps share the device with new prefills
    slo_s: float = 1.0
    max_running: int = 32  # the serving loop's concurrent requests
    max_prefill_tokens: int | None = None  # the serving loop's tokens computed per prefill call (Scheduler)
    seed: int = 0

    def __post_init__(self) -> None:
        for name, least in (("requests", 1), ("warm", 0), ("pool", 2), ("max_tokens", 1), ("max_running", 1),
                            ("max_prefill_tokens", 1)):
            value = getattr(self, name)
            if value is not None and value < least:
                raise ValueError(f"--{name.replace('_', '-')}: expected at least {least}, got {value}")
        for name in ("num_docs", "doc_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"--{name.replace('_', '-')}: expected lo,hi with 1 ≤ lo ≤ hi, got {lo},{hi}")
        if not 0 <= self.zipf < math.inf:
            raise ValueError(f"--zipf: expected a finite exponent ≥ 0, got {self.zipf}")
        if not 0 < self.slo_s < math.inf:
            raise ValueError(f"--slo-ms: expected a finite positive number, got {1e3 * self.slo_s:g}")


def nearest_rank(values: list[float], q: float) -> float:
    """The ``q`` quantile by nearest rank: the ⌈q·n⌉-th smallest of n values, the smallest value
    with at least ``q`` of them at or below it — so "p90 ≤ SLO" means at least 90% of requests
    within the SLO. (Until 2026-12-01 the rank was rounded to the nearest instead: a block of 48
    reported its 43rd value, 89.6%, as its p90.)"""
    ordered = sorted(values)
    rank = math.ceil(round(q * len(ordered), 9))  # round: 0.55 · 460 is 253.00000000000003 in floats
    return ordered[min(len(ordered), max(1, rank)) - 1]


@dataclass
class Probe:
    """One block of requests replayed at one rate under one mode."""
    mode: str
    rate: float
    ttft: list[float] = field(default_factory=list)  # s, arrival → first token, per answered request
    engine_ttft: list[float] = field(default_factory=list)  # s, the prefill alone (the engine's own clock)
    itl: list[float] = field(default_factory=list)  # s between consecutive tokens of every answered request
    errors: list[str] = field(default_factory=list)
    hits: int = 0
    misses: int = 0
    missing: int = 0  # requests with at least one miss: each makes its prefill call build entries
    prompt_tokens: int = 0
    moves: tuple[int, int, int] = (0, 0, 0)  # the store's promotions, demotions, evictions during the block
    move_s: float | None = 0.0  # host seconds the store spent issuing those copies (None: not reported)
    em: float | None = None  # exact match of the answers, when the model has a tokenizer of its own

    def quantile(self, q: float) -> float:
        return nearest_rank(self.ttft, q) if self.ttft else float("inf")

    def sustained(self, slo_s: float) -> bool:
        return not self.errors and self.quantile(QUANTILE) <= slo_s


class Target(Protocol):
    """What the sweep drives (``hypic.bench.trace_targets``: in process, or a server over HTTP)."""

    def begin(self, mode: str) -> None: ...  # the next calls use ``mode``, with empty caches

    def warm(self, indices: list[int]) -> None: ...

    def moves(self) -> Moves: ...

    def call(self, i: int, due: float, max_tokens: int) -> Outcome | str: ...

    def note(self) -> str: ...  # a line on the engine's work since the last note ("" if unknown)

    def close(self) -> None: ...


def replay(target: Target, requests: list[int], arrivals: list[float], max_tokens: int) -> list[Outcome | str]:
    """Send each request at its arrival (s from now) from a thread of its own; per request, its
    outcome, or the error that ended it."""
    out: list[Outcome | str] = ["never answered"] * len(requests)
    t0 = time.perf_counter() + 0.02  # every thread is started before the first arrival

    def one(j: int) -> None:
        due = t0 + arrivals[j]
        time.sleep(max(0.0, due - time.perf_counter()))
        out[j] = target.call(requests[j], due, max_tokens)

    threads = [threading.Thread(target=one, args=(j,), daemon=True) for j in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def make_trace(load: TraceLoad, rates: list[float]) -> Trace:
    """The warm-up block, then one block per rate; arrivals at 1 QPS (each block is rescaled)."""
    return generate_trace(load.seed, num_requests=load.warm + load.requests * len(rates), pool_size=load.pool,
                          rate_qps=1.0, zipf_s=load.zipf, num_docs=load.num_docs, doc_tokens=load.doc_tokens)


def run(target: Target, trace: Trace, load: TraceLoad, modes: list[str], rates: list[float]) -> list[Probe]:
    """Every mode's sweep over ``rates`` (ascending) on ``trace`` (``make_trace``)."""
    rates = sorted(rates)
    if not rates or not all(0 < r < math.inf for r in rates):
        raise ValueError(f"rates: expected finite positive numbers (QPS), got {rates}")
    n = load.requests
    if len(trace.requests) < load.warm + n * len(rates):
        raise ValueError(f"the trace has {len(trace.requests)} requests, the sweep needs "
                         f"{load.warm + n * len(rates)}")
    probes: list[Probe] = []
    try:
        for mode in modes:
            target.begin(mode)
            target.warm(list(range(load.warm)))
            target.note()  # the blocks' notes leave the warm-up out
            for k, rate in enumerate(rates):
                block = list(range(load.warm + k * n, load.warm + (k + 1) * n))
                first = trace.requests[block[0]].arrival_s  # the trace runs at 1 QPS: scale it to `rate`
                arrivals = [(trace.requests[i].arrival_s - first) / rate for i in block]
                probe, before = Probe(mode, rate), target.moves()
                results = replay(target, block, arrivals, load.max_tokens)
                after = target.moves()
                probe.moves = (after.promotions - before.promotions, after.demotions - before.demotions,
                               after.evictions - before.evictions)
                probe.move_s = None if after.seconds is None else after.seconds - (before.seconds or 0.0)
                ems = []
                for i, res in zip(block, results, strict=True):
                    if isinstance(res, str):
                        probe.errors.append(res)
                        continue
                    probe.ttft.append(res.ttft_s)
                    probe.engine_ttft.append(res.prefill_s)
                    probe.itl.extend(res.gaps)
                    probe.hits, probe.misses = probe.hits + res.hits, probe.misses + res.misses
                    probe.missing += res.misses > 0
                    probe.prompt_tokens += res.prompt_tokens
                    if res.answer is not None:
                        ems.append(best_score("em_f1", res.answer, trace.requests[i].references)["em"])
                probe.em = 100 * sum(ems) / len(ems) if ems else None
                probes.append(probe)
                print(f"trace {mode} {rate:g} QPS: p50 {1e3 * probe.quantile(0.5):.0f} ms, "
                      f"p90 {1e3 * probe.quantile(QUANTILE):.0f} ms, {len(probe.errors)} errors, "
                      f"{probe.missing} requests with a miss",
                      file=sys.stderr, flush=True)
                for e in sorted(set(probe.errors)):  # each distinct failure once: a bench must say why
                    print(f"trace {mode} {rate:g} QPS: {probe.errors.count(e)} × {e}", file=sys.stderr, flush=True)
                note = target.note()
                if note:
                    print(f"trace {mode} {rate:g} QPS: {note}", file=sys.stderr, flush=True)
                if not probe.sustained(load.slo_s):
                    break
    finally:
        target.close()
    return probes


def sustainable(probes: list[Probe], mode: str, slo_s: float) -> tuple[float | None, bool]:
    """(the highest rate ``mode`` sustained — None if it sustained none —, whether its sweep ended
    on the grid's last rate sustained: then the rate is only a lower bound)."""
    mine = [p for p in probes if p.mode == mode]
    ok = [p.rate for p in mine if p.sustained(slo_s)]
    return (max(ok) if ok else None), bool(mine) and mine[-1].sustained(slo_s)


def report(probes: list[Probe], load: TraceLoad, rates: list[float], title: str,
           cache_bytes: int | None = None, url: str | None = None) -> str:
    """The tables; ``url``: the requests went to that server (its own limits apply, not ``load``'s)."""
    slo_ms = 1e3 * load.slo_s
    budget = "" if cache_bytes is None else f" Segment store: {cache_bytes / 2**30:.3g} GiB on the device."
    cap = "" if load.max_prefill_tokens is None else f" and {load.max_prefill_tokens} tokens computed a prefill call"
    serving = (f"sent to {url} over HTTP (the server's own limits; ITL between streamed chunks of text, "
               f"on the client's clock)" if url is not None
               else f"at most {load.max_running} requests running{cap} (ITL by the serving loop's clock)")

    lines = [f"### {title}", "",
             f"{load.requests} requests per rate after {load.warm} warm-up requests; pool of {load.pool} documents "
             f"(Zipf {load.zipf:g}), {load.num_docs[0]}–{load.num_docs[1]} documents of "
             f"{load.doc_tokens[0]}–{load.doc_tokens[1]} tokens per request, {load.max_tokens} tokens decoded, "
             f"{serving}; SLO: p90 TTFT ≤ {slo_ms:.0f} ms.{budget}", "",
             "| mode | rate (QPS) | TTFT p50 (ms) | p90 (ms) | p99 (ms) | prefill p50 (ms) | "
             "ITL p50 / p99 / max (ms) | segment hits (requests with a miss) | "
             "promoted / demoted / evicted (host ms) | prompt tokens / request | EM | within SLO |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    modes = list(dict.fromkeys(p.mode for p in probes))
    for p in probes:
        seg, verdict = p.hits + p.misses, "yes" if p.sustained(load.slo_s) else "no"
        if p.errors:
            verdict += f" ({len(p.errors)} errors)"
        answered = max(1, len(p.ttft))
        prefill = nearest_rank(p.engine_ttft, 0.5) if p.engine_ttft else float("nan")  # as TTFT's p50
        itl = (" / ".join(f"{1e3 * nearest_rank(p.itl, q):.1f}" for q in (0.5, 0.99, 1.0)) if p.itl else "–")
        lines.append(f"| {p.mode} | {p.rate:g} | {1e3 * p.quantile(0.5):.1f} | {1e3 * p.quantile(QUANTILE):.1f} | "
                     f"{1e3 * p.quantile(0.99):.1f} | {1e3 * prefill:.1f} | {itl} | "
                     f"{100 * p.hits / seg if seg else 0:.0f}% ({100 * p.missing / answered:.0f}%) | "
                     f"{' / '.join(map(str, p.moves))}{'' if p.move_s is None else f' ({1e3 * p.move_s:.0f})'} | "
                     f"{p.prompt_tokens / answered:.0f} | "
                     f"{'–' if p.em is None else f'{p.em:.1f}'} | "
                     f"{verdict} |")
    lines += ["", "| mode | sustainable rate (QPS) | vs prefix | vs full |", "|---|---|---|---|"]
    best = {m: sustainable(probes, m, load.slo_s) for m in modes}
    for m in modes:
        rate, open_ended = best[m]
        cells = ["–" if base == m or base not in best else _ratio(best[m], best[base]) for base in ("prefix", "full")]
        # none sustained: below the grid's lowest rate (``--rates`` may be given in any order)
        shown = f"< {min(rates):g}" if rate is None else f"{'≥ ' if open_ended else ''}{rate:g}"
        lines.append(f"| {m} | {shown} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def _ratio(mine: tuple[float | None, bool], base: tuple[float | None, bool]) -> str:
    """One sustainable rate over another; a rate the grid did not bound above is a lower bound, so
    the ratio is one too (or an upper bound when it is the base's)."""
    (rate, open_mine), (ref, open_ref) = mine, base
    if rate is None or ref is None:
        return "–"
    if open_mine and open_ref:
        return "? (neither bounded)"
    return f"{'≥ ' if open_mine else '≤ ' if open_ref else ''}{rate / ref:.2f}×"
