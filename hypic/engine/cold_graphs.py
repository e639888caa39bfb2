"""Cold prefills replayed as CUDA graphs: one graph per shape (slots, padded length, seam).

Why: a cold prefill of a few documents is host-bound. At the 9B shape on the H200, 1–4 new
documents (100–1 200 tokens) cost 70–80 ms whatever their size (``scripts/trace_costs.py
--cold-alone``), the host launching some 1 500 kernels through Python, fla's wrappers and Triton's
launcher while the device needs 10–30 ms; riding in a serving call's combine pass, the cold part
still adds ≈ 50 ms of host work (trace prefill p50 152–160 vs 103 ms). A replay is one call, and
the device runs it while the host goes on to launch the combine pass.

How: a call's cold segments are grouped by (seam, padded length) and cut into groups of at most
``MAX_SLOTS``; each group runs as a ``PaddedColdContext`` of its own slot count. A call with more
than ``CALL_TOKENS`` of them is left to the eager path (``takes``). The first time a shape is seen
it runs eagerly — compiling and autotuning the kernels and filling the host caches the forward
consults — and is captured right after, while those caches still hold its plans
(``transfer.keeping`` keeps what the graph reads); from then on it is replayed. A model whose cold
forward cannot be captured is remembered, warned about once, and its cold prefills go back to the
eager one-forward path. Graphs of every shape share one memory pool (replays never overlap: one
stream, under the engine's lock) and one staging area, each group's share copied into its entries
before the next group runs. The pool is the runner's own: dropping the runner frees it (the engine
does so when the device runs out of memory, ``ColdPrefill.release_cold_graphs``): a pool the
process kept held its 30 GiB after the runner was dropped (the 9B trace, H200, session 23).

``capture=False`` runs the same padded forward eagerly (any device): the CPU tests' path, and an A/B.

Off by default (``HYPIC_COLD_GRAPHS``, ``ColdPrefill._cold_graphs``): alone, the cold prefill of one
document went 56–70 → 10–17 ms, but serving a trace with a miss in 76% of requests, calls were no
faster (prefill p50 159 ms with every shape captured, 133–160 ms without graphs, H200, session 19):
why is open (the replays' device time may add to the combine pass's instead of hiding behind its host work).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from hypic.cache.entry import Entry
from hypic.cache.keys import SegmentKey
from hypic.cache.layout import Header, allocate, resized
from hypic.engine.cold_padded import BLOCK, PaddedColdContext, Staging, padded_length, tail_width
from hypic.models.hybrid import HybridLM
from hypic.models.step_graph import GraphPool, out_of_memory
from hypic.ops.transfer import keeping

MAX_SLOTS = 8  # segments per replay; every count 1…8 has its shape, so no slot is computed empty
MAX_LENGTH = 512  # longer segments run eagerly: their prefill is device-bound, a graph saves little
# A call whose accepted misses hold more tokens runs them eagerly in one forward instead: a
# replay's groups (one per padded length) are small matmuls, run one after another, on padded
# rows. Measured (H200, 9B shape, trace_costs.py --cold-alone): 1 document 56–70 → 10–17 ms,
# 4 documents (1 100–1 300 tokens) 62–71 → 45–55 ms, but 16 (4 700–5 700 tokens, device-bound
# either way) 145–169 → 360–415 ms (then with empty slots padding groups to 1, 2, 4 or 8).
CALL_TOKENS = 1536

Segment = tuple[list[int], int, SegmentKey]


@dataclass
class _Shape:
    context: PaddedColdContext
    graph: torch.cuda.CUDAGraph | None = None
    kept: list = field(default_factory=list)  # device plans the graph reads (transfer.keeping)


class ColdGraphs:
    def __init__(self, model: HybridLM, header: Header, device: torch.device, *, capture: bool = True) -> None:
        if model.kinds.linear_family != "gdn":
            raise ValueError(f"ColdGraphs: padded cold prefills need GDN linear layers, not "
                             f"{model.kinds.linear_family!r}")
        self.model, self.header, self.device = model, header, device
        self.capture = capture and device.type == "cuda"
        self.tail = tail_width(header)
        self.staging: Staging | None = None  # made at the first prefill (≈ 0.9 GB at the 9B shape)
        self.shapes: dict[tuple[int, int, int], _Shape] = {}
        self.refused = False  # the model's cold forward could not be captured: eager one-forward path
        self.pool: GraphPool | None = None  # where the graphs' memory comes from, made at the first capture
        self.counts = {"eager": 0, "replayed": 0}  # groups run each way

    def held_bytes(self) -> int:
        """The device memory this runner holds beyond the cache: its graphs' pool and its staging."""
        return (0 if self.pool is None else self.pool.nbytes) + (0 if self.staging is None else self.staging.nbytes)

    def accepts(self, ids: list[int], seam: int) -> bool:
        return not self.refused and max(seam + 1, self.tail) <= len(ids) <= MAX_LENGTH

    def takes(self, segments: list[Segment]) -> list[Segment]:
        """The segments of one call that run padded: those it ``accepts``, unless they hold more than
        ``CALL_TOKENS`` tokens together (then none: that prefill is device-bound either way)."""
        fit = [s for s in segments if self.accepts(s[0], s[1])]
        return fit if sum(len(ids) for ids, _, _ in fit) <= CALL_TOKENS else []

    def prefill(self, segments: list[Segment]) -> list[Entry]:
        """The entries of ``segments`` (each ``accepts``-ed), in their order, filled on the stream."""
        if not all(self.accepts(ids, w) for ids, w, _ in segments):
            raise ValueError("ColdGraphs.prefill: a segment it does not accept (see accepts)")
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, (ids, w, _) in enumerate(segments):
            groups[w, padded_length(len(ids))].append(i)
        out: dict[int, Entry] = {}
        for (w, B), members in sorted(groups.items()):
            for at in range(0, len(members), MAX_SLOTS):
                chunk = members[at:at + MAX_SLOTS]
                for i, e in zip(chunk, self._run(len(chunk), B, w, [segments[i] for i in chunk]), strict=True):
                    out[i] = e
        return [out[i] for i in range(len(segments))]

    def prepare(self, seam: int) -> int:
        """Capture every shape of seam ``seam`` now (slots × padded lengths; documents longer than
        the seam get it whole); how many were new. Without this, each shape is captured the first
        time a call needs it, and that call pays an eager forward and a capture (on the H200's 9B
        shape a serving trace whose warm-up left most shapes uncaptured ran 2.4× slower prefills)."""
        if not self.capture:
            return 0
        new = 0
        for B in range(BLOCK, MAX_LENGTH + 1, BLOCK):
            if B <= max(seam, self.tail - 1):
                continue
            for n in range(1, MAX_SLOTS + 1):
                if (n, B, seam) in self.shapes and self.shapes[n, B, seam].graph is not None or self.refused:
                    continue
                dummy = [([1] * B, seam, SegmentKey(b"prepare", B))] * n
                self._run(n, B, seam, dummy)
                new += 1
        return new

    def _run(self, n: int, B: int, w: int, group: list[Segment]) -> list[Entry]:
        if self.staging is None:
            self.staging = Staging(self.header, MAX_SLOTS, MAX_LENGTH, self.device)
        shape = self.shapes.get((n, B, w))
        if shape is None:
            shape = self.shapes[n, B, w] = _Shape(PaddedColdContext(n, B, w, self.staging, self.tail, self.device))
        ctx = shape.context
        ctx.load(group)
        if shape.graph is not None:
            shape.graph.replay()
            self.counts["replayed"] += 1
        else:
            self.model.hidden_states(ctx.input_ids, ctx)
            self.counts["eager"] += 1
            if self.capture and not self.refused:
                self._capture(shape)
        entries = [allocate(resized(self.header, key, tuple(ids), sw), self.device) for ids, sw, key in group]
        ctx.deliver(entries)
        return entries

    def _capture(self, shape: _Shape) -> None:
        """Record ``shape``'s forward (nothing runs); on failure the model is refused, with a warning —
        but out of memory only frees the allocator's cached blocks (``step_graph.capture``'s reason)."""
        ctx, graph = shape.context, torch.cuda.CUDAGraph()
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)  # capture needs a stream of its own
        side.wait_stream(main)
        try:
            with torch.cuda.stream(side), keeping() as kept:
                if self.pool is None:
                    self.pool = GraphPool(self.device)
                graph.capture_begin(pool=self.pool.id, capture_error_mode="thread_local")
                try:
                    self.model.hidden_states(ctx.input_ids, ctx)
                finally:
                    graph.capture_end()
        except RuntimeError as e:
            if out_of_memory(e):  # memory, not the model: this shape stays eager until its next use
                torch.cuda.empty_cache()  # the capture's pool allocates fresh memory the general pool may hold
                return
            self.refused = True
            warnings.warn(f"cold prefills of this model run eagerly in one forward: its padded cold forward "
                          f"could not be captured as a CUDA graph ({e})", RuntimeWarning, stacklevel=4)
            return
        finally:
            main.wait_stream(side)
        shape.graph, shape.kept = graph, kept
