"""agentkv_server: the Anthropic Messages API in front of llama-server, from agentkv's parts."""

from __future__ import annotations

from agentkv_server.app import create_app
from agentkv_server.config import ServerConfig
from agentkv_server.gateway import Gateway

__all__ = ["Gateway", "ServerConfig", "create_app"]
