"""An index written under the old store key (the executable's size and time) is refused and its
files deleted the first time agentkv starts with the key that names the build."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.store import PrefixStore
from agentkv.store import StoreIndex
from tests.fakes import FakeLlama, write_state

pytestmark = pytest.mark.anyio

OLD = "model=abc|binary=llama-server:17944:1796102360649711793|ctx=4096|kv=f16"
NEW = "model=abc|build=" + "0" * 64 + "|ctx=4096|kv=f16"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_entries_under_the_old_key_are_deleted(tmp_path: Path) -> None:
    tokens = list(range(100))
    write_state(tmp_path / "akv-prefix-1.bin", tokens)
    record = {
        "id": "akv-prefix-1",
        "kind": "prefix",
        "tokens": len(tokens),
        "nbytes": 1000,
        "created": 0.0,
        "last_used": 0.0,
    }
    (tmp_path / "index.json").write_text(
        json.dumps({"version": 1, "compat": OLD, "entries": [record]})
    )
    fake = FakeLlama(save_dir=tmp_path)
    async with httpx.AsyncClient(transport=fake.transport(), base_url="http://e") as http:
        client = LlamaSlotClient("http://e", http=http, connect_retries=0)
        store = PrefixStore(tmp_path, client, StoreIndex(budget=1 << 30, compat=NEW))
        refused = await store.open()
    assert refused == ["akv-prefix-1"]
    assert not list(tmp_path.glob("akv-*.bin"))
    assert json.loads((tmp_path / "index.json").read_text()) == {
        "version": 1,
        "compat": NEW,
        "entries": [],
    }
