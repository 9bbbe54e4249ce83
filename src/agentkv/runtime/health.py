"""Is llama-server up: one ``/health`` probe, and the one readiness wait built on it."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import httpx

from agentkv.exceptions import EngineUnavailableError
from agentkv.runtime.error_map import error_message

__all__ = ["probe", "wait_until_ready"]


async def probe(
    http: httpx.AsyncClient,
    base_url: str,
    *,
    timeout: float = 5.0,  # noqa: ASYNC109 - passed on to httpx
) -> tuple[str, str]:
    """One ``GET /health``: ``("ready" | "loading" | "down", detail in words)``.

    ``/health`` needs no API key on llama-server.
    """
    url = f"{base_url.rstrip('/')}/health"
    try:
        try:
            response = await http.get(url, timeout=timeout)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            # Closed before the answer (a pooled connection llama-server had closed): once more.
            response = await http.get(url, timeout=timeout)
    except httpx.ConnectError:
        return "down", "not accepting connections yet"
    except httpx.HTTPError as exc:
        return "down", f"health check failed ({exc!r})"
    if response.status_code == 200:
        return "ready", "ready"
    if response.status_code == 503:
        return "loading", f"loading the model ({error_message(response)})"
    return "down", f"health check answered HTTP {response.status_code}: {error_message(response)}"


async def wait_until_ready(
    http: httpx.AsyncClient,
    base_url: str,
    *,
    timeout: float,  # noqa: ASYNC109 - a deadline for the whole wait, reported in the error
    on_progress: Callable[[str], None] | None = None,
    check: Callable[[], None] | None = None,
    interval: float = 0.25,
) -> None:
    """The one readiness wait: poll ``/health`` until llama-server has loaded its model.

    ``on_progress`` hears each change of state in words; ``check`` runs before each probe and
    may raise (a launcher's "the process has exited"). After ``timeout`` seconds:
    :class:`EngineUnavailableError` naming the last state.
    """
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        if check is not None:
            check()
        state, detail = await probe(http, base_url)
        if state == "ready":
            if on_progress is not None:
                on_progress(f"llama-server at {base_url} is ready")
            return
        message = f"llama-server at {base_url}: {detail}"
        if on_progress is not None and message != last:
            on_progress(message)
        last = message
        if time.monotonic() >= deadline:
            raise EngineUnavailableError(f"{message} (still not ready after {timeout:g} s)")
        await anyio.sleep(min(interval, max(0.0, deadline - time.monotonic())))
