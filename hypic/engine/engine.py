"""The engine: one entry point, ``generate``, for every mode of the ladder.

``hypic``/``transition``/``naive``: plan each request against the segment store, prefill the
misses (standalone, as one varlen batch, or in context), run the combine pass over the recompute
set, then decode. ``full`` runs the whole prompt; ``prefix`` reuses exact states of leading
segments. Decoding is batched across the requests of a call.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hypic.cache import persist
from hypic.cache.budgets import AUTO, Budget, resolve, resolve_host_dtype
from hypic.cache.keys import SegmentKey, segment_key
from hypic.cache.layout import Header, mismatch
from hypic.cache.store import SegmentStore
from hypic.engine.bad_words import BadWords, bad_words
from hypic.engine.cold import entry_template
from hypic.engine.cold_combine import ColdCombineContext
from hypic.engine.cold_prefill import ColdPrefill, cold_graphs_mode
from hypic.engine.collector import freeze_long_lived
from hypic.engine.combine import CombineContext
from hypic.engine.memory import within_memory
from hypic.engine.modes import ASSEMBLY, check_mode
from hypic.engine.plan import RequestPlan, SegmentPlan, all_seam, effective_seam
from hypic.engine.prefix import PrefixCache
from hypic.engine.prefix_prefill import PrefixPrefill
from hypic.engine.request import RequestMetrics, RequestOutput, SamplingParams
from hypic.engine.sampling import TokenCounts, sample, token_mask
from hypic.engine.scoring import Scored, score_prompts, score_with_first
from hypic.engine.structured import JsonConstraint, TokenVocab, token_bytes, token_marks
from hypic.engine.structured.formats import named_tokens
from hypic.models.context import SequenceContext, SequenceState
from hypic.models.decode_batch import DecodeBatch, DecodeStats, gather
from hypic.models.fingerprint import weight_fingerprint
from hypic.models.layers.fused import fuse_projections
from hypic.models.loader import LoadedModel
from hypic.ops.kernels import combine_precision
from hypic.ops.transfer import to_device
from hypic.parallel.pool import ColdPool, worker_devices
from hypic.parallel.router import POLICIES
from hypic.parallel.spec import ModelSpec

COLD_STRATEGIES = ("standalone", "in_context")
# Of the device tier's bytes, what it gives up when the device runs out of memory with nothing else to
# spare (Engine._shed_device_tier): an eighth of the 9B shape's 57 GiB auto tier is 7 GiB, nine times
# the largest allocation seen failing on the H200 (760 MiB, docs/benchmarks.md session 22), while
# seven eighths of the cache stays
SHED_FRACTION = 0.125
# ... but never below this share of what it held when it first shed: an out of memory a request causes
# (a prompt that never fits, retried by its client after each 503) must not shrink the cache call by call
SHED_FLOOR = 0.5


@dataclass
class Running:
    """A request being decoded: its sampling, decode state and output so far."""

    params: SamplingParams
    state: SequenceState
    output: RequestOutput
    generator: torch.Generator | None
    done: bool = False
    # [vocab] fp32: the prompt's next-token logits, kept only when start is asked (evaluation): a row
    # is a view of its call's [N, vocab] logits, which a serving run kept alive until it ended
    first_logits: torch.Tensor | None = None
    counts: TokenCounts | None = None  # its tokens on the device, for the penalties (sampling.TokenCounts)
    constraint: JsonConstraint | None = None  # structured output: what the grammar allows next
    only: torch.Tensor | None = None  # SamplingParams.allowed_token_ids as a mask, made at the first draw
    bad: BadWords | None = None  # SamplingParams.bad_words as token sequences
    _unbanned: torch.Tensor | None = None  # the mask less the one-token bad words, made at the first draw
    error: Exception | None = None  # why it ended without an answer (the scheduler tells its client)

    def allowed(self, size: int, device: torch.device) -> torch.Tensor | None:
        """What this run may draw next (structured output, or ``allowed_token_ids``: the two are
        not taken together; less the bad words' tokens banned now) as a [size] boolean mask on
        ``device`` (empty ids: nothing can follow), else None (any)."""
        if self.params.allowed_token_ids is not None:
            if self.only is None:
                self.only = token_mask(list(self.params.allowed_token_ids), size, device)
            base = self.only
        else:
            base = None if self.constraint is None else self.constraint.allowed_mask(size, device)
        if self.bad is None or (base is not None and base.dtype != torch.bool):  # nothing can follow anyway
            return base
        banned = self.bad.banned(self.output.token_ids)
        if not banned:
            return base
        if base is None and len(banned) == len(self.bad.always):  # the usual step: a mask made once
            if self._unbanned is None:
                self._unbanned = _without(torch.ones(size, dtype=torch.bool, device=device), banned)
            return self._unbanned
        mask = _without(torch.ones(size, dtype=torch.bool, device=device) if base is None else base.clone(), banned)
        # the grammar allows only banned tokens: it wins (a ban must not leave the draw nothing, nor
        # the text outside the grammar)
        return base if base is not None and not bool(mask.any()) else mask

    def accept(self, token: int, logprobs: dict[int, float] | None, eos: set[int]) -> None:
        if token < 0:  # its logits were not finite (``sample(isolate=True)``): this request fails alone
            self.error = RuntimeError("sampling: this request's logits are not finite (NaN or infinity)")
            self.done = self.state.done = True
            return
        if self.constraint is not None and not self.constraint.accept(token):
            # the grammar allowed nothing (the mask was empty, so the draw was free): the output ends
            # before the token, still a prefix of an accepted value, as if cut by max_tokens
            self.output.finish_reason, self.done = "length", True
            self.state.done = True
            return
        self.output.token_ids.append(token)
        if self.counts is not None:
            self.counts.add(token)
        if logprobs is not None:
            self.output.logprobs.append(logprobs)
        if self.params.stops_at(token, eos) or (self.constraint is not None and self.constraint.finished):
            self.output.finish_reason, self.done = "stop", True
        elif len(self.output.token_ids) >= self.params.max_tokens:
            self.output.finish_reason, self.done = "length", True
        self.state.done = self.done  # a finished run's decode state is dropped from its batch, not unpacked


def _without(mask: torch.Tensor, banned: list[int]) -> torch.Tensor:
    mask[to_device(banned, mask.device)] = False
    return mask


def _eos_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    sources = [loaded.config, loaded.config.get("text_config", {})]
    gen = loaded.path / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()))
    for src in sources:
        eos = src.get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else ({eos} if isinstance(eos, int) else set())
    return ids


def promote_after() -> int:
    """``HYPIC_PROMOTE_AFTER`` (default 2): the host-tier hit, counted since the entry's demotion, that
    promotes it (``SegmentStore``); the hits before are served from a device copy, the entry staying
    on the host. Measured on the 1 024-document trace (docs/benchmarks.md, session 21): 2 moves
    55–60% fewer entries between the tiers than 1 (the LRU model, scripts/trace_misses.py, predicted
    53%), with the same misses, and a lower TTFT p90 at 24 QPS in every pair of runs."""
    value = os.environ.get("HYPIC_PROMOTE_AFTER", "2")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"HYPIC_PROMOTE_AFTER: expected an integer ≥ 1, got {value!r}")
    return int(value)


class Engine(ColdPrefill, PrefixPrefill):
    def __init__(self, loaded: LoadedModel, *, seam: int = 8, cold: str = "standalone",
                 cache_device_bytes: Budget = AUTO, cache_host_bytes: Budget = AUTO,
                 cold_workers: int | list[str] | None = None, route: str = "lpt",
                 cache_host_dtype: str | None = AUTO) -> None:
        """``cold_workers``: extra devices whose worker processes prefill cold segments alongside
        this engine's device (``hypic.parallel``): a count (the next GPUs after the engine's, or
        CPU processes) or a list of devices; ``route`` is the router's policy (lpt | round_robin).
        ``cache_device_bytes`` / ``cache_host_bytes``: the store's tiers, in bytes, None for
        unbounded, or "auto" (``hypic.cache.budgets``: a share of the free memory; on the CPU no host tier).
        ``cache_host_dtype``: bfloat16 or float16 stores the host tier's summaries in half precision
        (nearly twice the entries; ``hypic.cache.store``); None or float32: as on the device; "auto"
        (default): bfloat16 on a GPU, float32 on the CPU (``hypic.cache.budgets``)."""
        if not isinstance(seam, int) or isinstance(seam, bool) or seam < 0:
            raise ValueError(f"seam: expected a non-negative integer, got {seam!r}")
        if route not in POLICIES:
            raise ValueError(f"route: expected one of {POLICIES}, got {route!r}")
        host_dtype = resolve_host_dtype(cache_host_dtype, loaded.device)
        if cold not in COLD_STRATEGIES:
            raise ValueError(f"cold: expected one of {COLD_STRATEGIES}, got {cold!r}")
        combine_precision()  # a bad HYPIC_COMBINE_PRECISION fails here, not in every warm request
        cold_graphs_mode()  # and a bad HYPIC_COLD_GRAPHS
        self.loaded, self.model, self.device = loaded, loaded.model, loaded.device
        if not any(p.requires_grad for p in self.model.parameters()):  # never a model being trained
            fuse_projections(self.model)  # sibling projections as one matmul: fewer launches per layer
        self.seam, self.cold = seam, cold
        self.max_positions = self.model.max_positions  # the context served (LLM's max_model_len may lower it)
        # decode steps replayed as CUDA graphs (hypic.models.step_graph); HYPIC_DECODE_GRAPHS=0: eager
        self.decode_graphs = self.device.type == "cuda" and os.environ.get("HYPIC_DECODE_GRAPHS", "1") != "0"
        self.decode_stats = DecodeStats()
        self._stamp: persist.Stamp | None = None  # the weights' fingerprint, computed once when first needed
        self._lock = threading.Lock()  # one forward at a time; concurrent callers queue here
        self.store = SegmentStore(self.device, device_bytes=resolve(cache_device_bytes, "device", self.device),
                                  host_bytes=resolve(cache_host_bytes, "host", self.device), pin_gate=self._lock,
                                  host_dtype=host_dtype, promote_after=promote_after())
        # an auto device budget is half the memory free beside the model; memory the engine itself
        # holds later (the cold graphs) lowers it (ColdPrefill._fit_cache_to_cold_graphs)
        self._auto_device_budget = self.store.budgets["device"] if cache_device_bytes == AUTO else None
        self.prefix = PrefixCache(max_bytes=self._prefix_room)
        self.eos = _eos_ids(loaded)
        self._token_vocab: TokenVocab | None = None  # structured output's trie, built at its first use
        self._token_vocab_lock = threading.Lock()  # built once, whichever thread asks first
        # a serving process's (hypic serve, run-batch): the vocabulary's tries, once built, out of the cycle
        # collector's full passes (``hypic.engine.collector``); never on a library caller's process
        self.freeze_collector = False
        self.dtype_name = str(loaded.dtype).removeprefix("torch.")
        # the configuration's, not the folder's: a checkpoint copied or moved (a container's mount, the
        # bundled model in another environment) keeps its saved cache; its weights are checked apart
        # (``stamp``: a saved cache, a cold worker's model)
        self.fingerprint = hashlib.blake2b(json.dumps(loaded.config, sort_keys=True).encode(),
                                           digest_size=16).hexdigest()
        self.pool: ColdPool | None = None
        self._template = None  # the model's entry layout (ColdPrefill._new_cold)
        self._graphs = {}  # padded cold prefills per HYPIC_COLD_GRAPHS value (ColdPrefill._cold_graphs)
        self._graphs_released = False  # after the device ran out of memory: no cold graphs any more
        # Who prefilled what: rank → [segments, tokens] (0: this device), and worker failures by kind.
        self.cold_counts: dict[int, list[int]] = {0: [0, 0]}
        self.cold_failures = {"request": 0, "lost": 0}
        # Prefill calls of the cached modes, and those that built entries (a cold part): on a trace with
        # a few percent of new documents most calls carry one, and its cost is fixed per call.
        # Each its own count: a reader between two updates must never see one go down (a reset to Prometheus).
        self.prefill_calls = {"calls": 0, "with_cold": 0, "without_cold": 0}
        # Tokens run through the model by finished prefill calls of every mode and by prewarm, wherever
        # they ran (this device or a cold worker): a cold segment shared by prompts of one call counts
        # once, while each request's RequestMetrics.recomputed_tokens counts its own misses whole.
        self.prefill_tokens = 0
        # Prefill calls that ran the device out of memory (hypic.engine.memory): tried again after
        # sparing memory, split in halves, and single prompts that failed even alone.
        self.out_of_memory = {"retried": 0, "split": 0, "failed": 0}
        # Times the device tier gave up part of itself after running out of memory, and the bytes it moved out
        self.cache_shed = {"times": 0, "bytes": 0}
        self._shed_floor: int | None = None  # the device tier's lowest budget from shedding (set at the first)
        devices = worker_devices(self.device, cold_workers or 0)
        if devices and cold != "standalone":
            raise ValueError("cold_workers: workers prefill segments standalone; they need cold='standalone'")
        if devices:
            self.pool = ColdPool(ModelSpec.of(loaded), self.device, devices, self.model, policy=route)

    def _key(self, ids: list[int], seam: int, salt: str | None, mode: str, cold: str | None = None) -> SegmentKey:
        """A document's key. A standalone entry is the document's alone, whatever mode reads it; an
        in-context one comes out of its first request's forward, which each mode assembles its own
        way (``ASSEMBLY``), so it is keyed by the mode (a ``naive`` request's entries, carrying
        naive's error, once served later ``transition`` requests) and apart from every standalone
        entry (a ``hypic`` one shared the standalone key: saved and loaded into a standalone engine,
        it answered 1.44 off in the logits)."""
        tag = f"in_context:{mode}" if (cold or self.cold) == "in_context" else "hypic"
        return segment_key(ids, model_fingerprint=self.fingerprint, seam=seam, dtype=self.dtype_name, salt=salt,
                           mode=tag)

    def _standalone_key(self, ids: list[int], mode: str, salt: str | None) -> SegmentKey:
        """The key a prewarmed (standalone) entry of this document has for ``mode``: what an in-context
        engine falls back to when it has no entry of its own."""
        return self._key(ids, self.seam if ASSEMBLY[mode].seam else 0, salt, mode, "standalone")

    def _keys_of(self, ids: list[int], salt: str | None) -> set[SegmentKey]:
        """Every key this engine can hold a document under: each mode's entries (at its seam, either
        cold strategy's) and the ``prefix`` mode's chain links (seam 0, the plain key)."""
        keys = {segment_key(ids, model_fingerprint=self.fingerprint, seam=0, dtype=self.dtype_name, salt=salt)}
        for m, assembly in ASSEMBLY.items():
            for cold in COLD_STRATEGIES:
                keys.add(self._key(ids, self.seam if assembly.seam else 0, salt, m, cold))
        return keys

    def _layout(self, segments: list[list[int]], mode: str, salt: str | None,
                cold: str | None = None) -> list[SegmentPlan]:
        """The request's segments at their true positions, each with its key (None: computed in
        context — the query, one all seam, an in-context repeat); nothing looked up."""
        seam = self.seam if ASSEMBLY[mode].seam else 0
        plans, start, seen = [], 0, set()
        repeats_in_context = (cold or self.cold) == "in_context"
        for i, ids in enumerate(segments):
            # the query is never cached
            in_context = (i == len(segments) - 1 or all_seam(seam, len(ids))
                          or (repeats_in_context and tuple(ids) in seen))
            seen.add(tuple(ids))
            key = None if in_context else self._key(ids, seam, salt, mode, cold)
            plans.append(SegmentPlan(ids, start, key, effective_seam(seam, len(ids)), in_context=in_context))
            start += len(ids)
        return plans

    def _plan(self, segments: list[list[int]], mode: str, salt: str | None, cold: str | None = None) -> RequestPlan:
        """The request's segments with their keys, cached entries looked up and pinned. ``cold``:
        the strategy its misses are built by (default the engine's). An in-context request takes a
        standalone entry when there is no in-context one (a prewarmed document): it is valid in any
        context; the reverse never happens. There, a document repeated in the prompt is computed in
        context after its first time: one key holds one context's entry, and the first copy's served
        the second (a warm request in the very same order answered 0.48 off)."""
        plans = self._layout(segments, mode, salt, cold)
        plan = RequestPlan(plans, salt)
        fallback = (cold or self.cold) == "in_context"
        try:
            for s in plans:
                if s.key is not None:
                    s.entry = self.store.lookup(s.key, tuple(s.token_ids))
                    if s.entry is None and fallback:
                        standalone = self._standalone_key(s.token_ids, mode, salt)
                        entry = self.store.lookup(standalone, tuple(s.token_ids))
                        if entry is not None:
                            s.key, s.entry = standalone, entry
                    s.hit = s.entry is not None
                    # pinned before the next lookup, whose promotion may make room: a host entry
                    # evicted there would free the arena region this request is about to read
                    self.store.pin([s.key])
                    plan.pinned.append(s.key)
        except BaseException:  # a lookup out of memory (a promotion's copy): no pin outlives the call
            self.store.unpin(plan.pinned)
            raise
        return plan

    def _assemble_in_memory(self, prompts: list[list[list[int]]], mode: str, salts: list[str | None],
                            metrics: list[RequestMetrics],
                            warmed: list[frozenset[SegmentKey]] | None = None
                            ) -> tuple[torch.Tensor, list[SequenceState]]:
        """``_assemble``, outliving the device running out of memory (``hypic.engine.memory``): the
        cache sheds at most once a call, however many times its halves run out."""
        spared: list[bool] = []

        def spare() -> None:
            self._spare_memory(shed=not spared)
            spared.append(True)

        warmed = warmed or [frozenset()] * len(prompts)
        return within_memory(lambda lo, hi: self._assemble(prompts[lo:hi], mode, salts[lo:hi], metrics[lo:hi],
                                                           warmed[lo:hi]),
                             len(prompts), spare, self.out_of_memory)

    def _spare_memory(self, *, shed: bool = True) -> None:
        """Let go of what the engine holds beyond its running requests, after the device ran out of
        memory: the cold graphs and their pools, for good (captured again they would take the memory
        back), or, when there are none and ``shed``, part of the cache (``_shed_device_tier``); then
        objects only the cycle collector frees (a packed decode state and its batch) and, on a GPU,
        the allocator's unused blocks. The prefix mode's kept states go first, always: a baseline's cache."""
        self.prefix.clear()
        if self._graphs:
            self.release_cold_graphs()
        elif shed:
            self._shed_device_tier()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _shed_device_tier(self) -> None:
        """Out of memory with nothing held beyond the cache and the running requests: the device
        tier gives up ``SHED_FRACTION`` of what it holds — its least recently used entries demoted to
        the host tier where it has room, else evicted — and its budget drops to match, so it does not
        fill that room again; never below ``SHED_FLOOR`` of what it held at its first shed. A budget
        set too large for the device (``--cache-device-bytes``) thus settles below what the device
        can hold, instead of every call out of memory once the tier is full."""
        used = self.store.stats().bytes["device"]
        if used == 0:
            return
        if self._shed_floor is None:
            self._shed_floor = int(SHED_FLOOR * used)
        budget = max(self._shed_floor, int(used * (1 - SHED_FRACTION)))
        if budget >= used:  # at the floor: nothing more to give
            return
        self.store.set_budget("device", budget)
        if self._auto_device_budget is not None:  # the cold graphs' release must not raise it back
            self._auto_device_budget = min(self._auto_device_budget, budget)
        self.cache_shed["times"] += 1
        self.cache_shed["bytes"] += used - self.store.stats().bytes["device"]

    def _assemble(self, prompts: list[list[list[int]]], mode: str, salts: list[str | None],
                  metrics: list[RequestMetrics],
                  warmed: list[frozenset[SegmentKey]]) -> tuple[torch.Tensor, list[SequenceState]]:
        """Prefill every prompt by ``mode``; returns first-token logits [N, vocab] and decode states.
        ``warmed``: per prompt, keys ``prefill_ahead`` built for it — hits here, its misses in its metrics."""
        if mode == "full":
            states = [SequenceState() for _ in prompts]
            lengths = [sum(len(s) for s in p) for p in prompts]
            ctx = SequenceContext(states, lengths, self.device)
            ids = to_device([t for p in prompts for s in p for t in s], self.device)
            logits = self.model(ids, ctx, to_device(self.model.last_token_rows(ctx.cu_seqlens), self.device))
            ctx.finish()
            for m, n in zip(metrics, lengths, strict=True):
                m.recomputed_tokens = n
            self.prefill_tokens += sum(lengths)
            return logits, states
        if mode == "prefix":
            out = self._prefix(prompts, salts, metrics)
            self.prefill_tokens += sum(m.recomputed_tokens for m in metrics)  # each prompt's own stretches
            return out
        plans: list[RequestPlan] = []
        try:
            for p, s in zip(prompts, salts, strict=True):
                plans.append(self._plan(p, mode, s))  # inside the try: earlier plans' pins released
            scattered = self._scatter(plans) if self.cold == "standalone" else []
            scattered += self._padded(plans)  # replayed graphs, when the misses fit one (cold_graphs)
            cold = self._cold_context(plans)
            ctx = CombineContext(plans, ASSEMBLY[mode], self.device)
            if cold is None:
                logits = self.model(ctx.input_ids, ctx, ctx.logits_rows())
            else:  # the standalone prefill and the combine pass in one forward, layer by layer
                both = ColdCombineContext(cold, ctx)
                logits = self.model(both.input_ids, both, both.logits_rows())
            built = scattered + ([] if cold is None else cold.entries)
            self.prefill_calls["calls"] += 1
            self.prefill_calls["with_cold" if built else "without_cold"] += 1
            for e in built:
                self.store.insert(e)
            for p in plans:
                for s in p.segments:
                    if s.in_context and s.key is not None:
                        self.store.insert(s.entry)
            shared: dict[SegmentKey, int] = {}  # every cold segment of the call, built once
            for m, p, own in zip(metrics, plans, warmed, strict=True):
                cached = [s for s in p.segments if s.key is not None]
                hits = [s for s in cached if s.hit and s.key not in own]  # entries older than the request
                m.segment_hits = len(hits)
                m.segment_misses = len(cached) - m.segment_hits
                m.cached_tokens = sum(s.length - s.seam for s in hits)
                # its own misses prefilled apart (once each, however many prompts of the call share one)
                cold = {s.key: s.length for s in cached if not s.hit and not s.in_context}
                ahead = {s.key: s.length for s in cached if s.hit and s.key in own}  # counted by prefill_ahead
                m.recomputed_tokens = p.recompute_tokens + sum(cold.values()) + sum(ahead.values())
                shared.update(cold)
            self.prefill_tokens += sum(p.recompute_tokens for p in plans) + sum(shared.values())
            return logits, ctx.decode_states
        finally:
            for p in plans:
                self.store.unpin(p.pinned)

    @torch.no_grad()
    def prefill_logits(self, prompts: list[list[list[int]]], *, mode: str = "hypic",
                       salts: list[str | None] | None = None) -> tuple[torch.Tensor, list[RequestMetrics]]:
        """First-token logits [N, vocab] (fp32) of each prompt under ``mode``; no decoding."""
        mode = check_mode(mode)
        _check_prompts(prompts)
        metrics = [RequestMetrics(prompt_tokens=sum(len(s) for s in p)) for p in prompts]
        with self._lock:
            logits, _ = self._assemble_in_memory(prompts, mode, salts or [None] * len(prompts), metrics)
        return logits, metrics

    @torch.no_grad()
    def start(self, prompts: list[list[list[int]]], params: list[SamplingParams], *, mode: str = "hypic",
              salts: list[str | None] | None = None,
              warmed: list[frozenset[SegmentKey]] | None = None, keep_logits: bool = False,
              first_logits: list[torch.Tensor] | None = None) -> list[Running]:
        """Prefill prompts (tokenized by segment, the query last) and sample their first tokens.
        ``keep_logits``: each run keeps its first-token logits (``Running.first_logits``).
        ``warmed``: per prompt, the keys ``prefill_ahead`` built for it (its metrics count them as
        its own misses, not as hits). ``first_logits``: each prompt's first-token logits, computed
        already (``score(first=…)``): nothing is prefilled, so every run must end at its first token
        (``max_tokens`` 1) — there is no decode state to go on from. Prompts that all ask their own
        log-probabilities and one token their mode draws as ``full`` does (vLLM's scoring idiom,
        ``max_tokens=1, prompt_logprobs=k``) are prefilled by the forward that scores them."""
        mode = check_mode(mode)
        salts = salts or [None] * len(prompts)
        params = self.checked(prompts, params)
        if first_logits is not None:
            _check_first(first_logits, params, self.model.vocab_size)
        token_vocab = self.token_vocab() if any(p.constraint_kinds for p in params) else None
        with self._lock:
            t0 = time.perf_counter()
            metrics = [RequestMetrics(prompt_tokens=sum(len(s) for s in p)) for p in prompts]
            scored = None
            if first_logits is None and _scored_whole(prompts, params, mode):
                scored = score_with_first(self.model, self.device, [[t for s in p for t in s] for p in prompts],
                                          [p.prompt_logprobs for p in params], first=[True] * len(prompts))
                first_logits = scored.first_logits
            if first_logits is None:
                logits, states = self._assemble_in_memory(prompts, mode, salts, metrics, warmed)
            else:  # computed by the forward that scored them: every token of it
                logits = torch.stack(first_logits).to(self.device).float()  # as HybridLM.forward gives them
                states = [SequenceState() for _ in prompts]
                for m in metrics:
                    m.recomputed_tokens = m.prompt_tokens
            runs = [Running(p, st, RequestOutput("", [], [] if p.logprobs is not None else None, m),
                            None if p.seed is None else torch.Generator().manual_seed(p.seed),
                            counts=self._token_counts(p, prompt))
                    for p, st, m, prompt in zip(params, states, metrics, prompts, strict=True)]
            for r in runs:
                if r.params.constraint_kinds:
                    r.constraint = JsonConstraint(token_vocab, r.params.constraint(), self.eos)
                r.bad = bad_words(self.loaded.tokenizer, r.params.bad_words)
            tokens, tops = sample(logits, params, [r.generator for r in runs], None,
                                  [r.counts for r in runs], self.eos,
                                  [r.allowed(logits.shape[-1], logits.device) for r in runs], isolate=True)
            ttft = time.perf_counter() - t0
            for r, t, lp, row in zip(runs, tokens, tops, logits, strict=True):
                r.output.metrics.ttft_s = ttft
                r.first_logits = row if keep_logits else None
                r.accept(t, lp, self.eos)
            # after the first token: not in TTFT; the prompts asking, scored together (unless scored already)
            if scored is not None:
                for r, rows in zip(runs, scored.rows, strict=True):
                    r.output.prompt_logprobs = rows if r.error is None else None
            asking = [(r, prompt) for r, prompt in zip(runs, prompts, strict=True)
                      if r.params.prompt_logprobs is not None and r.error is None and scored is None]
            scores = score_prompts(self.model, self.device, [[t for s in prompt for t in s] for _, prompt in asking],
                                   [r.params.prompt_logprobs for r, _ in asking])
            for (r, _), scored in zip(asking, scores, strict=True):
                r.output.prompt_logprobs = scored
        return runs

    def warm_constraints(self, params: list[SamplingParams]) -> None:
        """Each constrained request's first mask made now, on the caller's thread (the vocabulary's
        memo is shared and locked, its walks are not): ``start`` then finds it memoized. Made there,
        in the serving loop, a new constraint's first mask held every request's step — ≈ 0.2 s for a
        strict tool's free text at a 151 000-token vocabulary (docs/benchmarks.md, session 43; ≈ 0.14 s
        since session 44)."""
        constrained = [p for p in params if p.constraint_kinds]
        if constrained:
            vocab = self.token_vocab()
            for p in constrained:
                JsonConstraint(vocab, p.constraint(), self.eos).allowed()

    def checked(self, prompts: list[list[list[int]]], params: list[SamplingParams]) -> list[SamplingParams]:
        """The requests as ``start`` runs them (``max_tokens`` bounded by the context), or a
        ValueError naming what this engine cannot take: an empty segment, a token id of
        ``logit_bias`` or ``stop_token_ids`` outside the vocabulary, a prompt the context cannot hold,
        a ``json_schema`` without a tokenizer.
        The serving loop asks before prefilling a prompt's documents ahead: a request that would
        fail must not cost its whole prefill first."""
        _check_prompts(prompts)
        params = [self._bounded(p, sum(len(s) for s in prompt)) for p, prompt in zip(params, prompts, strict=True)]
        vocab = self.model.vocab_size
        for p in params:
            if p.n != 1:  # LLM.generate and the server run n answers as n requests (SamplingParams.for_choice)
                raise ValueError(f"n: the engine runs one answer per request, got n={p.n}; pass each answer's "
                                 "params (SamplingParams.for_choice)")
            p.check_enders(self.eos)
            for name, ids in (("logit_bias", p.logit_bias or ()), ("stop_token_ids", p.stop_token_ids),
                              ("allowed_token_ids", p.allowed_token_ids or ())):
                outside = [t for t in ids if t >= vocab]
                if outside:
                    raise ValueError(f"{name}: token id {outside[0]} is outside the vocabulary [0, {vocab})")
        if any(p.constraint_kinds for p in params):
            self.token_vocab()  # structured output needs the tokenizer's tokens (built once)
            for p in params:
                self.check_tokens(p)
        if self.loaded.tokenizer is None and any(p.bad_words for p in params):
            raise ValueError("bad_words: this model has no tokenizer.json to spell them with")
        return params

    def check_tokens(self, params: SamplingParams) -> None:
        """ValueError naming a token that a structural tag's token-level format names and this
        tokenizer has no special or added token for (a mark nothing writes: the answer would be stuck)."""
        if params.structural_tag is not None:
            self.token_vocab().check_tokens(named_tokens(params.structural_tag))

    def token_vocab(self) -> TokenVocab:
        """The tokenizer's tokens as bytes in a trie (structured output), built once; ValueError
        when the model has no tokenizer or its tokens cannot spell every JSON text."""
        with self._token_vocab_lock:
            if self._token_vocab is None:
                if self.loaded.tokenizer is None:
                    raise ValueError("json_schema: this model has no tokenizer.json, which structured output reads")
                tok = self.loaded.tokenizer
                self._token_vocab = TokenVocab(token_bytes(tok), token_marks(tok, set(self.eos)))
                if self.freeze_collector:
                    freeze_long_lived()
            return self._token_vocab

    def prompt_logprobs(self, prompt: list[list[int]], top: int = 0,
                        stop: Callable[[], str | None] | None = None) -> list[dict[int, float] | None]:
        """Each prompt token's log-probability given those before it (None for the first), with the
        ``top`` likeliest alternatives: a ``full`` forward over the whole prompt, whatever the cache
        holds, in pieces that each hold the engine's lock; ``stop`` may end it between them
        (``hypic.engine.scoring``)."""
        return self.prompts_logprobs([prompt], top, stop)[0]

    def prompts_logprobs(self, prompts: list[list[list[int]]], top: int | list[int] = 0,
                         stop: Callable[[], str | None] | None = None) -> list[list[dict[int, float] | None]]:
        """``prompt_logprobs`` for several prompts, scored together (packed into shared forwards);
        ``top``: one for all, or one per prompt."""
        return self.score(prompts, top, stop).rows

    def score(self, prompts: list[list[list[int]]], top: int | list[int] = 0,
              stop: Callable[[], str | None] | None = None, first: list[bool] | None = None) -> Scored:
        """``prompts_logprobs``, and the first-token logits (``full``'s, in the head's dtype) of each prompt
        ``first`` marks: what ``start(first_logits=…)`` draws a one-token answer from."""
        tops = top if isinstance(top, list) else [top] * len(prompts)
        return score_with_first(self.model, self.device, [[t for s in p for t in s] for p in prompts],
                                tops, first=first, lock=self._lock, stop=stop)

    def evict_segments(self, segments: list[list[int]], *, salt: str | None = None,
                       saved: str | Path | None = None) -> list[bool]:
        """Forget documents (changed, withdrawn, or not to be kept): each one's entries — under the
        seam the modes with seams use and under none — every ``prefix`` state whose prefix holds it,
        and, with ``saved`` (a folder ``save_cache`` wrote), its saved entries. Per segment: whether
        anything of it was cached. Under the engine's lock, between calls, when no entry is pinned.
        Every document leaves memory before the saved folder is touched: a folder that cannot be
        updated (ValueError, OSError) leaves none of them served."""
        out, digests = [], []
        with self._lock:
            for ids in segments:
                keys = self._keys_of(ids, salt)
                digests.append({k.digest for k in keys})
                status = [self.store.discard(k) for k in keys]
                assert "in_use" not in status, "an entry is pinned between engine calls"
                dropped = self.prefix.discard_containing(digests[-1])
                out.append("evicted" in status or dropped > 0)
            if saved is not None:
                for i, d in enumerate(digests):
                    out[i] = persist.forget(saved, d) > 0 or out[i]
        return out

    @torch.no_grad()
    def prewarm(self, segments: list[list[int]], *, salt: str | None = None) -> list[bool | None]:
        """Prefill documents into the cache (standalone, whatever the cold strategy) before the
        queries that will use them arrive. Per segment: True if it was cached already, False if it
        was filled now, None if it is too short to cache (all seam: recomputed in context anyway)."""
        with self._lock:
            plan = self._fill(segments, "hypic", salt)
        return [None if s.key is None else s.hit for s in plan.segments[:-1]]

    def _fill(self, segments: list[list[int]], mode: str, salt: str | None) -> RequestPlan:
        """Build the misses among ``segments`` standalone, as ``mode`` keys them (the caller holds the lock)."""
        plan = self._plan([*segments, []], mode, salt, cold="standalone")  # an empty query: nothing to answer
        try:
            self._cold_prefill([plan], cold="standalone")
            self.prefill_tokens += sum({s.key: s.length for s in plan.segments
                                        if s.key is not None and not s.hit}.values())
        finally:
            self.store.unpin(plan.pinned)
        return plan

    def layout(self, prompt: list[list[int]], *, mode: str = "hypic", salt: str | None = None) -> list[SegmentPlan]:
        """The prompt's segments as a prefill under ``mode`` would plan them, nothing looked up; in a
        mode that reads no entries (``full``, ``prefix``) every segment is computed (no key)."""
        mode = check_mode(mode)
        if mode not in ASSEMBLY:
            plans, start = [], 0
            for ids in prompt:
                plans.append(SegmentPlan(ids, start, None, 0, in_context=True))
                start += len(ids)
            return plans
        return self._layout(prompt, mode, salt)

    def uncached_tokens(self, layout: list[SegmentPlan], *, mode: str = "hypic", salt: str | None = None) -> int:
        """The tokens a prefill of this layout (``layout``, same mode and salt) would run through the
        model if it started now: a segment computed in context whole; a cached one's seam; a missing
        one built standalone and then its seam (in context: whole, once). An estimate for the
        serving loop's admission — entries may come and go before the call, and a document repeated
        in a prompt is counted each time though built once."""
        total = 0
        for s in layout:
            if s.key is None:
                total += s.length
            elif self._held(s, mode, salt):
                total += s.seam
            else:
                total += s.length + (s.seam if self.cold == "standalone" else 0)
        return total

    def _held(self, s: SegmentPlan, mode: str, salt: str | None) -> bool:
        """Whether a lookup of this segment would hit, as ``_plan`` looks (an in-context engine takes a
        standalone entry, a prewarmed document, when it has none of its own); nothing moves."""
        ids = tuple(s.token_ids)
        if self.store.holds(s.key, ids):
            return True
        return self.cold == "in_context" and self.store.holds(self._standalone_key(s.token_ids, mode, salt), ids)

    @torch.no_grad()
    def prefill_ahead(self, prompt: list[list[int]], *, mode: str = "hypic", salt: str | None = None,
                      max_tokens: int, skip: frozenset[SegmentKey] = frozenset()) -> frozenset[SegmentKey]:
        """Build the first of a prompt's documents missing from the cache, in prompt order, up to
        ``max_tokens`` tokens (one document at least, whatever its length); the keys built. The
        serving loop prefills a long prompt this way between decode steps, so the running requests
        wait one such slice at a time, not for the whole prompt: a cold document is prefilled
        standalone in any case, so building it ahead is the same computation (bitwise on the CPU in
        fp32; on a GPU it may batch with other documents than in the call, as batched cold calls
        do, and an entry demoted to a bf16 host tier before its call is read rounded, as any
        demoted entry is). Nothing for a mode that
        reads no entries (``full``, ``prefix``) or an engine whose misses are computed in context
        (their entries depend on the prompt). ``skip``: keys built ahead already — an entry evicted
        before its request runs is computed again there, not here, so repeated calls end. Out of
        device memory, the engine spares memory and the slice's keys are returned all the same: what
        was not built, the request's own call builds (and counts as its misses either way)."""
        mode = check_mode(mode)
        if mode not in ASSEMBLY or self.cold != "standalone":
            return frozenset()
        _check_prompts([prompt])
        with self._lock:
            chosen, tokens, seen = [], 0, set(skip)
            for s in self._layout(prompt, mode, salt):
                if s.key is None or s.key in seen or self.store.holds(s.key, tuple(s.token_ids)):
                    continue
                if chosen and tokens + s.length > max_tokens:
                    break
                chosen.append(s)
                seen.add(s.key)
                tokens += s.length
            if chosen:
                self.prefill_calls["calls"] += 1  # a cold call, as a request's with a cold part is
                self.prefill_calls["with_cold"] += 1
                try:
                    self._fill([s.token_ids for s in chosen], mode, salt)
                except torch.OutOfMemoryError:
                    self.out_of_memory["retried"] += 1  # its documents are tried again in the request's call
                    self._spare_memory()
        return frozenset(s.key for s in chosen)

    def stamp(self) -> persist.Stamp:
        """What this engine's entries are computed by (a saved cache must match it to load)."""
        if self._stamp is None:
            self._stamp = persist.Stamp(self.fingerprint, self.dtype_name, weight_fingerprint(self.model))
        return self._stamp

    def save_cache(self, folder: str | Path) -> int:
        """Write the segment store's entries into ``folder`` (``hypic.cache.persist``); how many."""
        with self._lock:
            return persist.save(self.store, folder, self.stamp())

    def load_cache(self, folder: str | Path) -> int:
        """Load entries saved by ``save_cache`` for this model; how many the store took. ValueError
        when the folder holds none, or holds another model's, dtype's or weights'."""
        with self._lock:
            return persist.load(self.store, folder, self.stamp(), self._unfit)

    def _unfit(self, header: Header) -> str | None:
        """Why a saved entry's header is no layout this engine's entries take (None: it is one)."""
        if self._template is None:
            self._template = entry_template(self.model, self.device)
        return mismatch(header, self._template, {0, effective_seam(self.seam, header.key.length)})

    @torch.no_grad()
    def step(self, runs: list[Running]) -> None:
        """One batched decode step for every unfinished sequence of ``runs``."""
        active = [r for r in runs if not r.done]
        if not active:
            return
        with self._lock:
            def pack() -> tuple[DecodeBatch, list[int]]:
                # the runs decoding together keep their state stacked between steps (DecodeBatch): a
                # step's work per layer does not grow with the number of runs. Packing newcomers in
                # and the arenas' growth may run out of memory; that changes nothing (the new arenas
                # are swapped in only once all are made), so it is retried
                batch, slots = gather([r.state for r in active], self.device, graphs=self.decode_graphs,
                                      stats=self.decode_stats)
                batch.reserve()
                return batch, slots

            spared, failed = False, None
            try:
                try:
                    batch, slots = pack()
                    grew = True
                except torch.OutOfMemoryError:
                    grew = False  # retried outside the handler: its traceback holds the half-grown arenas
                if not grew:
                    self.decode_stats.regrow_oom_retries += 1
                    self._spare_memory()
                    spared = True
                    batch, slots = pack()  # out of memory again: these runs fail, as any step's error fails them
                by_slot = [0] * len(slots)
                for r, i in zip(active, slots, strict=True):
                    by_slot[i] = r.output.token_ids[-1]
                logits = batch.step(self.model, by_slot)
            except BaseException as e:
                self._drop(active)  # these runs cannot continue: their stacked state is let go now
                if not isinstance(e, torch.OutOfMemoryError):
                    raise
                failed = e.with_traceback(None)  # no frame of the failed step outlives the handler
            if failed is not None:
                # not tried again (the step writes the states in place: half done, it cannot run
                # twice), but the next step should find room: on the 9B trace with cold graphs
                # on, ten steps in a row failed while only a prefill's failure spared memory
                self._spare_memory(shed=not spared)
                raise failed
            if slots != list(range(len(slots))):
                logits = logits[to_device(slots, self.device)]
            tokens, tops = sample(logits, [r.params for r in active], [r.generator for r in active],
                                  [len(r.output.token_ids) for r in active], [r.counts for r in active], self.eos,
                                  [r.allowed(logits.shape[-1], logits.device) for r in active], isolate=True)
            for r, t, lp in zip(active, tokens, tops, strict=True):
                r.accept(t, lp, self.eos)
            if all(s.done for s in batch.members):
                batch.clear()  # the last step of everyone in it: free the arenas now

    def _token_counts(self, p: SamplingParams, prompt: list[list[int]]) -> TokenCounts | None:
        """What the penalties read, on the device: the generated tokens' counts, and the prompt's
        tokens for a repetition penalty (None: no penalty asked)."""
        repeat = p.repetition_penalty != 1.0
        if not (p.penalized or repeat):
            return None
        return TokenCounts(self.model.vocab_size, self.device, [t for s in prompt for t in s] if repeat else None)

    def _prefix_room(self) -> int | None:
        """The prefix mode's kept states share the device budget with the segment store: they may hold
        what the store leaves of it when they are kept (None: unbounded)."""
        budget = self.store.budgets["device"]
        return None if budget is None else max(0, budget - self.store.stats().bytes["device"])

    def _bounded(self, p: SamplingParams, prompt_tokens: int) -> SamplingParams:
        """``max_tokens=None`` (vLLM's meaning): up to the model's context."""
        if p.max_tokens is not None:
            return p
        left = self.max_positions - prompt_tokens
        if left < max(1, p.min_tokens):
            raise ValueError(f"max_tokens: the prompt's {prompt_tokens} tokens leave {max(left, 0)} of the model's "
                             f"context of {self.max_positions} tokens, fewer than min_tokens "
                             f"({p.min_tokens}) or 1")
        return replace(p, max_tokens=left)

    def forget(self, runs: list[Running]) -> None:
        """Runs that will not step again (cancelled, failed): done now, and their decode state leaves
        its batch at once. (Left packed, a state and its batch keep each other — and the batch's
        arenas, gigabytes on a GPU — alive until the cycle collector runs.)"""
        with self._lock:
            self._drop(runs)

    @staticmethod
    def _drop(runs: list[Running]) -> None:
        batches = {}
        for r in runs:
            r.done = r.state.done = True
            if r.state.batch is not None:
                batches[id(r.state.batch)] = r.state.batch
                r.state.batch.release([r.state])  # done: dropped, not unpacked
        for batch in batches.values():  # members that finished at the last step are left alone: no
            if all(m.done for m in batch.members):  # step will release them, so their batch goes now
                batch.clear()

    def generate(self, prompts: list[list[list[int]]], params: list[SamplingParams], *, mode: str = "hypic",
                 salts: list[str | None] | None = None) -> list[RequestOutput]:
        """Prefill and decode to the end; text is left empty (the caller detokenizes)."""
        runs = self.start(prompts, params, mode=mode, salts=salts)
        self.finish(runs)
        return [r.output for r in runs]

    def finish(self, runs: list[Running]) -> None:
        """Decode every run of ``runs`` to its end; a run that failed (``Running.error``: its logits
        were not finite) raises its error once all have ended."""
        while not all(r.done for r in runs):
            self.step(runs)
        failed = next((r.error for r in runs if r.error is not None), None)
        if failed is not None:
            raise failed


def _scored_whole(prompts: list[list[list[int]]], params: list[SamplingParams], mode: str) -> bool:
    """Whether every prompt asks its own log-probabilities and one token that its mode draws from
    ``full``'s logits (one segment: nothing of it is cached in any mode; or ``full``)."""
    return bool(prompts) and all(p.prompt_logprobs is not None and p.max_tokens == 1 and (mode == "full" or len(q) == 1)
                                 for p, q in zip(params, prompts, strict=True))


def _check_first(first_logits: list[torch.Tensor], params: list[SamplingParams], vocab: int) -> None:
    """``start``'s given first-token logits: one [vocab] row per prompt, for runs of one token."""
    if len(first_logits) != len(params):
        raise ValueError(f"first_logits: expected one per prompt ({len(params)}), got {len(first_logits)}")
    for k, (row, p) in enumerate(zip(first_logits, params, strict=True)):
        if tuple(row.shape) != (vocab,):
            raise ValueError(f"first_logits[{k}]: expected shape ({vocab},), got {tuple(row.shape)}")
        if p.max_tokens != 1:
            raise ValueError(f"first_logits[{k}]: given logits answer one token, but max_tokens is {p.max_tokens}")


def _check_prompts(prompts: list[list[list[int]]]) -> None:
    """Every prompt a non-empty list of non-empty segments (ValueError naming the first that is not):
    an empty query left the logits and the decode state at the last cached segment's seam."""
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompts[{i}]: no segments")
        for j, seg in enumerate(prompt):
            if not seg:
                raise ValueError(f"prompts[{i}][{j}]: an empty segment (the query included)")
