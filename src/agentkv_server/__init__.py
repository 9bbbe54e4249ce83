"""agentkv_server: the Anthropic Messages API over HTTP, in front of an agentkv runtime."""

from __future__ import annotations

from agentkv_server.app import create_app
from agentkv_server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
