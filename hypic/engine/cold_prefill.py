"""The cold path of a request: the standalone prefill of its missing segments, on this device or
scattered over cold workers (``hypic.parallel``), producing their cache entries.

A mixin of ``Engine`` (it reads the engine's model, device, store, cold strategy and pool), kept in
its own file because it is its own concept: which segments are cold, who prefills them, what
happens when a worker fails, and the counts the server exports.
"""

from __future__ import annotations

import os
import warnings

import torch

from hypic.cache.budgets import DEVICE_FRACTION
from hypic.cache.entry import Entry
from hypic.cache.layout import Header
from hypic.cache.store import SegmentStore
from hypic.engine.cold import ColdContext, entry_template
from hypic.engine.cold_graphs import ColdGraphs
from hypic.engine.plan import RequestPlan, SegmentPlan
from hypic.models.hybrid import HybridLM
from hypic.parallel.pool import ColdPool, ColdSegment, WorkerLost


def cold_graphs_mode() -> str:
    """``HYPIC_COLD_GRAPHS`` checked: 0 (default), 1 or eager (``ColdPrefill._cold_graphs``)."""
    mode = os.environ.get("HYPIC_COLD_GRAPHS", "0")
    if mode not in ("0", "1", "eager"):
        raise ValueError(f"HYPIC_COLD_GRAPHS: expected 0, 1 or eager, got {mode!r}")
    return mode


class ColdPrefill:
    model: HybridLM
    device: torch.device
    store: SegmentStore
    cold: str
    seam: int
    pool: ColdPool | None
    cold_counts: dict[int, list[int]]  # rank → [segments, tokens] prefilled cold (0: this device)
    cold_failures: dict[str, int]  # cold workers' failures: "request" (retried here), "lost"
    _template: Header | None  # the model's entry layout, learned at the first cold prefill
    _graphs: dict[str, ColdGraphs]  # HYPIC_COLD_GRAPHS value → its runner, made at first use
    _graphs_released: bool  # release_cold_graphs ran: padded cold prefills are off from then on
    _auto_device_budget: int | None  # the store's device budget when "auto" (else None), before the graphs

    def _new_cold(self, segments: list[ColdSegment]) -> ColdContext:
        """A cold prefill of ``segments`` whose entries are each one buffer from the start
        (``HYPIC_ENTRY_BUFFERS=0``: tensor by tensor, as before, for an A/B; read at each call)."""
        if os.environ.get("HYPIC_ENTRY_BUFFERS", "1") != "1":
            return ColdContext(segments, self.device)
        if self._template is None:
            self._template = entry_template(self.model, self.device)
        return ColdContext(segments, self.device, self._template)

    def _cold_graphs(self) -> ColdGraphs | None:
        """The runner of padded cold prefills (``cold_graphs``), or None. ``HYPIC_COLD_GRAPHS`` (read
        at each call, for an A/B in one process): ``0`` (default) off — the misses ride in the combine
        pass's forward (``ColdCombineContext``); ``1`` CUDA graphs on a GPU, nothing elsewhere;
        ``eager`` the same padded forward without graphs, on any device. Off by default: on the H200
        graphs make a lone cold prefill of 1–4 documents 1.3–6× faster, but a serving trace with 76%
        of requests missing a document ran no faster with them (prefill p50 159 ms, against 133–160
        without), and capturing every shape first takes ≈ 68 s (docs/benchmarks.md)."""
        mode = cold_graphs_mode()
        if (mode == "0" or self._graphs_released or (mode == "1" and self.device.type != "cuda")
                or self.model.kinds.linear_family != "gdn" or os.environ.get("HYPIC_ENTRY_BUFFERS", "1") != "1"):
            return None
        if mode not in self._graphs:
            if self._template is None:
                self._template = entry_template(self.model, self.device)
            self._graphs[mode] = ColdGraphs(self.model, self._template, self.device, capture=mode == "1")
        runner = self._graphs[mode]
        if runner.refused:  # a capture failed (not for memory): eager from now on, and the shapes it had
            self.release_cold_graphs()  # captured, their pool and staging let go, the budget refit
            return None
        return runner

    def release_cold_graphs(self) -> None:
        """Drop the cold graphs and their private memory pools, and take no more (the device ran out
        of memory: on the 9B trace they held 30 GiB that nothing else may use; or a capture was refused)."""
        self._graphs.clear()
        self._graphs_released = True
        self._fit_cache_to_cold_graphs()

    def _fit_cache_to_cold_graphs(self) -> None:
        """An auto device budget is half the memory free beside the model (``hypic.cache.budgets``),
        the other half the slack that decoding and activations need. The cold graphs' pool and
        staging come out of that free memory too, so the budget becomes half of what they leave:
        without this, on the 9B trace they took 30 GiB of the slack and the device ran out of memory
        at 16–24 QPS (session 23, docs/benchmarks.md). Back to the whole once they are released."""
        if self._auto_device_budget is None:
            return
        runner = self._graphs.get("1")
        held = 0 if runner is None else runner.held_bytes()
        self.store.set_budget("device", max(0, self._auto_device_budget - int(DEVICE_FRACTION * held)))

    def prepare_cold_graphs(self) -> int:
        """Capture the cold graphs of this engine's seam now, before serving (see
        ``ColdGraphs.prepare``); how many shapes were new (0 where there are no cold graphs)."""
        runner = self._cold_graphs()
        if runner is None:
            return 0
        with torch.no_grad():
            new = runner.prepare(self.seam)
        self._fit_cache_to_cold_graphs()
        return new

    def _padded(self, plans: list[RequestPlan]) -> list[Entry]:
        """The misses a padded cold prefill takes (``_cold_graphs``) prefilled now, ahead of the
        combine pass; their entries, which the misses point to from now on. The rest stay misses."""
        runner = self._cold_graphs()
        if runner is None or self.cold != "standalone":
            return []
        misses = self._misses(plans)
        segments = runner.takes(self._distinct(misses))
        if not segments:
            return []
        eager = runner.counts["eager"]
        entries = runner.prefill(segments)
        if runner.capture and runner.counts["eager"] != eager:  # a shape seen for the first time, captured: more held
            self._fit_cache_to_cold_graphs()
        for ids, _, _ in segments:
            self._count_cold(0, len(ids))
        self._point(misses, entries)
        return entries

    def close(self) -> None:
        """Stop the cold workers, if any (the engine keeps serving on its own device)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    @staticmethod
    def _misses(plans: list[RequestPlan]) -> list[SegmentPlan]:
        return [s for p in plans for s in p.segments if s.key is not None and s.entry is None]

    @staticmethod
    def _distinct(misses: list[SegmentPlan]) -> list[ColdSegment]:
        """Each missing segment once (a document two requests share is prefilled once)."""
        return [(s.token_ids, s.seam, k) for k, s in {s.key: s for s in misses}.items()]

    @staticmethod
    def _point(misses: list[SegmentPlan], entries: list[Entry]) -> None:
        """The misses use the entries just built for them from now on."""
        built = {e.key: e for e in entries}
        for s in misses:
            if s.key in built:
                s.entry = built[s.key]

    def _prefill_alone(self, segments: list[ColdSegment]) -> list[Entry]:
        """The standalone prefill of ``segments`` on this engine's device, as its own forward."""
        ctx = self._new_cold(segments)
        self.model.hidden_states(ctx.input_ids, ctx)
        return ctx.entries

    def _scatter(self, plans: list[RequestPlan]) -> list[Entry]:
        """With cold workers, the distinct misses prefilled across them now; their entries, which the
        misses point to from now on. Nothing when there is no pool, or when the router keeps every
        miss on this device: then the one-forward cold request (``_cold_context``) is the faster path."""
        if self.pool is None:
            return []
        misses = self._misses(plans)
        segments = self._distinct(misses)
        if not segments:
            return []
        owner = self.pool.route(segments)
        if not any(owner):
            return []
        try:
            entries = self.pool.prefill(segments, owner, self._prefill_alone)
        except torch.OutOfMemoryError:  # this device's own share: no worker's fault (within_memory's)
            raise
        except RuntimeError as e:  # a worker failed: this request is answered on the engine's device alone
            lost = isinstance(e, WorkerLost)
            self.cold_failures["lost" if lost else "request"] += 1
            then = "prefilling on this device alone from now on" if lost else "retried on this device"
            warnings.warn(f"cold workers: {e}; {then}", RuntimeWarning, stacklevel=2)
            if lost:
                self.close()
            return []
        for (ids, _, _), rank in zip(segments, owner, strict=True):
            self._count_cold(rank, len(ids))
        self._point(misses, entries)
        return entries

    def _count_cold(self, rank: int, tokens: int) -> None:
        counts = self.cold_counts.setdefault(rank, [0, 0])
        counts[0] += 1
        counts[1] += tokens

    def _cold_context(self, plans: list[RequestPlan], cold: str | None = None) -> ColdContext | None:
        """The standalone prefill of every miss, not yet run: one varlen batch of the distinct missing
        segments, whose entries the misses point to from now on. None when nothing is missing, or
        when the cold strategy is in context (misses then join the combine pass's recompute set)."""
        misses = self._misses(plans)
        if (cold or self.cold) == "in_context":
            for s in misses:
                s.in_context = True
            return None
        segments = self._distinct(misses)
        if not segments:
            return None
        ctx = self._new_cold(segments)
        for ids, _, _ in segments:
            self._count_cold(0, len(ids))
        self._point(misses, ctx.entries)
        return ctx

    def _cold_prefill(self, plans: list[RequestPlan], cold: str | None = None) -> None:
        """Fill every miss now, on its own (``prewarm``): scattered over the cold workers if any."""
        for e in self._scatter(plans) + self._padded(plans):
            self.store.insert(e)
        ctx = self._cold_context(plans, cold)
        if ctx is not None:
            self.model.hidden_states(ctx.input_ids, ctx)
            for e in ctx.entries:
                self.store.insert(e)
