"""Echo scoring for the server: the prompts of every request waiting to be scored, packed together.

A harness scoring continuations (lm-eval's loglikelihood: ``echo`` + ``logprobs``) sends its
prompts a batch per request and often several requests at once. Scored one request at a time, each
paid whole forwards of its own; the scorer instead takes every request waiting when a round begins
(up to ``ROUND_TOKENS``) and scores all their prompts in one ``Engine.score`` call, whose forwards
pack them (``hypic.engine.scoring``). Requests arriving meanwhile wait for the next round. A request
whose answer is one token drawn from its prompt's first-token logits under ``full`` (``Ask.first``)
takes those logits from the same forwards.

Each request keeps its own limits: it waits at most its deadline and leaves when its client does —
the handler stops waiting at once and the request is *abandoned*; a round whose requests are all
abandoned, or that runs past the shutdown timeout, stops between two forwards. A request abandoned
while others in its round go on costs that round its prompts' tokens, no more. A round that runs out
of device memory is scored again request by request: only a request that does not fit alone fails.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hypic.engine.engine import Engine
from hypic.engine.scoring import Scored

ROUND_TOKENS = 1 << 16  # prompt tokens a round takes at most (more than that: the next round's)


class Overloaded(Exception):
    """``max_waiting`` requests wait already."""


@dataclass(eq=False)
class Ask:
    """One request's prompts (tokenized by segment) and how many alternatives it wants per token."""

    prompts: list[list[list[int]]]
    top: int
    first: bool = False  # each prompt's first-token logits wanted too (``Scored.first_logits``)
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    abandoned: bool = False  # its client left or its deadline passed: nobody reads its scores

    @property
    def tokens(self) -> int:
        return sum(len(s) for p in self.prompts for s in p)


class Scorer:
    """The rounds, one at a time, on a worker thread; lives on the server's event loop."""

    def __init__(self, engine: Engine, max_waiting: int, overdue: Callable[[], str | None]) -> None:
        """``overdue``: a reason every round stops for (the shutdown timeout passed), or None."""
        self.engine, self.max_waiting, self.overdue = engine, max_waiting, overdue
        self.queue: deque[Ask] = deque()
        self.scoring = 0  # requests in the round being scored
        self._worker: asyncio.Task | None = None

    @property
    def waiting(self) -> int:
        return len(self.queue)

    async def score(self, ask: Ask) -> Scored:
        """``ask``'s scores, one list per prompt (and its first-token logits, if it asked). Raises
        ``Overloaded``, ``ScoringStopped`` (the shutdown), ``torch.OutOfMemoryError`` (its prompts,
        scored alone, did not fit), or whatever else the round's engine call raised; a caller that
        stops waiting (cancelled, its deadline) calls ``abandon``."""
        if len(self.queue) >= self.max_waiting:
            raise Overloaded
        self.queue.append(ask)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._work())
        return await asyncio.shield(ask.done)

    def abandon(self, ask: Ask) -> None:
        """Nobody waits for ``ask`` now: out of the queue, or left to its round's end (or stop)."""
        ask.abandoned = True
        if ask in self.queue:
            self.queue.remove(ask)

    async def _work(self) -> None:
        while self.queue:
            batch = [self.queue.popleft()]
            tokens = batch[0].tokens
            while self.queue and tokens + self.queue[0].tokens <= ROUND_TOKENS:
                tokens += self.queue[0].tokens
                batch.append(self.queue.popleft())
            self.scoring = len(batch)
            try:
                await self._round(batch)
            finally:
                self.scoring = 0

    async def _round(self, batch: list[Ask]) -> None:
        def stop() -> str | None:
            reason = self.overdue()
            if reason is None and all(a.abandoned for a in batch):
                reason = "abandoned"
            return reason

        prompts = [p for a in batch for p in a.prompts]
        tops = [a.top for a in batch for _ in a.prompts]
        first = [a.first for a in batch for _ in a.prompts]
        short: torch.OutOfMemoryError | None = None
        try:
            scores = await asyncio.to_thread(self.engine.score, prompts, tops, stop, first)
        except torch.OutOfMemoryError as e:
            short = e.with_traceback(None)  # no frame of the failed round (its states) outlives the handler
        except Exception as e:  # noqa: BLE001 — every request of the round told at once (a bug: a 500),
            for a in batch:  # and the rounds go on: the worker must not die with requests waiting
                self._settle(a, e.with_traceback(None))
            return
        if short is not None:
            if len(batch) == 1:
                self._settle(batch[0], short)
            else:  # one request's prompts may not fit beside the serving: each alone (the failed round's
                for a in batch:  # memory freed first), the others served
                    await self._round([a])
            return
        at = 0
        for a in batch:
            end = at + len(a.prompts)
            self._settle(a, Scored(scores.rows[at:end], scores.first_logits[at:end],
                                   None if scores.ranks is None else scores.ranks[at:end]))
            at = end

    @staticmethod
    def _settle(ask: Ask, outcome: Scored | BaseException) -> None:
        """The answer, to whoever still waits; an abandoned ask's is dropped (cancelled: an error
        nobody reads would be logged as never retrieved)."""
        if ask.done.done():
            return
        if ask.abandoned:
            ask.done.cancel()
        elif isinstance(outcome, BaseException):
            ask.done.set_exception(outcome)
        else:
            ask.done.set_result(outcome)
