"""The Host check: a server bound to loopback answers loopback names only (DNS rebinding)."""

from __future__ import annotations

import httpx
import pytest

from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Runtime
from agentkv_server import create_app
from agentkv_server.cli import _server_config, build_parser
from agentkv_server.config import ServerConfig
from tests.fakes import FakeLlama

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    ("allowed", "header", "ok"),
    [
        (None, "evil.example", True),
        ("localhost,127.0.0.1,::1", "127.0.0.1:8788", True),
        ("localhost,127.0.0.1,::1", "LOCALHOST:8788", True),
        ("localhost,127.0.0.1,::1", "[::1]:8788", True),
        ("localhost,127.0.0.1,::1", "localhost", True),
        ("localhost,127.0.0.1,::1", "evil.example", False),
        ("localhost,127.0.0.1,::1", "evil.example:8788", False),
        ("localhost,127.0.0.1,::1", "127.0.0.1.evil.example", False),
        ("localhost,127.0.0.1,::1", "", False),
        ("localhost,127.0.0.1,::1", None, False),
        ("*", "anything", True),
    ],
)
def test_host_allowed(allowed: str | None, header: str | None, ok: bool) -> None:
    assert ServerConfig(allowed_hosts=allowed).host_allowed(header) is ok


def test_the_cli_limits_a_loopback_server_to_loopback_names() -> None:
    parser = build_parser()
    assert _server_config(parser.parse_args([])).allowed_hosts == "127.0.0.1,localhost,::1"
    assert _server_config(parser.parse_args(["--host", "0.0.0.0"])).allowed_hosts is None
    given = parser.parse_args(["--allowed-hosts", "box.lan,127.0.0.1"])
    assert _server_config(given).allowed_hosts == "box.lan,127.0.0.1"


async def test_a_foreign_host_gets_an_anthropic_shaped_400() -> None:
    fake = FakeLlama(reply="hi")
    engine = httpx.AsyncClient(transport=fake.transport(), base_url="http://engine")
    client = LlamaSlotClient("http://engine", http=engine, connect_retries=0)
    runtime = Runtime(client, RuntimeConfig(n_slots=1))
    app = create_app(runtime, ServerConfig(allowed_hosts="localhost,127.0.0.1"))
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with runtime, engine:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8788") as ok:
            assert (await ok.post("/v1/messages", json=body)).status_code == 200
        engine_calls = len(fake.requests)
        async with httpx.AsyncClient(transport=transport, base_url="http://rebound.example") as bad:
            response = await bad.post("/v1/messages", json=body)
            assert response.status_code == 400
            error = response.json()
            assert error["type"] == "error"
            assert error["error"]["type"] == "invalid_request_error"
            assert "rebound.example" in error["error"]["message"]
        # Refused before any engine work.
        assert len(fake.requests) == engine_calls
