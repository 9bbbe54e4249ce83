"""The real Claude Code CLI as the client: ``claude -p`` sessions against each configuration.

A agents × T fresh ``claude -p "Reply with the single word: <word>"`` sessions, in one temporary
git project, all agents started at once (each agent's sessions one after another), against:

- ``llama-server``: llama-server alone, Claude Code talking to its own ``/v1/messages``;
- ``agentkv``: agentkv in front of the same binary, model, slots and context, store empty;
- ``agentkv-warm``: agentkv again, on the store the ``agentkv`` run left (new words, so only
  what really is shared can come from the store).

The project (its path, its one commit with a fixed date) and the CLI's home directory are the
same for every configuration, so the prompts differ only where the sessions do.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs

from agentkv.snapshot import unstructure
from agentkv_bench._runs import run_claude, scratch, write_run
from agentkv_bench.engines import (
    NO_PREEMPTION,
    Engine,
    EngineSetup,
    agentkv_engine,
    llama_server_args,
    raw_llama_server,
)
from agentkv_bench.metrics import counting
from agentkv_bench.report import fmt, render_table
from agentkv_bench.scenarios import Bench, _store
from agentkv_bench.workload import WORDS

__all__ = ["CLAUDE_BIN_ENV", "CliSpec", "find_claude", "run_real_cli"]

CLAUDE_BIN_ENV = "AGENTKV_CLAUDE_BIN"
CONFIGS = ("llama-server", "agentkv", "agentkv-warm")
_LABELS = {
    "llama-server": "llama-server alone",
    "agentkv": "agentkv, empty store",
    "agentkv-warm": "agentkv, warm store",
}
_GIT_DATE = "2025-01-01T00:00:00+00:00"


@attrs.frozen
class CliSpec:
    agents: int = 3
    sessions: int = 2
    #: Seconds Claude Code waits for one reply (API_TIMEOUT_MS); a cold prefill takes minutes.
    timeout: float = 1800.0


def find_claude(explicit: str | None = None) -> Path:
    """The Claude Code CLI: ``explicit``, then ``$AGENTKV_CLAUDE_BIN``, then ``claude`` on PATH."""
    for candidate in (explicit, os.environ.get(CLAUDE_BIN_ENV), shutil.which("claude")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise SystemExit(
        f"agentkv-bench: Claude Code not found; install @anthropic-ai/claude-code and pass "
        f"--claude-bin PATH or set {CLAUDE_BIN_ENV}"
    )


def make_project(root: Path) -> tuple[Path, Path]:
    """A git project with one commit of fixed date (so its hash, which Claude Code puts in the
    prompt, is the same every time) and an empty home directory for the CLI."""
    project, home = root / "project", root / "home"
    project.mkdir(parents=True)
    home.mkdir()
    (project / "README.md").write_text("# demo\n\nA small project.\n")
    env = {
        **os.environ,
        "HOME": str(home),
        "GIT_AUTHOR_DATE": _GIT_DATE,
        "GIT_COMMITTER_DATE": _GIT_DATE,
    }
    for command in (
        ["git", "init", "-q", "-b", "main"],
        ["git", "config", "user.name", "Bench"],
        ["git", "config", "user.email", "bench@example.invalid"],
        ["git", "add", "README.md"],
        ["git", "commit", "-q", "-m", "init"],
    ):
        subprocess.run(command, cwd=project, env=env, check=True)
    return project, home


def _env(base_url: str, home: Path, agent: str, priority: int, ctx: int) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
    return {
        **keep,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "bench",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "API_TIMEOUT_MS": "1800000",
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(ctx),
        # llama-server ignores these; agentkv reads who asks and how urgent it is.
        "ANTHROPIC_CUSTOM_HEADERS": f"X-Agent-Id: {agent}\nX-Agent-Priority: {priority}",
    }


async def _session(
    claude: Path, project: Path, env: dict[str, str], word: str, limit_s: float
) -> dict[str, Any]:
    started = time.monotonic()
    prompt = f"Reply with the single word: {word}"
    rc, out, err = await run_claude([str(claude), "-p", prompt], project, env, limit_s)
    answer = out.strip()
    return {
        "word": word,
        "answer": answer[:200],
        "correct": word.lower() in answer.lower(),
        "rc": rc,
        "stderr": err.strip()[-300:],
        "seconds": round(time.monotonic() - started, 2),
    }


@contextlib.asynccontextmanager
async def llama_server_alone(setup: EngineSetup, scenario: str) -> AsyncIterator[Engine]:
    """llama-server alone, as a real client meets it (``--no-kv-unified``)."""
    args = [*llama_server_args(setup, "plain"), "--no-kv-unified"]
    log = setup.log_dir / f"llama-server-{scenario}.log"
    async with raw_llama_server(setup.binary, args, log) as url:
        yield Engine("llama-server", url, url, " ".join(args))


def _engine(
    setup: EngineSetup, name: str, store: Path
) -> contextlib.AbstractAsyncContextManager[Engine]:
    """llama-server alone, or agentkv on ``store``."""
    if name == "llama-server":
        return llama_server_alone(setup, "real-cli")
    return agentkv_engine(setup, store_dir=store, config=NO_PREEMPTION, name=name)


async def run_real_cli(
    bench: Bench, spec: CliSpec, *, claude: Path, configs: Sequence[str] = CONFIGS
) -> dict[str, Any]:
    """The real-CLI runs, one configuration after another; ``real-cli.{json,txt}``."""
    setup: EngineSetup = bench.setup
    reports: list[dict[str, Any]] = []
    started = time.monotonic()
    store = _store(bench, "agentkv", fresh=True, tag="real-cli")
    assert store is not None
    with scratch("cli") as root:
        project, home = make_project(root)
        for name in configs:
            bench.say(f"real-cli/{name}: {spec.agents} agents × {spec.sessions} sessions")
            # The warm run asks for other words: only what is really shared can be reused.
            first_word = spec.agents * spec.sessions if name == "agentkv-warm" else 0
            async with _engine(setup, name, store) as engine:
                report = await _measure(engine, claude, project, home, spec, setup.ctx, first_word)
                if engine.runtime is not None:
                    report["placements"] = unstructure(engine.runtime.snapshot().placements)
            reports.append(report)
            bench.say(f"real-cli/{name}: {report['wall_s']} s, {report['correct']} right")
    base = next((r["wall_s"] for r in reports if r["name"] == "llama-server"), None)
    for report in reports:
        report["wall_vs_llama_server"] = round(report["wall_s"] / base, 3) if base else None
    return await write_run(
        bench, "real-cli", spec, real_cli_table, started, engine=setup.binary.name, configs=reports
    )


async def _measure(
    engine: Engine,
    claude: Path,
    project: Path,
    home: Path,
    spec: CliSpec,
    ctx: int,
    first_word: int,
) -> dict[str, Any]:
    """One configuration's sessions, all agents at once, and llama-server's counters over them."""
    sessions: dict[str, list[dict[str, Any]]] = {}

    async def agent(index: int) -> None:
        name = f"agent-{index}"
        env = _env(engine.url, home, name, 1 + index % 2, ctx)
        rows = sessions.setdefault(name, [])
        for session in range(spec.sessions):
            word = WORDS[(first_word + index * spec.sessions + session) % len(WORDS)]
            rows.append(await _session(claude, project, env, word, spec.timeout))

    async with counting(engine) as counters:
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for index in range(spec.agents):
                tg.start_soon(agent, index)
        wall = time.monotonic() - started
    rows = [row for agent in sessions.values() for row in agent]
    return {
        "name": engine.name,
        "label": _LABELS.get(engine.name, engine.name),
        "wall_s": round(wall, 1),
        "sessions": sessions,
        "correct": sum(1 for row in rows if row["correct"]),
        "asked": len(rows),
        "failed": sum(1 for row in rows if row["rc"] != 0),
        "prefill_computed": int(counters["prompt_computed"]),
        "prefill_cached": int(counters["prompt_cached"]),
    }


def real_cli_table(result: dict[str, Any]) -> str:
    configs = result["configs"]
    rows = [
        ("wall time", lambda c: fmt(c["wall_s"], " s")),
        ("wall / llama-server alone", lambda c: fmt(c["wall_vs_llama_server"], "×")),
        ("answers right", lambda c: f"{c['correct']}/{c['asked']}"),
        ("sessions failed", lambda c: fmt(c["failed"])),
        ("prefill computed (tokens)", lambda c: fmt(c["prefill_computed"])),
        ("prefill reused (tokens)", lambda c: fmt(c["prefill_cached"])),
    ]
    answers = []
    for c in configs:
        for agent, rows_ in c["sessions"].items():
            said = ", ".join(f"{r['word']}→{r['answer'][:20]!r} ({r['seconds']} s)" for r in rows_)
            answers.append(f"- {c['label']}, {agent}: {said}")
    spec = result["spec"]
    return (
        render_table(configs, rows)
        + f"\n\n{spec['agents']} agents × {spec['sessions']} `claude -p` sessions on "
        f"{result['slots']} slots of {result['ctx_per_slot']} tokens.\n" + "\n".join(answers)
    )
