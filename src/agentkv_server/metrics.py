"""``GET /metrics``: the runtime in Prometheus' text format, through ``prometheus-client``.

Per-request series are fed by the runtime's request listener when a request ends; the rest are read
from the runtime's state at scrape time (:meth:`ServerMetrics.collect`). Each app has its own
registry, so several apps in a process never collide. No series is labelled by agent (agent ids
are client input and unbounded); every label takes a handful of values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.responses import Response

from agentkv.exceptions import AgentKVError
from agentkv.runtime.lifecycle import Runtime
from agentkv.runtime.record import RequestRecord
from agentkv.snapshot import CompactionRow

__all__ = ["ServerMetrics"]

#: Seconds: a warm request answers in well under a second; a cold 30,000-token prompt on a CPU
#: takes minutes.
_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320, 640)
_DURATION_BUCKETS = (0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320, 640, 1280, 1800)
#: What a divergence's section starts with; anything else counts as "other".
_SECTIONS = ("system", "tools", "tool", "message", "messages")
#: The store's counters: the metric's name (after ``agentkv_store_``), the field, the help.
_STORE_COUNTERS = (
    ("saves", "saves", "Slot states saved to the store"),
    ("restores", "restores", "Slot states restored from the store"),
    ("restored_tokens", "tokens_restored", "Prompt tokens restored instead of computed"),
    ("seconds_saved", "seconds_saved", "Estimated prefill seconds that restores saved"),
    ("save_seconds", "save_seconds", "Seconds spent saving slot states"),
    ("restore_seconds", "restore_seconds", "Seconds spent restoring slot states"),
    ("evictions", "evicted", "Entries deleted to stay within the budget"),
    ("expired", "expired", "Parked contexts deleted because their agent went away"),
    ("refused", "refused", "Entries refused at startup (another engine, bad file)"),
)
#: ``out``: the slot's engine, in a pool of engines, is down.
_STATES = ("idle", "prefilling", "decoding", "out")
#: Each series' help text, by name: the per-request series first, then those read at scrape time.
_HELP = {
    "agentkv_requests": "Requests that ran (were queued), by how they ended: ok, cancelled or the "
    "error type",
    "agentkv_refused_requests": "Messages requests answered with an error before they were queued "
    "(bad request, prompt too long, queue full, authentication), by error type",
    "agentkv_ttft_seconds": "Time from arrival to the first output event, queue wait included",
    "agentkv_request_duration_seconds": "Time from arrival to the end of the reply",
    "agentkv_queue_wait_seconds": "Time from arrival until the request got its slot",
    "agentkv_prompt_tokens": "Prompt tokens of finished requests as llama-server reported them: "
    "reused from its KV cache (cache_n) or computed (prompt_n)",
    "agentkv_output_tokens": "Tokens generated for finished requests",
    "agentkv_draft_tokens": "Speculative decoding of finished requests, as llama-server reported "
    "it: tokens drafted, and those the model accepted (accepted / drafted is the acceptance rate)",
    "agentkv_tool_call_retries": "Replies whose tool call could not be repaired and were asked for "
    "again, constrained",
    "agentkv_suspensions": "Times a request gave its slot up to a more urgent one and resumed "
    "later",
    "agentkv_stopped_requests": "Replies agentkv cut short, by reason (deadline: the client's "
    "timeout was near; repetition: a degenerate loop)",
    "agentkv_joined_retries": "Client retries of a running or just finished request that joined it "
    "instead of computing it again",
    "agentkv_cache_miss_seconds": "Estimated prefill seconds spent after a prompt left the best "
    "cached candidate, by the kind of section it left it in (system, tools, tool, message, other)",
    "agentkv_subagent_requests": "Requests of sub-agents (Claude Code's Agent tool), by whether "
    "their parent waited for them (they ran at its priority) or not (background, less urgent)",
    "agentkv_slots": "Engine slots by state",
    "agentkv_slot_tokens": "Tokens of KV cache each slot holds",
    "agentkv_queue_depth": "Requests waiting for a slot",
    "agentkv_queue_longest_wait_seconds": "How long the longest-waiting queued request has waited",
    "agentkv_queue_waiting_for_checkpoint": "Queued requests that wait for a shared prefix being "
    "computed, to restore it",
    "agentkv_background_queue_depth": "Background work (compactions, prepared compactions) waiting "
    "for an idle slot",
    "agentkv_checkpoints_running": "Shared prompt heads being computed to be saved for other "
    "agents",
    "agentkv_placements": "Slots handed out, by where the cached part of the prompt came from: the "
    "slot's own KV cache, the prefix store, or none (computed from scratch)",
    "agentkv_planned_prompt_tokens": "Prompt tokens agentkv expected to reuse or compute when it "
    "chose each slot",
    "agentkv_leases_reclaimed": "Slots taken back by the watchdog from requests that held them too "
    "long",
    "agentkv_store_enabled": "1 when the prefix store is on",
    "agentkv_store_entries": "Saved slot states in the prefix store",
    "agentkv_store_bytes": "Bytes of saved slot states on disk",
    "agentkv_store_budget_bytes": "The prefix store's size budget",
    **{f"agentkv_store_{name}": doc for name, _, doc in _STORE_COUNTERS},
    "agentkv_compactions": "Compactions in force (older messages replaced by a summary)",
    "agentkv_compactions_pending": "Compactions being computed",
    "agentkv_compaction_saved_tokens": "Prompt tokens the compactions in force save on every "
    "request",
    "agentkv_prepared_compactions": "Claude Code compaction requests (and their retries) predicted "
    "and prepared in idle time",
    "agentkv_prepared_compactions_served": "Prepared compactions whose request came as predicted "
    "after they had finished: served whole",
    "agentkv_prepared_compactions_joined": "Prepared compactions whose request came as predicted "
    "while they still ran: joined",
    "agentkv_prepared_compactions_missed": "Prepared compactions never served, by reason "
    "(not_compaction: the agent's next request was none; differs: another compaction request; "
    "expired, gave_way, failed, replaced)",
    "agentkv_prepared_compaction_wasted_tokens": "Tokens generated for prepared compactions that "
    "were never served (in idle time)",
    "agentkv_prepared_compactions_waiting": "Prepared compactions (and retries) waiting for their "
    "agent's request now",
    "agentkv_prepared_heads": "Conversations after a prepared compaction computed in idle time, up "
    "to the user's next words",
    "agentkv_prepared_heads_missed": "Of those, the ones whose request came otherwise than "
    "predicted (the log says where it parted)",
    "agentkv_agents": "Agents known to the agent tree: coordinators (a session or X-Agent-Id) and "
    "the sub-agents they started, by whether their parent waits for them",
    "agentkv_agents_waiting_for_subagents": "Agents waiting for their sub-agents now (their "
    "context is kept warm)",
    "agentkv_prefill_tokens_per_second": "Prompt tokens computed per second on an empty slot, as "
    "measured from the engine",
    "agentkv_decode_tokens_per_second": "Tokens generated per second, as measured from the engine",
    "agentkv_templated_prompts": "Prompts templated for placement and length checks: kept from "
    "before, or asked of the engine",
    "agentkv_tokenized_prompts": "Prompts tokenized: kept from before, from a kept prompt's tokens "
    "and the rest (pieces), or asked of the engine whole",
    "agentkv_engine_restarts": "Times the engine (llama-server) was restarted after it failed",
}


def _section_kind(section: object) -> str:
    word = str(section).split(" ", 1)[0].lower() if section else ""
    return word if word in _SECTIONS else "other"


class ServerMetrics(Collector):
    """The metrics of one app around one runtime; :meth:`response` is the scrape."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.registry = registry = CollectorRegistry()
        #: The engine's restarts so far, from the supervisor's status when there is one (in a
        #: pool of engines, every engine's summed).
        self.engine_restarts: Callable[[], int] = lambda: runtime.client.restarts

        def counter(name: str, *labels: str) -> Counter:
            return Counter(name, _HELP[name], labels, registry=registry)

        def histogram(name: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, _HELP[name], ["priority"], registry=registry, buckets=buckets)

        self.requests = counter("agentkv_requests", "status", "priority")
        self.refused = counter("agentkv_refused_requests", "type")
        self.ttft = histogram("agentkv_ttft_seconds", _LATENCY_BUCKETS)
        self.duration = histogram("agentkv_request_duration_seconds", _DURATION_BUCKETS)
        self.queue_wait = histogram("agentkv_queue_wait_seconds", _LATENCY_BUCKETS)
        self.prompt_tokens = counter("agentkv_prompt_tokens", "kind")
        self.output_tokens = counter("agentkv_output_tokens")
        self.draft_tokens = counter("agentkv_draft_tokens", "kind")
        self.tool_retries = counter("agentkv_tool_call_retries")
        self.suspensions = counter("agentkv_suspensions")
        self.stopped = counter("agentkv_stopped_requests", "reason")
        self.joined = counter("agentkv_joined_retries")
        self.divergence_seconds = counter("agentkv_cache_miss_seconds", "section")
        self.subagent_requests = counter("agentkv_subagent_requests", "waited_on")
        registry.register(self)
        runtime.add_listener(self.observe)

    def observe(self, record: RequestRecord) -> None:
        """Count one finished request (the runtime's listener)."""
        priority = str(record.priority)
        self.requests.labels(record.outcome, priority).inc()
        if record.ttft_s is not None:
            self.ttft.labels(priority).observe(record.ttft_s)
        if record.total_s is not None:
            self.duration.labels(priority).observe(record.total_s)
        if record.slot is not None:
            self.queue_wait.labels(priority).observe(record.queued_s)
        self.prompt_tokens.labels("reused").inc(record.cached_tokens)
        self.prompt_tokens.labels("computed").inc(record.computed_tokens)
        self.output_tokens.inc(record.output_tokens)
        self.draft_tokens.labels("drafted").inc(record.draft_tokens)
        self.draft_tokens.labels("accepted").inc(record.draft_accepted)
        if record.retried:
            self.tool_retries.inc()
        if record.suspended:
            self.suspensions.inc(record.suspended)
        if record.stopped:
            self.stopped.labels(record.stopped).inc()
        if record.attached > 1:
            self.joined.inc(record.attached - 1)
        if record.parent:
            self.subagent_requests.labels("true" if record.waited_on else "false").inc()
        divergence = record.divergence
        if isinstance(divergence, dict):
            seconds = divergence.get("seconds")
            if isinstance(seconds, int | float) and seconds > 0:
                self.divergence_seconds.labels(_section_kind(divergence.get("section"))).inc(
                    seconds
                )

    def refuse(self, path: str, exc: AgentKVError) -> None:
        """A Messages request was answered with an error before it reached the queue."""
        if path.startswith("/v1/messages") and not path.endswith("/count_tokens"):
            self.refused.labels(exc.error_type).inc()

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    def describe(self) -> list[Metric]:
        return []  # names are not known before the first scrape (the store may be off)

    def collect(self) -> Iterator[Metric]:
        """Gauges and counters that the runtime already keeps, read when Prometheus scrapes."""
        runtime = self.runtime
        snapshot = runtime.snapshot()
        slots, queue, placements = snapshot.slots, snapshot.queue, snapshot.placements
        yield _gauge(
            "agentkv_slots",
            {state: sum(1 for row in slots if row.state == state) for state in _STATES},
            label="state",
        )
        yield _gauge("agentkv_slot_tokens", {str(row.slot): row.tokens for row in slots}, "slot")
        yield _gauge("agentkv_queue_depth", len(queue))
        yield _gauge(
            "agentkv_queue_longest_wait_seconds", max((t.waited_s for t in queue), default=0.0)
        )
        yield _gauge(
            "agentkv_queue_waiting_for_checkpoint",
            sum(1 for t in queue if t.waiting_for_checkpoint is not None),
        )
        yield _gauge("agentkv_background_queue_depth", len(snapshot.background))
        yield _gauge("agentkv_checkpoints_running", len(snapshot.checkpoints))
        yield _counter(
            "agentkv_placements",
            {"slot": placements.from_slot, "store": placements.from_store, "none": placements.cold},
            label="source",
        )
        yield _counter(
            "agentkv_planned_prompt_tokens",
            {
                "reused": placements.planned_reused_tokens,
                "computed": placements.planned_computed_tokens,
            },
            label="kind",
        )
        yield _counter("agentkv_leases_reclaimed", placements.reclaimed)
        store = snapshot.store
        yield _gauge("agentkv_store_enabled", 1 if store else 0)
        if store is not None:
            yield _gauge("agentkv_store_entries", len(store.entries))
            yield _gauge("agentkv_store_bytes", store.bytes)
            yield _gauge("agentkv_store_budget_bytes", store.budget)
            for name, field, _ in _STORE_COUNTERS:
                yield _counter(f"agentkv_store_{name}", getattr(store, field))
        compactions = snapshot.compactions
        done = [row for row in compactions if isinstance(row, CompactionRow)]
        yield _gauge("agentkv_compactions", len(done))
        yield _gauge("agentkv_compactions_pending", len(compactions) - len(done))
        yield _gauge("agentkv_compaction_saved_tokens", sum(row.saved_tokens for row in done))
        prepared = runtime.preparations.stats()
        yield _counter("agentkv_prepared_compactions", prepared.prepared)
        yield _counter("agentkv_prepared_compactions_served", prepared.served)
        yield _counter("agentkv_prepared_compactions_joined", prepared.joined)
        yield _counter("agentkv_prepared_compactions_missed", prepared.missed, label="reason")
        yield _counter("agentkv_prepared_compaction_wasted_tokens", prepared.wasted_tokens)
        yield _gauge("agentkv_prepared_compactions_waiting", prepared.waiting)
        yield _counter("agentkv_prepared_heads", prepared.heads)
        yield _counter("agentkv_prepared_heads_missed", prepared.heads_missed)
        tree = snapshot.tree
        yield _gauge(
            "agentkv_agents",
            {
                "coordinator": sum(1 for row in tree if row.parent is None),
                "subagent_waited_on": sum(1 for row in tree if row.parent and row.waited_on),
                "subagent_background": sum(1 for row in tree if row.parent and not row.waited_on),
            },
            label="kind",
        )
        yield _gauge(
            "agentkv_agents_waiting_for_subagents", sum(1 for row in tree if row.waiting_for)
        )
        costs = runtime.costs
        yield _gauge("agentkv_prefill_tokens_per_second", costs.prefill.tokens_per_second(0, 1000))
        yield _gauge("agentkv_decode_tokens_per_second", costs.decode.rate)
        answers = runtime.client.prompt_answers()
        yield _counter(
            "agentkv_templated_prompts",
            {"kept": answers.templates_kept, "engine": answers.templates_asked},
            label="source",
        )
        yield _counter(
            "agentkv_tokenized_prompts",
            {
                "kept": answers.tokens_kept,
                "pieces": answers.tokens_pieces,
                "whole": answers.tokens_whole,
            },
            label="source",
        )
        yield _counter("agentkv_engine_restarts", self.engine_restarts())


def _family(
    kind: type[GaugeMetricFamily | CounterMetricFamily],
    name: str,
    value: float | Mapping[str, float],
    label: str = "",
) -> Metric:
    """One sample, or one sample per entry of ``value`` (in order) labelled ``label``."""
    if not isinstance(value, Mapping):
        return kind(name, _HELP[name], value=value)
    family = kind(name, _HELP[name], labels=[label])
    for key, each in value.items():
        family.add_metric([key], each)
    return family


_gauge = functools.partial(_family, GaugeMetricFamily)
_counter = functools.partial(_family, CounterMetricFamily)
