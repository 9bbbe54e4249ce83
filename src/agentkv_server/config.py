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
    allowed_hosts: str | None = setting(
        None,
        "comma-separated Host names the server answers (others get 400, which stops DNS "
        "rebinding); '*': any; default: agentkv-server bound to a loopback address answers "
        "localhost, 127.0.0.1 and ::1 only, otherwise any",
        group="server",
        metavar="HOSTS",
    )

    def host_allowed(self, header: str | None) -> bool:
        """Whether a request's ``Host`` header names this server (always, without a list)."""
        if self.allowed_hosts is None:
            return True
        allowed = {h.strip().lower() for h in self.allowed_hosts.split(",") if h.strip()}
        if "*" in allowed:
            return True
        name = (header or "").strip().lower()
        if name.startswith("["):  # [::1]:8788
            name = name[1 : name.find("]")] if "]" in name else name
        elif name.count(":") == 1:  # 127.0.0.1:8788, localhost:8788
            name = name.split(":", 1)[0]
        return name in allowed

    @property
    def body_limits(self) -> BodyLimits:
        """What the body reader enforces: size and nesting depth."""
        return BodyLimits(max_bytes=self.max_body_bytes, max_depth=self.max_json_depth)
