"""Request bodies → what the scheduler runs: token ids per segment, sampling, limits.

All validation that can refuse a request happens here, before it is queued, so that a refusal
is always a 4xx naming the field and the engine only ever sees inputs it accepts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, NamedTuple

from hypic.engine.request import SamplingParams
from hypic.llm import LLM, SEPARATOR, cut_prompt
from hypic.models.tokenize import encode
from hypic.server.chat import ChatSegment, ChatTemplate
from hypic.server.errors import bad_request, from_value_error
from hypic.server.protocol import ChatRequest, Common, CompletionRequest, Message, NamedToolChoice
from hypic.server.settings import ServerSettings
from hypic.server.text import text_offsets
from hypic.server.tools import ToolCalling, call_style, plan

if TYPE_CHECKING:
    from hypic.engine.engine import Engine

_SEGMENT_ERROR = re.compile(r"^[\w\[\]]+?\.segments\[(\d+)\]: (.*)$", re.S)


def tokenize(llm: LLM, texts: list[str], field: str, name: Callable[[int], str], limit: bool = True
             ) -> list[list[int]]:
    """Each text tokenized on its own (``LLM.tokenize``); an error names ``name(segment index)``;
    ``limit``: refused past the context (False: the prompt is cut afterwards, ``truncated``)."""
    try:
        return llm.tokenize(texts, where=field, limit=limit)
    except ValueError as e:
        m = _SEGMENT_ERROR.match(str(e))
        if m:
            i, param = int(m.group(1)), name(int(m.group(1)))
            where = f" (segment {i})" if param == field and len(texts) > 1 else ""
            raise bad_request(f"{param}{where}: {m.group(2)}", param) from None
        raise from_value_error(e, field) from None


def _check_count(count: int, field: str, settings: ServerSettings) -> None:
    if count > settings.max_segments:
        raise bad_request(f"{field}: {count} segments exceed this server's limit of {settings.max_segments} "
                          "(hypic serve --max-segments)", field)


def completion_segments(llm: LLM, req: CompletionRequest, settings: ServerSettings) -> list[list[list[int]]]:
    """Each prompt of the request (one, or a batch up to ``max_prompts``) as token ids per segment:
    text split on ``<<PIC_SEP>>``, token ids (one segment), or the ``segments`` extension."""
    limit = req.truncate_prompt_tokens is None  # a prompt to be cut may be longer than the context
    if req.segments is not None:
        _check_count(len(req.segments), "segments", settings)
        return [tokenize(llm, list(req.segments), "segments", lambda i: f"segments[{i}]", limit)]
    items = req.prompt_items
    if len(items) > settings.max_prompts:
        raise bad_request(f"prompt: a batch of {len(items)} prompts exceeds this server's limit of "
                          f"{settings.max_prompts} (hypic serve --max-prompts)", "prompt")
    return [_one_prompt(llm, item, "prompt" if len(items) == 1 else f"prompt[{k}]", settings, limit)
            for k, item in enumerate(items)]


def _one_prompt(llm: LLM, item: str | list[int], field: str, settings: ServerSettings,
                limit: bool) -> list[list[int]]:
    if isinstance(item, list):  # token ids: one segment, the query (nothing of it is cached)
        return tokenize(llm, [item], field, lambda i: field, limit)
    _check_count(item.count(SEPARATOR) + 1, field, settings)
    if not item:
        raise bad_request(f"{field}: empty prompt", field)
    return tokenize(llm, item.split(SEPARATOR), field, lambda i: field, limit)


def chat_segments(llm: LLM, template: ChatTemplate, req: ChatRequest, settings: ServerSettings,
                  limits: bool = True) -> list[list[int]]:
    """Each message (each text part) its own segment, wrapped by the model's chat template;
    ``limits``: refused past the server's segment count and the context (False: /tokenize counting a
    conversation, as vLLM's does, however long)."""
    messages = [(m.role, m.parts) for m in req.messages]
    if limits:
        _check_count(sum(len(parts) for _, parts in messages), "messages", settings)
    effort = {} if req.reasoning_effort is None else {"reasoning_effort": req.reasoning_effort}
    context = {**effort, **(req.chat_template_kwargs or {}),
               "tools": None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools]}
    try:
        segments = template.segments(messages, context, [m.extras for m in req.messages],
                                     add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message)
    except ValueError as e:
        raise from_value_error(e, "messages") from None
    if limits:
        _check_count(len(segments), "messages", settings)
    return tokenize(llm, [s.text for s in segments], "messages", lambda i: f"messages[{segments[i].message}]",
                    limits and req.truncate_prompt_tokens is None)


def message_segments(llm: LLM, template: ChatTemplate, messages: list[Message],
                     template_kwargs: dict[str, Any] | None, settings: ServerSettings) -> list[tuple[int, list[int]]]:
    """Each message's segments (with the message's index) as a chat request renders them between a
    system prompt and a question — where a retriever puts documents: what /v1/segments caches and
    evicts for ``messages``. Both are placeholders, rendered and left out (a template's preamble —
    a BOS, a default system prompt — goes with the first message of a chat, so a document cached
    first would miss behind a system prompt); messages that begin with their own system message
    are rendered from the start. A template that does not let a placeholder be cut off leaves the
    message beside it out with it."""
    lead = messages[0].role not in ("system", "developer")  # a system prompt placeholder goes first
    body, extras = [(m.role, m.parts) for m in messages], [m.extras for m in messages]
    _check_count(sum(len(parts) for _, parts in body), "messages", settings)
    context = {**(template_kwargs or {}), "tools": None}
    try:
        try:
            segments = _rendered(template, body, extras, context, lead)
        except ValueError:
            if not lead:
                raise
            lead = False  # a template that refuses a system message: the messages from the start
            segments = _rendered(template, body, extras, context, lead)
    except ValueError as e:
        raise from_value_error(e, "messages") from None
    first, question = int(lead), len(messages) + int(lead)
    asked = [i for i, s in enumerate(segments) if s.message == question]
    kept = [s for s in (segments[:asked[0]] if asked else segments)
            if s.message >= first and (asked or s.message < question - 1)]  # else the last holds the question
    _check_count(len(kept), "messages", settings)
    ids = tokenize(llm, [s.text for s in kept], "messages", lambda i: f"messages[{kept[i].message - first}]")
    return [(s.message - first, t) for s, t in zip(kept, ids, strict=True)]


def _rendered(template: ChatTemplate, body: list[tuple[str, list[str]]], extras: list[dict[str, Any]],
              context: dict[str, Any], lead: bool) -> list[ChatSegment]:
    turns = ([("system", ["?"])] if lead else []) + body + [("user", ["?"])]
    return template.segments(turns, context, ([{}] if lead else []) + extras + [{}])


def truncated(llm: LLM, segments: list[list[int]], keep: int | None) -> list[list[int]]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: the longest prompt the
    context reads, a token's room left; None: all), as segments — those before the cut left out, the
    one it falls in keeping its tail."""
    try:
        return cut_prompt(segments, keep, llm.max_positions)  # the library's own cut
    except ValueError as e:
        raise bad_request(str(e), "truncate_prompt_tokens") from None


def token_budget(llm: LLM, segments: list[list[int]], field: str, requested: int | None, default: int,
                 settings: ServerSettings, budget_field: str = "max_tokens") -> int:
    """Check the prompt against the limits; returns max_tokens (``default`` when not requested).
    ``budget_field``: the field ``requested`` came from, which a refusal names."""
    n = sum(len(s) for s in segments)
    limit = settings.max_prompt_tokens
    if limit is not None and n > limit:
        raise bad_request(f"{field}: {n} tokens exceed this server's limit of {limit} (hypic serve "
                          "--max-prompt-tokens)", field)
    room = llm.max_positions - n
    if requested is None:
        return max(1, min(default, settings.max_completion_tokens, room))
    if requested > settings.max_completion_tokens:
        raise bad_request(f"{budget_field}: {requested} exceeds this server's limit of "
                          f"{settings.max_completion_tokens} (hypic serve --max-completion-tokens)", budget_field)
    try:
        llm.check_context(n, requested)
    except ValueError as e:  # the library's message names its own parameter, max_tokens
        raise bad_request(budget_field + str(e).removeprefix("max_tokens"), budget_field) from None
    return requested


GREEDY_BELOW = 1e-5  # a temperature this small is greedy decoding (dividing logits by it overflows)


def tool_calling(req: ChatRequest, template: str = "") -> ToolCalling | None:
    """The request's tools and tool_choice (``hypic.server.tools``), or a 400 naming the field;
    ``template``: the chat template's text, which tells how the model writes a call. A request that
    gives its own constraint (``response_format`` …) keeps it: strict functions then add none."""
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    style = None if req.constraint_field is not None else call_style(template)
    try:
        calling = plan(None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools], choice,
                       style, req.parallel_tool_calls is not False)
    except ValueError as e:
        raise from_value_error(e, "tools") from None
    if calling is not None and calling.forced and req.constraint_field is not None:
        field = req.constraint_field.split(".")[0]
        raise bad_request(f"{field}: not with a tool_choice that forces a call (the call has its own shape)", field)
    return calling


def sampling(req: Common, max_tokens: int, top_logprobs: int | None, vocab_size: int,
             calling: ToolCalling | None = None, eos: Collection[int] = (), engine: Engine | None = None
             ) -> SamplingParams:
    """The engine always reports the chosen token's log-probability when any are asked for; a
    forced tool call constrains decoding to the call's schema. ``engine``: the tokens a structural
    tag names are checked against its tokenizer (a 400 now, not a refusal in the serving loop)."""
    temperature = 0.0 if req.temperature < GREEDY_BELOW else float(req.temperature)
    bias = None
    if req.logit_bias is not None:
        bias = {}
        for key, value in req.logit_bias.items():
            # the length first: Python refuses int() of a string over 4 300 digits (a 500)
            if not key.isascii() or not key.isdigit() or len(key) > 12 or int(key) >= vocab_size:
                raise bad_request(f"logit_bias: {key[:40]!r} is not a token id of this model's vocabulary "
                                  f"[0, {vocab_size})", "logit_bias")
            bias[int(key)] = value
    stop_ids = tuple(req.stop_token_ids or ())
    for name, ids in (("stop_token_ids", stop_ids), ("allowed_token_ids", req.allowed_token_ids or ())):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise bad_request(f"{name}: {outside[0]} is not a token id of this model's vocabulary "
                              f"[0, {vocab_size})", name)
    try:
        schema = req.constraint
    except ValueError as e:  # structured_outputs.json given as text that is no JSON
        raise from_value_error(e, "structured_outputs") from None
    regex, choice, grammar = req.text_constraint
    tag = req.tag_constraint
    if calling is not None and calling.forced:
        schema = calling.schema
    elif calling is not None and calling.tag is not None:  # auto with strict functions
        tag = calling.tag
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=float(req.top_p),
                              seed=req.seed, logprobs=top_logprobs,
                              presence_penalty=float(req.presence_penalty),
                              frequency_penalty=float(req.frequency_penalty), logit_bias=bias,
                              top_k=req.top_k, min_p=float(req.min_p),
                              repetition_penalty=float(req.repetition_penalty), stop_token_ids=stop_ids,
                              ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, json_schema=schema,
                              regex=regex, choice=choice, grammar=grammar, structural_tag=tag,
                              bad_words=req.bad_words,
                              allowed_token_ids=req.allowed_token_ids,
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              skip_special_tokens=req.skip_special_tokens)
        params.check_enders(eos)
        if engine is not None:
            engine.check_tokens(params)
        return params
    except ValueError as e:
        if calling is not None and calling.tag is not None and req.constraint_field is None:
            # the strict functions' tag, made from the chat template's call format (Kimi's special
            # tokens), names a token this tokenizer lacks: the tools cannot be held as asked
            why = str(e).removeprefix("structural_tag: ")
            raise bad_request(f"tools: a strict function's calls are held in the chat template's call format, "
                              f"but {why}", "tools") from None
        given = req.constraint_field or ("tool_choice" if calling is not None and calling.forced else None)
        raise from_value_error(_in_response_format(e, req.constraint_field, given), None) from None


def check_structured(llm: LLM, field: str | None = None) -> None:
    """Whether the tokenizer can spell every JSON text (its trie built now, once): a 400 now, not a
    failure in the serving loop. Slow the first time on a large vocabulary: run off the event loop."""
    try:
        llm.engine.token_vocab()
    except ValueError as e:
        field = field or "response_format.json_schema.schema"
        raise from_value_error(_in_response_format(e, field), field.split(".")[0]) from None


def _in_response_format(e: ValueError, field: str | None, given: str | None = None) -> ValueError:
    """The library names the schema ``json_schema``; a request holds it where ``field`` says
    (response_format.json_schema.schema, structured_outputs.json, guided_json), and asked for it by
    ``given`` (that, or tool_choice: a forced call's schema)."""
    text = str(e)
    for kind in ("json_schema", "regex", "choice", "grammar", "structural_tag"):  # the library's names for them
        if given is not None:  # "min_tokens: not with json_schema": the field the request gave it in
            text = text.replace(f"not with {kind}", f"not with {given.split('.')[0]}")
        if text.startswith(kind) and text[len(kind):len(kind) + 1] in (":", "."):  # json_schema.properties.a: …
            where = field or "response_format.json_schema.schema"
            if kind == "structural_tag" and where == "response_format.structures":  # its fields lie in response_format
                where = "response_format"
            text = where + text.removeprefix(kind)
    return ValueError(text)


class EchoText(NamedTuple):
    text: str
    offsets: list[int]  # per prompt token, where it starts in ``text`` (its ``text_offset``)


def echo_text(llm: LLM, req: CompletionRequest, k: int, segments: list[list[int]]) -> EchoText:
    """What ``echo`` puts ahead of prompt ``k``'s text — the prompt as sent: its text (``<<PIC_SEP>>``
    included), the ``segments`` extension's texts back to back, or token ids decoded — and where each
    of its tokens starts there. A text's tokens are placed by the tokenizer's own offsets into it (a
    leading space the tokenizer adds is not in the text; the parts of a split character start where
    it does), decoded ids by their incremental decoding."""
    if req.segments is not None:
        return _placed(llm, list(req.segments), segments, "")
    item = req.prompt_items[k]
    if isinstance(item, str):
        return _placed(llm, item.split(SEPARATOR), segments, SEPARATOR)
    return EchoText(llm.tokenizer.decode(segments[0], skip_special_tokens=False),
                    text_offsets(llm.tokenizer, segments[0]))


def _placed(llm: LLM, texts: list[str], segments: list[list[int]], separator: str) -> EchoText:
    """Segment texts joined by ``separator``, each token placed in them (``LLM.tokenize`` encoded each
    text alone, as here, so the encodings are the segments' tokens)."""
    offsets, start = [], 0
    for text, ids in zip(texts, segments, strict=True):
        spans = encode(llm.tokenizer, text).offsets
        assert len(spans) == len(ids)
        offsets += [start + a for a, _ in spans]
        start += len(text) + len(separator)
    return EchoText(separator.join(texts), offsets)
