"""The serving loop: requests arrive from many threads; one worker thread owns the engine.

Each iteration admits waiting requests (prefilled together, per mode; at most
``max_prefill_tokens`` tokens computed a call — what the cache does not hold: a warm prompt costs
its seams and its query — so a burst cannot build one long prefill that holds every request of the
burst to the slowest; a call that runs the device out of memory is split, ``engine/memory.py``),
runs one decode step for every running request — decode is batched across requests — and hands
new tokens to each request's event queue. A prompt that would compute more than that first has its
missing documents prefilled ahead, a slice of at most ``max_prefill_tokens`` tokens an iteration
(``Engine.prefill_ahead``), so the running requests go on decoding between slices instead of
waiting for the whole prompt: the segment-level counterpart of chunked prefill, the same
computation because a cold document is prefilled standalone anyway. Between two slices, the
requests behind it that fit the limit are admitted (a warm prompt does not wait for a cold one's
slices).
The waiting queue is bounded (``QueueFull`` lets a server answer 429/503).
A cancelled request leaves at the next iteration — a waiting one frees its place in the queue
then, or at the next submission, not only when it would have been admitted; shutdown stops
admitting, then finishes or cancels what runs.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from hypic.cache.keys import SegmentKey
from hypic.engine.engine import Engine, Running
from hypic.engine.plan import SegmentPlan
from hypic.engine.request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue is at its limit."""


@dataclass
class Event:
    kind: str  # "token" | "done" | "error"
    token: int | None = None
    logprobs: dict[int, float] | None = None
    output: RequestOutput | None = None
    error: Exception | None = None
    at: float = field(default_factory=time.monotonic)  # when the scheduler made it (time.monotonic)


CANCELLED = "cancelled"
SHUTDOWN = "the server shut down before the request finished"


@dataclass
class Submission:
    prompt: list[list[int]]
    params: SamplingParams
    mode: str
    salt: str | None
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    run: Running | None = None
    sent: int = 0  # tokens already handed out
    reason: str = CANCELLED  # what its error event says once cancelled
    warmed: frozenset[SegmentKey] = frozenset()  # its documents prefilled ahead (Engine.prefill_ahead)
    warm_s: float = 0.0  # seconds those slices took
    ahead: bool = True  # whether prefilling ahead may still find a document to build
    layout: list[SegmentPlan] | None = None  # its segments' keys, computed once (Scheduler._cost)
    # its first-token logits, computed already (an echo's scoring forward): nothing to prefill, one
    # token to draw (``Engine.start(first_logits=…)``)
    first_logits: torch.Tensor | None = None
    priority: int = 0  # vLLM's: a lower value is admitted first, ties in arrival order

    def cancel(self, reason: str = CANCELLED) -> None:
        if not self.cancelled.is_set():
            self.reason = reason
        self.cancelled.set()

    def stream(self, timeout: float | None = None):
        """Yield events until ``done`` or ``error`` (raises queue.Empty after ``timeout`` seconds idle)."""
        while True:
            event = self.events.get(timeout=timeout)
            yield event
            if event.kind in ("done", "error"):
                return


class Scheduler:
    def __init__(self, engine: Engine, *, max_running: int = 32, max_queue: int = 128,
                 max_prefill_tokens: int | None = None) -> None:
        """``max_prefill_tokens``: tokens computed by one prefill call (None: no limit), counted
        by what the cache holds when the request is admitted. A request that would compute more has
        its missing documents prefilled ahead in slices of at most that many tokens, one an
        iteration while others decode, then is admitted (alone if it still costs more: a document is
        never split, one longer than the limit is a slice of its own, and ``full`` and ``prefix``
        prompts, and every prompt of an engine whose misses are computed in context, run whole)."""
        if max_prefill_tokens is not None and (not isinstance(max_prefill_tokens, int)
                                               or isinstance(max_prefill_tokens, bool) or max_prefill_tokens < 1):
            raise ValueError(f"max_prefill_tokens: expected an integer ≥ 1 or None, got {max_prefill_tokens!r}")
        self.engine, self.max_running, self.max_queue = engine, max_running, max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self._waiting: deque[Submission] = deque()
        self._running: list[Submission] = []
        self._prefilling = 0  # taken off the queue by _admit, not yet running nor ended
        self._sliced: Submission | None = None  # the head the last iteration sliced: those behind it go first
        self._cost_errors: set[type] = set()  # exception types _cost has logged
        self._cv = threading.Condition()
        self._stopping = False
        self._cancel_all = False  # past the shutdown timeout: a request still starting is cancelled too
        self._thread = threading.Thread(target=self._loop, name="hypic-scheduler", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> tuple[int, int]:
        """(waiting, running): running counts the requests being prefilled too (as vLLM's
        num_requests_running does) — a replica busy with long prompts must not read as idle."""
        with self._cv:
            return len(self._waiting), len(self._running) + self._prefilling

    def submit(self, prompt: list[list[int]], params: SamplingParams, *, mode: str = "hypic",
               salt: str | None = None) -> Submission:
        return self.submit_all([(prompt, params, mode, salt)])[0]

    def submit_all(self, items: list[tuple[list[list[int]], SamplingParams, str, str | None]],
                   first_logits: list[torch.Tensor | None] | None = None,
                   priorities: list[int] | None = None) -> list[Submission]:
        """(prompt, params, mode, salt) each, queued together or not at all (``QueueFull``): a request's
        ``n`` choices take their places at once, so a refused one never held places another request
        could have had. The places are the queue's and the running slots free now (which the requests
        waiting take first). ``first_logits``: per item, its first-token logits if computed already
        (``Submission.first_logits``). ``priorities``: per item, vLLM's priority — each waits behind
        those of a lower or equal value and ahead of the higher ones (None: all 0, first come first
        served); a request already running is never stopped for one."""
        for name, given in (("first_logits", first_logits), ("priorities", priorities)):
            if given is not None and len(given) != len(items):
                raise ValueError(f"{name}: expected one per item ({len(items)}), got {len(given)}")
        subs = [Submission(prompt, params, mode, salt) for prompt, params, mode, salt in items]
        for sub, row, rank in zip(subs, first_logits or [None] * len(subs), priorities or [0] * len(subs),
                                  strict=True):
            sub.first_logits, sub.priority = row, rank
            sub.ahead = row is None  # nothing of its prompt is prefilled, ahead or not
        with self._cv:
            self._drop_cancelled_waiting()
            if self._stopping:
                raise QueueFull("the server is shutting down")
            free = max(0, self.max_running - len(self._running) - self._prefilling)
            if len(self._waiting) + len(subs) > self.max_queue + free:
                need = "" if len(subs) == 1 else f"; this request needs {len(subs)} places"
                raise QueueFull(f"{len(self._waiting)} requests are waiting (limit {self.max_queue}){need}")
            for sub in subs:
                self._enqueue(sub)
            self._cv.notify()
        return subs

    def _enqueue(self, sub: Submission) -> None:
        """Into the queue behind every request of a lower or equal priority (the caller holds the lock)."""
        if not self._waiting or self._waiting[-1].priority <= sub.priority:
            self._waiting.append(sub)  # first come, first served: always here
            return
        at = len(self._waiting)
        while at > 0 and self._waiting[at - 1].priority > sub.priority:
            at -= 1
        self._waiting.insert(at, sub)

    def _drop_cancelled_waiting(self) -> None:
        """Cancelled requests out of the waiting queue (the caller holds the lock): a client that went
        away must not keep a place that another could take."""
        if any(s.cancelled.is_set() for s in self._waiting):
            self._waiting = deque(_without_cancelled(self._waiting))

    def _emit(self, sub: Submission) -> None:
        out = sub.run.output
        for i in range(sub.sent, len(out.token_ids)):
            lp = out.logprobs[i] if out.logprobs is not None else None
            sub.events.put(Event("token", out.token_ids[i], lp))
        sub.sent = len(out.token_ids)
        if sub.run.done:
            sub.events.put(Event("done", output=out) if sub.run.error is None else Event("error", error=sub.run.error))

    def _admit(self) -> None:
        """This iteration's prefill call. While the queue head is prefilled ahead, iterations
        alternate: one slice of its documents, then the requests behind it that fit the limit (a warm
        prompt behind a cold one need not wait for all its slices, and the head still gets a slice
        every other iteration at least), then the next slice."""
        sliced, self._sliced = self._sliced, None
        if sliced is not None and self._admit_waiting(behind=sliced):
            return
        if self._prefill_ahead():
            return
        self._admit_waiting()

    def _admit_waiting(self, behind: Submission | None = None) -> bool:
        """Prefill waiting requests in arrival order, at most ``max_prefill_tokens`` tokens computed
        (the first one whole when it alone costs more). ``behind``: the head being prefilled ahead —
        while it is first in the queue it is left waiting, with a place kept for it, and only the
        requests that fit the limit go, each that does not skipped. Whether any was admitted."""
        with self._cv:
            ahead = int(bool(self._waiting) and self._waiting[0] is behind)
            if behind is not None and not ahead:
                return False  # the sliced head left (cancelled): the new head may need slicing itself
            room = max(0, self.max_running - len(self._running) - ahead)
            candidates = list(itertools.islice(self._waiting, ahead, ahead + room))
        # what each would compute, costed outside the queue's lock: that takes the store's, and a
        # submit (on the server's event loop) must not wait for a store call
        costs = [self._cost(s) for s in candidates]
        limit = self.max_prefill_tokens
        with self._cv:
            waiting = {id(s) for s in self._waiting}  # the cancelled were dropped meanwhile
            tokens, batch = 0, []
            for sub, n in zip(candidates, costs, strict=True):
                if id(sub) not in waiting:
                    continue
                if limit is not None and tokens + n > limit and (batch or ahead):
                    if ahead:
                        continue  # it waits for its turn at the head (to be sliced there)
                    break  # first come, first served: the next call takes it
                batch.append(sub)
                tokens += n
            taken = {id(s) for s in batch}
            self._waiting = deque(s for s in self._waiting if id(s) not in taken)
            self._prefilling = len(batch)
        if not batch:
            return False
        try:
            self._prefill(batch)
        finally:
            with self._cv:
                self._prefilling = 0
        return True

    def _cost(self, sub: Submission) -> int:
        """The tokens its prefill would compute now (``Engine.uncached_tokens``); the prompt's length
        when the engine cannot plan it (a bad mode, segment or salt: its call fails it by name). Only
        with ``max_prefill_tokens``: nothing is counted without a limit."""
        if self.max_prefill_tokens is None or sub.first_logits is not None:
            return 0
        try:
            if sub.layout is None:
                sub.layout = self.engine.layout(sub.prompt, mode=sub.mode, salt=sub.salt)
                sub.ahead = any(s.key is not None for s in sub.layout)  # else nothing to build ahead
            return self.engine.uncached_tokens(sub.layout, mode=sub.mode, salt=sub.salt)
        except Exception as e:  # noqa: BLE001 — whatever it is, the request's own call reports it
            if type(e) not in self._cost_errors:  # said once a kind: an engine bug must not hide here
                self._cost_errors.add(type(e))
                log.warning("a request could not be costed (%s: %s); it is admitted by its prompt's length",
                            type(e).__name__, e)
            sub.ahead = False
            return sum(len(s) for s in sub.prompt)

    def _prefill_ahead(self) -> bool:
        """One slice of the queue head's missing documents, when its prefill would compute more than
        ``max_prefill_tokens`` tokens, requests are decoding (an idle loop has no one to keep
        waiting: the prompt goes whole) and there is room for it to run. Whether a slice ran. The
        head keeps its place in the queue meanwhile, counted as waiting (a shutdown or a
        cancellation finds it there)."""
        if self.max_prefill_tokens is None:
            return False
        with self._cv:
            if not self._waiting or not self._running or len(self._running) >= self.max_running:
                return False
            head = self._waiting[0]
        if head.cancelled.is_set() or self._cost(head) <= self.max_prefill_tokens or not head.ahead:
            return False
        t0 = time.perf_counter()  # lock waits included (a concurrent prewarm): the request waited too
        try:
            if not head.warmed:  # a request that would fail must not cost its whole prefill first
                self.engine.checked([head.prompt], [head.params])
            built = self.engine.prefill_ahead(head.prompt, mode=head.mode, salt=head.salt,
                                              max_tokens=self.max_prefill_tokens, skip=head.warmed)
        except Exception as e:  # noqa: BLE001 — a bad request fails here, alone, and the queue goes on
            with self._cv:  # still queued (a request of a lower priority value may have gone ahead of
                told = any(s is head for s in self._waiting)  # it meanwhile)? Else a shutdown told it
                if told:
                    self._waiting = deque(s for s in self._waiting if s is not head)
            if told:
                head.events.put(Event("error", error=e))
            return True
        head.warm_s += time.perf_counter() - t0
        head.warmed |= built
        head.ahead = bool(built)
        if built:
            self._sliced = head
        return bool(built)

    def _settled(self, n: int) -> None:
        """n requests of the call being prefilled have ended or started running."""
        with self._cv:
            self._prefilling -= n

    def _prefill(self, batch: list[Submission]) -> None:
        kept = _without_cancelled(batch)
        self._settled(len(batch) - len(kept))
        batch = kept
        # one call per mode, and those whose first-token logits are given apart (nothing to prefill)
        kinds = {(s.mode, s.first_logits is not None) for s in batch}
        groups = [[s for s in batch if (s.mode, s.first_logits is not None) == kind] for kind in kinds]
        while groups:
            group = groups.pop()
            given = None if group[0].first_logits is None else [s.first_logits for s in group]
            try:
                runs = self.engine.start([s.prompt for s in group], [s.params for s in group], mode=group[0].mode,
                                         salts=[s.salt for s in group], warmed=[s.warmed for s in group],
                                         first_logits=given)
            except torch.OutOfMemoryError as e:  # a prompt too big for the device even alone
                if len(group) > 1:  # (hypic.engine.memory): the others are served, each alone
                    groups.extend([s] for s in group)
                    continue
                group[0].events.put(Event("error", error=e))
                self._settled(1)
                continue
            except Exception as e:  # one bad batch must not stop the loop: fail its requests
                for s in group:
                    s.events.put(Event("error", error=e))
                self._settled(len(group))
                continue
            for s, r in zip(group, runs, strict=True):
                s.run = r
                r.output.metrics.ttft_s += s.warm_s  # its prefill: the slices ahead and this call
                self._emit(s)
                with self._cv:
                    self._prefilling -= 1
                    if not r.done:
                        if self._cancel_all:  # it was prefilling as the shutdown timeout passed
                            s.cancel(SHUTDOWN)
                        self._running.append(s)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._running and not self._stopping:
                    self._cv.wait()
                if self._stopping and not self._running and not self._waiting:
                    return
                self._drop_cancelled_waiting()
            try:
                self._iterate()
            except Exception as e:  # noqa: BLE001 — a failure outside the step's own handling (a bug):
                # the thread dying would leave every request hanging to its timeout and the server
                # looking healthy; the running requests fail with it, and serving goes on
                self._fail_running(e)

    def _fail_running(self, error: Exception) -> None:
        with self._cv:
            failed, self._running = [s for s in self._running if not s.run.done], []
        try:
            self.engine.forget([s.run for s in failed])
        except Exception:  # noqa: BLE001 — their states go with the cycle collector instead
            pass
        for s in failed:
            s.events.put(Event("error", error=error))

    def _iterate(self) -> None:
        """One turn of the loop: admit what fits, drop the cancelled, one decode step of the rest."""
        self._admit()
        with self._cv:
            running = list(self._running)
        cancelled = [s for s in running if s.cancelled.is_set() and not s.run.done]
        if cancelled:
            self.engine.forget([s.run for s in cancelled])  # their decode state goes now
        for s in cancelled:
            s.run.output.finish_reason = "cancelled"
            s.events.put(Event("error", error=RuntimeError(s.reason)))
        live = [s for s in running if not s.run.done]
        if live:
            try:
                self.engine.step([s.run for s in live])
            except Exception as e:
                # whatever failed (the step, or sampling after it), their decode state goes now:
                # left packed, a state and its batch keep the arenas until the cycle collector runs
                self.engine.forget([s.run for s in live])
                for s in live:
                    s.events.put(Event("error", error=e))
            else:
                for s in live:
                    self._emit(s)
        with self._cv:
            self._running = [s for s in self._running if not s.run.done]

    def shutdown(self, timeout: float | None = 30.0, drain: bool = False) -> None:
        """Stop admitting; let running requests finish — and, with ``drain``, the queued ones — and cancel
        what has not after ``timeout`` seconds. Without ``drain`` the queued are refused at once (a
        ``QueueFull``: another server can take them now, rather than after this one's timeout)."""
        with self._cv:
            self._stopping = True
            if not drain:
                self._refuse_waiting(QueueFull("the server is shutting down"))
            self._cv.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cv:
                self._cancel_all = True
                self._refuse_waiting(RuntimeError(SHUTDOWN))  # queued, drained, and not reached in time
                for s in self._running:
                    s.cancel(SHUTDOWN)
            self._thread.join()

    def _refuse_waiting(self, error: Exception) -> None:
        """Every queued request ended with ``error`` (the caller holds the lock)."""
        for s in self._waiting:
            s.events.put(Event("error", error=error))
        self._waiting.clear()


def _without_cancelled(subs: Iterable[Submission]) -> list[Submission]:
    """``subs`` less the cancelled ones, each of those told by its error event. One reading of each
    flag: a request cancelled meanwhile stays, its event to come, rather than leaving without one."""
    kept = []
    for s in subs:
        if s.cancelled.is_set():
            s.events.put(Event("error", error=RuntimeError(s.reason)))
        else:
            kept.append(s)
    return kept
