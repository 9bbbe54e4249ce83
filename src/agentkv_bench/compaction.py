"""Claude Code's own compaction: one real ``claude -p`` session that crosses its compaction point
twice, with the same think time before each compaction turn, against llama-server alone, agentkv
with prepared compaction off, and agentkv (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs

from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.record import request_fields
from agentkv_bench._runs import run_claude, scratch, write_run
from agentkv_bench.claude import llama_server_alone, make_project
from agentkv_bench.engines import Engine, EngineSetup, agentkv_engine
from agentkv_bench.metrics import counting
from agentkv_bench.report import fmt, render_table
from agentkv_bench.scenarios import Bench
from agentkv_server.cli import claude_code_env

__all__ = ["CONFIGS", "CompactionSpec", "compaction_table", "run_compaction"]

CONFIGS = ("llama-server", "agentkv-noprep", "agentkv")
_LABELS = {
    "llama-server": "llama-server alone",
    "agentkv-noprep": "agentkv, preparation off",
    "agentkv": "agentkv",
}
#: What agentkv-noprep changes of agentkv's defaults.
NO_PREPARATION = RuntimeConfig(prepare_compaction=False)
#: Claude Code's ``-p`` output names the query that produced it; a compaction's is "compact".
_COMPACTED = '"query_source":"compact"'
_WORDS = (
    "module", "cache", "slot", "prefix", "agent", "request", "token", "engine", "queue",
    "summary", "reply", "context", "window", "turn", "file", "test", "build", "review",
)  # fmt: skip


@attrs.frozen
class CompactionSpec:
    #: Seconds between the turn that crosses the point and the compaction turn (the user reading,
    #: a tool running): the same for every configuration.
    think: float = 150.0
    #: Lines of notes in the first turn and in the fourth (about 16 tokens a line).
    notes: tuple[int, int] = (420, 250)
    #: Seconds one ``claude -p`` may take (a cold prefill takes minutes on 2 cores).
    timeout: float = 1800.0


def notes(lines: int, seed: int) -> str:
    """Deterministic filler that Claude Code sends as the user's words."""
    pick = random.Random(seed)
    return "\n".join(
        f"Note {i}: " + " ".join(pick.choice(_WORDS) for _ in range(9)) + "." for i in range(lines)
    )


def turns(spec: CompactionSpec) -> list[tuple[str, str, float]]:
    """(name, prompt, think time before it) of the session's turns."""
    first, second = spec.notes
    return [
        ("alpha", notes(first, 7) + "\n\nReply with the single word: alpha", 0.0),
        ("beta", "Reply with the single word: beta", 0.0),
        ("gamma", "Reply with the single word: gamma", spec.think),
        ("delta", notes(second, 8) + "\n\nReply with the single word: delta", 0.0),
        ("epsilon", "Reply with the single word: epsilon", spec.think),
    ]


def _env(base_url: str, home: Path, ctx: int) -> dict[str, str]:
    """The lines ``agentkv-server`` prints for Claude Code (every configuration gets them): its
    model id, which Claude Code does not know, so that the window it is told applies."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
    printed = {}
    for line in claude_code_env(base_url, None, ctx_per_slot=ctx).splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            printed[name] = value.split("  #", 1)[0].strip()
    return {**keep, **printed, "HOME": str(home)}


async def _session(
    engine: Engine, claude: Path, root: Path, spec: CompactionSpec, ctx: int
) -> dict[str, Any]:
    name = engine.name
    project, home = make_project(root / name)
    env = _env(engine.url, home, ctx)
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for index, (word, prompt, think) in enumerate(turns(spec)):
        await anyio.sleep(think)
        command = [str(claude), "-p", *(["--continue"] if index else []), prompt]
        async with counting(engine) as counters:
            asked = time.monotonic()
            rc, out, err = await run_claude(command, project, env, spec.timeout)
            seconds = time.monotonic() - asked
        said = out + err
        answer = said.strip()[-120:]
        rows.append(
            {
                "seconds": round(seconds, 2),
                "rc": rc,
                "compacted": _COMPACTED in said,
                "answer": answer,
                "word": word,
                "think_s": think,
                "prefill_computed": int(counters["prompt_computed"]),
                "correct": word in answer.lower(),
            }
        )
    wall = time.monotonic() - started
    return {
        "name": name,
        "label": _LABELS.get(name, name),
        "turns": rows,
        "wall_s": round(wall, 1),
        "busy_s": round(sum(r["seconds"] for r in rows), 1),
        "compactions": sum(1 for r in rows if r["compacted"]),
        "failed": sum(1 for r in rows if r["rc"] != 0),
    }


async def run_compaction(
    bench: Bench, spec: CompactionSpec, *, claude: Path, configs: Sequence[str] = CONFIGS
) -> dict[str, Any]:
    """The session against each configuration, one after another; ``compaction.{json,txt}``."""
    setup: EngineSetup = bench.setup
    reports: list[dict[str, Any]] = []
    started = time.monotonic()
    with scratch("compaction") as root:
        for name in configs:
            bench.say(f"compaction/{name}: 5 turns, {spec.think:g} s of think time twice")
            if name == "llama-server":
                engine = llama_server_alone(setup, "compaction")
            else:
                store = bench.out / "stores" / f"compaction-{name}"
                shutil.rmtree(store, ignore_errors=True)
                home = root / name / "home"
                config = NO_PREPARATION if name == "agentkv-noprep" else RuntimeConfig()
                # The harness's Claude Code has its own home: where its transcripts are.
                config = attrs.evolve(config, claude_config_dir=str(home / ".claude"))
                engine = agentkv_engine(setup, store_dir=store, config=config, name=name)
            async with engine as e:
                report = await _session(e, claude, root, spec, setup.ctx)
                if e.runtime is not None:
                    report["prepared"] = attrs.asdict(e.runtime.preparations.stats())
                    # what each request computed and where it parted from the cache
                    report["requests"] = [request_fields(r) for r in e.runtime.records()]
            reports.append(report)
            bench.say(f"compaction/{name}: {report['wall_s']} s ({report['busy_s']} s busy)")
    for report in reports:
        for base in ("llama-server", "agentkv-noprep"):
            other = next((r for r in reports if r["name"] == base), None)
            report[f"vs_{base}"] = _ratios(report, other)
    return await write_run(bench, "compaction", spec, compaction_table, started, configs=reports)


def _ratios(report: dict[str, Any], base: dict[str, Any] | None) -> dict[str, float | None]:
    """Each turn's time, the busy time and the wall time against ``base``'s."""
    if base is None:
        return {}
    ratios: dict[str, float | None] = {}
    for mine, theirs in zip(report["turns"], base["turns"], strict=True):
        ratios[mine["word"]] = round(mine["seconds"] / theirs["seconds"], 3)
    for key in ("busy_s", "wall_s"):
        ratios[key] = round(report[key] / base[key], 3) if base[key] else None
    return ratios


def compaction_table(result: dict[str, Any]) -> str:
    configs = result["configs"]
    words = [t["word"] for t in configs[0]["turns"]] if configs else []

    def turn(word: str, key: str, unit: str = "") -> Any:
        def cell(c: dict[str, Any]) -> str:
            row = next(t for t in c["turns"] if t["word"] == word)
            mark = " (compaction)" if key == "seconds" and row["compacted"] else ""
            return fmt(row[key], unit) + mark

        return cell

    rows: list[tuple[str, Any]] = []
    for word in words:
        rows.append((f"turn {word}: seconds", turn(word, "seconds", " s")))
        rows.append((f"turn {word}: prefill computed", turn(word, "prefill_computed")))
        for base, label in _BASES:
            rows.append((f"turn {word} / {label}", _ratio(base, word)))
    rows.append(("busy time (turns only)", lambda c: fmt(c["busy_s"], " s")))
    rows += [(f"busy / {label}", _ratio(base, "busy_s")) for base, label in _BASES]
    rows.append(("session wall time", lambda c: fmt(c["wall_s"], " s")))
    rows += [(f"wall / {label}", _ratio(base, "wall_s")) for base, label in _BASES]
    rows += [
        ("compactions seen", lambda c: fmt(c["compactions"])),
        ("turns failed", lambda c: fmt(c["failed"])),
        ("prepared / served / joined", _prepared),
        ("missed", _missed),
    ]
    spec = result["spec"]
    return render_table(configs, rows) + (
        f"\n\nOne `claude -p` session of {len(words)} turns on {result['slots']} slots of "
        f"{result['ctx_per_slot']} tokens, {spec['think']:g} s of think time before each "
        f"compaction turn (the same for every configuration)."
    )


#: What each configuration is compared with: llama-server alone, and agentkv without preparation
#: (with which Claude Code compacts at the same turns; see docs/benchmarks.md).
_BASES = (("llama-server", "llama-server alone"), ("agentkv-noprep", "preparation off"))


def _ratio(base: str, key: str) -> Any:
    def cell(config: dict[str, Any]) -> str:
        return fmt(config.get(f"vs_{base}", {}).get(key), "×")

    return cell


def _prepared(config: dict[str, Any]) -> str:
    stats = config.get("prepared")
    if stats is None:
        return "–"
    return f"{stats['prepared']} / {stats['served']} / {stats['joined']} ({stats['heads']} heads)"


def _missed(config: dict[str, Any]) -> str:
    stats = config.get("prepared")
    if stats is None:
        return "–"
    return ", ".join(f"{k} {v}" for k, v in stats["missed"].items() if v) or "0"
