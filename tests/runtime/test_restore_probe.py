"""The startup check that a restore gives reuse, against the fake engine; and the server's
answer when it does not (store off, contexts resident, said in the banner)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx
import pytest

from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.engine import free_port
from agentkv.runtime.store import PROBE_FILE, RestoreProbe, probe_length, probe_restore
from tests.fakes import FakeLlama
from tests.server.test_logs import Ended, fake_engine_over_http

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def client_of(fake: FakeLlama) -> AsyncIterator[LlamaSlotClient]:
    http = httpx.AsyncClient(transport=fake.transport(), base_url="http://engine")
    async with http:
        yield LlamaSlotClient("http://engine", http=http, connect_retries=0)


@pytest.mark.parametrize(
    ("tokens", "restored", "reused", "works"),
    [
        (1000, 1000, 1000, True),
        (1000, 1000, 900, True),  # a checkpoint a little short of the end still pays
        (1000, 1000, 0, False),  # every token restored, all computed again (sliding window)
        (1000, 1000, 512, False),
        (1000, 600, 600, False),  # the restore itself came back short
        (0, 0, 0, False),
    ],
)
def test_the_reuse_decision(tokens: int, restored: int, reused: int, works: bool) -> None:
    """The store works when every token comes back and at least 90 % are reused."""
    assert RestoreProbe(tokens, restored, reused).reuses is works


def test_the_probe_is_longer_than_a_sliding_window() -> None:
    """A plain model needs a few tokens; a sliding-window model more than window + batch."""
    assert probe_length(0) == 64
    assert probe_length(512, batch=512) > 1024
    assert probe_length(None) > 1024  # unknown model: assume a window


async def test_a_restore_with_reuse_keeps_the_store(tmp_path: Path) -> None:
    """On an engine whose restore gives reuse, the probe says so, and cleans up after itself."""
    fake = FakeLlama(save_dir=tmp_path)
    async with client_of(fake) as client:
        probe = await probe_restore(client, tmp_path, compat="c1", n_tokens=64)
    assert probe is not None and probe.reuses
    assert (probe.tokens, probe.restored) == (64, 64) and probe.reused >= 63
    assert [action for _, action, _ in fake.slot_actions] == ["save", "erase", "restore", "erase"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [PROBE_FILE]
    assert stat.S_IMODE((tmp_path / PROBE_FILE).stat().st_mode) == 0o600
    assert fake.cache.get(0) is None  # the slot is left empty


async def test_a_restore_without_reuse_is_detected(tmp_path: Path) -> None:
    """Tokens restored, every one computed again: the store would only cost time."""
    fake = FakeLlama(save_dir=tmp_path, restore_reuses=False)
    async with client_of(fake) as client:
        probe = await probe_restore(client, tmp_path, compat="c1", n_tokens=200)
    assert probe == RestoreProbe(200, 200, 0)
    assert not probe.reuses


async def test_the_probe_runs_once_per_engine_configuration(tmp_path: Path) -> None:
    """The result is kept for the configuration; another configuration is probed again."""
    fake = FakeLlama(save_dir=tmp_path, restore_reuses=False)
    async with client_of(fake) as client:
        first = await probe_restore(client, tmp_path, compat="c1", n_tokens=100)
        fake.restore_reuses = True  # a second probe would now see reuse
        again = await probe_restore(client, tmp_path, compat="c1", n_tokens=100)
        assert again == first and len(fake.slot_actions) == 4
        other = await probe_restore(client, tmp_path, compat="c2", n_tokens=100)
    assert other is not None and other.reuses
    assert json.loads((tmp_path / PROBE_FILE).read_text())["compat"] == "c2"


async def test_an_engine_that_cannot_save_leaves_the_decision_open(tmp_path: Path) -> None:
    """No --slot-save-path: the probe cannot tell (None), and writes nothing."""
    fake = FakeLlama(save_dir=None)
    async with client_of(fake) as client:
        assert await probe_restore(client, tmp_path, compat="c1", n_tokens=64) is None
    assert not (tmp_path / PROBE_FILE).exists()


@contextmanager
def server_with_store(engine_url: str, store: Path) -> Iterator[tuple[str, Ended]]:
    """``agentkv-server --upstream ENGINE --store-dir STORE``; stopped with SIGINT."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "AGENTKV_API_KEY"}
    command = [sys.executable, "-m", "agentkv_server.cli", "--upstream", engine_url]
    command += ["--slots", "4", "--ctx-per-slot", "4096", "--port", str(port)]
    command += ["--store-dir", str(store)]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    ended = Ended()
    try:
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert process.poll() is None, "agentkv-server exited during startup"
        yield url, ended
    finally:
        process.send_signal(2)
        try:
            ended.stderr = process.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            process.kill()
            ended.stderr = process.communicate()[1]
        ended.returncode = process.returncode


@pytest.mark.parametrize("reuses", [False, True])
def test_the_server_turns_the_store_off_when_restore_gives_no_reuse(
    tmp_path: Path, reuses: bool
) -> None:
    """No reuse: the banner says so and the store is off (no parking); reuse: it stays on."""
    fake = FakeLlama(save_dir=tmp_path, restore_reuses=reuses)
    with fake_engine_over_http(fake) as engine, server_with_store(engine, tmp_path) as (url, ended):
        table = httpx.get(f"{url}/agentkv/slots", timeout=10).json()
    assert ended.returncode == 0, ended.stderr
    block = ended.stderr
    if reuses:
        assert table["store"] is not None
        assert f"store    {tmp_path}" in block
        assert "prefix store off" not in block
    else:
        assert table["store"] is None
        assert "store    off" in block
        assert "warning: prefix store off: restoring a saved slot gives no reuse" in block
        assert "1600 tokens saved, 1600 restored, 0 reused by the next request" in block
