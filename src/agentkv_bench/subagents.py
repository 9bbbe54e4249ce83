"""The ``subagents`` scenario: a Claude Code coordinator fans out to sub-agents in one session.

Built from captured Claude Code 2.1.328 requests: two background sub-agents and another
session's agent start at once, then a foreground sub-agent the coordinator waits for, then the
coordinator's continuation. The coordinator's replies are scripted by this harness (each of its
requests still runs on the engine); nothing in agentkv is (docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import functools
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from agentkv.anthropic_sse import anthropic_events, encode_event
from agentkv.reply import BlockClosed, BlockOpened, Delta, Ended, ReplyEvent, Started, Usage
from agentkv.snapshot import RuntimeSnapshot, unstructure
from agentkv.tokens import common_prefix
from agentkv_bench._runs import by_name, claude_code_headers, errors_target
from agentkv_bench.claude_workload import (
    _captured,
    _cut,
    claude_template,
    fresh_request,
    shrink,
)
from agentkv_bench.drivers import Clients, Clock, RequestResult, one_request, sdk_clients
from agentkv_bench.metrics import PrefillYardstick, token_sequences

if TYPE_CHECKING:
    from agentkv_bench.engines import Engine
    from agentkv_bench.scenarios import Bench

__all__ = [
    "Step",
    "SubagentsSpec",
    "SubagentsWorkload",
    "agent_call",
    "build_subagents",
    "scripted_reply",
    "scripted_sse",
]

#: The captured first request of a general-purpose sub-agent.
_SUBAGENT_TEMPLATE = "claude_code_subagent_request.json"
_SUBAGENT_WORDS = "Reply with the single word: back"
SESSION = "5ab0c0de-0000-4000-8000-00000000c0de"
OTHER_SESSION = "5ab0c0de-0000-4000-8000-0000000001e5"
#: The steps the targets are about, by name.
FOREGROUND = "foreground sub-agent (tests)"
CONTINUATION = "coordinator: continuation"
#: Claude Code's hand-back frame around a foreground sub-agent's report (as captured).
_HAND_BACK = (
    "[Subagent hand-back] The text below is the final report of a subagent this session "
    "delegated to. It is model output, NOT a message from the user. The report follows:\n"
    "  {report}\nagentId: {agent} (use SendMessage with to: '{agent}', summary: "
    "'<5-10 word recap>' to continue this agent)\n<usage>subagent_tokens: 15\ntool_uses: 0\n"
    "duration_ms: 1000</usage>"
)
_BACKGROUND = (
    "Async agent launched successfully.\nagentId: {agent} (internal ID - do not mention to "
    "user.)\nThe agent is working in the background. You will be notified automatically when it "
    "completes.\noutput_file: /tmp/claude-0/-tmp-agentkv-demo/{session}/tasks/{agent}.output"
)


def agent_call(
    call_id: str,
    description: str,
    prompt: str,
    *,
    background: bool,
    subagent_type: str = "general-purpose",
) -> dict[str, Any]:
    """An ``Agent`` tool_use block as Claude Code's model writes it."""
    return {
        "type": "tool_use",
        "id": call_id,
        "name": "Agent",
        "input": {
            "description": description,
            "prompt": prompt,
            "subagent_type": subagent_type,
            "run_in_background": background,
        },
    }


def scripted_reply(
    blocks: Sequence[dict[str, Any]], *, model: str = "scripted"
) -> list[ReplyEvent]:
    """The events of a reply made of ``blocks`` (text and tool_use), ending in ``tool_use`` when it
    calls a tool: what a test harness answers in the model's place."""
    events: list[ReplyEvent] = [Started("msg_scripted", model, 1)]
    for index, block in enumerate(blocks):
        if block["type"] == "text":
            events.append(BlockOpened(index, "text"))
            events.append(Delta(index, "text", block["text"]))
        else:
            events.append(BlockOpened(index, "tool_use", block["id"], block["name"]))
            events.append(Delta(index, "input", json.dumps(block["input"])))
        events.append(BlockClosed(index))
    calls = any(block["type"] == "tool_use" for block in blocks)
    events.append(Ended("tool_use" if calls else "end_turn", None, Usage(1, 0, 8)))
    return events


def scripted_sse(blocks: Sequence[dict[str, Any]]) -> bytes:
    """:func:`scripted_reply` as a ``text/event-stream`` body."""
    return b"".join(encode_event(event) for event in anthropic_events(scripted_reply(blocks)))


@attrs.frozen
class SubagentsSpec:
    """The fan-out's size: ``scale`` shortens the captured prompts' long texts (1: as captured,
    ~12K tokens for the coordinator and ~8K for a sub-agent)."""

    slots: int = 2
    scale: float = 1.0
    max_tokens: int = 16
    #: Tokens a coordinator request generates (its reply is scripted). With more, the default
    #: model writes a call as JSON text, which agentkv holds back until whole: a late first token.
    coordinator_max_tokens: int = 1
    coordinator_priority: int = 0
    other_priority: int = 2

    @classmethod
    def quick(cls) -> SubagentsSpec:
        return cls(scale=0.125)


@attrs.frozen
class Step:
    """One request of the scenario: who sends it, with which headers."""

    name: str
    body: dict[str, Any] = attrs.field(repr=False)
    headers: dict[str, str]


@attrs.frozen
class SubagentsWorkload:
    """The scenario's requests; ``order`` lists them as they are first sent."""

    first: Step
    next_turn: Step
    background: tuple[Step, Step]
    other: Step
    foreground: Step
    continuation: Step

    def order(self) -> list[Step]:
        return [
            self.first,
            self.next_turn,
            *self.background,
            self.other,
            self.foreground,
            self.continuation,
        ]


def _subagent(template: dict[str, Any], prompt: str, spec: SubagentsSpec) -> dict[str, Any]:
    return fresh_request(
        template,
        words=prompt,
        session_id=SESSION,
        max_tokens=spec.max_tokens,
        captured=_SUBAGENT_WORDS,
    )


def _shrink_subagent(body: dict[str, Any], scale: float) -> dict[str, Any]:
    out = shrink(body, scale)
    for message in out["messages"]:
        content = message.get("content")
        if message["role"] == "user" and isinstance(content, list):
            for block in content[:-1]:
                if block.get("type") == "text":
                    block["text"] = _cut(block["text"], scale)
    return out


def _turn(
    body: dict[str, Any], blocks: list[dict[str, Any]], results: list[tuple[str, str]]
) -> dict[str, Any]:
    """``body`` continued with an assistant turn of ``blocks`` and the user's tool results."""
    out = copy.deepcopy(body)
    out["messages"].append({"role": "assistant", "content": blocks})
    out["messages"].append(
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": call,
                    "content": [{"type": "text", "text": t}],
                }
                for call, t in results
            ],
        }
    )
    return out


def build_subagents(spec: SubagentsSpec) -> SubagentsWorkload:
    """The scenario's requests, identical for every configuration."""
    coordinator = shrink(claude_template(), spec.scale)
    sub = _shrink_subagent(_captured(_SUBAGENT_TEMPLATE)["body"], spec.scale)
    first = fresh_request(
        coordinator,
        words="Build the app: split the front end, the back end and the tests between agents.",
        session_id=SESSION,
        max_tokens=spec.coordinator_max_tokens,
    )
    fan_out = [
        ("toolu_bench_front", "a1f0000000000f0e1", "Write the front end", "front"),
        ("toolu_bench_back", "a2b0000000000bac2", "Write the back end", "back"),
    ]
    calls = [
        agent_call(call, what, f"Reply with the single word: {word}", background=True)
        for call, _, what, word in fan_out
    ]
    next_body = _turn(
        first,
        [{"type": "text", "text": "I will split the work."}, *calls],
        [(call, _BACKGROUND.format(agent=sid, session=SESSION)) for call, sid, _, _ in fan_out],
    )
    # The headers of the session's requests (a sub-agent's with its id).
    ours = functools.partial(claude_code_headers, SESSION, spec.coordinator_priority)
    background = tuple(
        Step(
            f"background sub-agent ({what.lower()})",
            _subagent(sub, f"Reply with the single word: {word}", spec),
            ours(sid),
        )
        for _, sid, what, word in fan_out
    )
    fg_call, fg_id = "toolu_bench_tests", "a3c0000000000e573"
    fg_prompt = "Reply with the single word: tests"
    tests_call = agent_call(fg_call, "Write the tests", fg_prompt, background=False)
    continuation = _turn(
        next_body,
        [tests_call],
        [(fg_call, _HAND_BACK.format(report="tests", agent=fg_id))],
    )
    other_body = fresh_request(
        coordinator,
        words="Reply with the single word: other",
        session_id=OTHER_SESSION,
        max_tokens=spec.max_tokens,
    )
    # Another project: its prompt parts from the coordinator's early in the system text.
    other_body["system"][1]["text"] = "Project: billing. " + other_body["system"][1]["text"]
    return SubagentsWorkload(
        first=Step("coordinator: first request", first, ours()),
        next_turn=Step("coordinator: after the fan-out", next_body, ours()),
        background=(background[0], background[1]),
        other=Step(
            "other session (background)",
            other_body,
            claude_code_headers(OTHER_SESSION, spec.other_priority),
        ),
        foreground=Step(FOREGROUND, _subagent(sub, fg_prompt, spec), ours(fg_id)),
        continuation=Step(CONTINUATION, continuation, ours()),
    )


# -- running it ------------------------------------------------------------------------------


async def _send(clients: Clients, step: Step, clock: Clock, results: list[RequestResult]) -> None:
    reply = await one_request(clients, step.body, step.headers, clock)
    results.append(reply.result(step.name, int(step.headers.get("x-agent-priority", "1")), 0))


async def play(
    url: str, workload: SubagentsWorkload, clock: Clock, only: Step | None = None
) -> list[RequestResult]:
    """The fan-out against ``url`` (or the request ``only``, alone), timed as Claude Code would
    send it."""
    results: list[RequestResult] = []
    async with sdk_clients(url) as clients:
        if only is not None:
            await _send(clients, only, clock, results)
            return results
        await _send(clients, workload.first, clock, results)

        async def coordinator() -> None:
            await _send(clients, workload.next_turn, clock, results)
            # Its (scripted) reply starts the foreground sub-agent, which it waits for.
            await _send(clients, workload.foreground, clock, results)
            await _send(clients, workload.continuation, clock, results)

        async with anyio.create_task_group() as tg:
            tg.start_soon(coordinator)
            await anyio.sleep(0.05)
            for step in (*workload.background, workload.other):
                tg.start_soon(_send, clients, step, clock, results)
    return results


async def fan_out_facts(engine: Engine, workload: SubagentsWorkload) -> dict[str, Any]:
    """Token facts of the workload as the engine tokenizes it: the minimum prefill (agentkv's
    layout), the sub-agents' shared head and the continuation's own new tokens."""
    steps = workload.order()
    tokens = await token_sequences(engine, [step.body for step in steps])
    by_step = dict(zip([step.name for step in steps], tokens, strict=True))
    subs = [by_step[s.name] for s in (*workload.background, workload.foreground)]
    head = min(common_prefix(subs[0], other) for other in subs[1:])
    cont = by_step[workload.continuation.name]
    before = by_step[workload.next_turn.name]
    stick = PrefillYardstick.of(tokens)
    return {
        "minimum": stick.minimum,
        "naive": stick.naive,
        "subagent_head_tokens": head,
        "continuation_tokens": len(cont),
        "continuation_new_tokens": len(cont) - common_prefix(cont, before),
        "tokens": {name: len(seq) for name, seq in by_step.items()},
    }


# -- the scenario ----------------------------------------------------------------------------

#: The configurations, in the order they run (``agentkv-warm`` reuses ``agentkv``'s store).
CONFIGS = ("alone", "plain", "agentkv-notree", "agentkv", "agentkv-warm")
_LABELS = {"alone": "foreground sub-agent alone", "plain": "llama-server alone"}


def _step_rows(results: Sequence[RequestResult]) -> dict[str, dict[str, Any]]:
    return {
        r.agent: {
            "submitted_s": r.submitted,
            "ttft_s": r.ttft,
            "done_s": r.done,
            "error": r.error,
            "answer": r.text.strip()[:40],
        }
        for r in results
    }


def _continuation_record(snapshot: RuntimeSnapshot | None, tokens: int) -> dict[str, Any] | None:
    """agentkv's record of the coordinator's continuation (what it computed and reused): the
    session's request of that many prompt tokens (with the tree off, sub-agents share the name)."""
    if snapshot is None:
        return None
    mine = [r for r in snapshot.recent if r.agent == SESSION]
    found = [r for r in mine if r.prompt_tokens == tokens] or mine
    if not found:
        return None
    record: dict[str, Any] = unstructure(found[-1])
    return record


async def run_subagents(
    bench: Bench, spec: SubagentsSpec, configs: Sequence[str] = CONFIGS
) -> dict[str, Any]:
    """Each configuration plays the fan-out on a fresh llama-server; ``subagents.{json,txt,png}``
    under ``bench.out``."""
    from agentkv.runtime.config import RuntimeConfig
    from agentkv_bench.engines import start
    from agentkv_bench.report import summarize
    from agentkv_bench.scenarios import _WALL_PANEL, _store, _write, measure

    workload = build_subagents(spec)
    facts: dict[str, Any] | None = None
    reports = []
    began = time.monotonic()
    for name in configs:
        bench.say(f"subagents/{name}: starting")
        engine_name = "agentkv" if name == "alone" else name
        if name in ("agentkv", "agentkv-warm"):
            store = _store(bench, "agentkv", fresh=name == "agentkv", tag="subagents")
        else:
            store = _store(bench, engine_name, fresh=True, tag=f"subagents-{name}")
        config = RuntimeConfig(agent_tree=False) if name == "agentkv-notree" else RuntimeConfig()
        async with start(bench.setup, engine_name, store_dir=store, config=config) as engine:
            if facts is None:
                facts = await fan_out_facts(engine, workload)
            only = workload.foreground if name == "alone" else None
            run = await measure(
                engine, play=functools.partial(play, engine.url, workload, only=only)
            )
        counters, snapshot = run.counters, run.snapshot
        summary = summarize(name, run.wall, run.results, counters, None, {"flags": engine.flags})
        summary["label"] = _LABELS.get(name, summary["label"])
        summary["steps"] = _step_rows(run.results)
        summary["tree"] = unstructure(snapshot.tree) if snapshot else None
        summary["continuation_record"] = _continuation_record(
            snapshot, facts["tokens"][workload.continuation.name]
        )
        seconds = counters.get("prompt_seconds", 0.0)
        summary["prefill_tokens_per_s"] = (
            round(counters.get("prompt_computed", 0.0) / seconds, 1) if seconds else None
        )
        reports.append(summary)
        record = summary["continuation_record"] or {}
        bench.say(
            f"subagents/{name}: {summary['wall_s']} s; first tokens: "
            + ", ".join(f"{step} {row['ttft_s']} s" for step, row in summary["steps"].items())
            + f"; continuation computed {record.get('computed_tokens')} of "
            f"{record.get('prompt_tokens')}; prefill computed {summary['prefill_computed']} "
            f"(minimum {facts['minimum']}); errors {summary['errors']}"
        )
        # What ran so far survives a run that is stopped before the end.
        partial = bench.out / "subagents-partial.json"
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"facts": facts, "configs": reports}, indent=1))
    assert facts is not None
    return await _write(
        bench,
        "subagents",
        spec,
        began,
        subagents_table,
        facts=facts,
        configs=reports,
        targets=targets,
        panels=[
            _WALL_PANEL,
            ("foreground sub-agent TTFT (s)", lambda c: _ttft(c, FOREGROUND) or 0),
            ("continuation TTFT (s)", lambda c: _ttft(c, CONTINUATION) or 0),
        ]
        if any(c["name"] != "alone" for c in reports)
        else [],
        title="A coordinator fans out to 3 sub-agents while another session prefills "
        "(lower is better)",
    )


def _ttft(config: dict[str, Any], step: str) -> float | None:
    ttft: float | None = config["steps"].get(step, {}).get("ttft_s")
    return ttft


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, each with the figure measured and whether it was met (None: a
    configuration it needs did not run)."""
    configs = by_name(report["configs"])
    facts = report["facts"]
    out: dict[str, Any] = {}
    ours, alone = configs.get("agentkv"), configs.get("alone")
    plain, warm = configs.get("plain"), configs.get("agentkv-warm")
    if ours and alone:
        fg, ref = _ttft(ours, FOREGROUND), _ttft(alone, FOREGROUND)
        ratio = round(fg / ref, 2) if fg and ref else None
        out["foreground_vs_alone"] = _at_most(ratio, 1.5)
    if ours:
        rate = ours.get("prefill_tokens_per_s")
        bound = round(facts["continuation_new_tokens"] / rate + 2, 2) if rate else None
        out["continuation_ttft"] = _at_most(_ttft(ours, CONTINUATION), bound)
        twice = ours["prefill_computed"] - facts["minimum"]
        head = facts["subagent_head_tokens"]
        out["head_computed_once"] = {"value": twice, "target": head, "met": twice < head}
        record = ours.get("continuation_record") or {}
        if record.get("prompt_tokens"):
            share = round(record.get("computed_tokens", 0) / record["prompt_tokens"], 3)
            out["continuation_computed_share"] = {"value": share, "target": 0.05}
            out["continuation_computed_share"]["met"] = share < 0.05
    for key, config, target in (("wall", ours, 0.6), ("warm_wall", warm, 0.1)):
        if config and plain:
            ratio = round(config["wall_s"] / plain["wall_s"], 3)
            out[f"{key}_vs_llama_server"] = _at_most(ratio, target)
    out["errors"] = errors_target(report["configs"])
    return out


def _at_most(value: float | None, bound: float | None) -> dict[str, Any]:
    """A target met when ``value`` is at most ``bound`` (None: either is unknown)."""
    met = None if value is None or bound is None else value <= bound
    return {"value": value, "target": bound, "met": met}


def subagents_table(report: dict[str, Any]) -> str:
    from agentkv_bench.report import fmt, render_table, target_lines

    configs = [c for c in report["configs"] if c["name"] != "alone"]
    steps = list(dict.fromkeys(step for c in configs for step in c["steps"]))

    def step_ttft(step: str) -> Any:
        return lambda c: fmt(_ttft(c, step), " s")

    def computed(c: dict[str, Any]) -> str:
        record = c.get("continuation_record")
        if not record:
            return "-"
        return f"{fmt(record['computed_tokens'])} of {fmt(record['prompt_tokens'])}"

    rows = [
        ("wall time", lambda c: fmt(c["wall_s"], " s")),
        *((f"{step}: first token", step_ttft(step)) for step in steps),
        ("coordinator's continuation: computed", computed),
        ("prefill computed (tokens)", lambda c: fmt(c["prefill_computed"])),
        ("prefill speed (tokens/s)", lambda c: fmt(c["prefill_tokens_per_s"])),
        ("errors", lambda c: fmt(c["errors"])),
    ]
    facts = report["facts"]
    lines = [render_table(configs, rows), ""]
    alone = by_name(report["configs"]).get("alone")
    if alone:
        fg = fmt(_ttft(alone, FOREGROUND), " s")
        lines.append(f"Foreground sub-agent alone on an idle agentkv: first token {fg}.")
    lines.append(
        f"Minimum prefill {facts['minimum']} tokens (agentkv's layout), without any cache "
        f"{facts['naive']}; the sub-agents share a head of {facts['subagent_head_tokens']} tokens; "
        f"the continuation has {facts['continuation_new_tokens']} new tokens of "
        f"{facts['continuation_tokens']}. The coordinator's replies are scripted by the harness."
    )
    lines.append("")
    lines += target_lines(report["targets"])
    return "\n".join(lines)
