"""uvicorn's server, with the app's shutdown begun first.

On SIGINT/SIGTERM uvicorn stops listening, waits ``timeout_graceful_shutdown`` for open connections,
then cancels their tasks, and only then runs the app's lifespan shutdown. Left so, a stream still
running at the deadline was cut mid-body — no error event, no ``[DONE]``, two tracebacks in the log —
before the app's own cancellation could speak. ``HypicServer`` begins the app's shutdown when
uvicorn's does (``Runner.begin_shutdown``: no new requests, the in-flight ones cancelled after the
app's ``shutdown_timeout_s`` with an error they report), and ``config`` gives uvicorn ``GRACE_S``
more than that, so every response ends as the app ends it.
"""

from __future__ import annotations

import socket
from typing import Any

import uvicorn
from fastapi import FastAPI

from hypic.server.settings import ServerSettings

GRACE_S = 5  # seconds past the app's shutdown timeout for cancelled responses to be written


class HypicServer(uvicorn.Server):
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = getattr(getattr(self.config.app, "state", None), "hypic", None)
        if state is not None and state.runner is not None:
            state.runner.begin_shutdown()
        await super().shutdown(sockets)


def config(app: FastAPI, settings: ServerSettings, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for ``app``: its graceful shutdown outlasts the app's by ``GRACE_S``."""
    return uvicorn.Config(app, timeout_graceful_shutdown=round(settings.shutdown_timeout_s) + GRACE_S, **kwargs)
