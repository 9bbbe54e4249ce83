"""The tests' helpers around the fake llama-server (:mod:`agentkv_bench.fake_engine`, which the
benchmark's ``overhead`` scenario serves too): the app over it in-process, and waiting on state.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import attrs
import httpx

from agentkv_bench.fake_engine import FakeLlama, read_state, render, tokenize, write_state

__all__ = [
    "FakeLlama",
    "read_state",
    "render",
    "served",
    "split_config",
    "tokenize",
    "wait_for",
    "write_state",
]


def split_config(config: dict[str, Any]) -> tuple[Any, Any]:
    """Keyword settings as (ServerConfig, RuntimeConfig), each key to the class that has it."""
    from agentkv.runtime.config import RuntimeConfig
    from agentkv_server.config import ServerConfig

    server_keys = {f.name for f in attrs.fields(ServerConfig)}
    server = {k: v for k, v in config.items() if k in server_keys}
    runtime = {k: v for k, v in config.items() if k not in server_keys}
    return ServerConfig(**server), RuntimeConfig(**runtime)


@contextlib.asynccontextmanager
async def served(
    fake: FakeLlama,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    connect_retries: int = 0,
    **config: Any,
) -> AsyncIterator[httpx.AsyncClient]:
    """The app over ``fake``, its runtime running, and an HTTP client for it (in-process).

    ``config`` mixes ServerConfig and RuntimeConfig settings. ``http.app`` is the app and
    ``http.runtime`` the runtime, for tests that look inside. ``transport`` replaces the fake's
    own between the runtime and the fake (to inject faults); ``connect_retries`` is the client's.
    """
    from agentkv.runtime.client import LlamaSlotClient
    from agentkv.runtime.lifecycle import Runtime
    from agentkv_server.app import create_app

    server_config, runtime_config = split_config(config)
    engine_http = httpx.AsyncClient(
        transport=transport or fake.transport(), base_url="http://engine"
    )
    client = LlamaSlotClient(
        "http://engine", http=engine_http, connect_retries=connect_retries, retry_backoff=0.01
    )
    runtime = Runtime(client, runtime_config)
    app = create_app(runtime, server_config)
    async with engine_http, runtime:  # the runtime stops (its stop save) before the link closes
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://agentkv") as http:
            http.app = app  # type: ignore[attr-defined]
            http.runtime = runtime  # type: ignore[attr-defined]
            yield http


async def wait_for(condition: Callable[[], object], timeout: float = 5.0) -> None:  # noqa: ASYNC109
    """Wait until ``condition()`` is true (another task's state), failing after ``timeout``."""
    with anyio.fail_after(timeout):
        while not condition():  # noqa: ASYNC110 - the state belongs to other tasks
            await anyio.sleep(0.01)
