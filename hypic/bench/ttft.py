"""TTFT across the ladder on RAG prompts: a head, N documents in an order never seen before, a query.

Rows: ``full``; ``prefix`` (documents cached in another order, so only the head matches);
``hypic`` warm (every document cached); ``hypic`` cold (standalone prefill of every document
first); and the lower bound: a plain forward over as many tokens as the warm recompute set.
p50 over several prompts, each with a fresh document order and query.
"""

from __future__ import annotations

import contextlib
import importlib
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from hypic.cache.store import SegmentStore
from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams
from hypic.models.context import SequenceContext, SequenceState


@dataclass(frozen=True)
class RagShape:
    docs: int = 32
    doc_tokens: int = 1024
    head_tokens: int = 512
    query_tokens: int = 64


def rag_prompts(shape: RagShape, vocab: int, count: int, seed: int = 0) -> list[list[list[int]]]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    head, docs = tokens(shape.head_tokens), [tokens(shape.doc_tokens) for _ in range(shape.docs)]
    prompts = []
    for _ in range(count):
        order = rng.sample(range(shape.docs), shape.docs)
        prompts.append([head, *[docs[i] for i in order], tokens(shape.query_tokens)])
    return prompts


def _ttft(engine: Engine, prompt: list[list[int]], mode: str) -> tuple[float, object]:
    out = engine.generate([prompt], [SamplingParams(max_tokens=1)], mode=mode)[0]
    return out.metrics.ttft_s, out.metrics


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


@torch.no_grad()
def _lower_bound(engine: Engine, tokens: int, vocab: int) -> float:
    ids = torch.randint(10, vocab, (tokens,), device=engine.device)
    ctx = SequenceContext([SequenceState()], [tokens], engine.device)
    _sync(engine)
    t0 = time.perf_counter()
    engine.model(ids, ctx, torch.tensor([tokens - 1], device=engine.device)).cpu()
    return time.perf_counter() - t0


def run(engine: Engine, shape: RagShape, reps: int = 5, seed: int = 0, ab: bool = False) -> dict[str, float]:
    """p50 TTFT (s) per row; also the warm recompute-set size and the cache bytes per document.
    ``ab``: also warm requests with each of ``AB_SWITCHES`` undone (CUDA), to attribute the gains."""
    vocab = engine.model.vocab_size
    prompts = rag_prompts(shape, vocab, reps + 2, seed)
    res: dict[str, float] = {}

    def note(key: str) -> None:  # each row as soon as it is measured: a run cut off by a time limit keeps it
        print(f"ttft {key}: {1000 * res[key]:.1f} ms", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    engine.generate([prompts[0]], [SamplingParams(max_tokens=1)], mode="full")  # warm-up: kernels, autotune
    print(f"ttft warm-up: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    res["full"] = statistics.median(_ttft(engine, p, "full")[0] for p in prompts[1:reps + 1])
    note("full")
    _ttft(engine, prompts[0], "prefix")  # the documents enter the prefix cache in one order
    res["prefix"] = statistics.median(_ttft(engine, p, "prefix")[0] for p in prompts[1:reps + 1])
    note("prefix")
    cold = []
    for p in prompts[1:reps + 1]:
        engine.store = SegmentStore(engine.device, device_bytes=engine.store.budgets["device"],
                                    host_bytes=engine.store.budgets["host"])
        cold.append(_ttft(engine, p, "hypic")[0])
    res["hypic_cold"] = statistics.median(cold)
    note("hypic_cold")
    _ttft(engine, prompts[0], "hypic")  # every document cached
    warm = [_ttft(engine, p, "hypic") for p in prompts[1:reps + 1]]
    res["hypic_warm"] = statistics.median(t for t, _ in warm)
    note("hypic_warm")
    if ab:
        for key, switch in AB_SWITCHES.items():  # the same warm requests with one change undone
            with switch():
                res[key] = statistics.median(_ttft(engine, p, "hypic")[0] for p in prompts[1:reps + 1])
            note(key)
    recompute = warm[0][1].recomputed_tokens
    assert warm[0][1].segment_misses == 0, "warm requests must hit every document"
    _lower_bound(engine, recompute, vocab)
    res["lower_bound"] = statistics.median(_lower_bound(engine, recompute, vocab) for _ in range(reps))
    note("lower_bound")
    res["recompute_tokens"] = recompute
    stats = engine.store.stats()
    res["bytes_per_doc"] = (stats.bytes["device"] + stats.bytes["host"]) / max(1, sum(stats.entries.values()))
    return res


@contextlib.contextmanager
def _attribute(module: str, name: str, value: object) -> Iterator[None]:
    mod = importlib.import_module(module)
    old = getattr(mod, name)
    setattr(mod, name, value)
    try:
        yield
    finally:
        setattr(mod, name, old)


# Warm-path changes that a switch can undo, for A/B rows in one run (``--ab``).
AB_SWITCHES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "warm_chunked_short_runs": lambda: _attribute("hypic.ops.kernels", "RECURRENT_MAX", 0),
    "warm_fla_conv": lambda: _attribute("hypic.ops.conv", "_FLA_CONV", True),
}


def report(res: dict[str, float], shape: RagShape, title: str) -> str:
    rows = [("full", "full"), ("prefix (docs seen in another order)", "prefix"),
            ("hypic warm (all docs cached, new order)", "hypic_warm"), ("hypic cold (standalone)", "hypic_cold"),
            (f"lower bound: forward over {int(res['recompute_tokens'])} tokens", "lower_bound")]
    lines = [f"### {title}", "",
             f"Prompt: head {shape.head_tokens} + {shape.docs} docs × {shape.doc_tokens} + query {shape.query_tokens} "
             f"tokens; cache per document: {res['bytes_per_doc'] / 2**20:.1f} MiB", "",
             "| row | TTFT p50 (ms) | vs prefix |", "|---|---|---|"]
    rows += [(f"A/B: hypic warm, {key.removeprefix('warm_').replace('_', ' ')}", key) for key in AB_SWITCHES
             if key in res]
    for label, key in rows:
        lines.append(f"| {label} | {1000 * res[key]:.1f} | {res['prefix'] / res[key]:.2f}× |")
    lines.append("")
    lines.append(f"warm / lower bound = {res['hypic_warm'] / res['lower_bound']:.2f}; "
                 f"cold / full = {res['hypic_cold'] / res['full']:.2f}")
    return "\n".join(lines)
