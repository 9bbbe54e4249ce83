"""agentkv-server's own launch of the real llama-server with the default model: the context per
slot read from the GGUF, the engine's private API key, and a restart after kill -9."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agentkv.runtime.assemble import EngineHandle, EngineSettings, open_engine
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Runtime
from agentkv.runtime.model import read_model_shape
from agentkv_server import cli
from agentkv_server.app import create_app
from tests._engine_fixture import locate_engine

pytestmark = [pytest.mark.engine, pytest.mark.anyio]

SLOTS = 2


@pytest.fixture(scope="module")
async def launched(
    anyio_backend: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[EngineHandle]:
    """The engine exactly as agentkv-server launches it (no --ctx-per-slot), caches under tmp."""
    _, model = locate_engine()
    root = tmp_path_factory.mktemp("launched")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AGENTKV_CACHE_DIR", str(root))
        args = cli.build_parser().parse_args(
            ["--model", str(model), "--slots", str(SLOTS), "--kv-budget", "2GiB"]
        )
        async with open_engine(cli._from_args(EngineSettings, args)) as engine:
            yield engine


def process_of(engine: EngineHandle):  # type: ignore[no-untyped-def]
    assert engine.supervisor is not None
    return engine.supervisor.process


def find_key(data: Any, key: str) -> Any:
    """The first value of ``key`` anywhere in a JSON value (None if absent)."""
    if isinstance(data, dict):
        if key in data:
            return data[key]
        data = list(data.values())
    if isinstance(data, list):
        for item in data:
            found = find_key(item, key)
            if found is not None:
                return found
    return None


async def test_context_per_slot_follows_the_gguf(launched: EngineHandle) -> None:
    """The default model is trained for 32768 tokens and 2 slots of it fit 2 GiB: each slot has
    32768, as llama-server itself reports; its training context is what the GGUF said, and a saved
    slot takes the KV bytes per token computed from the GGUF."""
    process = process_of(launched)
    shape = read_model_shape(process.config.model)
    assert shape.n_ctx_train == 32768
    assert launched.ctx_per_slot == 32768
    assert launched.kv_bytes_per_token == shape.kv_bytes_per_token() == 12288
    async with process.client(read_timeout=120) as client:
        assert [slot["n_ctx"] for slot in await client.slots()] == [32768] * SLOTS
        models = await client._transport._http.get(
            process.base_url + "/v1/models", headers=process.headers
        )
        assert find_key(models.json(), "n_ctx_train") == shape.n_ctx_train
        # About 600 tokens in slot 0, then saved: the file holds their KV cache.
        rules = " ".join(f"Rule {i}: check the input of step {i} twice." for i in range(60))
        body = {"messages": [{"role": "user", "content": rules}], "max_tokens": 1}
        await client.chat(body, slot=0)
        saved = await client.save_slot(0, "bytes-per-token.bin")
    assert saved["n_saved"] > 400
    assert saved["n_written"] / saved["n_saved"] == pytest.approx(12288, rel=0.03)
    log = (await anyio.Path(process.log_path).read_text()) if process.log_path else ""
    assert "n_ctx_slot = 32768" in log


async def test_launched_engine_requires_its_key(launched: EngineHandle) -> None:
    """Without agentkv's key llama-server refuses a request; the key is not in ps or the log."""
    process = process_of(launched)
    assert launched.api_key
    async with httpx.AsyncClient(timeout=30) as http:
        bare = await http.post(process.base_url + "/tokenize", json={"content": "hi"})
        assert bare.status_code == 401
        wrong = await http.get(
            process.base_url + "/slots", headers={"authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401
        keyed = await http.post(
            process.base_url + "/tokenize", json={"content": "hi"}, headers=process.headers
        )
        assert keyed.status_code == 200
        assert (await http.get(process.base_url + "/health")).status_code == 200
    cmdline = (await anyio.Path(f"/proc/{process.pid}/cmdline").read_bytes()).decode()
    assert "--api-key-file" in cmdline
    assert launched.api_key not in cmdline
    assert launched.api_key not in process.log_path.read_text()


async def test_kill_9_is_restarted_and_serves_within_30_s(
    launched: EngineHandle, tmp_path: Path
) -> None:
    """kill -9 of llama-server: requests get 529 meanwhile, then agentkv serves again by itself."""
    process = process_of(launched)
    status = launched.status
    assert status is not None
    client = process.client(status=status, read_timeout=120)
    config = RuntimeConfig(n_slots=SLOTS, ctx_per_slot=launched.ctx_per_slot, store_dir=None)
    runtime = Runtime(client, config)
    app = create_app(runtime)
    body = {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Say yes."}],
    }
    transport = httpx.ASGITransport(app=app)
    async with (
        runtime,
        httpx.AsyncClient(transport=transport, base_url="http://agentkv", timeout=120) as http,
    ):
        assert (await http.post("/v1/messages", json=body)).status_code == 200
        generation = status.generation
        killed = time.monotonic()
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        with anyio.fail_after(10):
            await status.changed()
        # The restart waits its backoff and then loads the model: seconds in which to ask.
        during = await http.post("/v1/messages", json=body)
        health = await http.get("/health")
        assert during.status_code == 529, during.text
        assert during.json()["error"]["type"] == "overloaded_error"
        assert int(during.headers["retry-after"]) >= 1
        assert (health.status_code, health.json()["status"]) == (503, "engine_restarting")
        with anyio.fail_after(30):
            await status.wait_generation(generation)
            after = await http.post("/v1/messages", json=body)
        served = time.monotonic() - killed
        assert after.status_code == 200, after.text
        assert after.json()["type"] == "message"
        assert (await http.get("/health")).json()["status"] == "ready"
    print(f"\nrestart after kill -9: served again {served:.1f} s after the kill")
    assert served < 30
    await client.aclose()
