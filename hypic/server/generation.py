"""Running one generation request and answering it in OpenAI's shapes, streamed (server-sent
events, one chunk per token) or whole.

Both endpoints share the driver: ``Responder.pieces`` turns a job's events into text pieces (with
stop strings and incremental detokenization) and records metrics; the completion and chat flavours
differ only in how a piece, its log-probabilities and the envelope are spelled. A request for
``n`` choices is ``n`` jobs of the same prompt (their documents hit the cache after the first
prefill; with a ``seed``, choice ``i`` samples with ``seed + i``), answered as one response — a
completions batch (a list of prompts) is ``n`` jobs per prompt, in one response too: a
stream interleaves their chunks, each with its choice's index. A client that disconnects cancels
its jobs: for streams Starlette cancels the response task, for whole answers a watcher task sees
the ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from hypic.engine.request import SamplingParams
from hypic.server.errors import APIError
from hypic.server.logprobs import Scored, TokenTexts, chat_logprobs, completion_logprobs, joined, prompt_logprobs
from hypic.server.metrics import Metrics
from hypic.server.protocol import REQUEST_ID
from hypic.server.reasoning import ThinkSplit, split
from hypic.server.runner import Job, Runner, event_error, until_disconnected
from hypic.server.text import answer_text, stop_reason
from hypic.server.tools import StreamedCalls, ToolCalling


@dataclass
class Echo:
    """The completions API's ``echo``: the prompt as sent, ahead of each choice's text, and with
    ``logprobs`` its tokens' own log-probabilities (``Engine.prompt_logprobs``: a ``full`` forward)."""

    text: str
    tokens: list[int]
    offsets: list[int]  # per token, where it starts in ``text`` (``prompts.echo_text``)
    logprobs: list[dict[int, float] | None] | None  # None: no log-probabilities asked for


async def json_response(content: Any, headers: dict[str, str] | None = None) -> Response:
    """A ``JSONResponse`` rendered on a worker thread: writing a long prompt's log-probabilities or
    /tokenize's million ids takes seconds, which on the event loop would stall every stream."""
    return await asyncio.to_thread(JSONResponse, content, headers=headers)


def echo_logprobs(tokenizer: Any, echo: Echo, as_ids: bool = False) -> dict:
    assert echo.logprobs is not None
    return prompt_logprobs(TokenTexts(tokenizer, as_ids), echo.tokens, echo.logprobs, echo.offsets)


@dataclass
class Generation:
    chat: bool  # chat.completion vs text_completion shapes
    model: str
    prompt: list[list[int]]
    params: SamplingParams
    mode: str
    salt: str | None
    stream: bool
    include_usage: bool
    stops: list[str]
    top_logprobs: int | None  # None: no log-probabilities
    n: int = 1  # choices
    echo: Echo | None = None  # completions only
    tools: ToolCalling | None = None  # chat with tools: the answer may be calls (hypic.server.tools)
    think: bool | None = None  # chat: split <think> reasoning off (hypic.server.reasoning); True: opened by the prompt
    eos: tuple[int, ...] = ()  # the model's end tokens: kept out of the text (answer_text)
    request_id: str | None = None  # the client's (vLLM's field): the response's id after its prefix
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: each chunk carries its choice's usage
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and the answer's ids beside the text
    as_ids: bool = False  # vLLM's return_tokens_as_token_ids: log-probabilities name tokens "token_id:N"
    # [vocab] on the device: its first token's logits, from the forward that scored its echo (one
    # token to draw, no prefill: ``Submission.first_logits``)
    first_logits: torch.Tensor | None = None
    prompt_logprobs: list[dict[str, dict] | None] | None = None  # vLLM's, rendered (``vllm_prompt_logprobs``)
    priority: int = 0  # vLLM's: a lower value is admitted first (``--scheduling-policy priority``)

    @property
    def prompt_ids(self) -> list[int]:
        return [t for segment in self.prompt for t in segment]


@dataclass
class Piece:
    text: str
    tokens: list[Scored]
    finish: str | None = None


class Responder:
    """One request's run: the job, its text stream and how to spell its answer."""

    def __init__(self, gen: Generation, job: Job, tokenizer: Any, metrics: Metrics, index: int = 0,
                 id_: str | None = None, created: int | None = None) -> None:
        self.gen, self.job, self.tokenizer, self.metrics, self.index = gen, job, tokenizer, metrics, index
        special = gen.tools is not None and gen.tools.special_text
        self.text = answer_text(tokenizer, gen.params, gen.eos, stops=gen.stops, keep_special=special)
        self.id = id_ or f"{'chatcmpl' if gen.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time()) if created is None else created
        self.ended = False  # the answer is complete (finish_reason known)
        self.stop_reason: str | int | None = None  # vLLM's: the stop string or stop token that ended it
        self.last_token_at: float | None = None  # when the scheduler emitted the previous token
        # a chat answer told apart as it streams: reasoning from content, tool calls from text
        self.think = None if gen.think is None else ThinkSplit(gen.think)
        self.calls = None if gen.tools is None else StreamedCalls(gen.tools)
        self.prompt_ids_sent = False  # a stream's first chunk of this choice carries the prompt's ids

    async def pieces(self) -> AsyncIterator[Piece]:
        while True:
            event = await self.job.next()
            if event.kind == "error":
                raise event_error(event, self.job.retry_after_s)
            if event.kind == "done":
                self.ended = True
                self.metrics.request_seconds.observe(event.at - self.job.arrival)
                text = self.text.finish()  # a stop string may show only now (an incomplete character flushed)
                out = event.output
                self.stop_reason = stop_reason(self.text, out.token_ids, out.finish_reason,
                                               self.gen.params.stop_token_ids)
                yield Piece(text, [], "stop" if self.text.stopped else out.finish_reason)
                return
            if self.job.tokens == 1:
                self.metrics.first_token(self.job.metrics, self.job.first_token_at - self.job.arrival)
            elif self.last_token_at is not None:
                self.metrics.inter_token.observe(event.at - self.last_token_at)
            self.last_token_at = event.at
            self.metrics.generated_tokens.inc()
            scored = [Scored(event.token, event.logprobs, len(self.text.text))]  # its text starts where the text is
            text = self.text.push(event.token)
            if self.text.stopped:  # a stop string: the engine need not go on
                self.job.cancel()
                self.stop_reason = self.text.stop_string
                self.ended = True
                self.metrics.request_seconds.observe(event.at - self.job.arrival)
                yield Piece(text, scored, "stop")
                return
            yield Piece(text, scored)

    def logprobs(self, tokens: list[Scored]) -> dict | None:
        """``tokens``' log-probabilities; a completion's ``text_offset`` indexes the choice's text (a
        stream's chunks joined, the echoed prompt first), as vLLM's do."""
        n = self.gen.top_logprobs
        if n is None or not tokens:
            return None
        texts = TokenTexts(self.tokenizer, self.gen.as_ids)
        if self.gen.chat:
            return chat_logprobs(texts, tokens, n)
        shift = 0 if self.gen.echo is None else len(self.gen.echo.text)
        return completion_logprobs(texts, tokens, n, shift, len(self.text.text))

    def usage(self) -> dict:
        m = self.job.metrics
        prompt = m.prompt_tokens if m else sum(len(s) for s in self.gen.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": self.job.tokens, "total_tokens": prompt + self.job.tokens,
                "prompt_tokens_details": {"cached_tokens": m.cached_tokens if m else 0}}

    def extension(self) -> dict:
        """hypic's own accounting of the prompt, next to OpenAI's usage."""
        m, job = self.job.metrics, self.job
        return {"mode": self.gen.mode, "segments": len(self.gen.prompt),
                "segment_hits": m.segment_hits if m else 0, "segment_misses": m.segment_misses if m else 0,
                "recomputed_tokens": m.recomputed_tokens if m else 0, "prefill_s": m.ttft_s if m else None,
                "ttft_s": None if job.first_token_at is None else job.first_token_at - job.arrival}

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.gen.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.gen.model}

    def chunk(self, piece: Piece, delta: dict[str, Any] | None = None) -> dict:
        """A stream's chunk of ``piece``; ``delta`` instead of the piece's text (reasoning, tool calls)."""
        if delta is None:
            delta = {"content": piece.text} if self.gen.chat else {"text": piece.text}
        choice = {"index": self.index, **({"delta": delta} if self.gen.chat else delta),
                  "logprobs": self.logprobs(piece.tokens), "finish_reason": piece.finish,
                  "stop_reason": None if piece.finish is None else self.stop_reason, **self._ids(piece.tokens)}
        return {**self._envelope(True), "choices": [choice]}

    def _ids(self, tokens: list[Scored]) -> dict[str, list[int]]:
        """vLLM's return_token_ids in a choice: its tokens' ids and — a completion's, once (a stream's
        first chunk of the choice) — the prompt's; a chat's prompt ids are the response's (``chat_prompt_ids``)."""
        if not self.gen.token_ids:
            return {}
        out = {"token_ids": [s.id for s in tokens]}
        if not self.gen.chat and not self.prompt_ids_sent:
            out = {"prompt_token_ids": self.gen.prompt_ids, **out}
            self.prompt_ids_sent = True
        return out

    def chat_prompt_ids(self) -> dict[str, list[int]]:
        """A chat response's (or a stream's first chunk of a choice) ``prompt_token_ids``, when asked."""
        return {"prompt_token_ids": self.gen.prompt_ids} if self.gen.token_ids and self.gen.chat else {}

    def stream_delta(self, piece: Piece) -> tuple[dict[str, Any], str | None]:
        """A chat piece's delta when the answer is told apart (reasoning, tool calls): what can go
        out now — possibly nothing — and, at the end, what was held and the finish reason."""
        reasoning, text = ("", piece.text) if self.think is None else self.think.push(piece.text)
        finish = piece.finish
        if finish is not None and self.think is not None:
            r, t = self.think.finish()
            reasoning, text = reasoning + r, text + t
        delta: dict[str, Any] = {}
        if self.calls is None:
            if text:
                delta["content"] = text
        else:
            sent = self.calls.push(text)
            if finish is not None:
                delta, finish = self.calls.finish(finish)
            if sent:
                delta["content"] = sent + delta.get("content", "")
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
        return delta, finish

    def choice(self, text: str, tokens: list[Scored], finish: str) -> dict:
        body: dict[str, Any] = ({"message": {"role": "assistant", "content": text}} if self.gen.chat
                                else {"text": text})
        reasoning = None
        if self.gen.think is not None:
            reasoning, text = split(text, self.gen.think)
            body["message"]["content"] = text
        if self.gen.tools is not None:
            body["message"], finish = self.gen.tools.message(text, finish)
        if reasoning:
            body["message"]["reasoning_content"] = reasoning
        logprobs = self.logprobs(tokens)
        if self.gen.echo is not None:
            body["text"] = self.gen.echo.text + text
            if self.gen.echo.logprobs is not None:
                logprobs = joined(echo_logprobs(self.tokenizer, self.gen.echo, self.gen.as_ids), logprobs)
        own = self.gen.prompt_logprobs  # vLLM's: a completion's in its choice, a chat's at the top level
        scored = {} if self.gen.chat or own is None else {"prompt_logprobs": own}
        return {"index": self.index, **body, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": self.stop_reason, **self._ids(tokens), **scored}

    def echo_chunk(self, finish: str | None = None) -> dict:
        """A stream's first chunk of this choice when the prompt is echoed: the prompt and its logprobs."""
        echo = self.gen.echo
        assert echo is not None
        logprobs = None if echo.logprobs is None else echo_logprobs(self.tokenizer, echo, self.gen.as_ids)
        choice = {"index": self.index, "text": echo.text, "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": None, **self._ids([])}
        return {**self._envelope(True), "choices": [choice]}


def one_call_each(delta: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed delta holding several tool calls as one delta a call (OpenAI's and vLLM's way; clients
    such as LlamaIndex read a chunk's first call only), the rest of it with the first."""
    calls = delta.get("tool_calls") or []
    if len(calls) < 2:
        return [delta]
    return [{**delta, "tool_calls": calls[:1]}, *({"tool_calls": [c]} for c in calls[1:])]


def _usage(rs: list[Responder]) -> dict:
    """Each prompt once (a batch has several), every choice's completion tokens."""
    firsts: dict[int, Responder] = {}
    for r in rs:
        firsts.setdefault(id(r.gen), r)
    each = [r.usage() for r in firsts.values()]
    prompt = sum(u["prompt_tokens"] for u in each)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in each)
    completion = sum(r.job.tokens for r in rs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(rs: list[Responder]) -> AsyncIterator[str]:
    """Every choice's chunks as they come; the usage chunk (if asked for) after the last."""
    r0 = rs[0]
    queue: asyncio.Queue[tuple[Responder, Piece | Exception | None]] = asyncio.Queue()

    async def pump(r: Responder) -> None:
        try:
            async for piece in r.pieces():
                await queue.put((r, piece))
            await queue.put((r, None))
        except Exception as e:  # noqa: BLE001 — handed to the stream, which answers or re-raises it
            await queue.put((r, e))

    tasks, failed = [], False

    def sent(r: Responder, chunk: dict) -> str:
        """A choice's chunk; with continuous_usage_stats, its usage so far (vLLM's per-choice counts)."""
        if r.gen.continuous_usage:
            u = r.usage()
            chunk["usage"] = {k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return _sse(chunk)

    try:
        for r in rs:
            if r.gen.echo is not None:
                yield sent(r, r.echo_chunk())
        tasks = [asyncio.ensure_future(pump(r)) for r in rs]
        open_choices = len(rs)
        held: dict[int, list] = {}  # log-probabilities of tokens whose text is held back (reasoning, calls)
        opened: set[int] = set()  # chat choices whose role chunk went out
        while open_choices:
            r, item = await queue.get()
            if r0.gen.chat and r.index not in opened and not isinstance(item, Exception):
                # with its first token, not before the prefill (as vLLM): a client timing the first
                # chunk — vLLM's benchmark does — reads the time to the first token
                opened.add(r.index)
                role = {"index": r.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None, "stop_reason": None}
                yield sent(r, {**r0._envelope(True), **r.chat_prompt_ids(), "choices": [role]})
            if item is None:
                open_choices -= 1
            elif isinstance(item, Exception):
                raise item
            elif r.think is not None or r.calls is not None:
                tokens = held.pop(r.index, []) + item.tokens
                delta, finish = r.stream_delta(item)
                if delta or finish is not None:
                    parts = one_call_each(delta)
                    for k, part in enumerate(parts):  # the finish reason with the last
                        yield sent(r, r.chunk(Piece("", tokens if k == 0 else [],
                                                    finish if k == len(parts) - 1 else None), part))
                else:
                    held[r.index] = tokens
            elif item.text or item.finish or r.gen.top_logprobs is not None or (r.gen.token_ids and item.tokens):
                yield sent(r, r.chunk(item))  # (a token with no text yet: its id or log-probability still goes)
        if r0.gen.include_usage:
            yield _sse({**r0._envelope(True), "choices": [], "usage": _usage(rs), "hypic": r0.extension()})
    except APIError as e:
        failed = True  # counted once, by its own kind (a timeout's job is cancelled, not finished)
        r0.metrics.count_error(e.kind)
        yield _sse(e.body())
    finally:
        for task in tasks:
            task.cancel()
        if any(not r.job.finished for r in rs):
            for r in rs:
                r.job.cancel()
            if not failed and not all(r.ended for r in rs):
                r0.metrics.count_error("cancelled")  # the client went away (or the server is stopping)
    yield _sse("[DONE]")


async def collect(r: Responder) -> dict:
    """One choice, whole: its chat or completion ``choice`` object."""
    text, tokens = [], []
    async for piece in r.pieces():
        text.append(piece.text)
        tokens.extend(piece.tokens)
        if piece.finish is not None:
            return r.choice("".join(text), tokens, piece.finish)
    raise APIError(500, "generation ended without an answer", kind="engine", type="server_error")


async def _whole(rs: list[Responder]) -> dict:
    choices = await asyncio.gather(*(collect(r) for r in rs))
    r0 = rs[0]
    scored = {"prompt_logprobs": r0.gen.prompt_logprobs} if r0.gen.chat and r0.gen.prompt_logprobs is not None else {}
    return {**r0._envelope(False), **r0.chat_prompt_ids(), "choices": list(choices), "usage": _usage(rs),
            **scored, "hypic": r0.extension()}


class _JobStream(StreamingResponse):
    """A stream that cancels its jobs however the response ends — even when the client hangs up
    before the body iterator ever starts (then the iterator's own cleanup never runs)."""

    def __init__(self, jobs: list[Job], content: AsyncIterator[str], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.jobs = jobs

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                if not job.finished:
                    job.cancel()


Shape = tuple[Callable[[list["Responder"]], AsyncIterator[str]], Callable[[list["Responder"]], Awaitable[dict]]]


async def respond(request: Request, runner: Runner, metrics: Metrics, tokenizer: Any, gens: list[Generation],
                  arrival: float, shape: Shape | None = None, endpoint: str | None = None) -> Response:
    """One response for ``gens`` — one prompt, or a completions batch — each with its ``n`` choices,
    indexed prompt by prompt (choice index = prompt index × n + choice). ``shape``: the stream's
    events and the whole answer in another API's spelling (``hypic.server.responses``) than the
    chat or completions one; ``endpoint``: the label it is counted under."""
    places = sum(g.n for g in gens)
    room = runner.settings.max_queue + runner.settings.max_concurrent  # all choices are queued at once; at
    # best the running ones have left the queue by then: a request needing more could never be taken,
    # and a 429 tells the client to retry it for ever (run-batch did)
    if places > room:
        param = "n" if len(gens) == 1 else "prompt"
        raise APIError(400, f"{param}: this request's {places} choices need {places} places, more than the server "
                       f"ever has ({room}: max_queue + max_concurrent)", param=param)
    owners = [gen for gen in gens for _ in range(gen.n)]
    # a new constraint's first mask made here, off the serving loop, which would hold every request
    # meanwhile (a free text's at a 150 000-token vocabulary: tenths of a second)
    if any(gen.params.constraint_kinds for gen in gens):
        await asyncio.to_thread(runner.scheduler.engine.warm_constraints, [gen.params for gen in gens])
    # all choices or none, queued at once (a refused request holds no places meanwhile)
    jobs = runner.submit_all([(gen.prompt, gen.params.for_choice(i), gen.mode, gen.salt)
                              for gen in gens for i in range(gen.n)], arrival,
                             [gen.first_logits for gen in gens for _ in range(gen.n)],
                             [gen.priority for gen in gens for _ in range(gen.n)])
    gen = gens[0]
    metrics.requests.labels(endpoint or ("chat" if gen.chat else "completions")).inc()
    stream_body, whole_body = shape or (_stream, _whole)
    given = client_id(request, gen)
    base = given or uuid.uuid4().hex
    first = Responder(gen, jobs[0], tokenizer, metrics, id_=None if shape else
                      f"{'chatcmpl' if gen.chat else 'cmpl'}-{base}")
    named = {"X-Request-Id": base} if given or not shape else {}  # a Responses id is its own (resp_…)
    rs = [first] + [Responder(g, job, tokenizer, metrics, k, first.id, first.created)
                    for k, (g, job) in enumerate(zip(owners[1:], jobs[1:], strict=True), 1)]
    if gen.stream:
        return _JobStream(jobs, stream_body(rs), media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **named})
    consumer = asyncio.ensure_future(whole_body(rs))
    watcher = asyncio.ensure_future(until_disconnected(request.receive))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer.done():
            return await json_response(consumer.result(), named)
        metrics.count_error("cancelled")
        return Response(status_code=499)
    finally:
        for task in (consumer, watcher):
            task.cancel()
            # a consumer cancelled with an event at hand ends on that event's error (its job was
            # cancelled: "the request was cancelled"), which nobody awaits now: asyncio logged it
            task.add_done_callback(_retrieved)
        for job in jobs:
            if not job.finished:
                job.cancel()


def _retrieved(task: asyncio.Future) -> None:
    """Reads a finished task's exception, so that one ended after its request was answered (or its
    client left) is not logged as "never retrieved": nobody was waiting for it."""
    if not task.cancelled():
        task.exception()


_REQUEST_ID = re.compile(REQUEST_ID)  # the header's value held to the body's request_id rule


def client_id(request: Request, gen: Generation) -> str | None:
    """The client's name for the request (vLLM's ``request_id``, else an ``X-Request-Id`` header of
    visible ASCII; another header value is left unused), echoed in ``X-Request-Id`` and in the
    response's id: a client's log and the server's name the request alike."""
    header = request.headers.get("x-request-id")
    return gen.request_id or (header if header and _REQUEST_ID.fullmatch(header) else None)


def echo_only(request: Request, gens: list[Generation], tokenizer: Any, metrics: Metrics) -> Response:
    """``max_tokens: 0`` with ``echo``: each prompt (and its log-probabilities) is the whole answer,
    and nothing is queued — how a harness scores a context's continuation (lm-eval's loglikelihood)."""
    metrics.requests.labels("completions").inc()
    base = client_id(request, gens[0]) or uuid.uuid4().hex
    rid, created, named = f"cmpl-{base}", int(time.time()), {"X-Request-Id": base}
    envelope = {"id": rid, "object": "text_completion", "created": created, "model": gens[0].model}
    choices, tokens, scored = [], 0, 0
    for gen in gens:
        echo = gen.echo
        assert echo is not None and not gen.chat
        logprobs = None if echo.logprobs is None else echo_logprobs(tokenizer, echo, gen.as_ids)
        ids = {"prompt_token_ids": echo.tokens, "token_ids": []} if gen.token_ids else {}
        own = {} if gen.prompt_logprobs is None else {"prompt_logprobs": gen.prompt_logprobs}
        choices += [{"index": len(choices) + i, "text": echo.text, "logprobs": logprobs, "finish_reason": "length",
                     "stop_reason": None, **ids, **own} for i in range(gen.n)]
        tokens += len(echo.tokens)
        scored += len(echo.tokens) if echo.logprobs is not None or gen.prompt_logprobs is not None else 0
    usage = {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens,
             "prompt_tokens_details": {"cached_tokens": 0}}
    metrics.prompt_tokens.inc(tokens)
    extension = {"mode": "full", "segments": sum(len(g.prompt) for g in gens), "segment_hits": 0,
                 "segment_misses": 0, "recomputed_tokens": scored, "prefill_s": None, "ttft_s": None}
    if not gens[0].stream:
        return JSONResponse({**envelope, "choices": choices, "usage": usage, "hypic": extension}, headers=named)

    async def chunks() -> AsyncIterator[str]:
        for c in choices:
            yield _sse({**envelope, "choices": [c]})
        if gens[0].include_usage:
            yield _sse({**envelope, "choices": [], "usage": usage, "hypic": extension})
        yield _sse("[DONE]")
    return StreamingResponse(chunks(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **named})
