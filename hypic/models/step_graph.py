"""A decode step as a CUDA graph: captured once, replayed every step after.

Why: a decode step is host-bound. At the 9B shape one step over 16 sequences is ≈ 11 ms of device
work behind ≈ 33 ms of host work — some 850 launches, each through Python, fla's wrappers and
Triton's launcher (docs/benchmarks.md). A graph records the launches once; a replay is one call.

What makes a step capturable (``DecodeBatch.step``): it reads only device tensors whose addresses
stay put until the batch's arenas are regrown — the inputs are copied into a fixed buffer, the
arenas are written in place, every slot is computed whoever holds it — and it copies nothing from
the host and reads nothing back. So a captured step stays valid until the next regrow, and the
batch drops it then.

Capture records the launches without running them: the step that captures then replays. A batch
captures on its second step after a regrow; the first runs eagerly, compiling and autotuning the
Triton kernels and filling the host-side caches the forward consults (captured, those would be
recorded as one-offs). A model whose step cannot be captured (e.g. one that reads a count back to
the host) is remembered and decodes eagerly, after one warning; a capture that ran out of memory
is tried again later.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

_refused: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models whose step failed to capture

# Where a capture's memory comes from. By default each graph has a private pool, which stays
# reserved after its graph is dropped (at every regrow) until the allocator, out of room, frees
# every cached block with a device sync. One pool per device for every capture would avoid that,
# and is safe here: replays never overlap (one stream, under the engine's lock) and a step frees
# everything it allocates but its logits, which its graph keeps alive. Measured (scripts/graph_ab.py,
# H200, session 16): no allocator flush in either arm and TTFT within the noise, so not the
# default: HYPIC_GRAPH_POOL=shared (or setting SHARED_POOL) selects it.
# A pool is freed once no graph captured into it is left (at the first regrow) — on the device and
# in the pinned host allocator alike — and the next capture into the freed id fails an allocator
# assertion (measured on the H200, torch 2.11; a ``MemPool`` object keeps only the device side
# alive). So each pool holds an anchor: a one-op graph kept as long as the pool's owner is: the
# process for the decode steps' shared pool, a ``ColdGraphs`` runner for its cold prefills' pool.
SHARED_POOL = os.environ.get("HYPIC_GRAPH_POOL") == "shared"


class GraphPool:
    """A memory pool CUDA graphs are captured into, kept alive by its anchor; once this object and
    every graph captured into it are dropped, the allocator may free its memory (``empty_cache``).
    Make it on a side stream: it captures its anchor."""

    def __init__(self, device: torch.device) -> None:
        self.id = torch.cuda.graph_pool_handle()
        self._anchor = torch.cuda.CUDAGraph()
        self._anchor.capture_begin(pool=self.id, capture_error_mode="thread_local")
        try:
            torch.zeros(1, device=device).add_(1)
        finally:
            self._anchor.capture_end()
        self._device = device

    @property
    def nbytes(self) -> int:
        """The device memory the pool holds now (the allocator's segments of it)."""
        return pool_bytes(self._device).get(tuple(self.id), 0)


def pool_bytes(device: torch.device) -> dict[tuple[int, int], int]:
    """The device memory each graph pool on ``device`` holds now: pool id → bytes of its segments."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    pools: dict[tuple[int, int], int] = {}
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        if pool != (0, 0) and seg.get("device", index) == index:
            pools[pool] = pools.get(pool, 0) + seg["total_size"]
    return pools


_pools: dict[torch.device, GraphPool] = {}


def shared_pool(device: torch.device) -> tuple[int, int]:
    """The id of this device's decode-step pool, kept for the process's life (``HYPIC_GRAPH_POOL=shared``).
    Call on a side stream: it captures its anchor."""
    if device not in _pools:
        _pools[device] = GraphPool(device)
    return _pools[device].id


class StepGraph:
    def __init__(self, graph: torch.cuda.CUDAGraph, logits: Tensor) -> None:
        self._graph, self._logits = graph, logits

    def replay(self) -> Tensor:
        """Run the captured step; its logits, copied out of the graph's memory (the next replay
        overwrites that memory, and callers may keep a step's logits)."""
        self._graph.replay()
        return self._logits.clone()


def capture(model: nn.Module, forward: Callable[[], Tensor], device: torch.device) -> StepGraph | None:
    """``forward`` (one decode step of ``model``, returning logits) captured on ``device``; None if it
    could not be. A model whose step cannot be captured is refused for good (``refused``), with a
    warning the first time. Out of memory is not the model's fault: the capture's pool allocates
    fresh device memory, which blocks cached in the general pool may be holding (a trace under cache
    pressure: 58.6 GiB reserved but unallocated when a 32 MiB capture failed, session 20), so they
    are freed and the capture tried once more; failing again, it returns None and the caller tries
    another time (``DecodeBatch``: after ``OOM_RETRY_STEPS`` eager steps)."""
    if model in _refused:
        return None
    for attempt in (1, 2):
        try:
            return _capture_once(forward, device)
        except RuntimeError as e:
            if not out_of_memory(e):
                _refused.add(model)
                warnings.warn(f"decode steps of this model run eagerly: the step could not be captured as a "
                              f"CUDA graph ({e})", RuntimeWarning, stacklevel=3)
                return None
            error = e
        if attempt == 1:
            torch.cuda.empty_cache()  # a device sync; only after a capture ran out of memory
    warnings.warn(f"a decode step could not be captured as a CUDA graph for lack of memory ({error}); "
                  f"it runs eagerly and the capture is tried again later", RuntimeWarning, stacklevel=3)
    return None


def out_of_memory(e: BaseException) -> bool:
    """Whether a capture failed for lack of memory: the OOM itself, or a ``capture_end`` that failed
    after one (its error then carries the OOM as context)."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or isinstance(e.__context__, torch.cuda.OutOfMemoryError)


def refused(model: nn.Module) -> bool:
    """Whether ``model``'s decode step cannot be captured (it decodes eagerly from now on)."""
    return model in _refused


def _capture_once(forward: Callable[[], Tensor], device: torch.device) -> StepGraph:
    graph = torch.cuda.CUDAGraph()
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)  # capture needs a stream of its own
    side.wait_stream(main)
    try:
        with torch.cuda.stream(side):
            pool = shared_pool(device) if SHARED_POOL else None
            # thread-local: another thread's CUDA calls (the host tier's pinning) may not break it
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                logits = forward()
            finally:
                graph.capture_end()
    finally:
        main.wait_stream(side)
    return StepGraph(graph, logits)
