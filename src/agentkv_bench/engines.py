"""The configurations under test, each a running server: llama-server alone, or agentkv in front.

- ``plain``: llama-server with its own defaults (``-m -np -c --metrics``), driven through its own
  ``/v1/messages``; ``tuned``: the same plus :data:`TUNED_ARGS`;
- ``agentkv``: agentkv as ``agentkv-server`` builds it (:func:`agentkv_engine`), its app served by
  uvicorn on loopback.

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

from agentkv.runtime.assemble import EngineSettings, assemble
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.engine import LlamaServerProcess, free_port
from agentkv.runtime.lifecycle import Runtime
from agentkv_server.app import create_app

__all__ = [
    "LABELS",
    "NO_PREEMPTION",
    "REPLAYED",
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

#: agentkv's defaults but pre-emption off (the default is ``--preempt-from 1``), unless a scenario
#: asks for it: a suspended request is sent to llama-server again when it resumes, so llama-server
#: would count more prompt tokens than the workload's prompts hold.
NO_PREEMPTION = RuntimeConfig(preempt_from=None)
#: For clients the harness replays, also no prepared compaction (the default is on): a replayed
#: request never comes back as the compaction a real Claude Code would send next, so every
#: preparation would be background work the real client would not cause. The real-CLI scenarios
#: keep it on.
REPLAYED = RuntimeConfig(preempt_from=None, prepare_compaction=False)

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
    (for ``/metrics``), ``engine_key`` its API key (agentkv launches it with one; None: none).
    ``runtime`` is agentkv's, when it is in front."""

    name: str
    url: str
    engine_url: str
    flags: str
    runtime: Runtime | None = None
    engine_key: str | None = None


def llama_server_args(setup: EngineSetup, name: str) -> list[str]:
    """The command line (without the binary and port) of the ``plain`` or ``tuned`` server."""
    base = ["-m", str(setup.model), "-np", str(setup.slots), "-c", str(setup.slots * setup.ctx)]
    return [*base, "--metrics", *(setup.tuned_args if name == "tuned" else ())]


@contextlib.asynccontextmanager
async def raw_llama_server(binary: Path, args: Sequence[str], log_path: Path) -> AsyncIterator[str]:
    """llama-server started with exactly ``args`` (plus a free port, no key); yields its URL."""
    process = LlamaServerProcess.with_args(
        args,
        binary=binary,
        log_dir=log_path.parent,
        log_name=log_path.name,
        startup_timeout=300.0,
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


@contextlib.asynccontextmanager
async def agentkv_engine(
    setup: EngineSetup,
    *,
    store_dir: Path | None,
    config: RuntimeConfig = REPLAYED,
    name: str = "agentkv",
) -> AsyncIterator[Engine]:
    """agentkv as ``agentkv-server`` builds it: :func:`assemble` with the defaults, given only
    the binary, model, slots, context per slot and ``store_dir`` (the prefix store; None runs
    without one, ``--no-store``), and its app in front. ``config``: the runtime settings, which
    name every default they change (``RuntimeConfig()``: agentkv's defaults)."""
    settings = EngineSettings(
        llama_server=str(setup.binary),
        model=setup.model,
        slots=setup.slots,
        ctx_per_slot=setup.ctx,
        store_dir=store_dir,
        store=store_dir is not None,
    )
    async with assemble(settings, config) as built:
        runtime = built.runtime
        async with serve_app(create_app(runtime)) as url:
            yield Engine(
                name, url, built.engine.base_url, _flags(runtime), runtime, built.engine.api_key
            )


def _flags(runtime: Runtime) -> str:
    """What the report says of an agentkv configuration: its store and pre-emption, and the
    agent tree when it is off."""
    config = runtime.config
    preempt = "off" if config.preempt_from is None else config.preempt_from
    flags = f"agentkv (store {'on' if config.store_dir else 'off'}, preempt-from {preempt}"
    return flags + (")" if config.agent_tree else ", no agent tree)")


@contextlib.asynccontextmanager
async def start(
    setup: EngineSetup,
    name: str,
    *,
    store_dir: Path | None = None,
    config: RuntimeConfig = REPLAYED,
) -> AsyncIterator[Engine]:
    """Start configuration ``name`` (``plain``, ``tuned``, or ``agentkv``-anything, whose
    ``config`` changes agentkv's defaults; see :func:`agentkv_engine`)."""
    if name.startswith("agentkv"):
        async with agentkv_engine(setup, store_dir=store_dir, config=config, name=name) as engine:
            yield engine
        return
    if name not in ("plain", "tuned"):
        raise ValueError(f"unknown configuration {name!r}")
    args = llama_server_args(setup, name)
    log_path = setup.log_dir / f"llama-server-{name}.log"
    async with raw_llama_server(setup.binary, args, log_path) as url:
        yield Engine(name, url, url, " ".join(args[2:]))
