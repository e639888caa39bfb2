"""Offline batches in OpenAI's batch file format: ``hypic run-batch -i requests.jsonl -o results.jsonl``.

Each input line is a request — ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions" | "/v1/responses", "body"}`` — sent to the server's own app in process (no socket,
no key): every request is validated, cached and answered exactly as ``hypic serve`` answers it,
several at once so the scheduler batches them, and each result line — ``{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}`` — is written in the input's order. A
request the server refuses (a 4xx) is a response with that status, as OpenAI's batches report it; a
line that is not a request at all is an ``error`` line. Neither stops the batch. A request the queue
has no room for (a 429: the batch's own requests filled it) waits and is sent again.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass
class BatchTotals:
    requests: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    not_requests: int = 0  # lines answered with an error, never sent
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requeued: int = 0  # requests sent again after the server's queue was full (a 429)


def _request(line: str | bytes, seen: dict[str, int], k: int) -> tuple[str | None, dict[str, Any] | str]:
    """(custom_id, the request) or (custom_id or None, why it is not one); a line of bytes is
    decoded here, so one that is not UTF-8 is that line's error, not the batch's."""
    if isinstance(line, bytes):
        try:
            line = line.decode()
        except UnicodeDecodeError as e:
            return None, f"line {k + 1}: not UTF-8 ({e})"
    try:
        item = json.loads(line)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
        return None, f"line {k + 1}: not JSON ({e})"
    if not isinstance(item, dict):
        return None, f"line {k + 1}: expected a JSON object"
    cid = item.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return None, f"line {k + 1}: custom_id: expected a non-empty string"
    if cid in seen:
        return cid, f"custom_id: {cid!r} is already used by line {seen[cid] + 1}"
    seen[cid] = k
    if item.get("method") != "POST":
        return cid, f"method: expected POST, got {item.get('method')!r}"
    if item.get("url") not in URLS:
        return cid, f"url: expected one of {list(URLS)}, got {item.get('url')!r}"
    body = item.get("body")
    if not isinstance(body, dict):
        return cid, "body: expected a JSON object"
    if body.get("stream"):
        return cid, "body.stream: a batch answers each request whole"
    return cid, item


def _usage(body: Any) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of a response body in any of the three shapes."""
    u = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(u, dict):
        return 0, 0
    prompt = u.get("prompt_tokens", u.get("input_tokens", 0))
    details = u.get("prompt_tokens_details") or u.get("input_tokens_details") or {}
    return prompt, details.get("cached_tokens", 0)


async def run_batch(app: FastAPI, lines: list[str] | list[bytes],
                    concurrency: int) -> tuple[list[dict[str, Any]], BatchTotals]:
    """Every line's result, in order, and the totals. The app's lifespan (its scheduler) runs
    around the batch."""
    totals, seen = BatchTotals(), {}
    parsed = [(k, *_request(line, seen, k)) for k, line in enumerate(lines) if line.strip()]
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, cid: str | None, req: dict[str, Any] | str) -> dict[str, Any]:
        rid = f"batch_req_{uuid.uuid4().hex}"
        if isinstance(req, str):
            totals.not_requests += 1
            return {"id": rid, "custom_id": cid, "response": None, "error": {"code": "invalid_request", "message": req}}
        try:  # re-encoded as the line spelled it: NaN/Infinity and lone surrogates reach the server's checks
            content = json.dumps(req["body"], ensure_ascii=True, allow_nan=True).encode()
        except (ValueError, RecursionError) as e:
            totals.not_requests += 1
            return {"id": rid, "custom_id": cid, "response": None,
                    "error": {"code": "invalid_request", "message": f"body: {e}"}}
        async with gate:
            wait = 0.01
            while True:
                r = await client.post(req["url"], content=content, headers={"content-type": "application/json"})
                if r.status_code != 429:
                    break
                # the batch's own requests fill the queue (each of n choices and every prompt of a
                # completions list is one): the queue drains as they finish, so wait, never refuse
                await asyncio.sleep(wait)
                wait = min(2 * wait, 1.0)
                totals.requeued += 1
        try:
            body = r.json()
        except ValueError:
            body = r.text
        totals.requests += 1
        totals.by_status[r.status_code] = totals.by_status.get(r.status_code, 0) + 1
        prompt, cached = _usage(body)
        totals.prompt_tokens += prompt
        totals.cached_tokens += cached
        request_id = body.get("id", rid) if isinstance(body, dict) else rid
        return {"id": rid, "custom_id": cid,
                "response": {"status_code": r.status_code, "request_id": request_id, "body": body}, "error": None}

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a bug is a 500 line, not the end
        async with httpx.AsyncClient(transport=transport, base_url="http://hypic.batch", timeout=None) as client:
            results = await asyncio.gather(*(one(client, cid, req) for _, cid, req in parsed))
    return list(results), totals
