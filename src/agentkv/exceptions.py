"""The agentkv exception tree.

Every error carries the HTTP status and the Anthropic ``error.type`` it maps to, so that the one
place that turns exceptions into responses (the server) needs no table of its own.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "AgentKVError",
    "AuthenticationError",
    "EngineError",
    "EngineResponseError",
    "EngineRestartingError",
    "EngineStreamBrokenError",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "InvalidRequestError",
    "NotFoundError",
    "PromptTooLongError",
    "QueueFullError",
    "RequestTooLargeError",
    "SSEProtocolError",
]


class AgentKVError(Exception):
    """Base of every error agentkv raises on purpose."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "api_error"
    #: Seconds after which a retry may succeed; the server sends it as ``retry-after``.
    retry_after: float | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_anthropic(self) -> dict[str, Any]:
        """The Anthropic error body: ``{"type": "error", "error": {...}}``."""
        return {"type": "error", "error": {"type": self.error_type, "message": self.message}}


class InvalidRequestError(AgentKVError):
    """The client's request is malformed; ``path`` names the field (``messages[0].role``)."""

    status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


class PromptTooLongError(InvalidRequestError):
    """The prompt cannot fit the context. The message text is what clients look for to compact."""

    def __init__(self, tokens: int, maximum: int) -> None:
        super().__init__(f"prompt is too long: {tokens} tokens > {maximum} maximum")
        self.tokens = tokens
        self.maximum = maximum


class AuthenticationError(AgentKVError):
    """The request lacks the API key the server was configured with, or carries a wrong one."""

    status = 401
    error_type = "authentication_error"


class NotFoundError(AgentKVError):
    """No such route."""

    status = 404
    error_type = "not_found_error"


class RequestTooLargeError(AgentKVError):
    """The request body is over the server's size limit."""

    status = 413
    error_type = "request_too_large"


class QueueFullError(AgentKVError):
    """The scheduler's queue is at its cap; the client should retry later."""

    status = 529
    error_type = "overloaded_error"


class SSEProtocolError(AgentKVError):
    """The engine's stream broke the rules the assembler relies on (e.g. chunks after the end)."""


class EngineError(AgentKVError):
    """Base of every failure talking to llama-server."""


class EngineUnavailableError(EngineError):
    """llama-server could not be reached (refused, reset, not started, still loading)."""

    status = 503
    error_type = "overloaded_error"

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineRestartingError(EngineUnavailableError):
    """agentkv is restarting the llama-server it launched; ``retry_after`` says when to retry.

    529 ``overloaded_error`` is what Anthropic clients retry on by themselves, after
    ``retry-after`` seconds.
    """

    status = 529


class EngineTimeoutError(EngineError):
    """llama-server accepted the request but stopped answering within the time allowed."""

    status = 504
    error_type = "api_error"


class EngineResponseError(EngineError):
    """llama-server answered with an error status or a body that cannot be parsed."""

    def __init__(self, message: str, upstream_status: int | None = None) -> None:
        super().__init__(message)
        self.upstream_status = upstream_status
        # A 4xx from the engine is about the request (e.g. an image sent to a text-only model);
        # 401/403 are about agentkv's key for the engine, which is not the client's fault.
        if upstream_status in range(400, 500) and upstream_status not in (401, 403):
            self.status = 400  # type: ignore[misc]
            self.error_type = "invalid_request_error"  # type: ignore[misc]


class EngineStreamBrokenError(EngineResponseError):
    """A streamed reply from llama-server stopped before its end: the connection broke or closed
    mid-stream. The engine itself may be fine; what it had computed stays in its slot."""
