"""The bridge between the scheduler's worker thread and the async request handlers.

The scheduler (``hypic.engine.scheduler``) owns the engine in one thread, batches decode across
requests and hands each request's events to a thread-safe queue. A handler must never block the
event loop on that queue, so each job gets a small pump thread that forwards its events into an
``asyncio.Queue``; the thread ends with the job's last event (``done``, or ``error`` — which a
cancelled job always gets). Handlers wait on the async queue under the request's deadline and
cancel the job when the deadline passes or the client goes away; the scheduler then drops it at
its next iteration (prefill pins are released when prefill ends, so a dropped job holds none).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import torch

from hypic.engine.request import RequestMetrics, SamplingParams
from hypic.engine.scheduler import CANCELLED, SHUTDOWN, Event, QueueFull, Scheduler, Submission
from hypic.server.errors import APIError
from hypic.server.settings import ServerSettings

T = TypeVar("T")
OVERDUE_POLL_S = 0.1  # how often work that cannot be stopped looks whether the shutdown timeout passed


class Job:
    def __init__(self, sub: Submission, arrival: float, deadline: float, retry_after_s: int = 1) -> None:
        self.sub, self.arrival, self.deadline = sub, arrival, deadline
        self.retry_after_s = retry_after_s  # what a 503 for this job advertises
        self.first_token_at: float | None = None
        self.tokens = 0
        self.finished = False  # the last event was received
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._pump, args=(loop,), name="hypic-job-pump", daemon=True).start()

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        for event in self.sub.stream():
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self.sub.cancel()

    @property
    def metrics(self) -> RequestMetrics | None:
        """Prefill metrics, once the first token exists."""
        return self.sub.run.output.metrics if self.sub.run is not None else None

    def cancel(self) -> None:
        self.sub.cancel()

    async def next(self) -> Event:
        """The next event; on the deadline the job is cancelled and a 504 raised."""
        try:
            event = await asyncio.wait_for(self._queue.get(), max(0.0, self.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            self.cancel()
            raise ended_error(TIMEOUT) from None
        if event.kind == "token":
            self.tokens += 1
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
        elif event.kind in ("done", "error"):
            self.finished = True
        return event


TIMEOUT = "timeout"  # a request's deadline passed (CANCELLED and SHUTDOWN: the scheduler's reasons)


def ended_error(reason: str) -> APIError:
    """What a request ended early tells its client, by the reason: its client went away
    (``CANCELLED``), the shutdown timeout passed (``SHUTDOWN``) or its own deadline (``TIMEOUT``)."""
    if reason == SHUTDOWN:
        return APIError(503, SHUTDOWN, kind="shutting_down", type="server_error")
    if reason == TIMEOUT:
        return APIError(504, "the request timed out", kind="timeout", type="timeout_error")
    return APIError(499, "the request was cancelled", kind="cancelled", type="cancelled")


def event_error(event: Event, retry_after_s: int = 1) -> APIError:
    """What an ``error`` event means for the client."""
    e = event.error
    if isinstance(e, QueueFull):  # queued as the server began to stop: another server can take it now
        return APIError(503, "the server is shutting down", kind="shutting_down", type="server_error",
                        headers={"Retry-After": str(retry_after_s)})
    if isinstance(e, torch.OutOfMemoryError):  # alone, next to the requests running now: later, not never
        return APIError(503, "the prompt did not fit in device memory next to the requests running; retry later",
                        kind="out_of_memory", type="server_error", headers={"Retry-After": str(retry_after_s)})
    if isinstance(e, RuntimeError) and str(e) in (CANCELLED, SHUTDOWN):  # the scheduler's cancellations
        return ended_error(str(e))
    return APIError(500, f"generation failed: {type(e).__name__}: {e}", kind="engine", type="server_error")


class Runner:
    """One scheduler per app; refuses new work once shutdown begins."""

    def __init__(self, scheduler: Scheduler, settings: ServerSettings) -> None:
        self.scheduler, self.settings = scheduler, settings
        self.closing = False
        self.closing_at: float | None = None  # when the shutdown began (monotonic)
        self._stopping: threading.Thread | None = None

    def _unavailable(self, message: str, status: int, kind: str) -> APIError:
        return APIError(status, message, kind=kind, type="server_error" if status == 503 else "rate_limit_error",
                        headers={"Retry-After": str(self.settings.retry_after_s)})

    def submit(self, prompt: list[list[int]], params: SamplingParams, mode: str, salt: str | None,
               arrival: float) -> Job:
        return self.submit_all([(prompt, params, mode, salt)], arrival)[0]

    def submit_all(self, items: list[tuple[list[list[int]], SamplingParams, str, str | None]],
                   arrival: float, first_logits: list[torch.Tensor | None] | None = None,
                   priorities: list[int] | None = None) -> list[Job]:
        """(prompt, params, mode, salt) each — a request's choices — queued all or none (429 / 503);
        ``first_logits``: per item, its first-token logits if computed already (echo scoring);
        ``priorities``: per item, the request's priority (``--scheduling-policy priority``)."""
        if self.closing:
            raise self._unavailable("the server is shutting down", 503, "shutting_down")
        try:
            subs = self.scheduler.submit_all(items, first_logits, priorities)
        except QueueFull as e:
            if self.closing or "shutting down" in str(e):
                raise self._unavailable("the server is shutting down", 503, "shutting_down") from None
            raise self._unavailable(f"the server is busy: {e}; retry later", 429, "overloaded") from None
        return [Job(sub, arrival, arrival + self.settings.request_timeout_s, self.settings.retry_after_s)
                for sub in subs]

    def begin_shutdown(self) -> None:
        """Stop admitting now; in-flight jobs (and queued ones, ``shutdown_drain``) get the shutdown timeout
        to finish, then are cancelled with an error of their own (a stream ends with an error event and
        ``[DONE]``). Called as the server begins to stop (``HypicServer``), so it runs while uvicorn still
        writes responses."""
        if self._stopping is None:
            self.closing, self.closing_at = True, time.monotonic()
            self._stopping = threading.Thread(target=self.scheduler.shutdown,
                                              args=(self.settings.shutdown_timeout_s, self.settings.shutdown_drain),
                                              name="hypic-shutdown", daemon=True)
            self._stopping.start()

    def overdue(self) -> bool:
        """Past the shutdown timeout: what is still running is cancelled (echo scoring asks)."""
        return self.closing_at is not None and time.monotonic() > self.closing_at + self.settings.shutdown_timeout_s

    async def shutdown(self) -> None:
        """The lifespan's end: the shutdown begun (if it was not) and finished."""
        self.begin_shutdown()
        await asyncio.to_thread(self._stopping.join)


async def before_overdue(runner: Runner | None, work: Awaitable[T]) -> T:
    """``work`` awaited — engine work that cannot stop midway on a worker thread: a pre-warm, an
    eviction, a save — but once the shutdown timeout has passed its request ends with the shutdown's
    503, as a generation's does (left running, uvicorn cancelled it ``GRACE_S`` later: a 500 and a
    traceback in the log). The thread goes on to its end; the cache is saved after it."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=OVERDUE_POLL_S)
            if not task.done() and runner is not None and runner.overdue():
                raise ended_error(SHUTDOWN)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # no one reads its outcome now


async def until_disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client hangs up (the request body must have been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass
