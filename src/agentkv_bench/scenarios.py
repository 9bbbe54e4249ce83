"""The scenarios: which configurations run, what they are sent, and what their report shows.

- ``agents``: the synthetic workload (6 agents on 2 slots, a 1.4K-token shared prompt);
- ``claude``: fresh Claude Code sessions built from a real request, agents > slots;
- ``restart``: agentkv stopped and started again on its prefix store, then a new agent;
- ``priority``: a P0 coordinator arriving while sub-agents prefill Claude-Code-sized prompts.

Each configuration runs on a fresh llama-server of the same binary, model, slots and context;
prefill is read from llama-server's ``/metrics`` before and after.
"""

from __future__ import annotations

import os
import platform
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from agentkv.runtime.config import RuntimeConfig
from agentkv.snapshot import RuntimeSnapshot, StoreSnapshot, unstructure
from agentkv_bench.claude_workload import (
    ClaudeSpec,
    PrioritySpec,
    build_claude_workload,
    build_priority_workload,
    new_agent_workload,
)
from agentkv_bench.drivers import Clock, RequestResult, drive
from agentkv_bench.engines import REPLAYED, Engine, EngineSetup, start
from agentkv_bench.metrics import PrefillYardstick, counting, token_sequences, yardsticks
from agentkv_bench.report import Panel, Row, fmt, render_table, summarize, write_report
from agentkv_bench.workload import Workload, WorkloadSpec, build_workload, shared_prefix_len

__all__ = [
    "Bench",
    "answers_correct",
    "measure",
    "run_agents",
    "run_claude",
    "run_priority",
    "run_restart",
]

Say = Callable[[str], None]

#: Chart panels more than one scenario draws.
_WALL_PANEL: Panel = ("wall time (s)", lambda c: c["wall_s"])
_P0_PANEL: Panel = ("P0 TTFT p95 (s)", lambda c: c["ttft"].get("P0", {}).get("ttft_p95_s") or 0)


@attrs.frozen
class Bench:
    """One run's shared setup and output directory."""

    setup: EngineSetup
    out: Path
    say: Say = print


@attrs.frozen
class Measured:
    wall: float
    results: list[RequestResult]
    counters: dict[str, float]
    #: agentkv's own view at the end (None: the configuration runs no agentkv runtime here).
    snapshot: RuntimeSnapshot | None


async def measure(
    engine: Engine,
    phases: Sequence[tuple[str, Workload]] = (),
    *,
    play: Callable[[Clock], Awaitable[list[RequestResult]]] | None = None,
) -> Measured:
    """Run ``play`` (given the run's clock), then the phases one after another on ``engine``,
    counting llama-server's work."""
    clock = Clock()
    results: list[RequestResult] = []
    async with counting(engine) as counters:
        if play is not None:
            results += await play(clock)
        for phase, workload in phases:
            _, got = await drive(engine.url, workload, clock=clock, phase=phase)
            results.extend(got)
        wall = clock()
    snapshot = engine.runtime.snapshot() if engine.runtime is not None else None
    return Measured(wall, results, counters, snapshot)


def _store_summary(store: StoreSnapshot | None) -> dict[str, Any]:
    """The store's counters, for a report (its entries left out; {} when it is off)."""
    if store is None:
        return {}
    summary: dict[str, Any] = unstructure(store)
    del summary["entries"]
    return summary


def _hits(snapshot: RuntimeSnapshot | None) -> dict[str, Any]:
    """agentkv's own view of where prompts came from (its snapshot), for a report."""
    if snapshot is None:
        return {}
    return {
        "placements": unstructure(snapshot.placements),
        "store": _store_summary(snapshot.store),
        "recent": unstructure(snapshot.recent),
    }


def _expected_word(body: dict[str, Any]) -> str | None:
    """The word a fresh one-word request asks for: the last word of its last user turn (None for
    follow-up turns, which hold an assistant turn)."""
    messages = body.get("messages", [])
    if any(m.get("role") == "assistant" for m in messages):
        return None
    users = [m for m in messages if m.get("role") == "user"]
    if not users or not isinstance(users[-1].get("content"), list) or not users[-1]["content"]:
        return None
    words = str(users[-1]["content"][-1].get("text", "")).split()
    return words[-1].strip(".").lower() if words else None


def answers_correct(workload: Workload, results: Sequence[RequestResult]) -> tuple[int, int]:
    """(fresh requests answered with the word they asked for, fresh requests)."""
    bodies = {(a.name, t): body for a in workload.agents for t, body in enumerate(a.requests)}
    asked = correct = 0
    for result in results:
        word = _expected_word(bodies.get((result.agent, result.turn), {}))
        if word is None:
            continue
        asked += 1
        correct += word in result.text.lower()
    return correct, asked


# -- agents: the synthetic workload ---------------------------------------------------------------


async def run_agents(
    bench: Bench, spec: WorkloadSpec, configs: Sequence[str], *, overhead: bool
) -> dict[str, Any]:
    """The synthetic workload on each configuration; ``benchmarks.{json,txt,png}``."""
    workload = build_workload(spec)
    yardstick: PrefillYardstick | None = None
    reports = []
    started = time.monotonic()
    for name in configs:
        bench.say(f"{name}: starting")
        async with start(bench.setup, name, store_dir=_store(bench, name, fresh=True)) as engine:
            if yardstick is None:
                bodies = [body for _, _, body in workload.canonical_order()]
                yardstick = PrefillYardstick.of(await token_sequences(engine, bodies))
            bench.say(f"{name}: running {workload.n_requests} requests")
            run = await measure(engine, [("", workload)])
        extra = {"flags": engine.flags}
        reports.append(summarize(name, run.wall, run.results, run.counters, yardstick, extra))
        bench.say(f"{name}: {reports[-1]['wall_s']} s")
    measured_overhead: dict[str, Any] = {}
    if overhead:
        from agentkv_bench.overhead import gateway_overhead

        bench.say("gateway overhead: fake engine")
        measured_overhead["gateway_overhead"] = await gateway_overhead()
    return await _write(
        bench,
        "agents",
        spec,
        started,
        agents_table,
        prefill_minimum=yardstick.minimum if yardstick else None,
        prefill_naive=yardstick.naive if yardstick else None,
        configs=reports,
        **measured_overhead,
        stem="benchmarks",
        panels=[
            _WALL_PANEL,
            ("prefill computed / minimum", lambda c: c["prefill_ratio"] or 0),
            _P0_PANEL,
        ],
        title=f"{spec.agents} agents on {spec.slots} slots, {spec.turns} turns each "
        "(lower is better)",
    )


def _ttft_row(priority: str) -> Row:
    def cell(c: dict[str, Any]) -> str:
        row = c["ttft"].get(priority, {})
        return f"{fmt(row.get('ttft_p50_s'), ' s')} / {fmt(row.get('ttft_p95_s'), ' s')}"

    return f"TTFT {priority} p50 / p95", cell


def agents_table(report: dict[str, Any]) -> str:
    configs = report["configs"]
    rows = [
        ("wall time", lambda c: fmt(c["wall_s"], " s")),
        ("prefill computed (tokens)", lambda c: fmt(c["prefill_computed"])),
        ("prefill / minimum", lambda c: fmt(c["prefill_ratio"], "×")),
        ("cache-hit ratio", lambda c: fmt(c["cache_hit_ratio"])),
        *(_ttft_row(p) for p in sorted({p for c in configs for p in c["ttft"]})),
        ("longest wait", lambda c: fmt(c["longest_wait_s"], " s")),
        ("output tokens / s", lambda c: fmt(c["output_tokens_per_s"])),
        ("errors", lambda c: fmt(c["errors"])),
    ]
    lines = [render_table(configs, rows)]
    spec = report["workload"]
    lines.append(
        f"\n{spec['agents']} agents on {spec['slots']} slots, {spec['turns']} turns each; "
        f"minimum prefill {report['prefill_minimum']} tokens, "
        f"without any cache {report['prefill_naive']}."
    )
    overhead = report.get("gateway_overhead")
    if overhead:
        lines.append(
            f"Gateway overhead (fake engine): +{overhead['added_p50_ms']} ms p50, "
            f"+{overhead['added_p99_ms']} ms p99 per request "
            f"(+{overhead['added_new_prompt_p50_ms']} ms p50 with a new prompt each); "
            f"{overhead['engine_chunks_per_s']} engine chunks/s "
            f"({overhead['sse_events_per_s']} SSE events/s) relayed; "
            f"{overhead['bytes_per_idle_agent']} bytes per idle agent."
        )
    return "\n".join(lines)


def _machine(bench: Bench) -> dict[str, Any]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "engine": bench.setup.binary.name,
        "model": bench.setup.model.name,
        "slots": bench.setup.slots,
        "ctx_per_slot": bench.setup.ctx,
        "machine": f"{platform.machine()}, {cpus} CPUs",
    }


async def _write(
    bench: Bench,
    scenario: str,
    spec: Any,
    started: float,
    table: Callable[[dict[str, Any]], str],
    *,
    stem: str = "",
    panels: Sequence[Panel] = (),
    title: str = "",
    targets: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A scenario's report: what ran and on what, ``fields``, the ``targets`` of all that, and
    the run's total seconds; written as ``{stem}.{json,txt,png}`` (``stem``: the scenario's)."""
    report = {"scenario": scenario, "workload": attrs.asdict(spec), **_machine(bench), **fields}
    if targets is not None:
        report["targets"] = targets(report)
    report["total_s"] = round(time.monotonic() - started, 1)
    await write_report(
        report, table(report), bench.out, stem=stem or scenario, panels=panels, title=title
    )
    return report


def _store(bench: Bench, name: str, *, fresh: bool, tag: str = "") -> Path | None:
    """The prefix store directory of an agentkv configuration (emptied when ``fresh``)."""
    if not name.startswith("agentkv") or name.endswith("nostore"):
        return None
    path = bench.out / "stores" / (tag or name)
    if fresh and path.exists():
        shutil.rmtree(path)
    return path


# -- claude: fresh Claude Code sessions ------------------------------------------------------------


def _layout(name: str) -> str:
    return "agentkv" if name.startswith("agentkv") else "client"


async def run_claude(bench: Bench, spec: ClaudeSpec, configs: Sequence[str]) -> dict[str, Any]:
    """Fresh Claude-Code-shaped sessions, all agents at once; ``claude.{json,txt,png}``."""
    workload = build_claude_workload(spec)
    sticks: dict[str, PrefillYardstick] = {}
    reports = []
    started = time.monotonic()
    for name in configs:
        bench.say(f"claude/{name}: starting")
        async with start(bench.setup, name, store_dir=_store(bench, name, fresh=True)) as engine:
            if not sticks:
                sticks = await yardsticks(engine, [workload])
            bench.say(f"claude/{name}: {workload.n_requests} requests from {spec.agents} agents")
            run = await measure(engine, [("", workload)])
        layout = _layout(name)
        correct, asked = answers_correct(workload, run.results)
        extra = {
            "flags": engine.flags,
            "layout": layout,
            "answers_correct": correct,
            "asked": asked,
        }
        summary = summarize(name, run.wall, run.results, run.counters, sticks[layout], extra)
        summary["agentkv"] = _hits(run.snapshot)
        reports.append(summary)
        bench.say(f"claude/{name}: {summary['wall_s']} s")
    return await _write(
        bench,
        "claude",
        spec,
        started,
        claude_table,
        yardsticks=_as_dicts(sticks),
        configs=reports,
        panels=[
            _WALL_PANEL,
            ("prefill computed (K tokens)", lambda c: c["prefill_computed"] / 1000),
            ("slowest first answer (s)", lambda c: _slowest_first(c) or 0),
        ],
        title=f"Claude Code sessions: {spec.agents} agents × {spec.sessions} on "
        f"{spec.slots} slots (lower is better)",
    )


def _as_dicts(sticks: dict[str, PrefillYardstick]) -> dict[str, dict[str, Any]]:
    return {k: attrs.asdict(v) for k, v in sticks.items()}


def _slowest_first(config: dict[str, Any]) -> float | None:
    values = [a["first_ttft_s"] for a in config["agents"].values() if a["first_ttft_s"]]
    return max(values, default=None)


def _placements(c: dict[str, Any]) -> str:
    placements = (c.get("agentkv") or {}).get("placements")
    if not placements:
        return "-"
    return f"{placements['from_slot']} / {placements['from_store']} / {placements['cold']}"


def _first_answer(agent: str) -> Callable[[dict[str, Any]], str]:
    def cell(c: dict[str, Any]) -> str:
        return fmt(c["agents"].get(agent, {}).get("first_ttft_s"), " s")

    return cell


def claude_table(report: dict[str, Any]) -> str:
    configs = report["configs"]
    agents = sorted({a for c in configs for a in c["agents"]})
    rows: list[Row] = [("wall time", lambda c: fmt(c["wall_s"], " s"))]
    rows += [(f"{agent}: first answer", _first_answer(agent)) for agent in agents]
    rows += [
        (
            "TTFT p50 / p95",
            lambda c: f"{fmt(c['ttft_p50_s'], ' s')} / {fmt(c['ttft_p95_s'], ' s')}",
        ),
        ("prefill computed (tokens)", lambda c: fmt(c["prefill_computed"])),
        ("minimum, as this route lays prompts out", lambda c: fmt(c["prefill_minimum"])),
        ("computed / minimum", lambda c: fmt(c["prefill_ratio"], "×")),
        ("cache-hit ratio (engine)", lambda c: fmt(c["cache_hit_ratio"])),
        ("agentkv placements slot / store / cold", _placements),
        ("one-word answers right", lambda c: f"{c['answers_correct']}/{c['asked']}"),
        ("errors", lambda c: fmt(c["errors"])),
    ]
    spec = report["workload"]
    sticks = report["yardsticks"]
    notes = (
        f"\n\n{spec['agents']} agents × {spec['sessions']} fresh sessions"
        f" (+{spec['followups']} follow-ups each) on {spec['slots']} slots of "
        f"{report['ctx_per_slot']} tokens, prompt scale {spec['scale']}. Minimum prefill: "
        f"{sticks['client']['minimum']} tokens as sent (llama-server's route), "
        f"{sticks['agentkv']['minimum']} in agentkv's session layout; without any cache "
        f"{sticks['client']['naive']}."
    )
    return render_table(configs, rows) + notes


# -- restart: the prefix store across a restart ---------------------------------------------------


async def run_restart(bench: Bench, spec: ClaudeSpec) -> dict[str, Any]:
    """agentkv runs the claude workload, stops, starts again on the same store, and a new agent
    asks; the same new agent on a server without a store is the cold reference."""
    warm = build_claude_workload(spec)
    newcomer = new_agent_workload(spec)
    started = time.monotonic()
    store = _store(bench, "agentkv", fresh=True, tag="restart")
    assert store is not None
    bench.say("restart: agentkv with a store, first life")
    async with start(bench.setup, "agentkv", store_dir=store) as engine:
        sticks = await yardsticks(engine, [warm])
        newcomer_tokens, own = await _own_tokens(engine, warm, newcomer)
        first = await measure(engine, [("first life", warm)])
    bench.say("restart: agentkv restarted on the same store")
    async with start(bench.setup, "agentkv", store_dir=store) as engine:
        loaded = engine.runtime.snapshot().store if engine.runtime else None
        after = await measure(engine, [("after restart", newcomer)])
    bench.say("restart: agentkv without a store (cold)")
    async with start(bench.setup, "agentkv-nostore", store_dir=None) as engine:
        cold = await measure(engine, [("cold", newcomer)])
    with_store = summarize("agentkv", after.wall, after.results, after.counters, None)
    without = summarize("agentkv-nostore", cold.wall, cold.results, cold.counters, None)
    with_store["label"] = "agentkv, store, after restart"
    without["label"] = "agentkv, no store (cold)"
    ttft_after = after.results[0].ttft if after.results else None
    ttft_cold = cold.results[0].ttft if cold.results else None
    first_life = summarize("agentkv", first.wall, first.results, first.counters, sticks["agentkv"])
    first_life["agentkv"] = _hits(first.snapshot)
    return await _write(
        bench,
        "restart",
        spec,
        started,
        restart_table,
        newcomer_tokens=newcomer_tokens,
        newcomer_own_tokens=own,
        first_life=first_life,
        store_after_restart=_store_summary(loaded),
        ttft_after_restart_s=ttft_after,
        ttft_cold_s=ttft_cold,
        speedup=round(ttft_cold / ttft_after, 1) if ttft_after and ttft_cold else None,
        configs=[with_store, without],
    )


async def _own_tokens(engine: Engine, warm: Workload, newcomer: Workload) -> tuple[int, int]:
    """The newcomer's prompt tokens, and those of them that no earlier prompt holds (agentkv's
    layout)."""
    earlier = await token_sequences(engine, [b for _, _, b in warm.canonical_order()])
    (mine,) = await token_sequences(engine, [b for _, _, b in newcomer.canonical_order()])
    return len(mine), len(mine) - max((shared_prefix_len(mine, e) for e in earlier), default=0)


def restart_table(report: dict[str, Any]) -> str:
    configs = report["configs"]
    rows = [
        ("new agent: first token", lambda c: fmt(c["ttft_p50_s"], " s")),
        ("new agent: prefill computed (tokens)", lambda c: fmt(c["prefill_computed"])),
        (
            "new agent: reused (tokens)",
            lambda c: fmt(c["prompt_tokens_total"] - c["prefill_computed"]),
        ),
        ("answer", lambda c: next(iter(c["agents"].values()))["first_answer"].strip()[:24]),
    ]
    first = report["first_life"]
    return render_table(configs, rows) + (
        f"\n\nAfter the restart the new agent's first token came {fmt(report['speedup'])}× sooner "
        f"than on a server without a store ({fmt(report['ttft_after_restart_s'], ' s')} against "
        f"{fmt(report['ttft_cold_s'], ' s')}); its own tokens (held by no earlier prompt): "
        f"{report['newcomer_own_tokens']}. First life: {first['requests']} requests in "
        f"{fmt(first['wall_s'], ' s')}, {first['prefill_computed']} tokens computed "
        f"(minimum {first['prefill_minimum']}). Store after the restart: "
        f"{report['store_after_restart'].get('directory_entries')} entries, "
        f"{report['store_after_restart'].get('bytes')} bytes."
    )


# -- priority: P0 while sub-agents prefill ------------------------------------------------------


async def run_priority(bench: Bench, spec: PrioritySpec, configs: Sequence[str]) -> dict[str, Any]:
    """Per configuration: the coordinator's warm-up, then ``rounds`` rounds of sub-agents
    prefilling with the coordinator arriving ``delay`` s later. ``alone`` runs the coordinator's
    turns on an idle agentkv (the reference)."""
    warmup, rounds = build_priority_workload(spec)
    sticks: dict[str, PrefillYardstick] = {}
    reports = []
    started = time.monotonic()
    for name in configs:
        alone = name == "alone"
        engine_name = "agentkv" if alone else name
        # "agentkv-preempt" is agentkv's defaults (preempt-from 1); "agentkv", as everywhere
        # else, has pre-emption off.
        config = RuntimeConfig() if name == "agentkv-preempt" else REPLAYED
        phases = [("warmup", warmup)]
        for i, rnd in enumerate(rounds):
            # Alone: the coordinator's turns only, at once.
            p0 = tuple(attrs.evolve(a, start=0.0) for a in rnd.agents if a.priority == 0)
            agents = p0 if alone else rnd.agents
            phases.append((f"round {i}", attrs.evolve(rnd, agents=agents)))
        bench.say(f"priority/{name}: starting")
        store = _store(bench, engine_name, fresh=True, tag=name)
        async with start(bench.setup, engine_name, store_dir=store, config=config) as engine:
            if not sticks:
                sticks = await yardsticks(engine, [warmup, *rounds])
            run = await measure(engine, phases)
        stick = None if alone else sticks[_layout(engine_name)]
        measured = [r for r in run.results if r.phase != "warmup"]
        summary = summarize(name, run.wall, measured, run.counters, stick, {"flags": engine.flags})
        summary["label"] = {
            "alone": "P0 alone, idle agentkv",
            "agentkv-preempt": "agentkv, preempt-from 1",
        }.get(name, summary["label"])
        summary["warmup_ttft_s"] = next((r.ttft for r in run.results if r.phase == "warmup"), None)
        summary["agentkv"] = _hits(run.snapshot)
        reports.append(summary)
        bench.say(f"priority/{name}: {summary['wall_s']} s")
    return await _write(
        bench,
        "priority",
        spec,
        started,
        priority_table,
        yardsticks=_as_dicts(sticks),
        configs=reports,
        panels=[
            _P0_PANEL,
            _WALL_PANEL,
            ("computed twice (K tokens)", lambda c: (c["computed_twice"] or 0) / 1000),
        ],
        title=f"P0 arriving while {spec.subagents} sub-agents prefill, {spec.rounds} rounds "
        "(lower is better)",
    )


def priority_table(report: dict[str, Any]) -> str:
    configs = report["configs"]
    rows = [
        *(_ttft_row(p) for p in sorted({p for c in configs for p in c["ttft"]})),
        ("wall time (incl. warm-up)", lambda c: fmt(c["wall_s"], " s")),
        ("prefill computed (tokens)", lambda c: fmt(c["prefill_computed"])),
        ("computed twice (computed − minimum)", lambda c: fmt(c["computed_twice"])),
        ("errors", lambda c: fmt(c["errors"])),
    ]
    spec = report["workload"]
    return render_table(configs, rows) + (
        f"\n\n{spec['subagents']} sub-agents and a P0 coordinator on {spec['slots']} slots, "
        f"{spec['rounds']} rounds, P0 arriving {spec['delay']} s after the sub-agents; "
        f"prompt scale {spec['scale']}."
    )
