"""Launching and opening a pool of llama-servers (``agentkv-server --engines N``, or
``--upstream`` given more than once); :func:`agentkv.runtime.assemble.open_engine` uses it.

:func:`pool_layout` decides how ``N`` launched engines share the machine: on the CPU they split
the threads (``--threads``, else every core) and the KV budget; with at least ``N`` GPUs each
engine gets its own (``--device``) and that device's room for the KV cache. Each engine saves
its slots into its own directory, ``engine-<i>`` inside the store directory; the store's files
stay in the store directory (see :mod:`agentkv.runtime.pool`).

:func:`open_engines` makes the one client the runtime talks to: the engine's own client, or an
:class:`~agentkv.runtime.pool.EnginePool` over all of them, each engine's slot count read from
its ``/slots``. A pool whose engines say (``/props``) that they run different models, contexts
or builds is refused.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePath
from typing import Any, Protocol

import anyio
import attrs

from agentkv.exceptions import AgentKVError, EngineResponseError
from agentkv.runtime.build import DEVICE_MARGIN, Device, Offload
from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.engine import EngineConfig, LlamaServerProcess
from agentkv.runtime.pool import EnginePool
from agentkv.runtime.status import EngineStatus

__all__ = ["PoolLayout", "check_alike", "open_engines", "pool_layout", "start_all"]

log = logging.getLogger("agentkv.pool")


@attrs.frozen
class PoolLayout:
    """How the launched engines share the machine."""

    engines: int
    #: ``-t`` of each engine (None: llama-server's default).
    threads: int | None
    #: The KV memory each engine may take.
    kv_budget: int
    #: The device of each engine (empty: not one each).
    devices: tuple[Device, ...] = ()

    def configs(self, config: EngineConfig) -> list[EngineConfig]:
        """Engine ``config`` once per engine: its own slot directory (inside the store's) and
        device; one engine is ``config`` unchanged."""
        if self.engines == 1:
            return [config]
        out = []
        for i in range(self.engines):
            extra: tuple[str, ...] = ("--device", self.devices[i].name) if self.devices else ()
            slot_dir = (
                None if config.slot_save_dir is None else config.slot_save_dir / f"engine-{i}"
            )
            args = (*config.extra_args, *extra)
            # A port given (--engine-port) is the first engine's; the others take the next ones.
            port = config.port + i if config.port else 0
            # attrs' plugin and a tuple converter (as in agentkv_bench.restore_reuse).
            out.append(attrs.evolve(config, slot_save_dir=slot_dir, extra_args=args, port=port))  # type: ignore[arg-type]
        return out

    def describe(self) -> str:
        where = (
            ", ".join(d.name for d in self.devices)
            if self.devices
            else f"the CPU, {self.threads} thread{'' if self.threads == 1 else 's'} each"
            if self.threads
            else "the CPU"
        )
        return f"{self.engines} engines on {where}, {self.kv_budget / (1 << 30):.1f} GiB KV each"


def pool_layout(
    engines: int,
    offload: Offload,
    *,
    model_bytes: int,
    kv_budget: int,
    threads: int | None,
    cpus: int | None = None,
) -> PoolLayout:
    """Split the machine between ``engines`` llama-servers (see the module docstring).

    ``kv_budget`` is the KV memory of the whole pool (``--kv-budget``, or the default), split
    between the engines; ``threads`` the ``--threads`` given, also for the whole pool.
    """
    if engines <= 1:
        return PoolLayout(1, threads, kv_budget)
    devices = offload.devices if offload.gpu_layers > 0 else ()
    if len(devices) >= engines:
        # One GPU each: a copy of the model on each, and its KV cache within that room.
        used = tuple(devices[:engines])
        room = min(d.free for d in used) - model_bytes - DEVICE_MARGIN
        return PoolLayout(engines, threads, max(0, min(room, kv_budget // engines)), used)
    total = threads if threads is not None else (cpus or os.cpu_count() or 1)
    return PoolLayout(engines, max(1, total // engines), kv_budget // engines)


async def start_all(processes: Sequence[LlamaServerProcess]) -> None:
    """Start the engines side by side (their model loads overlap); the first failure is raised
    as it is (the caller stops every process, started or not)."""
    try:
        async with anyio.create_task_group() as tg:
            for process in processes:
                tg.start_soon(process.start)
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


class _MemberLike(Protocol):
    @property
    def base_url(self) -> str: ...
    @property
    def api_key(self) -> str | None: ...
    @property
    def status(self) -> EngineStatus | None: ...
    @property
    def slot_dir(self) -> Path | None: ...


async def _slot_count(client: LlamaSlotClient, expected: int) -> int:
    try:
        table = await client.slots()
    except AgentKVError as exc:
        log.warning(
            "could not read %s/slots (%s); assuming %d slots", client.base_url, exc, expected
        )
        return expected
    return len(table) or expected


def _shape(props: Mapping[str, Any]) -> tuple[str, Any, Any]:
    """What two engines of a pool must agree on, from ``/props``: the model file's name, the
    context per slot and the build."""
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, Mapping) else None
    return PurePath(str(props.get("model_path") or "")).name, n_ctx, props.get("build_info")


async def check_alike(clients: Sequence[LlamaSlotClient]) -> None:
    """Refuse a pool whose engines run different models, contexts or builds (as their
    ``/props`` say): a state saved on one would be restored on another that cannot use it. An
    engine too old to answer ``/props`` is not compared."""
    shapes = []
    for client in clients:
        try:
            shapes.append((client.base_url, _shape(await client.props())))
        except EngineResponseError:
            continue
    if len({shape for _, shape in shapes}) > 1:
        listed = "; ".join(
            f"{url}: model {name or '?'}, n_ctx {n_ctx}, build {build}"
            for url, (name, n_ctx, build) in shapes
        )
        raise AgentKVError(
            f"the engines of a pool must run one model with the same settings, but {listed}"
        )


async def open_engines(
    members: Sequence[_MemberLike],
    *,
    slots: int,
    store_dir: Path | None,
    timeout: float,  # noqa: ASYNC109 - how long the engines may take to load
    **client_settings: Any,
) -> LlamaSlotClient | EnginePool:
    """The client for one engine, or a pool over several; every engine has loaded its model."""
    clients = [
        LlamaSlotClient(m.base_url, api_key=m.api_key, status=m.status, **client_settings)
        for m in members
    ]
    if len(clients) == 1:
        return clients[0]
    try:
        for client in clients:
            await client.wait_ready(timeout)
        await check_alike(clients)
        counts = [await _slot_count(client, slots) for client in clients]
    except BaseException:
        for client in clients:
            await client.aclose()
        raise
    return EnginePool(
        clients,
        slots=counts,
        slot_dirs=[m.slot_dir for m in members],
        store_dir=store_dir,
    )
