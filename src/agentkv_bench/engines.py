"""The configurations under test, each a running server: llama-server alone, or agentkv in front.

- ``plain``: llama-server with its own defaults (``-m -np -c --metrics``), driven through its own
  ``/v1/messages``;
- ``tuned``: the same plus :data:`TUNED_ARGS`;
- ``agentkv``: agentkv's own launch of llama-server (``EngineConfig``/``LlamaServerProcess``) and
  its Starlette app, served by uvicorn on loopback.

Every configuration is a fresh llama-server process, so every in-memory cache starts cold; a
prefix store directory (agentkv's only) is the one thing that may outlive a restart.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import uvicorn

from agentkv import LlamaSlotClient
from agentkv.runtime.build import build_digest
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.engine import EngineConfig, LlamaServerProcess, free_port
from agentkv.runtime.lifecycle import Runtime
from agentkv_server.app import create_app

__all__ = [
    "LABELS",
    "TUNED_ARGS",
    "Engine",
    "EngineSetup",
    "agentkv_engine",
    "llama_server_args",
    "raw_llama_server",
    "serve_app",
    "start",
]

#: The hand-tuned flags of the ``tuned`` configuration; see docs/benchmarks.md for how they were
#: chosen. -sps 0: no similarity-based slot choice (it thrashes with many agents); --cache-ram:
#: keep evicted prompts in host RAM and restore them (explicitly sized; the default is 8 GiB).
TUNED_ARGS: tuple[str, ...] = ("-sps", "0", "--cache-ram", "4096")

LABELS = {
    "plain": "llama-server (defaults)",
    "tuned": "llama-server (tuned)",
    "agentkv": "agentkv + llama-server",
    "agentkv-notree": "agentkv, agent tree off",
    "agentkv-warm": "agentkv, warm store",
}


@attrs.frozen
class EngineSetup:
    """What every configuration of one run shares: binary, model, slots, context per slot."""

    binary: Path
    model: Path
    slots: int
    ctx: int
    log_dir: Path
    tuned_args: tuple[str, ...] = TUNED_ARGS


@attrs.frozen
class Engine:
    """A running configuration: ``url`` takes ``/v1/messages``; ``engine_url`` is llama-server
    (for ``/metrics``). ``runtime`` is agentkv's, when it is in front."""

    name: str
    url: str
    engine_url: str
    flags: str
    runtime: Runtime | None = None


def llama_server_args(setup: EngineSetup, name: str) -> list[str]:
    """The command line (without the binary and port) of the ``plain`` or ``tuned`` server."""
    base = ["-m", str(setup.model), "-np", str(setup.slots), "-c", str(setup.slots * setup.ctx)]
    base.append("--metrics")
    return base + (list(setup.tuned_args) if name == "tuned" else [])


@contextlib.asynccontextmanager
async def raw_llama_server(
    binary: Path, args: Sequence[str], log_path: Path, *, startup_timeout: float = 300.0
) -> AsyncIterator[str]:
    """llama-server started with exactly ``args`` (plus a free port, no key); yields its URL."""
    process = LlamaServerProcess.with_args(
        args,
        binary=binary,
        log_dir=log_path.parent,
        log_name=log_path.name,
        startup_timeout=startup_timeout,
    )
    async with process:
        yield process.base_url


@contextlib.asynccontextmanager
async def serve_app(app: Any) -> AsyncIterator[str]:
    """Serve an ASGI 3 app with uvicorn on a free loopback port, in this event loop."""
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", interface="asgi3"
    )
    server = uvicorn.Server(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        # uvicorn exposes readiness only as a flag.
        while not server.started:  # noqa: ASYNC110
            await anyio.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True


def _compat(setup: EngineSetup) -> str:
    """What the prefix store's entries are bound to (same model file, build and context)."""
    model = setup.model.stat()
    return (
        f"model={setup.model.name}:{model.st_size}:{model.st_mtime_ns}|"
        f"build={build_digest(setup.binary)}|ctx={setup.ctx}|kv=f16"
    )


@contextlib.asynccontextmanager
async def agentkv_engine(
    setup: EngineSetup,
    *,
    store_dir: Path | None,
    preempt_from: int | None = None,
    name: str = "agentkv",
    agent_tree: bool = True,
) -> AsyncIterator[Engine]:
    """agentkv's own launch of llama-server plus its gateway. ``store_dir`` is the prefix store
    (llama-server's ``--slot-save-path``); None runs without one. ``agent_tree`` False: a
    sub-agent is its session's agent (``--no-agent-tree``)."""
    config = EngineConfig(
        model=setup.model,
        slots=setup.slots,
        ctx_per_slot=setup.ctx,
        port=0,
        slot_save_dir=store_dir,
    )
    # No engine key: the benchmark reads /metrics and tokenizes on the engine directly.
    process = LlamaServerProcess(config, binary=setup.binary, log_dir=setup.log_dir, api_key=None)
    async with process as engine:
        client = LlamaSlotClient(engine.base_url)
        try:
            runtime_config = RuntimeConfig(
                n_slots=setup.slots,
                ctx_per_slot=config.effective_ctx_per_slot,
                store_dir=store_dir,
                preempt_from=preempt_from,
                agent_tree=agent_tree,
                # As Claude Code is run here (API_TIMEOUT_MS=1800000): a cold prefill takes minutes.
                client_timeout=1800.0,
            )
            compat = await anyio.to_thread.run_sync(_compat, setup)
            runtime = Runtime(client, runtime_config, store_compat=compat)
            async with serve_app(create_app(runtime)) as url:
                flags = f"agentkv (store {'on' if store_dir else 'off'}"
                flags += f", preempt-from {preempt_from}" if preempt_from is not None else ""
                flags += ")" if agent_tree else ", no agent tree)"
                yield Engine(name, url, engine.base_url, flags, runtime)
        finally:
            with anyio.CancelScope(shield=True):
                await client.aclose()


@contextlib.asynccontextmanager
async def start(
    setup: EngineSetup,
    name: str,
    *,
    store_dir: Path | None = None,
    preempt_from: int | None = None,
    agent_tree: bool = True,
) -> AsyncIterator[Engine]:
    """Start configuration ``name`` (``plain``, ``tuned``, or ``agentkv``-anything)."""
    if name.startswith("agentkv"):
        async with agentkv_engine(
            setup, store_dir=store_dir, preempt_from=preempt_from, name=name, agent_tree=agent_tree
        ) as engine:
            yield engine
        return
    if name not in ("plain", "tuned"):
        raise ValueError(f"unknown configuration {name!r}")
    args = llama_server_args(setup, name)
    log_path = setup.log_dir / f"llama-server-{name}.log"
    async with raw_llama_server(setup.binary, args, log_path) as url:
        yield Engine(name, url, url, " ".join(args[2:]))
