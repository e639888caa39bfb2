"""Every path a served request can take, run once before the first request arrives.

Why: on a GPU the first request down a path pays for its kernels. Triton compiles a kernel the
first time it is launched with new constants (an initial state or none, one sequence or varlen,
transitions' widened states), and flash-linear-attention's kernels autotune each such variant over
several configurations. On the 9B shape a fresh process's first `full` request took 53 s and its
first cold `hypic` request 24 s, against ≈ 0.25 s each afterwards (docs/benchmarks.md, session 36).
A server should pay that before it listens, not on a user's request.

The kernels' compiled variants and tuned configurations depend on the model's dimensions and on
which path runs, not on the prompt's length (fla's autotune keys are head counts, head sizes and
chunk sizes; hypic's own kernels take fixed launch shapes), so short synthetic prompts cover what
long ones will meet. The warm-up sends random token ids (never EOS) down each path: ``full``; a
cold ``hypic`` request (documents prefilled standalone with their transitions, a segment for every
device — cold workers compile their own kernels —, the combine pass with seams); the same documents
warm in another order, with a query long enough for the chunked kernels started from a state;
``prefix`` twice (the second continues a kept state); decode steps (on a GPU the second step of a
batch captures its graph); echo scoring; with a tokenizer, the vocabulary's trie that structured
output reads and one constrained answer; and on a GPU two prompts long enough for attention's
long-prompt path (cuDNN, whose first calls set it up). Its documents live under a salt of their
own and are evicted afterwards, and what the server reports or routes by is put back (the counters,
the cold workers' learned handicaps): the cache and the metrics read as if nothing had run. (What
stays is what the warm-up is for: the compiled kernels, the tuned configurations and the
allocator's cached blocks.)
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass

import torch

from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams
from hypic.ops import attention

SALT = "\x00hypic warm-up"  # the warm-up's entries apart from every request's (and evicted after)
# Document lengths: short, a multiple of 16 and not (Triton compiles an integer argument divisible
# by 16 apart), past three chunks of 64, and long enough that the matmuls meet the kernels large
# prompts use (cuBLAS picks its kernel by size, each loaded at its first use)
DOCUMENTS = (40, 96, 200, 1000)
HEAD, QUERY, LONG_QUERY, DECODE = 24, 12, 100, 4


@dataclass(frozen=True)
class WarmUp:
    seconds: float
    requests: int  # engine calls made (prefills, decode runs, scorings)
    tokens: int  # prompt tokens sent


def warm_up(engine: Engine, seed: int = 0) -> WarmUp:
    """Run each path once on synthetic prompts and leave the cache and the counters as they were.
    Raises whatever a request would (a model that cannot run is better found before serving)."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    eos = set(engine.eos)
    usable = [t for t in range(min(engine.model.vocab_size, 4096)) if t not in eos]

    def tokens(n: int) -> list[int]:
        return [rng.choice(usable) for _ in range(n)]

    head, query, long_query = tokens(HEAD), tokens(QUERY), tokens(LONG_QUERY)
    docs = [tokens(n) for n in _fitting(engine.max_positions - HEAD - LONG_QUERY - DECODE)]
    # one cold segment at least per device prefilling them (each cold worker compiles its own kernels)
    devices = 1 if engine.pool is None else engine.pool.workers
    extra = [tokens(min(48, len(docs[0]))) for _ in range(max(0, devices - 1 - len(docs)))]
    greedy = SamplingParams(max_tokens=DECODE, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=DECODE, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)
    calls: list[tuple[str, list[list[list[int]]], list[SamplingParams]]] = [
        ("full", [[head, *docs, query]], [greedy]),
        ("hypic", [[head, *docs, *extra, query]], [greedy]),  # cold: every document new
        ("hypic", [[head, *reversed(docs), long_query], [head, docs[-1], query]], [greedy, sampled]),
        ("prefix", [[head, *docs[:2], query]], [greedy]),
        ("prefix", [[head, *docs[:2], long_query]], [greedy]),  # continues the kept state
    ]
    if _structured_ready(engine):  # a constrained answer: the masks' path on the device
        calls.append(("hypic", [[head, docs[0], query]], [SamplingParams(max_tokens=DECODE, temperature=0.0,
                                                                          choice=["yes", "no"])]))
    for n in _long_prompts(engine.device.type, engine.max_positions):  # cuDNN's set-up
        calls.append(("full", [[tokens(n)]], [SamplingParams(max_tokens=1, ignore_eos=True)]))
    saved = _counters(engine)
    if engine.pool is not None:  # route as a fresh pool does: a segment for every device, the
        engine.pool.handicap[:] = [0.0] * len(engine.pool.handicap)  # learned handicaps back after
    sent = 0
    try:
        for mode, prompts, params in calls:
            engine.generate(prompts, params, mode=mode, salts=[SALT] * len(prompts))
            sent += sum(len(s) for p in prompts for s in p)
        scored = [[head, *docs, query]]
        engine.prompts_logprobs(scored, 1)
        sent += sum(len(s) for s in scored[0])
    finally:
        engine.evict_segments([head, *docs, *extra, query, long_query], salt=SALT)
        _restore(engine, saved)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return WarmUp(time.perf_counter() - t0, len(calls) + 1, sent)


def _structured_ready(engine: Engine) -> bool:
    """Build the trie structured output reads (≈ 3 s and ≈ 180 MB of host memory at a 150 000-token
    vocabulary, else paid by the first constrained request); False when the model has no tokenizer
    or its tokens cannot spell JSON (constrained requests are refused then, and say why)."""
    if engine.loaded.tokenizer is None:
        return False
    try:
        engine.token_vocab()
    except ValueError:
        return False
    return True


def _long_prompts(device_type: str, max_positions: int) -> list[int]:
    """Lengths of prompts long enough for attention's long-prompt path (cuDNN, on CUDA, from
    ``attention.CUDNN_MIN_TOKENS`` on), or none where that path is never taken. One sets cuDNN up.
    With exact lengths (``attention.LONG_BUCKETS`` 0) a second: the first length that is not a
    multiple of 64 cost ≈ 1 s more on its own (0.6 s on the 9B shape); bucketed lengths are
    multiples of 1 024 and never pay it (scripts/cudnn_shapes.py, docs/benchmarks.md, session 37)."""
    n = attention.CUDNN_MIN_TOKENS
    lengths = [n] if attention.LONG_BUCKETS > 0 else [n, n + ODD]
    if device_type != "cuda" or lengths[-1] + 1 > max_positions:
        return []
    return lengths


ODD = 37  # a length past CUDNN_MIN_TOKENS no power of two divides


def _fitting(room: int) -> list[int]:
    """``DOCUMENTS`` as far as a context leaves ``room`` for them (the last one cut to fit), at least
    one of a few tokens."""
    lengths = []
    for n in DOCUMENTS:
        n = min(n, room - sum(lengths))
        if n < 8:
            break
        lengths.append(n)
    return lengths or [max(1, min(8, room))]


def _counters(engine: Engine) -> dict[str, object]:
    """What the server's metrics read off the engine and its store (deep copies)."""
    store = engine.store
    return {"engine": {name: copy.deepcopy(getattr(engine, name)) for name in _ENGINE_COUNTERS},
            "decode": copy.deepcopy(engine.decode_stats),
            "handicap": None if engine.pool is None else list(engine.pool.handicap),
            "store": {name: getattr(store, name) for name in _STORE_COUNTERS}}


def _restore(engine: Engine, saved: dict[str, object]) -> None:
    for name, value in saved["engine"].items():  # type: ignore[union-attr]
        if isinstance(value, dict):  # in place: whoever holds the dict keeps reading the engine's
            getattr(engine, name).clear()
            getattr(engine, name).update(value)
        else:
            setattr(engine, name, value)
    engine.decode_stats.__dict__.update(saved["decode"].__dict__)  # type: ignore[union-attr]
    if saved["handicap"] is not None and engine.pool is not None:  # learned from a call of cold kernels
        engine.pool.handicap[:] = saved["handicap"]  # type: ignore[index]
    with engine.store._lock:
        for name, value in saved["store"].items():  # type: ignore[union-attr]
            setattr(engine.store, name, value)


_ENGINE_COUNTERS = ("cold_counts", "cold_failures", "prefill_calls", "prefill_tokens", "out_of_memory", "cache_shed")
_STORE_COUNTERS = ("hits", "misses", "evictions", "promotions", "demotions", "move_s")
