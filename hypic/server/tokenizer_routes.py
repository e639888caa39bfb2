"""The tokenizer over HTTP, as vLLM serves it: ``GET /tokenizer_info``, ``POST /tokenize``,
``POST /detokenize`` at the server's root.

Why: a client that must count or build token-id prompts (lm-eval's ``local-completions`` probes for
these two routes and then tokenizes on the server instead of loading the model's tokenizer itself)
gets exactly the ids the server reads, with no copy of the model folder.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import Field

from hypic.llm import LLM, SEPARATOR
from hypic.server.chat import ChatTemplate
from hypic.server.errors import bad_request
from hypic.server.generation import json_response
from hypic.server.protocol import Strict, Text


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: Text
    add_special_tokens: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1 << 20)]


def tokenizer_router(llm: LLM, template: ChatTemplate, read_body: Callable[..., Awaitable[Any]],
                     max_body_bytes: int, require_key: Callable[..., Awaitable[None]],
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
        req = await read_body(request, TokenizeRequest, max_body_bytes)
        check_model(req.model)
        # as a completion reads it: each <<PIC_SEP>> part on its own (spelled out whole, the separator
        # counted 38 tokens where the server read 14), the parts' ids back to back
        def ids() -> list[int]:
            return [t for part in req.prompt.split(SEPARATOR)
                    for t in tokenizer.encode(part, add_special_tokens=req.add_special_tokens).ids]

        tokens = await asyncio.to_thread(ids)  # a long prompt takes seconds: off the event loop, and so
        return await json_response({"tokens": tokens, "count": len(tokens),  # is writing its ids
                                    "max_model_len": llm.max_positions})

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await read_body(request, DetokenizeRequest, max_body_bytes)
        check_model(req.model)
        outside = [t for t in req.tokens if t >= llm.vocab_size]
        if outside:
            raise bad_request(f"tokens: token id {outside[0]} is outside this model's vocabulary "
                              f"[0, {llm.vocab_size})", "tokens")
        text = await asyncio.to_thread(tokenizer.decode, req.tokens, skip_special_tokens=False)  # up to 1 M ids
        return {"prompt": text}

    return router
