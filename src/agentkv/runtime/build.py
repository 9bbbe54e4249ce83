"""What a llama-server binary is: its build, named by content, and the devices it can use.

:func:`build_digest` names the engine's build by the content of the executable and of the
llama.cpp libraries it loads (``libllama``, ``libggml*``, ``libmtmd``): the executable of a
shared build is a small launcher, and the engine lives in those libraries. Two installs of one
build (two virtual environments, a reinstall, another host) get the same digest; a rebuilt
library behind an unchanged executable gets another. Each file is hashed once; the hashes are
kept in ``build-hashes.json`` in the cache directory (owner-only), keyed by path, size and
modification time.

:func:`list_devices` asks the binary which devices it can offload to (``llama-server
--list-devices``), and :func:`plan_offload` decides from that whether agentkv offloads every
layer and how much device memory the KV cache may take.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

from agentkv.runtime.model import default_cache_dir, sha256_of, write_atomic

__all__ = [
    "ALL_LAYERS",
    "DEVICE_MARGIN",
    "Device",
    "Offload",
    "build_digest",
    "choose_offload",
    "engine_files",
    "file_digest",
    "gpu_on_machine",
    "list_devices",
    "parse_device_list",
    "plan_offload",
    "run_captured",
]

_CACHE_FILE = "build-hashes.json"
#: The llama.cpp libraries that make up the engine (what ldd lists, or what lies beside it).
_ENGINE_LIBRARY = re.compile(r"^lib(llama|ggml|mtmd)[\w.+-]*\.(so(\.[0-9]+)*|dylib|dll)$")


def run_captured(args: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str] | None:
    """``args`` run to their end with their output captured as text (no input); None when
    they could not be run or took longer than ``timeout`` seconds."""
    try:
        return subprocess.run(
            args,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


# -- the build, by content ------------------------------------------------------------------


def _linked_libraries(binary: Path) -> list[Path]:
    """The shared libraries the dynamic loader resolves for ``binary`` (``ldd``); [] where
    there is no ``ldd`` or it cannot tell (a static binary, macOS)."""
    ldd = shutil.which("ldd")
    done = None if ldd is None else run_captured([ldd, str(binary)], 30)
    if done is None:
        return []
    found: list[Path] = []
    for line in done.stdout.splitlines():
        # "\tlibllama.so.0 => /venv/.../bin/libllama.so.0 (0x00007f...)"
        match = re.match(r"\s*(\S+)\s+=>\s+(/\S+)", line)
        if match and _ENGINE_LIBRARY.match(match.group(1)):
            found.append(Path(match.group(2)))
    return found


def _beside(binary: Path) -> list[Path]:
    """llama.cpp libraries next to ``binary`` or in a ``lib`` folder beside its folder: a
    backend built to be loaded at run time (``GGML_BACKEND_DL``) is found there, not by ldd."""
    found: list[Path] = []
    folder = binary.parent
    for directory in (folder, folder.parent / "lib", folder.parent / "lib64"):
        with contextlib.suppress(OSError):
            found += [
                path
                for path in directory.iterdir()
                if _ENGINE_LIBRARY.match(path.name) and path.is_file()
            ]
    return found


def engine_files(binary: Path) -> list[Path]:
    """The executable and the llama.cpp libraries it loads, each once (symlinks resolved),
    the executable first and the libraries by name.

    The libraries are those ldd resolves, plus the ggml backends beside the executable (loaded
    at run time); without ldd's answer, every llama.cpp library beside it (a wheel also ships
    the libraries of its other tools, which then count too)."""
    executable = Path(binary).resolve()
    linked = _linked_libraries(executable)
    beside = _beside(executable)
    if linked:
        beside = [path for path in beside if path.name.startswith("libggml")]
    libraries: dict[Path, None] = {}
    for path in [*linked, *beside]:
        with contextlib.suppress(OSError):
            libraries.setdefault(path.resolve(strict=True))
    libraries.pop(executable, None)
    return [executable, *sorted(libraries, key=lambda p: (p.name, str(p)))]


def _stat_key(path: Path) -> str | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return f"{path}|{stat.st_size}|{stat.st_mtime_ns}"


def _read_cache(cache: Path) -> dict[str, str]:
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    items = data.items() if isinstance(data, dict) else ()
    return {k: v for k, v in items if isinstance(k, str) and isinstance(v, str)}


def _file_hashes(files: Iterable[Path], cache_dir: Path) -> list[str]:
    cache = cache_dir / _CACHE_FILE
    known = _read_cache(cache)
    hashes: list[str] = []
    changed = False
    for path in files:
        key = _stat_key(path)
        value = known.get(key) if key is not None else None
        if value is None:
            value = sha256_of(path)
            if key is not None:
                known[key] = value
                changed = True
        hashes.append(value)
    if changed:
        # Keep only files that are still there as they were: a rebuild leaves no stale line.
        kept = {
            key: value
            for key, value in known.items()
            if _stat_key(Path(key.rsplit("|", 2)[0])) == key
        }
        with contextlib.suppress(OSError):
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(cache, json.dumps(kept, indent=1, sort_keys=True).encode())
    return hashes


def file_digest(path: Path, *, cache_dir: Path | None = None) -> str:
    """sha256 of the file at ``path`` (a model), cached as the build's files are."""
    return _file_hashes([path.resolve()], cache_dir or default_cache_dir())[0]


def build_digest(binary: Path, *, cache_dir: Path | None = None) -> str:
    """sha256 naming the engine build of ``binary``: the content of the executable and of the
    llama.cpp libraries it loads, by library name (paths and timestamps do not count)."""
    files = engine_files(binary)
    hashes = _file_hashes(files, cache_dir or default_cache_dir())
    lines = [f"executable {hashes[0]}"]
    lines += [f"{path.name} {value}" for path, value in zip(files[1:], hashes[1:], strict=True)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


# -- devices --------------------------------------------------------------------------------

#: ``-ngl`` for "every layer": llama-server caps it at the model's layer count. A number, not
#: ``all``, because older builds parse ``-ngl`` as an integer only.
ALL_LAYERS = 999
_MIB = 1 << 20
#: Device memory left free besides weights and KV cache, for compute buffers (llama.cpp's own
#: ``--fit`` keeps the same margin per device).
DEVICE_MARGIN = 1 << 30


@attrs.frozen
class Device:
    """One device llama-server can offload to, as ``--list-devices`` reports it."""

    name: str
    description: str
    total: int
    free: int

    def describe(self) -> str:
        return f"{self.name} {self.description} ({self.free / (1 << 30):.1f} GiB free)"


#: ``  CUDA0: NVIDIA H200 (143156 MiB, 142523 MiB free)``, as llama.cpp's
#: ``common_print_available_devices`` writes each non-CPU device.
_DEVICE_LINE = re.compile(
    r"^\s+(?P<name>[^\s:]+): (?P<desc>.*) \((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$"
)


def parse_device_list(text: str) -> tuple[Device, ...] | None:
    """The devices in ``llama-server --list-devices`` output; None when ``text`` is not such a
    list (an older build without the option). Devices without memory of their own (BLAS and
    other accelerators that compute in host memory) are left out: nothing is offloaded to them.
    """
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Available devices:")
    except StopIteration:
        return None
    devices = []
    for line in lines[start + 1 :]:
        match = _DEVICE_LINE.match(line)
        if match is None:
            continue
        total = int(match.group("total")) * _MIB
        if total > 0:
            free = int(match.group("free")) * _MIB
            devices.append(Device(match.group("name"), match.group("desc"), total, free))
    return tuple(devices)


def list_devices(binary: Path, *, timeout: float = 60.0) -> tuple[Device, ...] | None:
    """The devices ``binary`` can offload to (empty for a CPU-only build); None when it cannot
    say (it failed, or has no ``--list-devices``)."""
    done = run_captured([str(binary), "--list-devices"], timeout)
    if done is None or done.returncode != 0:
        return None
    return parse_device_list(done.stdout + "\n" + done.stderr)


def gpu_on_machine(dev: Path = Path("/dev")) -> str | None:
    """A GPU this machine has, in words (``nvidia-smi -L``'s first line, or the device file);
    None when none is seen."""
    smi = shutil.which("nvidia-smi")
    done = None if smi is None else run_captured([smi, "-L"], 15)
    first = done.stdout.strip().splitlines()[:1] if done is not None else []
    if done is not None and done.returncode == 0 and first:
        return first[0]
    for name, words in (("nvidia0", "an NVIDIA GPU"), ("kfd", "an AMD GPU")):
        if (dev / name).exists():
            return f"{words} ({dev / name})"
    return None


@attrs.frozen
class Offload:
    """Where the model runs: ``gpu_layers`` for ``-ngl``, the KV budget the device allows
    (None: size it from host memory), the devices used, and a warning for the banner."""

    gpu_layers: int
    kv_budget: int | None = None
    devices: tuple[Device, ...] = ()
    warning: str | None = None

    def describe(self) -> str:
        """The banner's ``device`` row."""
        if not self.devices or self.gpu_layers == 0:
            return "CPU"
        layers = "all layers" if self.gpu_layers >= ALL_LAYERS else f"{self.gpu_layers} layers"
        return f"{', '.join(d.describe() for d in self.devices)}: {layers} offloaded"


def plan_offload(
    devices: Sequence[Device] | None,
    *,
    model_bytes: int,
    min_kv_bytes: int,
    requested: int | None = None,
    gpu_seen: str | None = None,
) -> Offload:
    """Where to run a model of ``model_bytes``: on the GPU when the build has one with room for
    the weights, :data:`DEVICE_MARGIN` and ``min_kv_bytes`` of KV cache; on the CPU otherwise.

    ``requested`` (``--gpu-layers``) wins; with a device, the KV budget is still its free
    memory less the weights. ``gpu_seen`` is :func:`gpu_on_machine`: a GPU the binary cannot
    use gets a warning.
    """
    usable = tuple(devices or ())
    room = sum(d.free for d in usable) - model_bytes - DEVICE_MARGIN
    if not usable:
        warning = None
        if gpu_seen is not None and devices is not None:
            warning = (
                f"this machine has a GPU ({gpu_seen}) but llama-server has no GPU backend: the "
                "model runs on the CPU. Install a GPU build (see docs/engine.md) or pass "
                "--llama-server PATH"
            )
        return Offload(requested or 0, warning=warning)
    if requested is not None:
        budget = max(room, 0) if requested > 0 else None
        return Offload(requested, budget, usable if requested > 0 else ())
    if room < min_kv_bytes:
        free = sum(d.free for d in usable)
        return Offload(
            0,
            warning=(
                f"the model ({model_bytes / (1 << 30):.1f} GiB) does not fit in the free memory "
                f"of {', '.join(d.name for d in usable)} ({free / (1 << 30):.1f} GiB) with its "
                "KV cache: it runs on the CPU; pass --gpu-layers N to offload part of it"
            ),
        )
    return Offload(ALL_LAYERS, room, usable)


def choose_offload(
    binary: Path, *, model_bytes: int, min_kv_bytes: int, requested: int | None = None
) -> Offload:
    """:func:`plan_offload` for ``binary`` on this machine: asks it for its devices (unless
    ``requested`` is 0, the CPU by choice) and looks for a GPU it cannot use."""
    if requested == 0:
        return Offload(0)
    devices = list_devices(binary)
    gpu_seen = gpu_on_machine() if not devices else None
    return plan_offload(
        devices,
        model_bytes=model_bytes,
        min_kv_bytes=min_kv_bytes,
        requested=requested,
        gpu_seen=gpu_seen,
    )
