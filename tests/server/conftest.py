"""A live agentkv server on loopback, in front of a real llama-server with the default model.

Both run in a background event loop (an anyio blocking portal), so tests can use the synchronous
and the asynchronous Anthropic SDK alike.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import anyio.from_thread
import httpx
import pytest
import uvicorn

from agentkv import LlamaSlotClient
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.engine import LlamaServerProcess, free_port
from agentkv.runtime.lifecycle import Runtime
from agentkv_server import create_app
from tests._engine_fixture import (
    ENGINE_CTX_PER_SLOT,
    ENGINE_SLOTS,
    engine_config,
    locate_engine,
)
from tests.fakes import FakeLlama, served


class Live(NamedTuple):
    url: str
    engine_url: str
    runtime: Runtime
    portal: anyio.from_thread.BlockingPortal
    engine_key: str | None = None

    def engine_table(self) -> dict[str, Any]:
        """agentkv's own slot table, as GET /agentkv/slots shows it."""
        return httpx.get(f"{self.url}/agentkv/slots", timeout=30).json()  # type: ignore[no-any-return]

    def engine_slots(self) -> list[dict[str, Any]]:
        async def get() -> list[dict[str, Any]]:
            async with LlamaSlotClient(self.engine_url, api_key=self.engine_key) as client:
                return await client.slots()

        return self.portal.call(get)


@contextlib.contextmanager
def start_live(root: Path, **settings: Any) -> Iterator[Live]:
    """agentkv on a free loopback port in front of a new llama-server with 2 slots of 4096
    tokens; ``settings`` override the RuntimeConfig."""
    binary, model = locate_engine()
    with anyio.from_thread.start_blocking_portal() as portal:
        process = LlamaServerProcess(
            engine_config(model, root), binary=binary, log_dir=root / "logs"
        )
        with portal.wrap_async_context_manager(process):
            client = process.client(read_timeout=300)
            config = RuntimeConfig(
                **{
                    "n_slots": ENGINE_SLOTS,
                    "ctx_per_slot": ENGINE_CTX_PER_SLOT,
                    "ping_interval": 1.0,
                    "store_dir": root / "slots",
                    # A client that drops is not waited for: no test retries a request.
                    "retry_grace": 1.0,
                    **settings,
                }
            )
            runtime = Runtime(client, config)
            app = create_app(runtime)
            port = free_port()
            server = uvicorn.Server(
                uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
            )
            done = portal.start_task_soon(server.serve)
            deadline = time.monotonic() + 30
            while not server.started:
                assert not done.done(), "agentkv server exited during startup"
                assert time.monotonic() < deadline, "agentkv server did not start"
                time.sleep(0.05)
            try:
                yield Live(
                    f"http://127.0.0.1:{port}", process.base_url, runtime, portal, process.api_key
                )
            finally:
                server.should_exit = True
                done.result(timeout=30)
                portal.call(client.aclose)


@pytest.fixture(scope="session")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """agentkv on a free loopback port, fronting llama-server with 2 slots."""
    with start_live(tmp_path_factory.mktemp("live")) as server:
        yield server


Serve = Callable[..., Awaitable[httpx.AsyncClient]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """``await serve(fake, **settings)``: the app over a fake engine, its runtime running;
    ``settings`` mix ServerConfig and RuntimeConfig fields."""
    async with contextlib.AsyncExitStack() as stack:

        async def _serve(fake: FakeLlama, **config: Any) -> httpx.AsyncClient:
            return await stack.enter_async_context(served(fake, **config))

        yield _serve
