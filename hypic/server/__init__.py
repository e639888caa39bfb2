"""The OpenAI-compatible server (``hypic serve``): FastAPI app, protocol, chat templating, metrics.

``create_app`` and ``ServerSettings`` load on first use, so the parts the library uses without a
server (``chat``'s templating for ``LLM.chat``) import without FastAPI."""

from typing import Any

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from hypic.server.app import create_app

        return create_app
    if name == "ServerSettings":
        from hypic.server.settings import ServerSettings

        return ServerSettings
    raise AttributeError(f"module 'hypic.server' has no attribute {name!r}")
