"""agentkv_server: the Anthropic Messages API in front of llama-server, from agentkv's parts."""

from __future__ import annotations

from agentkv.runtime.gateway import Gateway
from agentkv_server.app import create_app
from agentkv_server.config import ServerConfig

__all__ = ["Gateway", "ServerConfig", "create_app"]
