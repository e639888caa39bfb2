"""Where ``hypic bench trace`` sends its requests: the serving loop in this process, or a running
``hypic serve`` over HTTP.

Both answer the same calls — start a mode with empty caches, warm up, serve one request that
arrived at a given moment, report the store's moves — so one sweep (``hypic.bench.trace``)
measures either. In process, the engine's own caches are emptied between modes; over HTTP a
fresh ``cache_salt`` per mode gives the same effect (entries under another salt are never found),
and the server's counters come from its ``/metrics``.
"""

from __future__ import annotations

import cProfile
import dataclasses
import io
import itertools
import json
import pstats
import re
import secrets
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hypic.engine.engine import Engine
from hypic.engine.prefix import PrefixCache
from hypic.engine.request import SamplingParams
from hypic.engine.scheduler import QueueFull, Scheduler
from hypic.eval.trace import Trace
from hypic.models.decode_batch import DecodeStats
from hypic.models.step_graph import pool_bytes


@dataclass(frozen=True)
class Outcome:
    ttft_s: float  # arrival → first token, as the client saw it
    prefill_s: float  # the engine's own clock for the prefill call that served the request
    hits: int
    misses: int
    prompt_tokens: int
    answer: str | None  # the decoded answer, when it means something (a trained model)
    gaps: tuple[float, ...] = ()  # s between consecutive tokens (over HTTP: chunks of text), inter-token latency


@dataclass(frozen=True)
class Moves:
    promotions: int
    demotions: int
    evictions: int
    seconds: float | None  # host time issuing them (None: not reported over HTTP)


def encode_trace(trace: Trace, tokenizer, vocab: int) -> list[list[list[int]]]:
    """Every request as the engine sees it: per segment token ids (the query last). Ids beyond a
    random-weight model's vocabulary wrap around: such a model only needs the lengths to be right."""
    def ids(text: str) -> list[int]:
        return [t % vocab for t in tokenizer.encode(text, add_special_tokens=False).ids]

    head, docs = ids(trace.head), [ids(d) for d in trace.documents]
    return [[head, *(docs[i] for i in r.doc_ids), ids(r.query)] for r in trace.requests]


def warm_groups(indices: list[int]) -> Iterator[list[int]]:
    """The warm-up in calls of 1, 2, 4, then 8 requests: a single prompt, a packed batch and a decode
    step each specialise kernels of their own on the GPU (a first single-prompt `full` call took
    2.8 s after a warm-up by batches alone), and none of that may land in a measured block."""
    sizes, at = itertools.chain((1, 2, 4), itertools.repeat(8)), 0
    while at < len(indices):
        group = indices[at:at + next(sizes)]
        at += len(group)
        yield group


def reset_caches(engine: Engine) -> None:
    """Empty the engine's segment store (same budgets) and its prefix cache."""
    engine.store.clear()
    engine.prefix = PrefixCache(engine.prefix.max_states, engine.prefix.max_bytes)


class DevicePeak:
    """The most device memory allocated at once over a run (CUDA). Each block's note resets the
    allocator's peak so that its line is its block's; read after the last note, the allocator's own
    peak covered only the time since then — about what the run still held at its end — so each
    peak is kept before its reset."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.before = device, 0  # bytes: the highest peak read before a reset

    def reset(self) -> None:
        self.before = self.bytes()
        torch.cuda.reset_peak_memory_stats(self.device)

    def bytes(self) -> int:
        return max(self.before, torch.cuda.max_memory_allocated(self.device))


class ProfiledScheduler(Scheduler):
    """The serving loop with its thread under cProfile (``hypic bench trace --profile``): where a
    block's host time goes, function by function, on the engine's own thread. cProfile slows
    Python-heavy code (≈ 1.5–2×): read the shares, not the times."""

    profile: cProfile.Profile | None = None

    def _loop(self) -> None:
        self.profile = cProfile.Profile()
        self.profile.runcall(super()._loop)


class EngineTarget:
    """The serving loop (``Scheduler``) around an engine in this process."""

    def __init__(self, engine: Engine, trace: Trace, tokenizer, *, answers_from=None, max_running: int = 32,
                 max_queue: int = 1024, max_prefill_tokens: int | None = None, profile: str | None = None) -> None:
        """``answers_from``: the tokenizer that decodes answers (None for random weights); ``profile``: a
        file the serving loop's cProfile statistics go to (each mode's, at its end; ``ProfiledScheduler``)."""
        self.engine, self.answers_from, self.profile = engine, answers_from, profile
        self.prompts = encode_trace(trace, tokenizer, engine.model.vocab_size)
        self._limits = dict(max_running=max_running, max_queue=max_queue, max_prefill_tokens=max_prefill_tokens)
        self.scheduler: Scheduler | None = None
        self.mode = "hypic"
        self._decode = dataclasses.replace(engine.decode_stats)  # as of the last note
        self._calls = dict(engine.prefill_calls)  # as of the last note
        self._graph_counts: dict[str, int] = {}
        self._retries = 0  # the allocator's retries as of the last note
        self._oom = dict(engine.out_of_memory)  # prefill calls that ran out of memory, as of the last note
        self._shed = dict(engine.cache_shed)  # the device tier's sheds, as of the last note
        self.peak = DevicePeak(engine.device)  # the run's, across the notes' resets (CUDA)

    def begin(self, mode: str) -> None:
        self.close()
        reset_caches(self.engine)
        self.mode = mode

    def warm(self, indices: list[int]) -> None:
        arena = self.engine.store.arena
        if arena is not None and self.engine.store.budgets["device"] is not None:
            # Pin the host tier before the warm-up: a one-time cost (≈ 0.5 s per GiB). Pinned only as
            # the device tier overflows, the arena's thread gets the engine's lock only between calls,
            # and back-to-back calls left it little: demotions found no room and dropped their entries,
            # so the blocks after a warm-up that overflowed the device tier (the 1 024-document pool)
            # missed 2–3× the documents the store's LRU model predicts (session 20).
            t0 = time.perf_counter()
            arena.pin_all(timeout=600)
            print(f"host tier: {arena.pinned_bytes / 2**30:.1f} GiB pinned, {time.perf_counter() - t0:.1f} s "
                  "before the warm-up", flush=True)
        t0 = time.perf_counter()
        if shapes := self.engine.prepare_cold_graphs():
            budget = self.engine.store.budgets["device"]
            print(f"cold graphs: {shapes} shapes captured in {time.perf_counter() - t0:.1f} s, holding "
                  f"{self.engine._graphs['1'].held_bytes() / 2**30:.1f} GiB; the device tier's budget "
                  f"{'unbounded' if budget is None else f'{budget / 2**30:.1f} GiB'}", flush=True)
        for group in warm_groups(indices):  # back to back, one decode step each
            batch = [self.prompts[i] for i in group]
            self.engine.generate(batch, [SamplingParams(max_tokens=2)] * len(batch), mode=self.mode)
        self.scheduler = (ProfiledScheduler if self.profile else Scheduler)(self.engine, **self._limits)

    def note(self) -> str:
        now = dataclasses.replace(self.engine.decode_stats)
        line, self._decode = _decode_since(now, self._decode), now
        calls = dict(self.engine.prefill_calls)
        line = _calls_since(calls, self._calls) + "; " + line
        self._calls = calls
        graphs = self.engine._graphs.get("1")
        if graphs is not None:  # groups of cold segments replayed, and those run eagerly (each a capture)
            counts = dict(graphs.counts)
            line += (f"; cold graphs {counts['replayed'] - self._graph_counts.get('replayed', 0)} replayed, "
                     f"{counts['eager'] - self._graph_counts.get('eager', 0)} eager")
            self._graph_counts = counts
        oom = dict(self.engine.out_of_memory)
        if oom != self._oom:  # prefill calls out of memory: tried again, split, prompts failed alone
            line += "; out of memory: " + ", ".join(f"{oom[k] - self._oom[k]} {k}" for k in oom)
            line += " (cold graphs released)" if self.engine._graphs_released else ""
            self._oom = oom
        shed = dict(self.engine.cache_shed)
        if shed != self._shed:  # the device tier gave up part of itself (a budget set too large settles)
            budget = self.engine.store.budgets["device"]
            line += (f"; the cache shed {shed['times'] - self._shed['times']} times, "
                     f"{(shed['bytes'] - self._shed['bytes']) / 2**30:.1f} GiB, device budget now "
                     + ("none" if budget is None else f"{budget / 2**30:.1f} GiB"))
            self._shed = shed
        if self.engine.device.type == "cuda":
            # an allocation that found no room makes the allocator free every cached block (a device
            # sync) and retry: the count says whether memory pressure stalled the block
            mem = torch.cuda.memory_stats(self.engine.device)
            retries = mem.get("num_alloc_retries", 0)
            line += (f"; allocator: {retries - self._retries} retries, "
                     f"{mem.get('reserved_bytes.all.peak', 0) / 2**30:.1f} GiB reserved at the peak")
            self._retries = retries
            line += "; " + _graph_pools(self.engine)
            self.peak.reset()  # the next note's peak is its block's
        return line

    def moves(self) -> Moves:
        s = self.engine.store.stats()
        return Moves(s.promotions, s.demotions, s.evictions, s.move_s)

    def call(self, i: int, due: float, max_tokens: int) -> Outcome | str:
        assert self.scheduler is not None, "warm() starts the serving loop"
        try:
            sub = self.scheduler.submit(self.prompts[i], SamplingParams(max_tokens=max_tokens), mode=self.mode)
        except QueueFull as e:
            return f"queue full: {e}"
        first, stamps = None, []
        for ev in sub.stream(timeout=600):
            if ev.kind == "token":
                stamps.append(ev.at)  # the serving loop's clock: no client thread's wake-up in it
                first = first if first is not None else time.perf_counter() - due
            elif ev.kind == "error":
                return f"{type(ev.error).__name__}: {ev.error}"
            elif ev.kind == "done":
                m, out = ev.output.metrics, ev.output
                answer = (None if self.answers_from is None
                          else self.answers_from.decode(out.token_ids, skip_special_tokens=True).strip())
                return Outcome(first if first is not None else time.perf_counter() - due, m.ttft_s,
                               m.segment_hits, m.segment_misses, m.prompt_tokens, answer, _gaps(stamps))
        return "the stream ended without an answer"

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()
            profile = getattr(self.scheduler, "profile", None)
            if profile is not None and self.profile:
                path = f"{self.profile}.{self.mode}"
                profile.dump_stats(path)
                out = io.StringIO()
                pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(30)
                print(f"the serving loop's profile ({self.mode}; all of it in {path}), by own time:\n"
                      f"{out.getvalue()}", file=sys.stderr, flush=True)
            self.scheduler = None


def _gaps(stamps: list[float]) -> tuple[float, ...]:
    return tuple(b - a for a, b in itertools.pairwise(stamps))


def _graph_pools(engine) -> str:
    """A note's line on the device memory CUDA graphs' private pools hold (a pool's memory serves
    only captures into it), and how much of it is the cold graphs' pool (``ColdGraphs.pool``)."""
    pools = pool_bytes(engine.device)
    runner = engine._graphs.get("1")
    cold = pools.get(tuple(runner.pool.id), 0) if runner is not None and runner.pool is not None else 0
    return (f"graph pools: {sum(pools.values()) / 2**30:.1f} GiB in {len(pools)}, "
            f"the cold graphs' {cold / 2**30:.1f} GiB")


def _decode_since(now: DecodeStats, before: DecodeStats) -> str:
    """A note's line on what decoding did between two readings of the counters."""
    d = {f.name: getattr(now, f.name) - getattr(before, f.name) for f in dataclasses.fields(now)}
    return (f"decode {d['steps']:.0f} steps, {d['replays']:.0f} replayed, {d['captures']:.0f} captures "
            f"({1e3 * d['capture_s']:.0f} ms), {d['regrows']:.0f} regrows"
            + (f" ({d['regrow_oom_retries']:.0f} out of memory, retried)" if d["regrow_oom_retries"] else ""))


def _calls_since(now: dict[str, float], before: dict[str, float]) -> str:
    """A note's line on the prefill calls between two readings: how many carried a cold part."""
    return (f"prefill {now['calls'] - before['calls']:.0f} calls, "
            f"{now['with_cold'] - before['with_cold']:.0f} with a cold part")


def _counter(metrics: str, name: str) -> float:
    """A counter's value in a Prometheus text scrape (0 when absent)."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.M)
    return 0.0 if m is None else float(m.group(1))


class HttpTarget:
    """A running ``hypic serve``: streamed ``/v1/completions`` with the prompt as its segments."""

    def __init__(self, url: str, trace: Trace, *, api_key: str | None = None, answers: bool = True) -> None:
        self.url, self.trace, self.answers = url.rstrip("/"), trace, answers
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"}
                                                                if api_key else {})}
        models = self._get("/v1/models")
        self.model = json.loads(models)["data"][0]["id"]
        self.mode, self.salt = "hypic", ""
        self._decode = DecodeStats()  # the server's decode counters as of the last note
        self._calls = {"calls": 0.0, "with_cold": 0.0}  # and its prefill calls

    def _get(self, path: str) -> str:
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=self.headers),
                                        timeout=60) as r:
                return r.read().decode()
        except (urllib.error.URLError, OSError, ValueError) as e:  # ValueError: not a URL at all
            raise ValueError(f"cannot reach {self.url + path}: {e}") from None

    def begin(self, mode: str) -> None:
        self.mode, self.salt = mode, f"bench-trace-{mode}-{secrets.token_hex(8)}"  # the server's caches, empty

    def warm(self, indices: list[int]) -> None:
        for group in warm_groups(indices):  # each group at once: the server batches what arrives together
            threads = [threading.Thread(target=self.call, args=(i, time.perf_counter(), 2)) for i in group]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    def note(self) -> str:
        text = self._get("/metrics")  # the server's DecodeStats, field by field
        now = DecodeStats(*(_counter(text, f"hypic_decode_{name}_total") for name in
                            ("steps", "graph_replays", "graph_captures", "graph_capture_seconds", "arena_regrows")))
        line, self._decode = _decode_since(now, self._decode), now
        cold, warm = (_counter(text, f'hypic_prefill_calls_total{{cold="{c}"}}') for c in ("yes", "no"))
        calls = {"calls": cold + warm, "with_cold": cold}
        line, self._calls = _calls_since(calls, self._calls) + "; " + line, calls
        return line

    def moves(self) -> Moves:
        text = self._get("/metrics")
        promotions, demotions, evictions = (int(_counter(text, f"hypic_cache_{name}_total"))
                                            for name in ("promotions", "demotions", "evictions"))
        return Moves(promotions, demotions, evictions, None)

    def call(self, i: int, due: float, max_tokens: int) -> Outcome | str:
        body = {"model": self.model, "segments": self.trace.segments(self.trace.requests[i]), "mode": self.mode,
                "cache_salt": self.salt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        request = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers=self.headers, method="POST")
        first, text, ext, usage, stamps = None, "", None, None, []
        try:
            with urllib.request.urlopen(request, timeout=600) as r:
                for raw in r:  # server-sent events, one `data: …` line each
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return f"{event['error'].get('type', 'error')}: {event['error'].get('message', '')}"
                    if event.get("choices"):
                        first = first if first is not None else time.perf_counter() - due
                        piece = event["choices"][0].get("text") or ""
                        if piece:  # a chunk of text as the client read it (not the closing chunk)
                            stamps.append(time.perf_counter())
                        text += piece
                    ext, usage = event.get("hypic", ext), event.get("usage", usage)
        except urllib.error.HTTPError as e:
            return f"HTTP {e.code}: {e.read().decode(errors='replace')[:200]}"
        except (urllib.error.URLError, OSError) as e:
            return f"{type(e).__name__}: {e}"
        if ext is None or usage is None:
            return "the stream ended without its usage"
        return Outcome(first if first is not None else time.perf_counter() - due, ext["prefill_s"] or 0.0,
                       ext["segment_hits"], ext["segment_misses"], usage["prompt_tokens"],
                       text.strip() if self.answers else None, _gaps(stamps))

    def close(self) -> None:
        pass
