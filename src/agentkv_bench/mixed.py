"""The ``mixed`` scenario: Claude Code agents and Codex agents on one engine, in one run.

Claude Code agents stream ``/v1/messages`` and Codex agents ``/v1/responses``, from requests
captured from the real CLIs, each with its own headers and priorities; ``direct`` (each client to
llama-server itself, Codex as Chat Completions) runs against ``agentkv``, and the starvation check
runs over agentkv's tickets of both APIs (docs/benchmarks.md).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from agentkv import MessagesTranslator
from agentkv.openai_translate import OpenAITranslator
from agentkv.runtime.lifecycle import Runtime
from agentkv.runtime.record import RequestRecord
from agentkv_bench._runs import by_name, claude_code_headers, errors_target
from agentkv_bench.claude_workload import ClaudeSpec, build_claude_workload
from agentkv_bench.codex_workload import (
    CodexSession,
    codex_follow_up,
    codex_template,
    fresh_codex_request,
    shrink_codex,
)
from agentkv_bench.drivers import RequestResult
from agentkv_bench.engines import Engine, start
from agentkv_bench.metrics import PrefillYardstick, yardsticks
from agentkv_bench.report import (
    Row,
    fmt,
    percentile,
    render_table,
    rounded,
    summarize,
    target_lines,
)
from agentkv_bench.scenarios import (
    _WALL_PANEL,
    Bench,
    _as_dicts,
    _first_answer,
    _hits,
    _slowest_first,
    _store,
    _write,
    answers_correct,
    measure,
)
from agentkv_bench.workload import WORDS, Agent, Workload

__all__ = [
    "CONFIGS",
    "MixedSpec",
    "TicketTimes",
    "build_mixed",
    "direct_workload",
    "messages_view",
    "mixed_table",
    "run_mixed",
    "starvation",
]

#: The configurations, in the order they run.
CONFIGS = ("direct", "agentkv")
#: The API each kind of agent speaks, as the report names it.
API_NAMES = {"messages": "Claude Code", "responses": "Codex", "chat": "Codex"}
_LABELS = {"direct": "each client direct to llama-server", "agentkv": "agentkv + llama-server"}
#: Slack allowed in the starvation check: arrival and dispatch are read from the records, whose
#: times are rounded to 0.1 ms and taken when the request's task runs, a little after the lease.
_TOLERANCE_S = 0.05


@attrs.frozen
class MixedSpec:
    """``claude_agents`` Claude Code agents and ``codex_agents`` Codex agents on ``slots`` slots,
    ``turns`` requests each. ``scale`` shortens the captured prompts' long texts (1: as captured,
    ~11.8K tokens for Claude Code, ~10K for Codex)."""

    claude_agents: int = 2
    codex_agents: int = 2
    slots: int = 2
    turns: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    max_tokens: int = 16
    scale: float = 1.0
    #: Agent i of each kind runs at priorities[i % len(priorities)].
    priorities: tuple[int, ...] = (1, 2)

    @classmethod
    def quick(cls) -> MixedSpec:
        """CI-sized: the same shape with the texts cut to an eighth (~1.5K tokens a prompt)."""
        return cls(scale=0.125)

    def priority(self, index: int) -> int:
        return self.priorities[index % len(self.priorities)]


def _word(index: int) -> str:
    return f"Reply with the single word: {WORDS[index % len(WORDS)]}"


def _claude_agents(spec: MixedSpec) -> list[Agent]:
    claude = ClaudeSpec(
        agents=spec.claude_agents,
        slots=spec.slots,
        sessions=1,
        followups=spec.turns - 1,
        max_tokens=spec.max_tokens,
        scale=spec.scale,
    )
    agents = []
    for index, agent in enumerate(build_claude_workload(claude, salt="mixed").agents):
        user = json.loads(agent.requests[0]["metadata"]["user_id"])
        headers = claude_code_headers(user["session_id"], spec.priority(index))
        agents.append(
            attrs.evolve(
                agent,
                name=f"claude-{index}",
                priority=spec.priority(index),
                headers=tuple(headers.items()),
            )
        )
    return agents


def _codex_agents(spec: MixedSpec) -> list[Agent]:
    template, captured_headers = codex_template()
    template = shrink_codex(template, spec.scale)
    agents = []
    for index in range(spec.codex_agents):
        session = CodexSession(
            session_id=f"01a23002-0000-7000-8000-{0xC0DE0000 + index:012x}",
            turn_id=f"01a23002-0001-7000-8000-{0xC0DE0000 + index:012x}",
        )
        body = fresh_codex_request(
            template,
            words=_word(spec.claude_agents + index),
            session=session,
            max_tokens=spec.max_tokens,
        )
        # Each follow-up continues the request before it.
        requests = itertools.accumulate(range(spec.turns - 1), codex_follow_up, initial=body)
        priority = spec.priority(index)
        agents.append(
            Agent(
                name=f"codex-{index}",
                priority=priority,
                requests=tuple(requests),
                api="responses",
                headers=tuple(session.headers(captured_headers, priority).items()),
            )
        )
    return agents


def build_mixed(spec: MixedSpec) -> Workload:
    """The agents, Claude Code and Codex taking turns (``claude-0``, ``codex-0``, ``claude-1``, …),
    so that the arrival order mixes the APIs; identical for every configuration."""
    claude, codex = _claude_agents(spec), _codex_agents(spec)
    agents: list[Agent] = []
    for index in range(max(len(claude), len(codex))):
        agents += claude[index : index + 1] + codex[index : index + 1]
    return Workload(agents=tuple(agents))


def _as_messages(agent: Agent, body: Mapping[str, Any]) -> dict[str, Any]:
    """The Messages body of one request (a Codex body through :class:`OpenAITranslator`, as
    agentkv's ``/v1/responses`` translates it)."""
    if agent.api == "responses":
        return OpenAITranslator().responses(body).body
    return dict(body)


def messages_view(workload: Workload) -> Workload:
    """``workload`` with every request as its Messages body: what the yardsticks tokenize and
    the one-word answers are checked against."""
    agents = tuple(
        attrs.evolve(
            agent,
            api="messages",
            requests=tuple(_as_messages(agent, body) for body in agent.requests),
        )
        for agent in workload.agents
    )
    return attrs.evolve(workload, agents=agents)


def direct_workload(workload: Workload) -> Workload:
    """``workload`` as each client sends it to llama-server itself: Claude Code's bodies to its
    ``/v1/messages`` as they are; Codex's as the Chat Completions body a direct client sends
    (llama-server has no ``/v1/responses``), in the order the client wrote it."""
    translator = MessagesTranslator(session_layout=False)
    agents = []
    for agent in workload.agents:
        if agent.api == "responses":
            bodies = tuple(
                translator.translate(_as_messages(agent, body)).body for body in agent.requests
            )
            agent = attrs.evolve(agent, api="chat", requests=bodies)
        agents.append(agent)
    return attrs.evolve(workload, agents=tuple(agents))


def _identities(workload: Workload) -> dict[str, str]:
    """agentkv's agent id of each agent (from the client's own headers) → the agent's name."""
    ids = {}
    for agent in workload.agents:
        headers = dict(agent.headers)
        key = headers.get("thread-id") or headers.get("x-claude-code-session-id") or agent.name
        ids[key] = agent.name
    return ids


# -- the starvation check -------------------------------------------------------------------


@attrs.frozen
class TicketTimes:
    """One request's ticket as agentkv's record tells it: when it arrived and got its slot
    (seconds on the runtime's clock), in which order, and what it computed."""

    agent: str
    api: str
    priority: int
    arrival: float
    dispatch: float
    seq: int | None
    #: Prompt tokens the engine computed for it, a head computed on its own first included.
    computed: int = 0
    cached: int = 0
    prompt_tokens: int = 0
    status: str = "ok"

    @property
    def waited(self) -> float:
        return self.dispatch - self.arrival


def ticket_log(
    runtime: Runtime, names: Mapping[str, str], apis: Mapping[str, str]
) -> list[TicketTimes]:
    """The tickets of ``runtime`` from now on (a record listener fills the list), each named by
    ``names``."""
    tickets: list[TicketTimes] = []

    def heard(record: RequestRecord) -> None:
        # Called as the request ends: its record's total_s runs from its arrival to now.
        arrival = runtime.clock() - (record.total_s or 0.0)
        name = names.get(record.agent, record.agent)
        tickets.append(
            TicketTimes(
                agent=name,
                api=apis.get(name, "?"),
                priority=record.priority,
                arrival=arrival,
                dispatch=arrival + record.queued_s,
                seq=record.dispatch_seq,
                computed=record.computed_tokens,
                cached=record.cached_tokens,
                prompt_tokens=record.prompt_tokens,
                status=record.outcome,
            )
        )

    runtime.add_listener(heard)
    return tickets


def starvation(
    tickets: Sequence[TicketTimes], *, aging: float, tie_window: float
) -> dict[str, Any]:
    """The starvation check over ``tickets`` of every API together.

    :mod:`agentkv.scheduler` proves: if ticket U is dispatched while ticket T waits, then
    ``arrival(U) - arrival(T) <= (priority(T) - priority(U) + tie_window) / aging``. The check
    holds when no such pair (by the gateway's dispatch order) passes it; also each API's worst
    wait for a slot and the window ``(p + tie_window) / aging`` in which it could be overtaken.
    """
    dispatched = [t for t in tickets if t.seq is not None]
    worst_pair: dict[str, Any] | None = None
    pairs = 0
    for waiting, ahead in itertools.permutations(dispatched, 2):
        assert ahead.seq is not None and waiting.seq is not None
        if ahead.seq > waiting.seq or ahead.dispatch <= waiting.arrival:
            continue
        pairs += 1
        bound = (waiting.priority - ahead.priority + tie_window) / aging
        overtook = ahead.arrival - waiting.arrival
        margin = bound - overtook
        if worst_pair is None or margin < worst_pair["margin_s"]:
            worst_pair = {
                "waiting": f"{waiting.agent} (P{waiting.priority})",
                "ahead": f"{ahead.agent} (P{ahead.priority})",
                "arrived_after_s": round(overtook, 3),
                "bound_s": round(bound, 3),
                "margin_s": round(margin, 3),
            }
    per_api: dict[str, Any] = {}
    for api in sorted({t.api for t in tickets}):
        mine = [t for t in dispatched if t.api == api]
        worst = max(mine, key=lambda t: t.waited, default=None)
        per_api[api] = {
            "requests": len(mine),
            "worst_wait_s": None if worst is None else round(worst.waited, 3),
            "worst_wait_agent": None if worst is None else worst.agent,
            "window_s": None if worst is None else round((worst.priority + tie_window) / aging, 3),
        }
    holds = worst_pair is None or worst_pair["margin_s"] >= -_TOLERANCE_S
    worst = max(dispatched, key=lambda t: t.waited, default=None)
    return {
        "aging": aging,
        "tie_window": tie_window,
        "tickets": len(tickets),
        "undispatched": len(tickets) - len(dispatched),
        "pairs_overtaken": pairs,
        "worst_pair": worst_pair,
        "worst_wait_s": None if worst is None else round(worst.waited, 3),
        "worst_wait_agent": None if worst is None else f"{worst.agent} (P{worst.priority})",
        "per_api": per_api,
        "holds": holds and len(dispatched) == len(tickets),
    }


# -- the scenario ---------------------------------------------------------------------------


def _per_api(
    results: Sequence[RequestResult], apis: Mapping[str, str], sticks: Mapping[str, int]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for api in sorted(set(apis.values())):
        mine = [r for r in results if apis.get(r.agent) == api]
        ttfts = [r.ttft for r in mine if r.ttft is not None]
        out[api] = {
            "requests": len(mine),
            "errors": sum(1 for r in mine if r.error is not None),
            "ttft_p50_s": rounded(percentile(ttfts, 0.5)),
            "ttft_worst_s": rounded(max(ttfts, default=None)),
            "prefill_minimum": sticks.get(api),
        }
    return out


async def _api_minimums(
    engine: Engine, view: Workload, apis: Mapping[str, str]
) -> dict[str, dict[str, int]]:
    """Each API's minimum prefill over its own agents' prompts, in each layout."""
    out: dict[str, dict[str, int]] = {"client": {}, "agentkv": {}}
    for api in sorted(set(apis.values())):
        agents = tuple(a for a in view.agents if apis[a.name] == api)
        sticks = await yardsticks(engine, [attrs.evolve(view, agents=agents)])
        for layout, minimums in out.items():
            minimums[api] = sticks[layout].minimum
    return out


async def run_mixed(
    bench: Bench, spec: MixedSpec, configs: Sequence[str] = CONFIGS
) -> dict[str, Any]:
    """Each configuration runs the workload on a fresh llama-server; ``mixed.{json,txt,png}``."""
    workload = build_mixed(spec)
    view = messages_view(workload)
    direct = direct_workload(workload)
    apis = {agent.name: API_NAMES[agent.api] for agent in workload.agents}
    sticks: dict[str, PrefillYardstick] = {}
    api_minimum: dict[str, dict[str, int]] = {}
    reports = []
    began = time.monotonic()
    for name in configs:
        if name not in CONFIGS:
            raise ValueError(f"unknown configuration {name!r}")
        bench.say(f"mixed/{name}: starting")
        engine_name, layout = ("plain", "client") if name == "direct" else ("agentkv", "agentkv")
        store = _store(bench, engine_name, fresh=True, tag="mixed")
        async with start(bench.setup, engine_name, store_dir=store) as engine:
            if not sticks:
                sticks = await yardsticks(engine, [view])
                api_minimum = await _api_minimums(engine, view, apis)
            runtime = engine.runtime
            tickets = None if runtime is None else ticket_log(runtime, _identities(workload), apis)
            bench.say(f"mixed/{name}: {workload.n_requests} requests from {len(apis)} agents")
            run = await measure(engine, [("", direct if name == "direct" else workload)])
            config = runtime.config if runtime is not None else None
        correct, asked = answers_correct(view, run.results)
        extra = {"flags": engine.flags, "layout": layout, "answers_correct": correct}
        summary = summarize(name, run.wall, run.results, run.counters, sticks[layout], extra)
        summary["asked"] = asked
        summary["label"] = _LABELS[name]
        summary["api"] = apis
        summary["per_api"] = _per_api(run.results, apis, api_minimum[layout])
        summary["agentkv"] = _hits(run.snapshot)
        if tickets is not None and config is not None:
            summary["tickets"] = [attrs.asdict(t) for t in tickets]
            for api, row in summary["per_api"].items():
                row["prefill_computed"] = sum(t.computed for t in tickets if t.api == api)
            summary["starvation"] = starvation(
                tickets, aging=config.aging, tie_window=config.tie_window
            )
        reports.append(summary)
        bench.say(
            f"mixed/{name}: {summary['wall_s']} s; prefill {summary['prefill_computed']} "
            f"(minimum {summary['prefill_minimum']}); errors {summary['errors']}"
        )
    return await _write(
        bench,
        "mixed",
        spec,
        began,
        mixed_table,
        yardsticks=_as_dicts(sticks),
        api_minimum=api_minimum,
        configs=reports,
        targets=targets,
        panels=[
            _WALL_PANEL,
            ("prefill / minimum", lambda c: c["prefill_ratio"] or 0),
            ("slowest first answer (s)", lambda c: _slowest_first(c) or 0),
        ],
        title=f"{spec.claude_agents} Claude Code + {spec.codex_agents} Codex agents × "
        f"{spec.turns} turns on {spec.slots} slots (lower is better)",
    )


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's checks: every agent of both kinds answered, none starved (the scheduler's
    bound held over both APIs), no errors. None: the configuration it needs did not run."""
    configs = by_name(report["configs"])
    out: dict[str, Any] = {}
    ours = configs.get("agentkv")
    if ours is not None and "starvation" in ours:
        check = ours["starvation"]
        pair = check["worst_pair"]
        out["starvation_bound"] = {
            "value": None if pair is None else pair["margin_s"],
            "target": f">= -{_TOLERANCE_S} s margin",
            "met": check["holds"],
        }
    for name, config in configs.items():
        answered = [a for a in config["agents"].values() if a["first_ttft_s"] is not None]
        out[f"{name}_every_agent_answered"] = {
            "value": f"{len(answered)}/{len(config['api'])}",
            "target": "all",
            "met": len(answered) == len(config["api"]),
        }
    out["errors"] = errors_target(report["configs"])
    return out


def _api_cell(api: str, key: str, unit: str = "") -> Callable[[dict[str, Any]], str]:
    return lambda c: fmt(c["per_api"].get(api, {}).get(key), unit)


def _api_ttft(api: str) -> Callable[[dict[str, Any]], str]:
    p50, worst = _api_cell(api, "ttft_p50_s", " s"), _api_cell(api, "ttft_worst_s", " s")
    return lambda c: f"{p50(c)} / {worst(c)}"


def _wait_cell(c: dict[str, Any]) -> str:
    check = c.get("starvation")
    if not check:
        return "-"
    return f"{fmt(check['worst_wait_s'], ' s')} ({check['worst_wait_agent']})"


def _bound_cell(c: dict[str, Any]) -> str:
    check = c.get("starvation")
    if not check:
        return "- (no scheduler)"
    pair = check["worst_pair"]
    verdict = "holds" if check["holds"] else "BROKEN"
    if pair is None:
        return f"{verdict}: no ticket went ahead of a waiting one"
    return (
        f"{verdict}: {check['pairs_overtaken']} went ahead of a waiting one; closest to the bound: "
        f"{pair['ahead']} ahead of {pair['waiting']}, arrived {fmt(pair['arrived_after_s'], ' s')} "
        f"after it, bound {fmt(pair['bound_s'], ' s')}"
    )


def mixed_table(report: dict[str, Any]) -> str:
    configs = report["configs"]
    first = configs[0]
    agents = list(first["api"])
    apis = sorted(set(first["api"].values()))
    priority = {row["agent"]: row["priority"] for row in first["per_request"]}
    rows: list[Row] = [
        ("wall time", lambda c: fmt(c["wall_s"], " s")),
        *(
            (
                f"{agent} ({first['api'][agent]}, P{priority.get(agent, '?')}): first answer",
                _first_answer(agent),
            )
            for agent in agents
        ),
        *((f"{api}: TTFT p50 / worst", _api_ttft(api)) for api in apis),
        ("prefill computed (tokens)", lambda c: fmt(c["prefill_computed"])),
        ("minimum, as this route lays prompts out", lambda c: fmt(c["prefill_minimum"])),
        ("computed / minimum", lambda c: fmt(c["prefill_ratio"], "×")),
        *(
            (f"{api}: {what}", _api_cell(api, key))
            for what, key in (
                ("computed (agentkv's records, checkpoints too)", "prefill_computed"),
                ("minimum of its own prompts", "prefill_minimum"),
            )
            for api in apis
        ),
        ("one-word answers right", lambda c: f"{c['answers_correct']}/{c['asked']}"),
        ("errors", lambda c: fmt(c["errors"])),
        ("worst wait for a slot", _wait_cell),
        ("starvation bound (both APIs)", _bound_cell),
    ]
    spec = report["workload"]
    mix = ", ".join(f"agent {i} of each kind P{p}" for i, p in enumerate(spec["priorities"]))
    check = next((c["starvation"] for c in configs if c.get("starvation")), None)
    lines = [render_table(configs, rows), ""]
    lines.append(
        f"{spec['claude_agents']} Claude Code agents (/v1/messages) and {spec['codex_agents']} "
        f"Codex agents (/v1/responses, streamed) × {spec['turns']} turns on {spec['slots']} "
        f"slots of {report['ctx_per_slot']} tokens, all fresh sessions started at once; prompt "
        f"scale {spec['scale']}; priorities: {mix}. Minimum prefill "
        f"{report['yardsticks']['client']['minimum']} tokens as sent, "
        f"{report['yardsticks']['agentkv']['minimum']} in agentkv's layout; without any cache "
        f"{report['yardsticks']['client']['naive']}."
    )
    if check is not None:
        lines.append(
            f"Starvation bound (agentkv.scheduler): a ticket U dispatched while T waits arrived "
            f"at most (p_T - p_U + {check['tie_window']}) / {check['aging']} s after T."
        )
    lines.append("")
    lines += target_lines(report["targets"], "Checks:")
    return "\n".join(lines)
