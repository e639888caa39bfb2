"""OpenAI's Responses API (``POST /v1/responses``), as agent frameworks call it, over the chat route.

A request becomes a chat request — ``instructions`` a system message, each ``input`` item a message
(a segment, cached as the chat route caches it), ``function_call`` items an assistant's tool calls,
``function_call_output`` items tool messages, ``text.format`` the response format, the flat function
tools the chat route's nested ones — and its answer is read back as Responses output items:
``reasoning`` (with ``--reasoning-parser``), one ``message`` of ``output_text``, ``function_call``s.
Streamed, it is the API's typed events (``response.created`` … ``response.output_text.delta`` …
``response.completed``, or ``response.incomplete`` at the token limit, the item it cut off
``incomplete`` too); tool calls come whole at the end, as on the chat route. The latest responses
are kept in memory (``ResponseStore``, bounded; ``store: false`` keeps none) with the items they
answered, so ``previous_response_id`` continues a conversation — its items, then the new ones,
each a segment that hits the cache — and ``GET`` / ``DELETE /v1/responses/{id}`` read and forget
one; a restart forgets them all. ``include: ["message.output_text.logprobs"]`` (with ``top_logprobs``)
gives the message's text its tokens' log-probabilities, whole and in each text delta (``MessageTokens``).
"""

from __future__ import annotations

import itertools
import json
import re
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
)

from hypic.engine.modes import MODES
from hypic.models.tokenize import encode
from hypic.server.errors import APIError, bad_request, loc_to_param
from hypic.server.generation import Piece, Responder
from hypic.server.logprobs import Scored, TokenTexts, chat_logprobs
from hypic.server.protocol import (
    EFFORTS,
    INT64,
    VERBOSITY,
    ChatRequest,
    FunctionName,
    Metadata,
    Salt,
    Strict,
    Text,
    not_supported,
)


class ContentText(Strict):
    """A text part: ``input_text`` in a request's own messages, ``output_text`` in an assistant's
    earlier output sent back (with the annotations and log-probabilities it came with)."""

    type: Literal["input_text", "output_text", "text"]
    text: Text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | Annotated[list[ContentText], Field(min_length=1)]
    id: str | None = None
    status: str | None = None


class CallItem(Strict):
    call_id: str = Field(min_length=1, max_length=128)
    id: str | None = None
    status: str | None = None


class FunctionCallItem(CallItem):
    """An assistant's earlier tool call, sent back with the conversation."""

    type: Literal["function_call"]
    name: FunctionName
    arguments: Text


class FunctionCallOutput(CallItem):
    """What the call returned."""

    type: Literal["function_call_output"]
    output: Text


class ReasoningItem(BaseModel):
    """An earlier answer's reasoning sent back: accepted and left out of the prompt (chat templates
    drop past reasoning too)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]


def _item_type(value: object) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else None


Item = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                 | Annotated[FunctionCallOutput, Tag("function_call_output")]
                 | Annotated[ReasoningItem, Tag("reasoning")],
                 Discriminator(_item_type, custom_error_type="item_type",
                               custom_error_message="expected an item of type message, function_call, "
                                                    "function_call_output or reasoning")]


class FunctionTool(Strict):
    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


LOGPROBS = "message.output_text.logprobs"
# what ``include`` may ask for: the message's log-probabilities, and the reasoning's encrypted content
# (which the Agents SDK and Codex ask for when nothing is stored) — hypic's reasoning comes back as
# plain text and a continuation leaves past reasoning out of the prompt, so nothing is encrypted
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content")


def _included(value: str) -> str:
    if value not in INCLUDABLE:
        raise ValueError(f"not supported: include {value!r} (hypic serves {' and '.join(map(repr, INCLUDABLE))}; "
                         "it has no built-in tools, files or images)")
    return value


class NamedFunction(Strict):
    type: Literal["function"]
    name: FunctionName


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal[VERBOSITY] | None = None  # type: ignore[valid-type]  # a hint: accepted, the answer is the model's


class ReasoningConfig(Strict):
    """OpenAI's reasoning settings: the effort reaches the chat template as ``reasoning_effort`` (as
    vLLM hands it; a template that reads it — gpt-oss's — acts on it, others ignore it); summaries
    are not made."""

    effort: Literal[EFFORTS] | None = None  # type: ignore[valid-type]
    summary: Annotated[None, BeforeValidator(not_supported("reasoning summaries: with --reasoning-parser the "
                                                           "reasoning comes back whole"))] = None
    generate_summary: Annotated[None, BeforeValidator(not_supported("reasoning summaries"))] = None


class ResponsesStreamOptions(Strict):
    # accepted: the events carry no obfuscation padding, whatever it says (it is for side channels
    # over the public internet; a client sets it false to save bytes)
    include_obfuscation: bool | None = None


class ResponsesRequest(Strict):
    model: str | None = None
    input: Text | Annotated[list[Item], Field(min_length=1)]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: Metadata | None = None  # kept with the response
    user: str | None = Field(None, max_length=1024)  # kept with the response and echoed
    prompt_cache_key: str | None = Field(None, max_length=1024)  # accepted: hypic caches by content
    safety_identifier: str | None = Field(None, max_length=1024)
    service_tier: Literal["auto", "default"] | None = None
    store: bool | None = None  # None: kept, as OpenAI's default (in memory, the latest few: ResponseStore)
    previous_response_id: str | None = Field(None, max_length=128)
    # what hypic does not do, accepted at the values that ask for nothing more ("auto" truncation: a
    # prompt too long for the context is a 400 either way, nothing is dropped from it)
    truncation: Literal["disabled", "auto"] | None = None
    include: Annotated[list[Annotated[str, AfterValidator(_included)]], Field(max_length=16)] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)  # with include's LOGPROBS: the likeliest per token
    background: Literal[False] | None = None
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None  # accepted: hypic's cache has its own budget
    priority: int = Field(0, ge=-(2 ** 63), lt=2 ** 63)  # vLLM's (--scheduling-policy priority)
    reasoning: ReasoningConfig | None = None
    max_tool_calls: int | None = Field(None, ge=1)  # accepted: it bounds built-in tools' calls; hypic has none
    stream_options: ResponsesStreamOptions | None = None
    conversation: Annotated[None, BeforeValidator(not_supported(
        "the Conversations API: continue a conversation with previous_response_id"))] = None
    prompt: Annotated[None, BeforeValidator(not_supported("stored prompt templates: send the input itself"))] = None
    # hypic's extensions, as on the other routes
    seed: int | None = Field(None, **INT64)
    cache_salt: Salt | None = None
    mode: Literal[MODES] = "hypic"  # type: ignore[valid-type]


def _content(item: InputMessage) -> str | list[dict[str, str]]:
    if isinstance(item.content, str):
        return item.content
    return [{"type": "text", "text": p.text} for p in item.content]


def input_items(req: ResponsesRequest) -> list[Any]:
    """The request's own items (a string input is one user message)."""
    return [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else list(req.input)


def bare(items: list[Any]) -> list[Any]:
    """What a continuation needs of ``items``: what the prompt reads. Reasoning, ids, statuses,
    annotations and log-probabilities are not bounded by the prompt's limit and would only fill the
    store (``ResponseStore``)."""
    out: list[Any] = []
    for item in items:
        if isinstance(item, ReasoningItem):
            continue
        update: dict[str, Any] = {"id": None, "status": None}
        if isinstance(item, InputMessage) and not isinstance(item.content, str):
            update["content"] = [p.model_copy(update={"annotations": None, "logprobs": None}) for p in item.content]
        out.append(item.model_copy(update=update))
    return out


def listed(items: list[Any]) -> list[dict[str, Any]]:
    """A response's own input items (``bare``) as ``GET /v1/responses/{id}/input_items`` lists them:
    each with an id of its own, made when the response is kept, and status completed."""
    out = []
    for item in items:
        if isinstance(item, InputMessage):
            kind = "output_text" if item.role == "assistant" else "input_text"
            parts = [item.content] if isinstance(item.content, str) else [p.text for p in item.content]
            content = [{"type": kind, "text": t, **({"annotations": []} if kind == "output_text" else {})}
                       for t in parts]
            body, prefix = {"type": "message", "role": item.role, "content": content}, "msg"
        else:
            body = item.model_dump(exclude_none=True)
            prefix = "fc" if item.type == "function_call" else "fco"
        out.append({"id": f"{prefix}_{uuid.uuid4().hex}", **body, "status": "completed"})
    return out


def messages(req: ResponsesRequest, earlier: list[Any] = ()) -> list[dict[str, Any]]:
    """The conversation as chat messages — the earlier items (a previous response's conversation),
    then the request's — one per item, an assistant's consecutive tool calls gathered into one
    message, reasoning left out."""
    out: list[dict[str, Any]] = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    for item in [*earlier, *input_items(req)]:
        if isinstance(item, InputMessage):
            out.append({"role": item.role, "content": _content(item)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutput):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    if not out:
        raise bad_request("input: holds no message (reasoning items alone are no prompt)", "input")
    return out


def wants_logprobs(req: ResponsesRequest) -> bool:
    return LOGPROBS in (req.include or ())


def chat_request(req: ResponsesRequest, earlier: list[Any] = ()) -> ChatRequest:
    """The chat request this one is (after ``earlier`` items); a 400 names the Responses field at fault."""
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.name is None:
            raise bad_request("text.format.name: required for json_schema", "text.format.name")
        response_format = {"type": "json_schema", "json_schema": {
            "name": fmt.name, **({} if fmt.schema_ is None else {"schema": fmt.schema_}),
            **({} if fmt.strict is None else {"strict": fmt.strict})}}
    elif fmt is not None:
        for field, value in (("schema", fmt.schema_), ("name", fmt.name), ("strict", fmt.strict),
                             ("description", fmt.description)):
            if value is not None:  # dropped, the answer would not be held to the schema the client sent
                raise bad_request(f"text.format.{field}: only with type json_schema, not {fmt.type}",
                                  f"text.format.{field}")
        response_format = {"type": fmt.type}
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) else req.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    body = {"model": req.model, "messages": messages(req, earlier), "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream, "seed": req.seed,
            "tools": None if not req.tools else [  # [] (the Agents SDK's, an agent without tools): none
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in req.tools],
            "reasoning_effort": None if req.reasoning is None else req.reasoning.effort,
            "tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": response_format, "cache_salt": req.cache_salt, "mode": req.mode,
            "priority": req.priority,
            **({"logprobs": True, "top_logprobs": req.top_logprobs or 0} if wants_logprobs(req) else {})}
    try:
        return ChatRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:  # only what the conversion carries over unchecked: a message's shape
        err = e.errors()[0]
        raise bad_request(f"input: {err['msg']} (as chat: {loc_to_param(err['loc'])})", "input") from None


# the chat route's names for fields a Responses request spells otherwise (what its 400s name)
_CHAT_NAMES = ((re.compile(r"^max_(?:completion_)?tokens\b"), "max_output_tokens"),
               (re.compile(r"^response_format(?:\.json_schema)?\b"), "text.format"),
               (re.compile(r"^(tools\[\d+\])\.function\b"), r"\1"))


def renamed(e: APIError) -> APIError:
    """A chat route's refusal naming the Responses field at fault."""
    for pattern, name in _CHAT_NAMES:
        if e.param is not None and pattern.match(e.param):
            e.param = pattern.sub(name, e.param, count=1)
            e.message = pattern.sub(name, e.message, count=1)
            break
    return e


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_format(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    return {"format": {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)}


def envelope(req: ResponsesRequest, model: str, rid: str, created: int, stored: bool) -> dict[str, Any]:
    """What every response object of this request says besides its output and status; ``stored``:
    whether it will be kept (``ResponseStore``)."""
    return {"id": rid, "object": "response", "created_at": created, "model": model, "error": None,
            "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction)
                            else req.tool_choice or "auto"),
            "parallel_tool_calls": req.parallel_tool_calls is not False, "text": _text_format(req),
            "metadata": req.metadata or {}, "previous_response_id": req.previous_response_id,
            "store": stored,
            "reasoning": None if req.reasoning is None else {"effort": req.reasoning.effort, "summary": None},
            "truncation": req.truncation or "disabled", "user": req.user, "top_logprobs": req.top_logprobs}


def _usage(r: Responder, output: list[dict[str, Any]]) -> dict[str, Any]:
    u = r.usage()
    # the reasoning's tokens, re-counted from its text (the <think> markers aside)
    reasoning = "".join(p["text"] for o in output if o["type"] == "reasoning" for p in o["content"])
    thought = len(encode(r.tokenizer, reasoning).ids) if reasoning else 0
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": min(thought, u["completion_tokens"])},
            "total_tokens": u["total_tokens"]}


def _finished(base: dict[str, Any], r: Responder, output: list[dict[str, Any]], finish: str) -> dict[str, Any]:
    incomplete = finish == "length"
    return {**base, "status": "incomplete" if incomplete else "completed", "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": _usage(r, output), "hypic": r.extension()}


def _reasoning_item(text: str, rid: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": rid or _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _message_item(text: str, mid: str | None = None, status: str = "completed",
                  logprobs: list[dict[str, Any]] = ()) -> dict[str, Any]:
    return {"type": "message", "id": mid or _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}]}


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


Keep = Callable[[dict[str, Any]], None] | None  # what is done with the finished response (ResponseStore.keep)


class MessageTokens:
    """The message's log-probabilities (``include``'s LOGPROBS), read off the answer piece by piece as
    the stream sends it — the whole answer goes through the same pieces, so the two agree: the
    message's tokens are those after the last token that carried reasoning text (a closing tag's
    among them) up to the message text they came with; a tool call's are not."""

    def __init__(self, r: Responder) -> None:
        self.r = r
        self.texts = None if r.gen.top_logprobs is None else TokenTexts(r.tokenizer)
        self.pending: list[Scored] = []  # tokens whose text has not gone out (held, or none yet)
        self.message: list[dict[str, Any]] = []  # the message's so far

    def delta(self, piece: Piece) -> tuple[dict[str, Any], str | None, list[dict[str, Any]]]:
        """``piece`` as the chat route's stream delta, its finish reason, and the log-probabilities of
        the message text in it."""
        r = self.r
        if r.think is not None or r.calls is not None:
            delta, finish = r.stream_delta(piece)
        else:
            delta, finish = {"content": piece.text}, piece.finish
        if self.texts is None:
            return delta, finish, []
        self.pending += piece.tokens
        taken: list[dict[str, Any]] = []
        if delta.get("content"):
            taken = chat_logprobs(self.texts, self.pending, self.r.gen.top_logprobs or 0)["content"]
            self.message += taken
            self.pending = []
        elif delta.get("reasoning_content") or delta.get("tool_calls"):
            self.pending = []
        return delta, finish, taken


async def whole(r: Responder, base: dict[str, Any], keep: Keep = None) -> dict[str, Any]:
    """The response object once the answer is complete."""
    text, tokens, message_tokens = [], [], MessageTokens(r)
    async for piece in r.pieces():
        text.append(piece.text)
        tokens.extend(piece.tokens)
        if message_tokens.texts is not None:  # asked for: read as the stream reads it
            message_tokens.delta(piece)
        if piece.finish is not None:
            choice = r.choice("".join(text), tokens, piece.finish)
            break
    else:
        raise APIError(500, "generation ended without an answer", kind="engine", type="server_error")
    message, output = choice["message"], []
    # the token limit cuts off the last text item (OpenAI's "incomplete"): the message, or the reasoning
    # when no message came
    cut = "incomplete" if choice["finish_reason"] == "length" else "completed"
    if message.get("reasoning_content"):
        output.append(_reasoning_item(message["reasoning_content"],
                                      status="completed" if message.get("content") else cut))
    if message.get("content"):
        output.append(_message_item(message["content"], status=cut, logprobs=message_tokens.message))
    output += [_call_item(c) for c in message.get("tool_calls") or []]
    done = _finished(base, r, output, choice["finish_reason"])
    if keep is not None:
        keep(done)
    return done


def _event(seq: Callable[[], int], kind: str, **data: Any) -> str:
    body = json.dumps({"type": kind, "sequence_number": seq(), **data}, ensure_ascii=False)
    return f"event: {kind}\ndata: {body}\n\n"


async def events(r: Responder, base: dict[str, Any], keep: Keep = None) -> AsyncIterator[str]:
    """The answer as the API's typed server-sent events: an output item opens when its kind of text
    (reasoning, then the message) first comes, and closes when the other kind or the end does."""
    counter = itertools.count()
    seq = lambda: next(counter)  # noqa: E731
    output: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None  # the open item: kind, id, text, logprobs
    message_tokens = MessageTokens(r)

    def open_item(kind: str) -> list[str]:
        nonlocal current
        current = {"kind": kind, "id": _id("rs" if kind == "reasoning" else "msg"), "text": "", "logprobs": []}
        at = len(output)
        if kind == "reasoning":
            item = {**_reasoning_item("", current["id"]), "content": [], "status": "in_progress"}
            return [_event(seq, "response.output_item.added", output_index=at, item=item),
                    _event(seq, "response.content_part.added", item_id=current["id"], output_index=at, content_index=0,
                           part={"type": "reasoning_text", "text": ""})]
        item = {**_message_item("", current["id"], "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [_event(seq, "response.output_item.added", output_index=at, item=item),
                _event(seq, "response.content_part.added", item_id=current["id"], output_index=at, content_index=0,
                       part=part)]

    def close_item(status: str = "completed") -> list[str]:
        """``status``: "incomplete" for the item the token limit cut off."""
        nonlocal current
        if current is None:
            return []
        at, (kind, iid, text, logprobs) = len(output), (current["kind"], current["id"], current["text"],
                                                         current["logprobs"])
        current = None
        if kind == "reasoning":
            item = _reasoning_item(text, iid, status)
            output.append(item)
            return [_event(seq, "response.reasoning_text.done", item_id=iid, output_index=at, content_index=0,
                           text=text),
                    _event(seq, "response.content_part.done", item_id=iid, output_index=at, content_index=0,
                           part=item["content"][0]),
                    _event(seq, "response.output_item.done", output_index=at, item=item)]
        item = _message_item(text, iid, status, logprobs)
        output.append(item)
        return [_event(seq, "response.output_text.done", item_id=iid, output_index=at, content_index=0, text=text,
                       logprobs=logprobs),
                _event(seq, "response.content_part.done", item_id=iid, output_index=at, content_index=0,
                       part=item["content"][0]),
                _event(seq, "response.output_item.done", output_index=at, item=item)]

    failed = False
    yield _event(seq, "response.created", response={**base, "status": "in_progress", "output": []})
    yield _event(seq, "response.in_progress", response={**base, "status": "in_progress", "output": []})
    try:
        async for piece in r.pieces():
            delta, finish, logprobs = message_tokens.delta(piece)
            for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
                text = delta.get(key)
                if not text:
                    continue
                if current is None or current["kind"] != kind:
                    for e in close_item() + open_item(kind):
                        yield e
                current["text"] += text
                where = dict(item_id=current["id"], output_index=len(output), content_index=0, delta=text)
                if kind == "reasoning":
                    yield _event(seq, "response.reasoning_text.delta", **where)
                else:
                    current["logprobs"] += logprobs
                    yield _event(seq, "response.output_text.delta", **where, logprobs=logprobs)
            if finish is None:
                continue
            for e in close_item("incomplete" if finish == "length" else "completed"):
                yield e
            for call in delta.get("tool_calls") or []:
                item, at = _call_item(call), len(output)
                yield _event(seq, "response.output_item.added", output_index=at,
                             item={**item, "arguments": "", "status": "in_progress"})
                yield _event(seq, "response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                             delta=item["arguments"])
                yield _event(seq, "response.function_call_arguments.done", item_id=item["id"], output_index=at,
                             arguments=item["arguments"])
                yield _event(seq, "response.output_item.done", output_index=at, item=item)
                output.append(item)
            done = _finished(base, r, output, finish)
            if keep is not None:
                keep(done)
            yield _event(seq, f"response.{done['status']}", response=done)
            return
    except APIError as e:
        failed = True  # counted once, by its own kind (a timeout's job is cancelled, not finished)
        r.metrics.count_error(e.kind)
        error = {"code": e.code or e.kind, "message": e.message}
        yield _event(seq, "error", **error, param=e.param)
        yield _event(seq, "response.failed", response={**base, "status": "failed", "output": output, "error": error})
    finally:
        if not r.job.finished:  # the client went away (or the server is stopping): the engine stops too
            r.job.cancel()
            if not failed and not r.ended:
                r.metrics.count_error("cancelled")


class ResponseStore:
    """The latest responses (at most ``capacity``, least recently used out first) with the items of
    their conversations: what ``previous_response_id`` continues from. In memory only."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # id → (the response, its conversation's items, its own input items as listed)
        self._kept: OrderedDict[str, tuple[dict[str, Any], list[Any], list[dict[str, Any]]]] = OrderedDict()

    def conversation(self, rid: str) -> list[Any]:
        """The items a continuation of ``rid`` starts from: its conversation and its output."""
        if rid not in self._kept:
            raise APIError(400, f"previous_response_id: no response {rid!r} is kept here (never made, not stored, "
                           "deleted, or forgotten to make room)", param="previous_response_id",
                           code="previous_response_not_found")
        self._kept.move_to_end(rid)
        response, items, _ = self._kept[rid]
        return [*items, *bare([_output_item(o) for o in response["output"]])]

    def keep(self, response: dict[str, Any], items: list[Any], own: list[dict[str, Any]] = ()) -> None:
        """``own``: the request's own input items, ``listed``."""
        if self.capacity == 0:
            return
        self._kept[response["id"]] = (response, items, list(own))
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def get(self, rid: str) -> dict[str, Any] | None:
        kept = self._kept.get(rid)
        return None if kept is None else kept[0]

    def delete(self, rid: str) -> bool:
        return self._kept.pop(rid, None) is not None

    def input_items(self, rid: str, order: str = "desc", limit: int = 20, after: str | None = None
                    ) -> dict[str, Any] | None:
        """A kept response's own input items, OpenAI's list page (``order`` of arrival, ``limit`` of
        them after the item ``after``); None when no such response is kept; an unknown ``after`` is a
        400."""
        kept = self._kept.get(rid)
        if kept is None:
            return None
        items = kept[2] if order == "asc" else kept[2][::-1]
        if after is not None:
            at = next((i for i, item in enumerate(items) if item["id"] == after), None)
            if at is None:
                raise bad_request(f"after: no input item {after!r} in response {rid!r}", "after")
            items = items[at + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


# a kept output item, read back as the input item a continuation sends
_output_item = TypeAdapter(Item).validate_python
