"""Host → device copies that do not stall the host.

A copy from ordinary (pageable) host memory makes the host wait until the GPU has run everything
queued before it, so one such copy inside a forward serialises host and device time. Index tensors
built on the host go through pinned memory with a non-blocking copy instead: the copy is queued in
order on the stream and the host runs ahead. (PyTorch keeps a pinned buffer alive until its copy
has run.)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def to_device(data: Tensor | list | tuple, device: torch.device | str,
              dtype: torch.dtype | None = torch.long) -> Tensor:
    """``data`` (a host tensor or a nested list of numbers) on ``device``, queued without a host stall."""
    t = data if isinstance(data, Tensor) else torch.tensor(data, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    if torch.cuda.is_current_stream_capturing():
        # a captured copy would re-read this pinned buffer at every replay, long after it is freed
        raise RuntimeError("to_device: a host → device copy inside a CUDA graph capture")
    return t.pin_memory().to(device, non_blocking=True)


def copy_to(dst: Tensor, src: Tensor) -> None:
    """Host tensor ``src`` copied into ``dst`` in place (a fixed buffer a captured step reads), queued
    without a host stall when ``dst`` is on the GPU."""
    if dst.device.type == "cuda" and src.device.type == "cpu":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


def to_device_many(parts: list[Tensor], device: torch.device | str) -> list[Tensor]:
    """Several 1-D host tensors of one dtype on ``device`` in one copy (one pinned buffer, one
    transfer), returned as views in order."""
    sizes = [len(p) for p in parts]
    return list(to_device(torch.cat(parts), device, None).split(sizes))


# Device plans that cached helpers hand out (index tensors made once per layout, rope tables) live
# outside any CUDA graph's memory pool. A graph captured while reading one reads that same memory
# at every replay, so the graph's owner must keep it alive after the cache has dropped it (freed,
# the allocator would hand the memory to someone else and the replay would read their data).
_KEPT: ContextVar[list | None] = ContextVar("hypic_kept_plans", default=None)


@contextlib.contextmanager
def keeping() -> Iterator[list]:
    """Within the block (a CUDA graph's capture), every object ``device_cache`` helpers return, and
    the rope tables used, is also appended to the yielded list: keep it as long as the graph."""
    kept: list = []
    token = _KEPT.set(kept)
    try:
        yield kept
    finally:
        _KEPT.reset(token)


def keep(obj: object) -> None:
    """Record ``obj`` for the capture under way, if any (see ``keeping``)."""
    kept = _KEPT.get()
    if kept is not None:
        kept.append(obj)


def device_cache(maxsize: int) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """``functools.lru_cache`` for helpers that return device plans, whose results a capture keeps
    (``keeping``). ``cache_clear`` and ``cache_info`` pass through."""
    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args: object) -> T:
            out = cached(*args)
            keep(out)
            return out

        call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        call.cache_info = cached.cache_info  # type: ignore[attr-defined]
        return call
    return wrap
