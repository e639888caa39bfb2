"""Prefill calls that outlive the device running out of memory.

A call that runs the device out of memory is tried again once the engine has let go of what it holds
beyond its running requests (``spare``: the cold graphs, else an eighth of the device tier —
``Engine._spare_memory``), then in halves, down to single prompts; it
fails only when a prompt does not fit alone (and the scheduler then starts each of its requests
alone, so the others are served). Never does one out-of-memory fail every call after it, as it did
on an H200 with cold graphs on (30 GiB held in their private pools): a RAG trace failed 192 and 200
of its 200 requests at 24 QPS once the device had run out (session 22, docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

S = TypeVar("S")
Run = Callable[[int, int], tuple[torch.Tensor, list[S]]]  # prompts [lo, hi) → (first-token logits, states)


def _attempt(run: Run, lo: int, hi: int) -> tuple[tuple[torch.Tensor, list[S]] | None, BaseException | None]:
    try:
        return run(lo, hi), None
    except torch.OutOfMemoryError as e:
        # without its traceback the error holds no frame, so the failed attempt's tensors are freed
        # now, before the next attempt needs their memory
        return None, e.with_traceback(None)


def within_memory(run: Run, n: int, spare: Callable[[], None], counts: dict[str, int]) -> tuple[torch.Tensor, list[S]]:
    """``run(0, n)``; out of memory, ``spare()`` and again, then each half the same way. Rows of the
    logits and states keep the prompts' order. ``counts``: "retried" calls, "split" calls, "failed"
    single prompts (whose error is raised: the caller fails that request)."""

    def solve(lo: int, hi: int) -> tuple[torch.Tensor, list[S]]:
        out, err = _attempt(run, lo, hi)
        if out is not None:
            return out
        del err
        counts["retried"] += 1
        spare()
        out, err = _attempt(run, lo, hi)
        if out is not None:
            return out
        if hi - lo == 1:
            counts["failed"] += 1
            raise err
        del err
        counts["split"] += 1
        mid = (lo + hi) // 2
        (a, sa), (b, sb) = solve(lo, mid), solve(mid, hi)
        return torch.cat([a, b]), sa + sb

    return solve(0, n)
