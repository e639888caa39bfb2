"""The tokenizer over HTTP, as vLLM serves it: ``GET /tokenizer_info``, ``POST /tokenize``,
``POST /detokenize`` at the server's root.

Why: a client that must count or build token-id prompts (lm-eval's ``local-completions`` probes for
these two routes and then tokenizes on the server instead of loading the model's tokenizer itself)
gets exactly the ids the server reads, with no copy of the model folder. ``/tokenize`` takes a chat's
``messages`` too (vLLM's chat form): the conversation rendered as ``/v1/chat/completions`` renders it,
so its ids are the ``prompt_token_ids`` that route's ``return_token_ids`` reports — what an RL rollout
builds its next turn's prompt from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import Field, model_validator

from hypic.llm import LLM, SEPARATOR
from hypic.models.tokenize import encode
from hypic.server.chat import ChatTemplate
from hypic.server.errors import bad_request
from hypic.server.generation import json_response
from hypic.server.prompts import chat_segments
from hypic.server.protocol import ChatRequest, Message, Strict, Text, ToolDef, check_template_kwargs
from hypic.server.settings import ServerSettings


class TokenizeRequest(Strict):
    """A text (``prompt``) or a chat (``messages`` and how to render them, as the chat route reads them)."""

    model: str | None = None
    prompt: Text | None = None
    add_special_tokens: bool | None = None  # a text: True unless said (vLLM's defaults); a chat: False only
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ToolDef], Field(min_length=1, max_length=128)] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of a text to tokenize and messages (a chat to render)")
        if self.messages is None:
            chat_only = [k for k in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                                     "tools") if k in self.model_fields_set]
            if chat_only:
                raise ValueError(f"{chat_only[0]}: only with messages")
        elif self.add_special_tokens:
            raise ValueError("add_special_tokens: a chat's ids are what its template renders (false only)")
        else:
            check_template_kwargs(self.chat_template_kwargs)  # refused here, as the chat route refuses it
        return self

    def chat(self) -> ChatRequest:
        """The chat request whose prompt this renders (its rendering is the chat route's own)."""
        return ChatRequest(messages=self.messages, add_generation_prompt=self.add_generation_prompt,
                           continue_final_message=self.continue_final_message,
                           chat_template_kwargs=self.chat_template_kwargs, tools=self.tools)


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1 << 20)]


def tokenizer_router(llm: LLM, template: ChatTemplate, read_body: Callable[..., Awaitable[Any]],
                     settings: ServerSettings, require_key: Callable[..., Awaitable[None]],
                     check_model: Callable[[str | None], None]) -> APIRouter:
    """``check_model``: the /v1 routes' 404 for a model not served here (a client pointed at the wrong
    server would otherwise get another tokenizer's ids)."""
    router = APIRouter(dependencies=[Depends(require_key)])
    tokenizer = llm.tokenizer
    eos = sorted(llm.engine.eos)

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        eos_token = template.eos_token or (tokenizer.id_to_token(eos[0]) if eos else None)
        return {"tokenizer_class": "tokenizers.Tokenizer", "eos_token": eos_token,
                "bos_token": template.bos_token or None, "pad_token": None, "chat_template": template.source,
                "model_max_length": llm.max_positions, "vocab_size": llm.vocab_size}

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await read_body(request, TokenizeRequest, settings.max_body_bytes)
        check_model(req.model)

        def ids() -> list[int]:
            if req.messages is not None:  # rendered and cut into segments as the chat route does
                segments = chat_segments(llm, template, req.chat(), settings, limits=False)  # counted however long
                return [t for segment in segments for t in segment]
            # as a completion reads it: each <<PIC_SEP>> part on its own (spelled out whole, the separator
            # counted 38 tokens where the server read 14), the parts' ids back to back
            special = req.add_special_tokens is not False
            return [t for part in req.prompt.split(SEPARATOR)
                    for t in encode(tokenizer, part, add_special_tokens=special).ids]

        tokens = await asyncio.to_thread(ids)  # a long prompt takes seconds: off the event loop, and so
        return await json_response({"tokens": tokens, "count": len(tokens),  # is writing its ids
                                    "max_model_len": llm.max_positions})

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await read_body(request, DetokenizeRequest, settings.max_body_bytes)
        check_model(req.model)
        outside = [t for t in req.tokens if t >= llm.vocab_size]
        if outside:
            raise bad_request(f"tokens: token id {outside[0]} is outside this model's vocabulary "
                              f"[0, {llm.vocab_size})", "tokens")
        text = await asyncio.to_thread(tokenizer.decode, req.tokens, skip_special_tokens=False)  # up to 1 M ids
        return {"prompt": text}

    return router
