"""Prometheus metrics, one registry per app (so two servers in a process never share counters).

Request-level series are updated as requests run: time to first token by cache outcome, the
engine's prefill time, the time between a request's tokens and its whole time, segment hits and
misses, prompt / cached / recomputed / generated tokens, requests by endpoint and errors by kind.
Cache and queue gauges are read from the store and the scheduler when scraped, so they are never
stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hypic.cache.store import TIERS, SegmentStore
from hypic.engine.engine import Engine
from hypic.engine.request import RequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
# up to the request timeout's default (600 s): a quantile past the last bound reads as that bound
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                120.0, 300.0, 600.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 600.0, 960.0)


def cache_outcome(m: RequestMetrics) -> str:
    """hit: every cacheable segment was cached; miss: none was; partial; none: nothing cacheable."""
    if m.segment_hits + m.segment_misses == 0:
        return "none"
    return "hit" if m.segment_misses == 0 else "miss" if m.segment_hits == 0 else "partial"


class _Live(Collector):
    """Cache tiers, queue depth and who prefilled cold segments, read at scrape time."""

    def __init__(self, store: SegmentStore, depth: Callable[[], tuple[int, int]], engine: Engine | None = None) -> None:
        self.store, self.depth, self.engine = store, depth, engine

    def collect(self) -> Iterator[Metric]:
        s = self.store.stats()
        for name, doc, values in (("hypic_cache_bytes", "Bytes held by cache entries per tier", s.bytes),
                                  ("hypic_cache_entries", "Cache entries per tier", s.entries)):
            g = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier in TIERS:
                g.add_metric([tier], values[tier])
            yield g
        g = GaugeMetricFamily("hypic_cache_budget_bytes", "Byte budget per tier (absent: unbounded)", labels=["tier"])
        for tier in TIERS:
            if s.budgets[tier] is not None:
                g.add_metric([tier], s.budgets[tier])
        yield g
        yield GaugeMetricFamily("hypic_cache_host_pinned_bytes", "Page-locked host memory the host tier holds "
                                "(pinned ahead of demotions, used or not)", value=s.host_pinned_bytes)
        for name, value in (("evictions", s.evictions), ("promotions", s.promotions), ("demotions", s.demotions),
                            ("lookup_hits", s.hits), ("lookup_misses", s.misses)):
            yield CounterMetricFamily(f"hypic_cache_{name}", f"Cache {name.replace('_', ' ')}"
                                      + (" (every store lookup, prewarm's included)" if "lookup" in name else ""),
                                      value=value)
        yield CounterMetricFamily("hypic_cache_move_seconds", "Host time spent issuing promotions and demotions "
                                  "(copies between the tiers, on the engine's thread)", value=s.move_s)
        waiting, running = self.depth()
        yield GaugeMetricFamily("hypic_queue_depth", "Requests waiting for a decode slot", value=waiting)
        yield GaugeMetricFamily("hypic_running_requests", "Requests being prefilled or decoding (and echo "
                                "prompts being scored)", value=running)
        if self.engine is not None:
            e = self.engine
            states, nbytes = e.prefix.stats()
            yield GaugeMetricFamily("hypic_prefix_states", "Sequence states the prefix mode keeps (in what the "
                                    "segment store leaves of the device budget)", value=states)
            yield GaugeMetricFamily("hypic_prefix_bytes", "Bytes the prefix mode's kept states hold (shared "
                                    "buffers once)", value=nbytes)
            yield CounterMetricFamily("hypic_recomputed_tokens", "Tokens run through the model in prefill "
                                      "and prewarm, on every device (a cold segment shared by prompts of one call "
                                      "once; echo scoring apart)", value=e.prefill_tokens)
            yield GaugeMetricFamily("hypic_cold_devices", "Devices prefilling cold segments (this one and its "
                                    "cold workers)", value=1 if e.pool is None else e.pool.workers)
            for name, doc, i in (("segments", "Cold segments prefilled, by device rank (0: the engine's)", 0),
                                 ("tokens", "Cold segment tokens prefilled, by device rank (0: the engine's)", 1)):
                c = CounterMetricFamily(f"hypic_cold_{name}", doc, labels=["rank"])
                for rank, counts in sorted(e.cold_counts.items()):
                    c.add_metric([str(rank)], counts[i])
                yield c
            c = CounterMetricFamily("hypic_cold_worker_failures", "Cold workers' failures: a request retried on "
                                    "the engine's device, or a worker lost", labels=["kind"])
            for kind, n in e.cold_failures.items():
                c.add_metric([kind], n)
            yield c
            c = CounterMetricFamily("hypic_prefill_calls", "Prefill calls of the cached modes, by whether they "
                                    "prefilled cold segments (a slice of a long prompt's documents prefilled "
                                    "ahead, --max-prefill-tokens, is one with)", labels=["cold"])
            c.add_metric(["yes"], e.prefill_calls["with_cold"])
            c.add_metric(["no"], e.prefill_calls["without_cold"])
            yield c
            c = CounterMetricFamily("hypic_prefill_out_of_memory", "Prefill calls that ran the device out of memory: "
                                    "retried after sparing memory, split in halves, or a single prompt that failed",
                                    labels=["outcome"])
            for outcome, n in e.out_of_memory.items():
                c.add_metric([outcome], n)
            yield c
            yield CounterMetricFamily("hypic_cache_shed", "Times the device tier gave up part of itself (and lowered "
                                      "its budget) after the device ran out of memory", value=e.cache_shed["times"])
            yield CounterMetricFamily("hypic_cache_shed_bytes", "Bytes the device tier moved out when it shed",
                                      value=e.cache_shed["bytes"])
            d = e.decode_stats
            for name, doc, value in (
                    ("steps", "Batched decode steps", d.steps),
                    ("graph_replays", "Decode steps replayed from a captured CUDA graph", d.replays),
                    ("graph_captures", "Decode steps captured as CUDA graphs", d.captures),
                    ("graph_capture_seconds", "Host time spent capturing decode steps", d.capture_s),
                    ("arena_regrows", "Decode arenas (re)allocated, each dropping its captured step", d.regrows),
                    ("arena_oom_retries", "Arena growths that ran out of device memory and were tried again "
                     "after sparing memory", d.regrow_oom_retries)):
                yield CounterMetricFamily(f"hypic_decode_{name}", doc, value=value)


class Metrics:
    def __init__(self, store: SegmentStore, depth: Callable[[], tuple[int, int]], engine: Engine | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("hypic_time_to_first_token_seconds", "Arrival to first token, by cache outcome "
                              "(echo with logprobs: the prompt's scoring included)",
                              ["cache"], buckets=TTFT_BUCKETS, registry=r)
        self.prefill = Histogram("hypic_prefill_seconds", "Engine time to assemble a prompt's state and sample "
                                 "its first token", buckets=TTFT_BUCKETS, registry=r)
        self.waiting = Histogram("hypic_wait_seconds", "Arrival to first token less the request's own prefill: "
                                 "what it waited for (the queue, its scoring, other requests' prefills and decode "
                                 "steps; vLLM's request_queue_time)", buckets=TTFT_BUCKETS, registry=r)
        self.inter_token = Histogram("hypic_inter_token_seconds", "Time between a request's consecutive tokens, "
                                     "as the serving loop emits them (decode steps and the prefills between "
                                     "them)", buckets=INTER_TOKEN_BUCKETS, registry=r)
        self.request_seconds = Histogram("hypic_request_seconds", "Arrival to the last token of a request answered "
                                         "to its end (its limit, EOS or a stop string; not cancelled or failed)",
                                         buckets=REQUEST_BUCKETS, registry=r)
        self.requests = Counter("hypic_requests", "Requests accepted, by endpoint", ["endpoint"], registry=r)
        self.errors = Counter("hypic_errors", "Errors by kind", ["kind"], registry=r)
        self.segment_hits = Counter("hypic_segment_hits", "Requests' cacheable segments found in the cache",
                                    registry=r)
        self.segment_misses = Counter("hypic_segment_misses", "Requests' cacheable segments not found in the cache "
                                      "(one prefilled for several requests of a call counts in each)", registry=r)
        self.prompt_tokens = Counter("hypic_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter("hypic_cached_tokens", "Prompt tokens served from the cache", registry=r)
        self.generated_tokens = Counter("hypic_generated_tokens", "Tokens generated", registry=r)
        self.prewarmed_segments = Counter("hypic_prewarmed_segments", "Segments prefilled by /v1/segments (a "
                                          "request's repeated segment once)",
                                          registry=r)
        self.evicted_segments = Counter("hypic_evicted_segments", "Segments forgotten by /v1/segments/evict",
                                        registry=r)
        self.scored_tokens = Counter("hypic_scored_prompt_tokens", "Prompt tokens scored for echo with logprobs "
                                     "(a full forward each)", registry=r)
        for kind in ("invalid_request", "authentication", "not_found", "overloaded", "shutting_down", "timeout",
                     "cancelled", "engine", "internal", "out_of_memory"):
            self.errors.labels(kind)  # every kind is exported from the start, at 0
        r.register(_Live(store, depth, engine))

    def count_error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def first_token(self, m: RequestMetrics, ttft_s: float) -> None:
        """A request's prefill is done: its cache outcome and prompt accounting are known."""
        self.ttft.labels(cache_outcome(m)).observe(ttft_s)
        self.prefill.observe(m.ttft_s)
        self.waiting.observe(max(0.0, ttft_s - m.ttft_s))
        self.segment_hits.inc(m.segment_hits)
        self.segment_misses.inc(m.segment_misses)
        self.prompt_tokens.inc(m.prompt_tokens)
        self.cached_tokens.inc(m.cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
