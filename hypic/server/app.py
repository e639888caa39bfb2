"""The OpenAI-compatible HTTP server: ``create_app(llm, settings)`` → a FastAPI app.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (streamed or whole),
``POST /v1/segments`` (pre-warm documents into the cache), ``GET /v1/segments/stats``,
``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health``, ``GET /metrics`` (Prometheus).
``/v1/*`` needs the API key when one is set. Bodies are read and validated here (not by FastAPI's
body injection) so that every malformed body — bad JSON, wrong types, unknown fields — is a 400 in OpenAI's error shape
naming the field. The scheduler is started and stopped by the app's lifespan: on shutdown new
requests get 503 while in-flight ones finish (or are cancelled after the shutdown timeout).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal, TypeVar

import torch
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from hypic.engine.scheduler import CANCELLED, SHUTDOWN, Scheduler
from hypic.engine.scoring import Scored, ScoringStopped
from hypic.llm import LLM
from hypic.server import beams, prompts, responses
from hypic.server.chat import ChatTemplate
from hypic.server.errors import APIError, bad_request, from_validation_error, install_handlers
from hypic.server.generation import Echo, Generation, echo_only, respond
from hypic.server.logprobs import TokenTexts, trimmed, vllm_prompt_logprobs
from hypic.server.metrics import CONTENT_TYPE, Metrics
from hypic.server.protocol import ChatRequest, Common, CompletionRequest, SegmentsRequest
from hypic.server.reasoning import after_reasoning, opened_by
from hypic.server.responses import ResponsesRequest, ResponseStore
from hypic.server.runner import TIMEOUT, Runner, before_overdue, ended_error, until_disconnected
from hypic.server.scorer import Ask, Overloaded, Scorer
from hypic.server.settings import ServerSettings
from hypic.server.tokenizer_routes import tokenizer_router
from hypic.server.tools import KIMI_OPEN

M = TypeVar("M", bound=BaseModel)


@dataclass
class ServerState:
    llm: LLM
    settings: ServerSettings
    template: ChatTemplate
    metrics: Metrics
    responses: ResponseStore  # the Responses API's kept responses (previous_response_id)
    runner: Runner | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    prewarm_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one prewarm thread at a time
    scorer: Scorer | None = None  # echo scoring: rounds of every request waiting

    def live_runner(self) -> Runner:
        if self.runner is None or self.runner.closing:
            raise APIError(503, "the server is not accepting requests (starting or shutting down)",
                           kind="shutting_down", type="server_error",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        return self.runner


async def read_body(request: Request, model: type[M], limit: int) -> M:
    """The body as ``model``, or a 4xx: too large, not JSON, not the model's shape."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the body exceeds this server's limit of {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the body exceeds this server's limit of {limit} bytes")
    except ClientDisconnect:  # the client hung up mid-upload: cancelled, not a server error
        raise APIError(499, "the client closed the connection before its request arrived",
                       kind="cancelled") from None
    try:
        data = json.loads(bytes(body))
    except (ValueError, RecursionError) as e:
        if isinstance(e, ValueError) and "integer string conversion" in str(e):  # Python's own limit, not
            e = ValueError(f"an integer of more than {sys.get_int_max_str_digits()} digits")  # a setting to change
        raise APIError(400, f"malformed JSON: {e}", code="invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None
    except RecursionError:
        raise bad_request("the body is nested too deeply") from None


def create_app(llm: LLM, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    if llm.tokenizer is None:
        raise ValueError("model: serving text needs a tokenizer.json in the model folder")
    state: ServerState

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.runner = Runner(Scheduler(llm.engine, max_running=settings.max_concurrent, max_queue=settings.max_queue,
                                        max_prefill_tokens=settings.max_prefill_tokens), settings)
        store = llm.engine.store
        if store.arena is not None and store.budgets["device"] is not None:
            store.arena.pin_ahead()  # the host tier pinned while idle, before the first overflow
        yield
        await state.runner.shutdown()

    app = FastAPI(title="hypic", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    def depth() -> tuple[int, int]:
        """(waiting, running): the scheduler's requests and the echoes scored beside them."""
        waiting, running = state.runner.scheduler.depth if state.runner else (0, 0)
        return waiting + state.scorer.waiting, running + state.scorer.scoring

    metrics = Metrics(llm.engine.store, depth, llm.engine)
    state = ServerState(llm, settings, ChatTemplate.from_model(llm.loaded.tokenizer_config, llm.loaded.path), metrics,
                        ResponseStore(settings.max_stored_responses))
    state.scorer = Scorer(llm.engine, settings.max_queue,
                          lambda: SHUTDOWN if state.runner is not None and state.runner.overdue() else None)
    app.state.hypic = state
    install_handlers(app, metrics.count_error)

    async def require_key(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                           kind="authentication", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.model_name and name not in settings.model_aliases:
            raise APIError(404, f"model: {name!r} is not served here (serving {settings.model_name!r})",
                           param="model", kind="not_found", code="model_not_found")

    def scheduled(priority: int) -> int:
        if priority != 0 and settings.scheduling_policy != "priority":
            raise bad_request(f"priority: {priority} asks for priority scheduling, which this server does not do: it "
                              "serves first come, first served (hypic serve --scheduling-policy priority)", "priority")
        return priority

    def choices(n: int) -> int:
        if n > settings.max_choices:
            raise bad_request(f"n: {n} choices exceed this server's limit of {settings.max_choices} "
                              "(hypic serve --max-choices)", "n")
        return n

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    async def score(request: Request, prompts: list[list[list[int]]], top: int, arrival: float,
                    first: bool = False) -> Scored:
        """The prompts' own log-probabilities (echo), and with ``first`` their first-token logits,
        scored with every other request's waiting then
        (``hypic.server.scorer``), between the scheduler's calls, and held as any request is: at most
        --max-queue wait to be scored (429), the request's timeout bounds the wait and the scoring
        (504), a client that leaves is dropped, waiting or scoring, and past the shutdown timeout it
        ends with a 503; out of device memory, a 503 to retry."""
        state.live_runner()
        ask = Ask(prompts, top, first)
        watcher = asyncio.ensure_future(until_disconnected(request.receive))
        scoring = asyncio.ensure_future(state.scorer.score(ask))
        try:
            await asyncio.wait({scoring, watcher}, timeout=max(0.0, arrival + settings.request_timeout_s
                                                                - time.monotonic()),
                               return_when=asyncio.FIRST_COMPLETED)
            if not scoring.done():
                raise ended_error(CANCELLED if watcher.done() else TIMEOUT)
            scores = scoring.result()
        except Overloaded:
            raise APIError(429, f"the server is busy: {state.scorer.waiting} requests wait to be scored; retry "
                           "later", kind="overloaded", type="rate_limit_error",
                           headers={"Retry-After": str(settings.retry_after_s)}) from None
        except ScoringStopped as e:
            raise ended_error(str(e)) from None
        except torch.OutOfMemoryError:  # the device is busy serving: later, not never
            raise APIError(503, "scoring the prompt ran out of device memory; retry later", kind="overloaded",
                           type="server_error", headers={"Retry-After": str(settings.retry_after_s)}) from None
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 — the round's engine call failed (as a generation's failure)
            raise APIError(500, f"scoring failed: {type(e).__name__}: {e}", kind="engine",
                           type="server_error") from None
        finally:
            state.scorer.abandon(ask)  # a no-op once scored
            scoring.cancel()
            watcher.cancel()
        metrics.scored_tokens.inc(sum(len(s) for s in scores.rows))
        return scores

    async def prompt_scores(request: Request, req: Common, gens: list[Generation], arrival: float,
                            echo_top: int | None = None) -> Scored | None:
        """The prompts' own log-probabilities a request asks — echo's, with ``echo_top`` alternatives,
        and vLLM's ``prompt_logprobs`` (rendered into each generation) — in one scoring for the larger
        count; None when it asks none. A one-token answer its mode draws as ``full`` does (lm-eval's
        loglikelihood: echo, max_tokens 1) takes its logits from the same forward: no second prefill."""
        tops = [t for t in (echo_top, req.prompt_logprobs) if t is not None]
        if not tops:
            return None
        state.live_runner()  # a stopping server scores nothing either
        first = req.max_tokens != 0 and all(
            gen.params.max_tokens == 1 and (gen.mode == "full" or len(gen.prompt) == 1) for gen in gens)
        scores = await score(request, [gen.prompt for gen in gens], max(tops), arrival, first)
        wants = req.prompt_logprobs
        if wants is not None:
            def render() -> None:  # a long prompt's: off the event loop
                for gen, rows, ranks in zip(gens, scores.rows, scores.ranks or [], strict=True):
                    ids = gen.prompt_ids
                    gen.prompt_logprobs = vllm_prompt_logprobs(TokenTexts(llm.tokenizer, gen.as_ids), ids,
                                                               trimmed(rows, ids, wants), ranks)
            await asyncio.to_thread(render)
        for gen, logits in zip(gens, scores.first_logits, strict=True):
            gen.first_logits = logits
        return scores

    async def structured_ready(req: Common, held_calls: bool = False) -> None:
        """Structured output's trie, built once and off the event loop (≈ 3 s for 151 000 tokens);
        ``held_calls``: a forced call's schema or strict functions' tag holds the answer."""
        if held_calls or req.constraint_field is not None:
            await asyncio.to_thread(prompts.check_structured, llm, req.constraint_field)

    async def names_ready(top: int | None) -> None:
        """Log-probabilities' token names (``hypic.server.logprobs``), read from the vocabulary once and
        off the event loop."""
        if top is not None:
            await asyncio.to_thread(TokenTexts, llm.tokenizer)

    async def beam_search(request: Request, gens: list[Generation], arrival: float, req: Common,
                          endpoint: str) -> Response:
        """vLLM's use_beam_search (``hypic.server.beams``): n is the beam width, the answer whole; a
        client that leaves stops the search (its step's requests cancelled)."""
        beams.check(gens)
        metrics.requests.labels(endpoint).inc()
        search = asyncio.ensure_future(beams.answer(state.live_runner(), llm.tokenizer, gens, arrival,
                                                    set(llm.engine.eos), req.length_penalty,
                                                    req.include_stop_str_in_output))
        watcher = asyncio.ensure_future(until_disconnected(request.receive))
        try:
            await asyncio.wait({search, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not search.done():
                metrics.count_error("cancelled")
                raise ended_error(CANCELLED)
            return JSONResponse(search.result())
        finally:
            search.cancel()
            watcher.cancel()

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await read_body(request, CompletionRequest, settings.max_body_bytes)
        check_model(req.model)
        # tokenizing and compiling a schema: off the event loop (a 4 MiB prompt held every stream 8 s)
        batch = await asyncio.to_thread(prompts.completion_segments, llm, req, settings)
        if req.truncate_prompt_tokens is not None:
            if req.echo:  # the echoed prompt is the one sent, its offsets into it: no cut one to echo
                raise bad_request("truncate_prompt_tokens: not with echo (the prompt is echoed as sent)",
                                  "truncate_prompt_tokens")
            batch = [prompts.truncated(llm, segments, req.truncate_prompt_tokens) for segments in batch]
        await structured_ready(req)
        await names_ready(req.logprobs)
        n = choices(req.n)

        def prepare() -> list[Generation]:
            gens = []
            for k, segments in enumerate(batch):
                field_name = "segments" if req.segments is not None else "prompt" if len(batch) == 1 else f"prompt[{k}]"
                max_tokens = prompts.token_budget(llm, segments, field_name, req.max_tokens, 16, settings)
                params = prompts.sampling(req, max(1, max_tokens), req.logprobs, llm.vocab_size,  # checked even for 0
                                          eos=llm.engine.eos, engine=llm.engine)
                gens.append(Generation(False, settings.model_name, segments, params, req.mode, req.cache_salt,
                                       req.stream, req.include_usage, req.stops, req.logprobs, n,
                                       eos=tuple(sorted(llm.engine.eos)), request_id=req.request_id,
                                       priority=scheduled(req.priority),
                                       continuous_usage=req.continuous_usage, token_ids=bool(req.return_token_ids),
                                       as_ids=bool(req.return_tokens_as_token_ids)))
            return gens

        gens = await asyncio.to_thread(prepare)
        if req.use_beam_search:
            return await beam_search(request, gens, arrival, req, "completions")
        echo_top = req.logprobs if req.echo else None
        scores = await prompt_scores(request, req, gens, arrival, echo_top)
        if req.echo:
            state.live_runner()  # a stopping server echoes nothing either
            for k, gen in enumerate(gens):
                def echoed(k: int = k, gen: Generation = gen) -> Echo:
                    said = prompts.echo_text(llm, req, k, gen.prompt)
                    rows = None if scores is None or echo_top is None else trimmed(scores.rows[k], gen.prompt_ids,
                                                                                  echo_top)
                    return Echo(said.text, gen.prompt_ids, said.offsets, rows)
                gen.echo = await asyncio.to_thread(echoed)
            if req.max_tokens == 0:  # the prompt's tokens named and offset: off the event loop too
                return await asyncio.to_thread(echo_only, request, gens, llm.tokenizer, metrics)
        return await respond(request, state.live_runner(), metrics, llm.tokenizer, gens, arrival)

    async def chat_generation(req: ChatRequest, field: str = "messages") -> Generation:
        """A chat request's generation; ``field``: what a 400 about its messages names (the
        Responses API's ``input``)."""
        try:  # rendering and tokenizing off the event loop (a 4 MiB prompt held every stream for 8 s)
            segments = await asyncio.to_thread(prompts.chat_segments, llm, state.template, req, settings)
        except APIError as e:
            if e.param is not None and e.param.startswith("messages"):
                e.param = field
            raise
        segments = prompts.truncated(llm, segments, req.truncate_prompt_tokens)
        calling = prompts.tool_calling(req, state.template.source)
        if calling is not None and llm.tokenizer.token_to_id(KIMI_OPEN) is not None:
            if calling.forced:  # the call's id in Kimi's form: the conversation's calls counted
                calling = replace(calling, kimi_index=sum(len(m.tool_calls or []) for m in req.messages))
            else:
                calling = replace(calling, special_text=True)  # Kimi's call markers are special tokens
        await structured_ready(req, calling is not None and (calling.forced or calling.tag is not None))
        max_tokens = prompts.token_budget(llm, segments, field, req.token_budget,
                                          settings.max_completion_tokens, settings, req.token_budget_field)
        top = (req.top_logprobs or 0) if req.logprobs else None
        await names_ready(top)
        params = await asyncio.to_thread(prompts.sampling, req, max_tokens, top, llm.vocab_size, calling,
                                         llm.engine.eos, llm.engine)
        think = None
        if settings.reasoning_parser is not None:  # does the generation prompt open the reasoning itself?
            think = opened_by(llm.tokenizer.decode(segments[-1][-32:], skip_special_tokens=False))
            params = after_reasoning(params, think)  # a constraint holds the answer, after the reasoning
        return Generation(True, settings.model_name, segments, params, req.mode, req.cache_salt, req.stream,
                          req.include_usage, req.stops, top, choices(req.n), tools=calling, think=think,
                          eos=tuple(sorted(llm.engine.eos)), request_id=req.request_id,
                          priority=scheduled(req.priority),
                          continuous_usage=req.continuous_usage, token_ids=bool(req.return_token_ids),
                          as_ids=bool(req.return_tokens_as_token_ids))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await read_body(request, ChatRequest, settings.max_body_bytes)
        check_model(req.model)
        gen = await chat_generation(req)
        if req.use_beam_search:
            return await beam_search(request, [gen], arrival, req, "chat")
        await prompt_scores(request, req, [gen], arrival)
        return await respond(request, state.live_runner(), metrics, llm.tokenizer, [gen], arrival)

    @v1.post("/responses")
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API over the chat route (``hypic.server.responses``)."""
        arrival = time.monotonic()
        req = await read_body(request, ResponsesRequest, settings.max_body_bytes)
        check_model(req.model)
        if req.store and settings.max_stored_responses == 0:
            raise bad_request("store: this server keeps no responses (--max-stored-responses 0)", "store")
        earlier = [] if req.previous_response_id is None else state.responses.conversation(req.previous_response_id)
        try:
            gen = await chat_generation(responses.chat_request(req, earlier), "input")
        except APIError as e:
            raise responses.renamed(e) from None
        stored = req.store is not False and settings.max_stored_responses > 0
        base = responses.envelope(req, settings.model_name, f"resp_{uuid.uuid4().hex}", int(time.time()), stored)
        own = responses.bare(responses.input_items(req))
        items = [*earlier, *own]  # earlier: bare already
        keep = (lambda done: state.responses.keep(done, items, responses.listed(own))) if stored else None
        shape = (lambda rs: responses.events(rs[0], base, keep), lambda rs: responses.whole(rs[0], base, keep))
        return await respond(request, state.live_runner(), metrics, llm.tokenizer, [gen], arrival, shape,
                             "responses")

    def kept_response(rid: str) -> dict[str, Any]:
        response = state.responses.get(rid)
        if response is None:
            raise APIError(404, f"response_id: no response {rid!r} is kept here", param="response_id",
                           kind="not_found", code="response_not_found")
        return response

    @v1.get("/responses/{rid}")
    async def get_response(rid: str) -> dict[str, Any]:
        return kept_response(rid)

    @v1.get("/responses/{rid}/input_items")
    async def list_input_items(rid: str, order: Literal["asc", "desc"] = "desc",
                               limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None,
                               include: Annotated[list[str] | None, Query()] = None) -> dict[str, Any]:
        """A kept response's own input items (what ``client.responses.input_items.list`` reads), each
        with the id made when it was kept; ``include`` is accepted (no item carries more here)."""
        page = state.responses.input_items(rid, order, limit, after)
        if page is None:
            kept_response(rid)  # the 404
        return page

    @v1.delete("/responses/{rid}")
    async def delete_response(rid: str) -> dict[str, Any]:
        kept_response(rid)
        state.responses.delete(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}

    async def segments_body(request: Request) -> tuple[SegmentsRequest, list[list[int]], list[dict[str, Any]]]:
        """A /v1/segments* body, its documents' token ids (each tokenized alone) and what to say of
        each (a message's segments name their message), or a 4xx."""
        req = await read_body(request, SegmentsRequest, settings.max_body_bytes)
        check_model(req.model)
        if req.messages is not None:
            found = await asyncio.to_thread(prompts.message_segments, llm, state.template, req.messages,
                                            req.chat_template_kwargs, settings)
            return req, [ids for _, ids in found], [{"message": m} for m, _ in found]
        if len(req.segments) > settings.max_segments:
            raise bad_request(f"segments: {len(req.segments)} segments exceed this server's limit of "
                              f"{settings.max_segments} (hypic serve --max-segments)", "segments")
        return req, [prompts.tokenize(llm, [text], f"segments[{i}]", lambda _, i=i: f"segments[{i}]")[0]
                     for i, text in enumerate(req.segments)], [{} for _ in req.segments]

    @v1.post("/segments")
    async def prewarm(request: Request) -> dict[str, Any]:
        req, ids, said = await segments_body(request)
        for i, (seg, about) in enumerate(zip(ids, said, strict=True)):
            field = f"messages[{about['message']}]" if about else f"segments[{i}]"
            prompts.token_budget(llm, [seg], field, 1, 1, settings)
        runner = state.live_runner()

        async def fill() -> list[bool | None]:
            async with state.prewarm_lock:
                return await asyncio.to_thread(llm.engine.prewarm, ids, salt=req.cache_salt)

        cached = await before_overdue(runner, fill())
        metrics.prewarmed_segments.inc(len({tuple(s) for s, c in zip(ids, cached, strict=True) if c is False}))
        data = [{"index": i, **about, "tokens": len(seg), "cached": c is True, "cacheable": c is not None}
                for i, (seg, c, about) in enumerate(zip(ids, cached, said, strict=True))]
        return {"object": "list", "model": settings.model_name, "data": data,
                "usage": {"prompt_tokens": sum(len(s) for s in ids),
                          "cached_tokens": sum(len(s) for s, c in zip(ids, cached, strict=True) if c)}}

    @v1.post("/segments/evict")
    async def evict(request: Request) -> dict[str, Any]:
        """Forget documents: their cache entries (every tier) and the prefix states holding them."""
        req, ids, said = await segments_body(request)

        async def forget() -> list[bool]:
            async with state.prewarm_lock:
                return await asyncio.to_thread(llm.engine.evict_segments, ids, salt=req.cache_salt,
                                               saved=settings.cache_dir)  # gone from the saved cache too

        try:
            evicted = await before_overdue(state.runner, forget())
        except (ValueError, OSError) as e:  # the folder, not the request: gone from memory, not from it
            raise APIError(500, f"the documents left the cache, but the saved cache could not be updated: {e}",
                           kind="internal", type="server_error") from None
        metrics.evicted_segments.inc(sum(evicted))
        return {"object": "list", "model": settings.model_name,
                "data": [{"index": i, **about, "tokens": len(seg), "evicted": e}
                         for i, (seg, e, about) in enumerate(zip(ids, evicted, said, strict=True))]}

    @v1.post("/segments/save")
    async def save_segments() -> dict[str, Any]:
        """Write the segment cache into the server's ``--cache-dir`` now (a snapshot a crash cannot
        take away; shutdown writes it too). Requests wait while it is written: the engine's lock."""
        if settings.cache_dir is None:
            raise APIError(400, "this server was started without --cache-dir: there is nowhere to save the cache")
        try:
            n = await before_overdue(state.runner, asyncio.to_thread(llm.save_cache, settings.cache_dir))
        except (OSError, ValueError) as e:  # ValueError: --cache-dir became a file since the start
            raise APIError(500, f"the cache could not be saved: {e}", kind="internal",
                           type="server_error") from None
        return {"object": "cache.saved", "entries": n}

    @v1.get("/segments/stats")
    async def segment_stats() -> dict[str, Any]:
        return {"object": "cache.stats", "seam": llm.engine.seam, **llm.cache_stats()}

    def model_object() -> dict[str, Any]:
        return {"id": settings.model_name, "object": "model", "created": state.created, "owned_by": "hypic",
                "root": str(llm.loaded.path), "parent": None, "max_model_len": llm.max_positions}

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_object()]}

    @v1.get("/models/{name:path}")  # path: an id may hold a slash (org/model)
    async def model(name: str) -> dict[str, Any]:
        check_model(name)
        return model_object()

    app.include_router(v1)
    app.include_router(tokenizer_router(llm, state.template, read_body, settings, require_key, check_model))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' and uptime checks' probe
    async def health() -> Response:
        if state.runner is None or state.runner.closing:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
