"""A real llama-server with the default model, shared by every engine-backed test.

Import the fixtures into a conftest
(``from tests._engine_fixture import anyio_backend, engine``); the
``engine`` fixture is module-scoped, so the server starts once per test module. When no
llama-server or no default model is installed the fixture skips, except under ``CI`` where it
fails, so a broken engine install cannot pass CI silently.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.engine import (
    EngineConfig,
    EngineNotFoundError,
    LlamaServerProcess,
    find_llama_server,
)
from agentkv.runtime.model import ModelNotFoundError, default_model_path

ENGINE_SLOTS = 2
ENGINE_CTX_PER_SLOT = 4096


class Engine(NamedTuple):
    """The running server, a client for it, and its URL."""

    process: LlamaServerProcess
    client: LlamaSlotClient
    base_url: str


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """One asyncio loop per module: the module-scoped server and client live in it, and it is closed
    afterwards, so later tests can start event loops of their own."""
    return "asyncio"


def locate_engine() -> tuple[Path, Path]:
    try:
        return find_llama_server(), default_model_path()
    except (EngineNotFoundError, ModelNotFoundError) as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the engine tests need llama-server and the default model: {exc}")
        pytest.skip(f"no engine: {exc}")


def engine_config(model: Path, root: Path, **overrides: Any) -> EngineConfig:
    """The test engine: 2 slots of 4096 tokens, a free port, slot saving under ``root``."""
    return EngineConfig(
        model=model,
        slots=ENGINE_SLOTS,
        ctx_per_slot=ENGINE_CTX_PER_SLOT,
        port=0,
        slot_save_dir=root / "slots",
        **overrides,
    )


@pytest.fixture(scope="module")
async def engine(
    anyio_backend: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Engine]:
    """llama-server with the default model: 2 slots of 4096 tokens, a free port, slot saving on."""
    binary, model = locate_engine()
    root = tmp_path_factory.mktemp("engine")
    # No host-RAM prompt cache: the tests observe what each slot's own KV cache holds.
    config = engine_config(model, root, cache_ram_mib=0)
    async with LlamaServerProcess(
        config, binary=binary, log_dir=root / "logs", startup_timeout=300
    ) as process:
        client = process.client(read_timeout=120)
        try:
            yield Engine(process, client, process.base_url)
        finally:
            await client.aclose()
