"""``agentkv-server``: the Anthropic-compatible gateway in front of llama-server.

The options of the ``server``, ``scheduling``, ``streaming``, ``prompts``, ``long contexts`` and
``prefix store`` groups are generated from the fields of :class:`ServerConfig` and
:class:`RuntimeConfig` (their help text, defaults and types), so the command line, the config
classes and the documentation table (``options_markdown``) say the same thing.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import anyio
import attrs
import uvicorn

from agentkv import AgentKVError
from agentkv.forecast import compaction_point
from agentkv.runtime.adapters import engine_name
from agentkv.runtime.assemble import EngineSettings, assemble
from agentkv.runtime.config import RuntimeConfig
from agentkv_server import logs, status, store_cmd
from agentkv_server.app import create_app
from agentkv_server.config import ServerConfig
from agentkv_server.limits import BodyTimeoutMiddleware, h11_with_header_timeout

__all__ = [
    "build_parser",
    "claude_code_compacts_at",
    "claude_code_env",
    "fields_markdown",
    "main",
    "options_markdown",
]

log = logging.getLogger("agentkv.server")

_CONFIGS: tuple[type[Any], ...] = (EngineSettings, ServerConfig, RuntimeConfig)
#: The option groups of ``--help``, in order; all but "connections" are generated.
_GROUPS = (
    "engine",
    "connections",
    "server",
    "scheduling",
    "streaming",
    "prompts",
    "long contexts",
    "prefix store",
)


# -- options generated from the config classes -------------------------------------------------


def _base_type(annotation: Any) -> Any:
    """``int`` for ``int | None``, ``Path`` for ``tuple[Path, ...]``, else the annotation."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    if _repeated(annotation):
        return get_args(annotation)[0]
    return annotation


def _repeated(annotation: Any) -> bool:
    """A ``tuple[X, ...]`` field: an option given once per value."""
    return get_origin(annotation) is tuple


def _options(cls: type[Any]) -> Iterator[tuple[attrs.Attribute[Any], str]]:
    """Each field of ``cls`` that is a command-line option, with its flag."""
    attrs.resolve_types(cls)
    for field in attrs.fields(cls):
        flag = field.metadata.get("flag")
        if flag is False or "help" not in field.metadata:
            continue
        yield field, flag or "--" + field.name.replace("_", "-")


def _worded(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` for argparse: its ValueError's own words become the usage error."""

    def parse_option(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_option


def _add_options(groups: dict[str, argparse._ArgumentGroup]) -> None:
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
            repeated = _repeated(field.type)
            # argparse appends to a copy of the default: a repeated option starts from None
            # (the field's converter makes that its empty tuple).
            default = None if repeated else field.default
            shown = "unset" if default is None else default
            parse = field.metadata.get("parse")
            group.add_argument(
                flag,
                dest=field.name,
                action="append" if repeated else "store",
                type=_worded(parse)
                if parse is not None
                else (kind if kind in (int, float, Path) else str),
                default=default,
                metavar=field.metadata.get("metavar"),
                choices=field.metadata.get("choices"),
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
            "  agentkv-server --engines 2 --slots 2   # a pool of two llama-servers\n"
            "  agentkv-server --upstream http://127.0.0.1:8000 --engine-kind vllm --slots 16\n"
            "  agentkv-server status --watch   # the slot table of a running agentkv-server\n"
            "  agentkv-server store clear [--agent ID]   # delete saved KV states\n"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    groups = {name: parser.add_argument_group(name) for name in _GROUPS}
    conn = groups["connections"]
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
    _add_options(groups)
    parser.set_defaults(api_key=os.environ.get("AGENTKV_API_KEY"))
    return parser


# -- running ------------------------------------------------------------------------------------

#: The longest reply Claude Code asks for. It also sets how early Claude Code compacts
#: (:func:`agentkv.forecast.compaction_point`, docs/claude-code.md).
CLAUDE_CODE_MAX_OUTPUT_TOKENS = 4096
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

    Claude Code does not know a local model: it gets one model id for every tier (so no helper
    asks for a model whose window it believes larger), the slot's real window (so it compacts
    before a slot overflows), a bounded reply length, and no traffic to Anthropic's services.
    ``timeout`` is the runtime's ``client_timeout``: agentkv ends every reply within it. The key
    itself is never printed (these lines end up in logs): the line reads ``$AGENTKV_API_KEY``.
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


def codex_config(
    url: str, api_key: str | None, *, model_name: str = "agentkv-local", ctx_per_slot: int | None
) -> str:
    """The lines a user puts into Codex's ``config.toml`` (and the one for its shell).

    Codex speaks only the Responses API; it reads the key from the variable ``env_key`` names and
    refuses to start without it, so the variable is set even when no key is required. It does not
    know a local model's window: ``model_context_window`` tells it the slot's, so that it compacts
    before a slot overflows.
    """
    lines = [f'model = "{model_name}"', 'model_provider = "agentkv"']
    if ctx_per_slot is not None:
        lines.append(f"model_context_window = {ctx_per_slot}")
    lines += [
        "[model_providers.agentkv]",
        'name = "agentkv"',
        f'base_url = "{url}/v1"',
        'wire_api = "responses"',
        'env_key = "AGENTKV_API_KEY"',
        "# optional, one per agent: who it is, and how urgent (0 = most urgent … 3 = background)",
        '# http_headers = { "X-Agent-Id" = "coder", "X-Agent-Priority" = "0" }',
        "",
        "# and in the shell that starts Codex:",
        "# export AGENTKV_API_KEY=<the key>"
        if api_key
        else "export AGENTKV_API_KEY=agentkv  # any value: no key is required",
    ]
    return "\n".join(lines)


def claude_code_compacts_at(ctx_per_slot: int) -> int:
    """The context size at which Claude Code (2.1.x) compacts, given the lines printed above."""
    return compaction_point(ctx_per_slot, CLAUDE_CODE_MAX_OUTPUT_TOKENS)


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
        "timeout_keep_alive": args.keep_alive_timeout,  # Claude Code reconnects freely
        # 503 at once, before the process runs out of file descriptors and stops accepting.
        "limit_concurrency": max_connections,
        # h11 even where httptools is installed, so that the header limit below holds.
        "http": h11_with_header_timeout(args.header_timeout),
        # uvicorn's default is 16 KiB; the body has its own limit (--max-body-bytes).
        "h11_max_incomplete_event_size": 64 * 1024,
        # Open streams get this long on shutdown before they are cut.
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

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets=sockets)
        # A second Ctrl-C (force_exit) makes uvicorn skip the application's shutdown: the
        # runtime would then be cancelled after its engine client closed, and the stop save
        # fail. It still stops in order here; only the wait for open connections is skipped.
        lifespan = getattr(self, "lifespan", None)
        done = getattr(lifespan, "shutdown_event", None)
        if self.force_exit and lifespan is not None and done is not None and not done.is_set():
            await lifespan.shutdown()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises a caught SIGINT/SIGTERM once it has stopped serving, which would end
        # this process before it stops the llama-server it launched: here it only asks to stop.
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
    settings: EngineSettings = _from_args(EngineSettings, args)
    name = engine_name(settings.engine_kind)
    for upstream in settings.upstream:
        logs.say(f"waiting for {name} at {upstream.rstrip('/')}")
    async with assemble(settings, _from_args(RuntimeConfig, args), on_progress=logs.say) as built:
        engine, runtime = built.engine, built.runtime
        runtime_config = runtime.config
        server_config = _server_config(args)
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
        supervisors = engine.supervisors
        if supervisors:
            # A signal stops the engines on purpose: no restarts while shutting down. When the
            # supervisors give up (all of a pool's), the server stops and exits non-zero.
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
        client: dict[str, Any] = {
            "model_name": server_config.model_name,
            "ctx_per_slot": runtime_config.ctx_per_slot,
        }
        fields = logs.startup_fields(
            engine=", ".join(m.base_url for m in engine.engines),
            engine_name=built.engine_name,
            launched=not settings.upstream,
            model=str(engine.model) if engine.model is not None else built.served_model,
            slots=runtime_config.n_slots,
            ctx_per_slot=runtime_config.ctx_per_slot,
            store=str(runtime_config.store_dir) if runtime_config.store_dir is not None else None,
            store_budget=runtime_config.store_budget,
            url=url,
            api_key=bool(server_config.api_key),
            claude_code=claude_code_env(
                url, server_config.api_key, timeout=runtime_config.client_timeout, **client
            ),
            device=engine.device,
            warnings=list(built.warnings),
            codex=codex_config(url, server_config.api_key, **client),
        )
        server.on_started = lambda: logs.announce(fields)
        await server.serve()
        failures = [each.failure for each in supervisors if each.failure is not None]
        if supervisors and len(failures) == len(supervisors):
            raise failures[0]


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"status": status.main, "store": store_cmd.main}
    if argv and argv[0] in commands:
        return commands[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level, args.log_format)
    for option in ("slots", "engines"):
        if getattr(args, option) < 1:
            raise SystemExit(f"agentkv-server: --{option} must be at least 1")
    try:
        _from_args(EngineSettings, args)
    except ValueError as exc:
        raise SystemExit(f"agentkv-server: {exc}") from None
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
