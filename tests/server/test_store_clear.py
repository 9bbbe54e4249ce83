"""Clearing the prefix store: ``DELETE /agentkv/store`` and ``agentkv-server store clear``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Runtime
from agentkv_server import create_app, store_cmd
from agentkv_server.cli import main as cli_main
from tests.fakes import FakeLlama

pytestmark = pytest.mark.anyio

SYSTEM = "You are a careful coding agent. " * 300


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def conversation(agent: str, turns: int) -> dict[str, Any]:
    """A long, agent-specific conversation, so that each agent leaves its own context."""
    messages: list[dict[str, Any]] = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{agent} step {turn}: " + "work " * 400})
        messages.append({"role": "assistant", "content": f"done {turn}"})
    messages.append({"role": "user", "content": f"{agent}: next"})
    return {"model": "m", "max_tokens": 4, "system": SYSTEM, "messages": messages}


def files(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("akv-*.bin")}


async def test_delete_clears_one_agent_then_everything(tmp_path: Path) -> None:
    fake = FakeLlama(reply="ok", save_dir=tmp_path)
    http = httpx.AsyncClient(transport=fake.transport(), base_url="http://engine")
    client = LlamaSlotClient("http://engine", http=http, connect_retries=0)
    # One slot: each agent's request evicts the other's context, which is parked in the store.
    config = RuntimeConfig(n_slots=1, store_dir=tmp_path, ctx_per_slot=32768)
    async with http, Runtime(client, config) as runtime:
        app = create_app(runtime)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://agentkv") as api:
            for agent in ("a", "b", "a", "b"):
                response = await api.post(
                    "/v1/messages", json=conversation(agent, 3), headers={"x-agent-id": agent}
                )
                assert response.status_code == 200, response.text
            assert runtime.store is not None
            owners = Counter(entry.agent for entry in runtime.store.index.entries())
            assert owners["a"] >= 1 and owners["b"] >= 1, owners
            a_files = {f"{e.id}.bin" for e in runtime.store.index.entries() if e.agent == "a"}
            assert a_files <= files(tmp_path)

            response = await api.delete("/agentkv/store", params={"agent": "a"})
            assert response.status_code == 200
            assert response.json() == {"deleted": owners["a"], "agent": "a"}
            assert not a_files & files(tmp_path)
            assert {e.agent for e in runtime.store.index.entries()} == set(owners) - {"a"}

            response = await api.delete("/agentkv/store")
            assert response.json()["deleted"] == sum(owners.values()) - owners["a"]
            assert files(tmp_path) == set()
            assert runtime.store.index.entries() == []
            # No slot still claims to be saved in an entry that is gone.
            assert all(row.stored is None for row in runtime.dispatcher.slots.table())
            index = json.loads((tmp_path / "index.json").read_text())
            assert index["entries"] == []


def test_offline_clear_edits_a_stopped_servers_directory(tmp_path: Path) -> None:
    entries = [
        {"id": "akv-1", "agent": "a"},
        {"id": "akv-2", "agent": "b"},
        {"id": "akv-3", "agent": "a"},
    ]
    (tmp_path / "index.json").write_text(json.dumps({"version": 1, "entries": entries}))
    for entry in entries:
        (tmp_path / f"{entry['id']}.bin").write_bytes(b"state")
    (tmp_path / "akv-orphan.bin").write_bytes(b"state")

    assert cli_main(["store", "clear", "--agent", "a", "--offline", str(tmp_path)]) == 0
    assert files(tmp_path) == {"akv-2.bin", "akv-orphan.bin"}
    kept = json.loads((tmp_path / "index.json").read_text())["entries"]
    assert [e["id"] for e in kept] == ["akv-2"]

    assert store_cmd.clear_offline(tmp_path) == 1
    assert files(tmp_path) == set()
    assert (tmp_path / "index.json").stat().st_mode & 0o077 == 0


def test_online_clear_sends_the_agent_and_the_key() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.headers.get("x-api-key") != "k":
            return httpx.Response(401)
        return httpx.Response(200, json={"deleted": 2, "agent": "a"})

    transport = httpx.MockTransport(handle)
    assert store_cmd.clear_online("http://x", "k", agent="a", transport=transport) == 2
    assert seen[-1].method == "DELETE" and seen[-1].url.params["agent"] == "a"
    with pytest.raises(store_cmd.StoreCommandError, match="API key"):
        store_cmd.clear_online("http://x", None, transport=transport)


def test_a_stopped_server_is_said_in_words(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["store", "clear", "--url", "http://127.0.0.1:1"]) == 1
    assert "--offline" in capsys.readouterr().err
