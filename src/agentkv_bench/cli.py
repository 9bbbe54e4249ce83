"""``agentkv-bench``: the command line.

``agentkv-bench --scenario NAME`` runs one scenario (``agents`` by default); ``--quick`` makes it
CI-sized. See docs/benchmarks.md for what each scenario measures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs

from agentkv.runtime.engine import find_llama_server
from agentkv.runtime.model import default_model_path
from agentkv_bench.engines import TUNED_ARGS, EngineSetup
from agentkv_bench.scenarios import Bench

__all__ = ["build_parser", "main"]

SCENARIOS = (
    "agents",
    "claude",
    "restart",
    "priority",
    "subagents",
    "mixed",
    "real-cli",
    "real-cli-fanout",
    "overhead",
    "soak",
    "decode",
    "compaction",
    "band",
)
_CONFIGS = {
    "agents": ("plain", "tuned", "agentkv"),
    "claude": ("plain", "tuned", "agentkv"),
    "priority": ("alone", "plain", "tuned", "agentkv", "agentkv-preempt"),
    "subagents": ("alone", "plain", "agentkv-notree", "agentkv", "agentkv-warm"),
    "mixed": ("direct", "agentkv"),
    "real-cli": ("llama-server", "agentkv", "agentkv-warm"),
    "real-cli-fanout": ("llama-server", "agentkv"),
    "compaction": ("llama-server", "agentkv-noprep", "agentkv"),
    "band": ("high-water", "band"),
}


#: The size flags and their help, in the order ``--help`` lists them; all but
#: :data:`_FRACTIONAL` take whole numbers.
_SIZES = {
    "--agents": "agents (agents 6, claude 3; quick 3; mixed: of each kind, 2)",
    "--slots": "llama-server slots (default 2)",
    "--turns": "agents, mixed: requests per agent (default 4; quick 2; mixed 2); band: turns (24)",
    "--sessions": "claude: fresh sessions per agent (default 2)",
    "--followups": "claude: follow-up turns per session (default 0; quick 1)",
    "--scale": "claude, restart, priority, subagents, mixed: length of the captured prompts' "
    "texts, 1 = as captured (~11.6K tokens for Claude Code; quick 0.125)",
    "--rounds": "priority: P0 arrivals (default 3; quick 2)",
    "--subagents": "priority: sub-agents (default 2)",
    "--runs": "real-cli-fanout: runs (default 3; quick 1)",
    "--delay": "priority: seconds from the sub-agents' start to P0's arrival",
    "--think": "compaction: seconds of think time before each compaction turn (default 150)",
    "--clients": "soak: concurrent clients (default 16; quick 4)",
    "--requests": "soak: requests per client (default 3; quick 2)",
    "--disconnect": "soak: share of requests dropped on purpose at a random moment (default 0.3)",
    "--kill-at": "soak: seconds from the clients' start to the engine's SIGKILL "
    "(default 20; quick 10)",
}
_FRACTIONAL = {"--scale", "--delay", "--think", "--disconnect", "--kill-at"}
#: Each scenario run on an :class:`EngineSetup`: its module, the stem of its ``run_*`` and
#: ``*_table``, its spec class (in that module), the quick spec's arguments (None: the class's
#: ``quick()``) and the spec field each size flag sets (``field=flag`` where the names differ);
#: a spec with ``slots`` gets ``--slots``.
_ON_ENGINE: dict[str, tuple[str, str, str, dict[str, int] | None, str]] = {
    "agents": ("scenarios", "agents", "WorkloadSpec", None, "agents turns seed"),
    "claude": ("scenarios", "claude", "ClaudeSpec", None, "agents sessions followups scale"),
    "restart": ("scenarios", "restart", "ClaudeSpec", None, "agents sessions followups scale"),
    "priority": ("scenarios", "priority", "PrioritySpec", None, "subagents rounds delay scale"),
    "subagents": ("subagents", "subagents", "SubagentsSpec", None, "scale"),
    "mixed": (
        "mixed",
        "mixed",
        "MixedSpec",
        None,
        "claude_agents=agents codex_agents=agents turns scale",
    ),
    "real-cli": ("claude", "real_cli", "CliSpec", {"agents": 1, "sessions": 1}, "agents sessions"),
    "real-cli-fanout": ("fanout", "fanout", "FanoutSpec", {"runs": 1}, "runs"),
    "compaction": ("compaction", "compaction", "CompactionSpec", {}, "think"),
    "band": ("band", "band", "BandSpec", None, "turns"),
}
#: Context per slot: the synthetic prompts are short; Claude Code's first request is ~11.8K.
_CTX = {"agents": 4096, "band": 4096}
_CTX_DEFAULT = 32768


def _configs_help() -> str:
    """Each scenario's configurations, scenarios with the same ones named together."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for scenario, configs in _CONFIGS.items():
        groups.setdefault(configs, []).append(scenario)
    return "; ".join(f"{', '.join(names)}: {','.join(c)}" for c, names in groups.items())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkv-bench",
        description="Multi-agent benchmark: agentkv against llama-server alone, in one run.",
    )
    parser.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="agents",
        help="agents: synthetic agents > slots; claude: fresh Claude Code sessions; restart: "
        "the prefix store across a restart; priority: P0 while sub-agents prefill; subagents: a "
        "Claude Code coordinator fanning out to sub-agents (its replies scripted); mixed: Claude "
        "Code and Codex agents together, each API its own route; real-cli: "
        "the real Claude Code CLI; real-cli-fanout: the real CLI's coordinator starting two "
        "sub-agents (its first reply scripted); overhead: the gateway against a fake engine; "
        "decode: replies decoded at Claude Code's depth, speculative decoding on and off; "
        "compaction: a real Claude Code session that compacts twice, with think time; "
        "band: agentkv's own compaction of a long conversation, high-water against incremental; "
        "soak: many clients, dropped requests and an engine kill against agentkv-server "
        "(default agents)",
    )
    parser.add_argument("--quick", action="store_true", help="the small CI-sized version")
    size = parser.add_argument_group("size")
    for flag, text in _SIZES.items():
        size.add_argument(flag, type=float if flag in _FRACTIONAL else int, help=text)
    size.add_argument(
        "--seed",
        type=int,
        default=1,
        help="agents: workload seed; soak: its random plan (default 1)",
    )
    parser.add_argument(
        "--ctx-per-slot",
        type=int,
        help=f"context per slot (agents, band 4096, otherwise {_CTX_DEFAULT})",
    )
    parser.add_argument("--configs", help=f"comma list of configurations ({_configs_help()})")
    parser.add_argument(
        "--tuned-args",
        default=" ".join(TUNED_ARGS),
        help=f"extra llama-server flags of the tuned config (default: {' '.join(TUNED_ARGS)})",
    )
    parser.add_argument(
        "--no-overhead", action="store_true", help="agents: skip the gateway micro-benchmark"
    )
    parser.add_argument("--overhead-only", action="store_true", help="same as --scenario overhead")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory")
    parser.add_argument("--llama-server", type=Path, help="llama-server binary")
    parser.add_argument("--model", type=Path, help="GGUF model (default: the bundled one)")
    parser.add_argument(
        "--claude-bin",
        help="real-cli: the Claude Code CLI (default: $AGENTKV_CLAUDE_BIN, then claude on PATH)",
    )
    return parser


def _evolve(spec: Any, **changes: Any) -> Any:
    return attrs.evolve(spec, **{k: v for k, v in changes.items() if v is not None})


def _configs(args: argparse.Namespace, scenario: str) -> list[str]:
    allowed = _CONFIGS[scenario]
    if args.configs is None:
        return list(allowed)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(configs) - set(allowed)
    if unknown:
        raise SystemExit(f"agentkv-bench: unknown config(s): {', '.join(sorted(unknown))}")
    return configs


def _say(message: str) -> None:
    print(f"agentkv-bench: {message}", file=sys.stderr, flush=True)


async def _run(args: argparse.Namespace, scenario: str) -> tuple[dict[str, Any], str]:
    """The scenario's report and its text table."""
    if scenario == "soak":
        from agentkv_bench.soak import SoakSpec, run_soak, soak_table

        try:
            soak_spec = _evolve(
                SoakSpec.quick(args.seed) if args.quick else SoakSpec(seed=args.seed),
                clients=args.clients,
                requests=args.requests,
                disconnect=args.disconnect,
                kill_at=args.kill_at,
                slots=args.slots,
            )
        except ValueError as exc:
            raise SystemExit(f"agentkv-bench: {exc}") from None
        report = await run_soak(
            args.out,
            soak_spec,
            llama_server=args.llama_server,
            model=args.model,
            ctx_per_slot=args.ctx_per_slot,
            say=_say,
        )
        return report, soak_table(report)
    if scenario == "decode":
        from agentkv_bench.decode import DecodeSpec, decode_table, run_decode

        decode_spec = DecodeSpec.quick() if args.quick else DecodeSpec()
        report = await run_decode(decode_spec, args.out, model=args.model, echo=_say)
        return report, decode_table(report)
    ctx = args.ctx_per_slot or _CTX.get(scenario, _CTX_DEFAULT)
    setup = EngineSetup(
        binary=find_llama_server(args.llama_server),
        model=args.model or default_model_path(),
        slots=args.slots or 2,
        ctx=ctx,
        log_dir=args.out / "logs",
        tuned_args=tuple(args.tuned_args.split()),
    )
    module_name, stem, spec_name, quick, flags = _ON_ENGINE[scenario]
    module = importlib.import_module(f"agentkv_bench.{module_name}")
    spec_class = getattr(module, spec_name)
    if not args.quick:
        spec = spec_class()
    else:
        spec = spec_class.quick() if quick is None else spec_class(**quick)
    pairs = (item.partition("=") for item in flags.split())
    changes = {field: getattr(args, flag or field) for field, _, flag in pairs}
    if "slots" in attrs.fields_dict(spec_class):
        changes["slots"] = setup.slots
    spec = _evolve(spec, **changes)
    options: dict[str, Any] = {}
    if module_name in ("claude", "fanout", "compaction"):
        from agentkv_bench.claude import find_claude

        options["claude"] = find_claude(args.claude_bin)
    if scenario == "agents":
        options["overhead"] = not args.no_overhead
    if scenario != "restart":
        options["configs"] = _configs(args, scenario)
    bench = Bench(setup=setup, out=args.out, say=_say)
    report = await getattr(module, f"run_{stem}")(bench, spec, **options)
    return report, getattr(module, f"{stem}_table")(report)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    scenario = "overhead" if args.overhead_only else args.scenario
    if scenario == "overhead":
        from agentkv_bench.overhead import gateway_overhead

        print(json.dumps(anyio.run(gateway_overhead), indent=2))
        return 0
    report, text = anyio.run(_run, args, scenario)
    print(text)
    print(f"\nwritten under {args.out}; total {report['total_s']} s")
    # A scenario with pass criteria (soak) fails the command when they are not met.
    return 1 if report.get("passed") is False else 0


if __name__ == "__main__":
    raise SystemExit(main())
