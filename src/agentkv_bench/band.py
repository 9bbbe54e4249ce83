"""The ``band`` scenario: agentkv's own compaction for a client that never compacts, the
high-water design against incremental compaction (``compact_from`` at half the slot), on one long
synthetic conversation; between turns the client waits for agentkv's idle work
(docs/benchmarks.md).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import anthropic
import anyio
import attrs

from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Runtime
from agentkv_bench._runs import write_run
from agentkv_bench.engines import EngineSetup, agentkv_engine
from agentkv_bench.metrics import counting
from agentkv_bench.report import Row, fmt, render_table
from agentkv_bench.scenarios import Bench

__all__ = ["CONFIGS", "BandSpec", "band_table", "run_band"]

CONFIGS = ("high-water", "band")
AGENT = "band"
_WORDS = ["cache", "slot", "prefix", "agent", "token", "engine", "queue", "reply", "window", "test"]


@attrs.frozen
class BandSpec:
    #: Turns of the conversation.
    turns: int = 32
    #: Lines of notes in each user message (about 12 tokens a line).
    lines: int = 12
    #: Seconds the client waits, at most, for agentkv's idle work after a turn.
    idle_limit: float = 600.0

    @classmethod
    def quick(cls) -> BandSpec:
        return cls(turns=10, lines=12)


def _message(turn: int, lines: int) -> str:
    pick = random.Random(turn)
    notes = "\n".join(
        f"Turn {turn} note {i}: " + " ".join(pick.choice(_WORDS) for _ in range(7)) + "."
        for i in range(lines)
    )
    return notes + "\n\nReply with one word."


def _config(name: str, ctx: int) -> RuntimeConfig:
    """agentkv's defaults, ``band`` with incremental compaction from half the slot; neither
    prepares Claude Code's compaction (no Claude Code here) nor keeps a prefix store."""
    config = RuntimeConfig(prepare_compaction=False)
    return attrs.evolve(config, compact_from=ctx // 2) if name == "band" else config


async def _idle(runtime: Runtime, limit: float) -> float:
    """Wait until agentkv has no work left (the agent's compaction and every request ended)."""
    started = time.monotonic()
    with anyio.move_on_after(limit):
        # polled: the runtime offers no event for "nothing left to do"
        while runtime.compactor.store.pending(AGENT) or runtime.running():  # noqa: ASYNC110
            await anyio.sleep(0.2)
    return round(time.monotonic() - started, 2)


async def _conversation(name: str, setup: EngineSetup, spec: BandSpec) -> dict[str, Any]:
    config = _config(name, setup.ctx)
    rows: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    async with agentkv_engine(setup, store_dir=None, config=config, name=name) as engine:
        runtime = engine.runtime
        assert runtime is not None
        threshold = runtime.config.compaction_threshold  # the slot's, once assembled
        client = anthropic.AsyncAnthropic(
            base_url=engine.url, api_key="agentkv", default_headers={"x-agent-id": AGENT}
        )
        async with counting(engine) as counters:
            started = time.monotonic()
            # the agent's compaction in force after each turn (a fold replaces the one before it)
            seen: list[object] = []
            for turn in range(spec.turns):
                messages.append({"role": "user", "content": _message(turn, spec.lines)})
                asked = time.monotonic()
                reply = await client.messages.create(
                    model="agentkv-local",
                    max_tokens=16,
                    messages=messages,  # type: ignore[arg-type]
                )
                seconds = time.monotonic() - asked
                text = "".join(b.text for b in reply.content if b.type == "text") or "ok"
                messages.append({"role": "assistant", "content": text})
                record = next(r for r in reversed(runtime.records()) if r.agent == AGENT)
                waited = await _idle(runtime, spec.idle_limit)
                latest = runtime.compactor.store.latest(AGENT)
                if latest is not None and not any(latest is c for c in seen):
                    seen.append(latest)
                rows.append(
                    {
                        "turn": turn,
                        "seconds": round(seconds, 2),
                        "prompt_tokens": record.prompt_tokens,
                        "computed_tokens": record.computed_tokens,
                        "compactions": len(seen),
                        "idle_wait_s": waited,
                    }
                )
            busy = sum(r["seconds"] for r in rows)
            wall = time.monotonic() - started
    first = next((r["turn"] for r in rows if r["compactions"] > 0), None)
    after = [r["prompt_tokens"] for r in rows if first is not None and r["turn"] > first]
    return {
        "name": name,
        "label": name,
        "compact_at": threshold,
        "compact_from": config.compact_from,
        "turns": rows,
        "busy_s": round(busy, 1),
        "wall_s": round(wall, 1),
        "idle_wait_s": round(sum(r["idle_wait_s"] for r in rows), 1),
        "compactions": rows[-1]["compactions"] if rows else 0,
        "band": [min(after), max(after)] if after else None,
        "prompt_total": sum(r["prompt_tokens"] for r in rows),
        "engine_prompt_computed": int(counters["prompt_computed"]),
        "engine_generated": int(counters["predicted"]),
    }


async def run_band(
    bench: Bench, spec: BandSpec, configs: Sequence[str] = CONFIGS
) -> dict[str, Any]:
    """The conversation against each configuration; ``band.{json,txt}``."""
    reports = []
    started = time.monotonic()
    for name in configs:
        bench.say(f"band/{name}: {spec.turns} turns")
        reports.append(await _conversation(name, bench.setup, spec))
        bench.say(f"band/{name}: {reports[-1]['busy_s']} s busy, {reports[-1]['wall_s']} s")
    return await write_run(bench, "band", spec, band_table, started, configs=reports)


def band_table(result: dict[str, Any]) -> str:
    configs = result["configs"]

    def turn(index: int) -> Any:
        def cell(c: dict[str, Any]) -> str:
            t = c["turns"][index]
            return f"{t['prompt_tokens']} / {t['computed_tokens']} / {fmt(t['seconds'], ' s')}"

        return cell

    def band(c: dict[str, Any]) -> str:
        return "–" if not c["band"] else "–".join(str(v) for v in c["band"])

    rows: list[Row] = [
        ("compact at / from", lambda c: f"{c['compact_at']} / {c['compact_from'] or '–'}"),
        ("compactions", lambda c: fmt(c["compactions"])),
        ("prompt once one is in force (min–max)", band),
        ("prompt tokens sent, all turns", lambda c: fmt(c["prompt_total"])),
        ("prompt tokens llama-server computed", lambda c: fmt(c["engine_prompt_computed"])),
        ("tokens llama-server generated", lambda c: fmt(c["engine_generated"])),
        ("client busy (turns only)", lambda c: fmt(c["busy_s"], " s")),
        ("slowest turn", lambda c: fmt(max((t["seconds"] for t in c["turns"]), default=0.0), " s")),
        ("idle work waited for", lambda c: fmt(c["idle_wait_s"], " s")),
    ]
    rows += [
        (f"turn {i}: prompt / computed / time", turn(i))
        for i in range(len(configs[0]["turns"]) if configs else 0)
    ]
    spec = result["spec"]
    return render_table(configs, rows) + (
        f"\n\nOne conversation of {spec['turns']} turns ({spec['lines']} lines of notes each) "
        f"on {result['slots']} slots of {result['ctx_per_slot']} tokens."
    )
