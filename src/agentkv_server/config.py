"""The HTTP server's own settings (what the runtime does is in ``RuntimeConfig``)."""

from __future__ import annotations

import attrs

from agentkv.runtime.config import setting
from agentkv_server.body import BodyLimits

__all__ = ["ServerConfig"]


@attrs.frozen
class ServerConfig:
    """How the server listens and whom it serves."""

    host: str = setting("127.0.0.1", "address to bind", group="server")
    port: int = setting(8788, "port to listen on", group="server")
    api_key: str | None = setting(
        None,
        "require this key as x-api-key or Authorization: Bearer (default $AGENTKV_API_KEY; "
        "unset: no check)",
        group="server",
    )
    max_body_bytes: int = setting(
        32 * 1024 * 1024,
        "largest accepted request body; larger ones get 413 request_too_large",
        group="server",
        metavar="BYTES",
    )
    max_json_depth: int = setting(
        64, "deepest nesting of JSON arrays and objects in a body; deeper is a 400", flag=False
    )
    model_name: str = setting("agentkv-local", "the model id /v1/models lists", group="server")

    @property
    def body_limits(self) -> BodyLimits:
        """What the body reader enforces: size and nesting depth."""
        return BodyLimits(max_bytes=self.max_body_bytes, max_depth=self.max_json_depth)
