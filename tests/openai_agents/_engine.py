"""A scripted engine (FakeLlama) on a loopback port, for ``agentkv-server --upstream``."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

from tests.claude._cli import free_port
from tests.fakes import FakeLlama

#: ``agentkv-server`` flags in front of a scripted engine: its URL is added.
SCRIPTED_ARGS = ("--ctx-per-slot", "32768", "--slots", "2", "--no-store")


@contextlib.contextmanager
def engine_over_http(fake: FakeLlama) -> Iterator[str]:
    """The fake engine on a loopback port, for an ``agentkv-server --upstream``."""
    port = free_port()
    config = uvicorn.Config(
        fake.asgi, host="127.0.0.1", port=port, log_level="warning", interface="asgi3"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the scripted engine did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
