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
batch captures its graph); echo scoring and its one token; with a tokenizer, the vocabulary's trie
that structured output reads and one constrained answer; and on a GPU a prompt long enough for attention's
long-prompt path (cuDNN, whose first call sets it up). It does not cover every sampling option
(penalties, logit_bias, top-n logprobs: host-side work, no kernels of their own to compile). Its
documents live under a salt of their own and are evicted afterwards, and what the server reports
or routes by is put back (the counters of work, the cold workers' learned handicaps, a device
budget an out-of-memory shed lowered): the metrics read as if nothing had run, but for faults (a
call out of memory, a cold worker lost), which the operator should see whoever met them. Into an
empty cache — how ``hypic serve`` runs it, before loading a saved cache — the cache is left as it
was; into a full one, the entries its documents pushed down a tier or out stay there. (What stays
is what the warm-up is for: the compiled kernels, the tuned configurations and the allocator's
cached blocks.)
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass

import torch

from hypic.engine.engine import Engine
from hypic.engine.plan import all_seam
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
    out_of_memory: int = 0  # calls that ran out of device memory and were retried (counted in the metrics too)
    workers_lost: int = 0  # cold workers lost (the engine goes on without them; counted in the metrics too)


MIN_CONTEXT = 32  # a context shorter than this (a test model's) has nothing worth warming


def warm_up(engine: Engine, seed: int = 0) -> WarmUp:
    """Run each path once on synthetic prompts and leave the cache and the counters as they were:
    the counters of work put back, those of faults (out of memory, a cold worker lost) kept, and
    reported in the result. Raises whatever a request would (a model that cannot run is better
    found before serving); the cache and the counters are put back then too. Not while requests run:
    it puts counters back that they would have moved."""
    t0 = time.perf_counter()
    if engine.max_positions < MIN_CONTEXT:
        return WarmUp(time.perf_counter() - t0, 0, 0)
    rng = random.Random(seed)
    eos = set(engine.eos)
    usable = [t for t in range(min(engine.model.vocab_size, 4096)) if t not in eos]

    def tokens(n: int) -> list[int]:
        return [rng.choice(usable) for _ in range(n)]

    room = engine.max_positions - DECODE  # a small context scales the head and the queries down
    head, query, long_query = (tokens(min(n, room // 4)) for n in (HEAD, QUERY, LONG_QUERY))
    # one cold segment at least per device prefilling them (each cold worker compiles its own kernels);
    # a segment no longer than the seam is never cold (computed in context), so the extras are longer
    devices = 1 if engine.pool is None else engine.pool.workers
    extra_len = max(48, engine.seam + 1)
    docs = [tokens(n) for n in _fitting(room - len(head) - len(long_query) - (devices - 1) * extra_len)]
    extra = [tokens(extra_len) for _ in range(_extra_count(engine.seam, [head, *docs], devices))]
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
    faults = (sum(engine.out_of_memory.values()), engine.cold_failures["lost"])
    if engine.pool is not None:  # route as a fresh pool does: a segment for every device, the
        engine.pool.handicap[:] = [0.0] * len(engine.pool.handicap)  # learned handicaps back after
    sent = 0
    try:
        for mode, prompts, params in calls:
            engine.generate(prompts, params, mode=mode, salts=[SALT] * len(prompts))
            sent += sum(len(s) for p in prompts for s in p)
        scored = [[head, *docs, query]]  # echo scoring, and its one token drawn from the same forward
        first = engine.score(scored, 1, first=[True]).first_logits
        engine.start(scored, [SamplingParams(max_tokens=1, temperature=0.0, logprobs=1)], first_logits=first)
        sent += sum(len(s) for s in scored[0])
    finally:
        try:  # the counters come back even if the eviction fails
            engine.evict_segments([head, *docs, *extra, query, long_query], salt=SALT)
        finally:
            _restore(engine, saved)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return WarmUp(time.perf_counter() - t0, len(calls) + 2, sent,
                  sum(engine.out_of_memory.values()) - faults[0], engine.cold_failures["lost"] - faults[1])


def _extra_count(seam: int, segments: list[list[int]], devices: int) -> int:
    """Segments to add so that a cold call holds one for every device: those given count only when
    longer than the seam (a shorter one is never cached, so never prefilled cold)."""
    return max(0, devices - sum(not all_seam(seam, len(s)) for s in segments))


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
    ``attention.CUDNN_MIN_TOKENS`` on), or none where that path is never taken. The first call sets
    cuDNN up (≈ 5 s in a fresh process on the H200). With bucketed lengths one prompt, not on a
    bucket, so the padding runs too. With exact lengths (``attention.LONG_BUCKETS`` 0) two: the first
    length that is not a multiple of 64 cost ≈ 1 s more on its own (0.6 s on the 9B shape; bucketed
    lengths never pay it; scripts/cudnn_shapes.py, docs/benchmarks.md, sessions 36–37)."""
    n = attention.CUDNN_MIN_TOKENS
    lengths = [n + ODD] if attention.LONG_BUCKETS > 0 else [n, n + ODD]
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
            "budget": (engine.store.budgets["device"], engine._shed_floor, engine._auto_device_budget),
            "decode": copy.deepcopy(engine.decode_stats),
            "handicap": None if engine.pool is None else list(engine.pool.handicap),
            "store": {name: getattr(store, name) for name in _STORE_COUNTERS}}


def _restore(engine: Engine, saved: dict[str, object]) -> None:
    if engine.cache_shed != saved["engine"]["cache_shed"]:  # type: ignore[index]
        _restore_budget(engine, saved["budget"])  # type: ignore[arg-type]
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


def _restore_budget(engine: Engine, budget: tuple[int | None, int | None, int | None]) -> None:
    """The device running out of memory during the warm-up made the cache shed part of its device
    tier and lower its budget to match, for good, measured against what the tier held then: the
    warm-up's own few entries on a server that has loaded nothing yet, a budget of a few MB. Put the
    budget back (the entries shed stay shed); real traffic that runs out of memory sheds again."""
    device, floor, auto = budget
    engine._shed_floor = floor
    if auto is not None:  # an auto budget is refitted to the cold graphs still held
        engine._auto_device_budget = auto
        engine._fit_cache_to_cold_graphs()
    else:
        engine.store.set_budget("device", device)


# Counters of work, put back. Counters of faults stay as they are (``cold_failures``: a cold worker
# lost; ``out_of_memory``): the operator needs them whoever met the fault. ``cache_shed`` is put back
# with the device budget a shed lowered (``_restore_budget``).
_ENGINE_COUNTERS = ("cold_counts", "prefill_calls", "prefill_tokens", "cache_shed")
_STORE_COUNTERS = ("hits", "misses", "evictions", "promotions", "demotions", "move_s")
