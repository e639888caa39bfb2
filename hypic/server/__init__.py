"""The OpenAI-compatible server (``hypic serve``): FastAPI app, protocol, chat templating, metrics."""

from hypic.server.app import create_app
from hypic.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
