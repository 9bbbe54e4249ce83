"""agentkv-server's launch on the real llama-server with the default model, behind a stand-in
for a GPU build: all layers offloaded, the device named, the store key naming the build, and the
startup check that a restore gives reuse (it does on the default model)."""

from __future__ import annotations

import json
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentkv.runtime.assemble import EngineHandle, EngineSettings, check_store, open_engine
from agentkv.runtime.build import ALL_LAYERS, engine_files
from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.store import PROBE_FILE
from agentkv_server import cli
from tests._engine_fixture import locate_engine

pytestmark = [pytest.mark.engine, pytest.mark.anyio]

#: What a CUDA build prints for --list-devices; the real (CPU) binary does the rest, and ignores
#: -ngl with a warning.
WRAPPER = """#!/bin/sh
if [ "$1" = "--list-devices" ]; then
  printf 'Available devices:\\n  CUDA0: Stand-in GPU (16384 MiB, 15360 MiB free)\\n'
  exit 0
fi
exec {binary} "$@"
"""


@pytest.fixture(scope="module")
async def launched(
    anyio_backend: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[EngineHandle, Path]]:
    """The engine as agentkv-server launches it through the stand-in, caches under tmp."""
    binary, model = locate_engine()
    root = tmp_path_factory.mktemp("gpu")
    wrapper = root / "llama-server"
    wrapper.write_text(WRAPPER.format(binary=binary))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AGENTKV_CACHE_DIR", str(root / "cache"))
        args = cli.build_parser().parse_args(
            [
                "--model", str(model),
                "--llama-server", str(wrapper),
                "--slots", "2",
                "--ctx-per-slot", "4096",
                "--store-dir", str(root / "store"),
            ]
        )  # fmt: skip
        async with open_engine(cli._from_args(EngineSettings, args)) as engine:
            yield engine, binary


async def test_a_gpu_build_gets_every_layer_and_the_banner_names_the_device(
    launched: tuple[EngineHandle, Path],
) -> None:
    engine, _ = launched
    assert engine.device == "CUDA0 Stand-in GPU (15.0 GiB free): all layers offloaded"
    assert engine.warnings == ()
    assert engine.supervisor is not None
    command = engine.supervisor.process._command
    assert command[command.index("-ngl") + 1] == str(ALL_LAYERS)


async def test_the_store_key_names_the_build(launched: tuple[EngineHandle, Path]) -> None:
    """The key holds the build's digest, not the executable's size and time, and what lays out a
    saved state (KV type, flash attention); on the installed engine the digest covers its
    llama.cpp libraries, found beside the executable."""
    engine, binary = launched
    parts = dict(part.split("=", 1) for part in engine.compat.split("|"))
    assert set(parts) == {"model", "build", "ctx", "kv", "fa"}
    assert parts["fa"] == "auto"  # the stand-in GPU: llama-server's own choice
    assert len(parts["build"]) == 64
    names = [path.name for path in engine_files(binary)]
    assert any(name.startswith("libllama") for name in names), names
    assert any(name.startswith("libggml") for name in names), names


async def test_the_startup_probe_finds_the_store_works_on_the_default_model(
    launched: tuple[EngineHandle, Path],
) -> None:
    """Save, erase, restore, extend: every token comes back and the next request reuses them."""
    engine, _ = launched
    assert engine.probe_tokens == 64  # the default model has no sliding window
    assert engine.api_key is not None
    async with LlamaSlotClient(engine.base_url, api_key=engine.api_key) as client:
        store, note = await check_store(client, engine, engine.ctx_per_slot)
    assert store == engine.store_dir and note is None
    assert engine.store_dir is not None
    record = json.loads((engine.store_dir / PROBE_FILE).read_text())
    assert record["compat"] == engine.compat
    assert record["tokens"] == record["restored"] == 64
    assert record["reused"] >= 63
