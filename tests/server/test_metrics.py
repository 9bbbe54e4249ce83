"""GET /metrics against a fake engine: the exposition parses, counters move, labels stay bounded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentkv.runtime.record import RequestRecord, RequestStatus, request_fields, request_line
from agentkv_server.metrics import ServerMetrics
from tests.fakes import FakeLlama, tokenize, wait_for

pytestmark = pytest.mark.anyio

BODY: dict[str, Any] = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "Say hello."}],
}


@attrs.define
class Diverged(RequestRecord):
    """A record that says where its prompt left the best cached candidate."""

    divergence: dict[str, Any] | None = None


#: Every label a series may carry; none of them holds an agent id.
BOUNDED_LABELS = {
    "status",
    "priority",
    "type",
    "kind",
    "reason",
    "section",
    "state",
    "slot",
    "source",
    "le",
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(http: httpx.AsyncClient, **headers: str) -> Samples:
    """Every sample of a scrape, parsed by prometheus_client's own parser."""
    r = await http.get("/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def conversation(turns: int) -> list[dict[str, Any]]:
    """One agent's growing conversation: each turn's prompt starts with the previous one."""
    messages: list[dict[str, Any]] = []
    bodies = []
    for n in range(turns):
        messages = [*messages, {"role": "user", "content": f"step {n}: carry on with the task."}]
        bodies.append({**BODY, "messages": messages})
        messages = [*messages, {"role": "assistant", "content": "fine"}]
    return bodies


async def test_counters_move_after_requests(serve: Any, tmp_path: Path) -> None:
    """Requests, latencies, reused and computed tokens and placements count what happened."""
    fake = FakeLlama(reply="fine", save_dir=tmp_path)
    http = await serve(fake, n_slots=2, store_dir=tmp_path)
    before = await scrape(http)
    assert value(before, "agentkv_requests_total", status="ok", priority="1") == 0
    assert value(before, "agentkv_store_enabled") == 1
    for body in conversation(3):
        r = await http.post("/v1/messages", json=body, headers={"x-agent-id": "coder"})
        assert r.status_code == 200
    r = await http.post(
        "/v1/messages", json=BODY, headers={"x-agent-id": "boss", "x-agent-priority": "0"}
    )
    assert r.status_code == 200
    after = await scrape(http)
    records = http.runtime.records()  # type: ignore[attr-defined]
    assert len(records) == 4
    assert value(after, "agentkv_requests_total", status="ok", priority="1") == 3
    assert value(after, "agentkv_requests_total", status="ok", priority="0") == 1
    assert value(after, "agentkv_ttft_seconds_count", priority="1") == 3
    assert value(after, "agentkv_ttft_seconds_sum", priority="1") == pytest.approx(
        sum(r.ttft_s for r in records if r.priority == 1)
    )
    assert value(after, "agentkv_request_duration_seconds_count", priority="0") == 1
    assert value(after, "agentkv_queue_wait_seconds_count", priority="1") == 3
    # What llama-server (here the fake) reported: turns 2 and 3 reuse the earlier turns.
    reused = sum(r.cached_tokens for r in records)
    computed = sum(r.computed_tokens for r in records)
    assert reused > 0 and computed > 0
    assert value(after, "agentkv_prompt_tokens_total", kind="reused") == reused
    assert value(after, "agentkv_prompt_tokens_total", kind="computed") == computed
    assert computed == fake.computed
    assert value(after, "agentkv_output_tokens_total") == sum(r.output_tokens for r in records)
    # Placements: the first turn and the other agent cold, turns 2 and 3 from the slot.
    assert value(after, "agentkv_placements_total", source="slot") == 2
    assert value(after, "agentkv_placements_total", source="none") == 2
    assert value(after, "agentkv_placements_total", source="store") == 0
    assert value(after, "agentkv_slots", state="idle") == 2
    assert value(after, "agentkv_queue_depth") == 0
    held = {row.slot: row.tokens for row in http.runtime.snapshot().slots}  # type: ignore[attr-defined]
    for slot, tokens in held.items():
        assert value(after, "agentkv_slot_tokens", slot=str(slot)) == tokens
    assert value(after, "agentkv_store_entries") == len(http.runtime.store.index.entries())  # type: ignore[attr-defined]
    assert value(after, "agentkv_engine_restarts_total") == 0


async def test_prompt_answers_are_counted_by_where_they_came_from(serve: Any) -> None:
    """The same request twice: its template and tokens asked of the engine once, then kept."""
    http = await serve(FakeLlama(reply="fine"), n_slots=2)
    for _ in range(2):
        r = await http.post("/v1/messages", json=BODY, headers={"x-agent-id": "coder"})
        assert r.status_code == 200
    after = await scrape(http)
    assert value(after, "agentkv_templated_prompts_total", source="engine") == 1
    assert value(after, "agentkv_templated_prompts_total", source="kept") == 1
    assert value(after, "agentkv_tokenized_prompts_total", source="whole") == 1
    assert value(after, "agentkv_tokenized_prompts_total", source="kept") == 1
    assert value(after, "agentkv_tokenized_prompts_total", source="pieces") == 0


async def test_store_saves_and_restores_are_counted_with_their_time(
    serve: Any, tmp_path: Path
) -> None:
    """On one slot, a second agent parks the first one's context; the first one comes back and
    restores it: one save, one restore, and their seconds."""
    fake = FakeLlama(reply="fine", save_dir=tmp_path)
    http = await serve(fake, n_slots=1, store_dir=tmp_path, park_min=8)
    long = "a long system prompt that is worth keeping " * 40
    first = {**BODY, "system": long}
    other = {**BODY, "system": "something else entirely " * 40}
    for agent, body in (("a", first), ("b", other), ("a", first)):
        r = await http.post("/v1/messages", json=body, headers={"x-agent-id": agent})
        assert r.status_code == 200
    samples = await scrape(http)
    store = http.runtime.store.snapshot()  # type: ignore[attr-defined]
    assert store.saves >= 1 and store.restores == 1
    assert value(samples, "agentkv_store_saves_total") == store.saves
    assert value(samples, "agentkv_store_restores_total") == 1
    assert value(samples, "agentkv_placements_total", source="store") == 1
    assert value(samples, "agentkv_store_restored_tokens_total") == len(
        tokenize("<system>" + long + "<user>Say hello.")
    )
    assert value(samples, "agentkv_store_save_seconds_total") > 0
    assert value(samples, "agentkv_store_restore_seconds_total") > 0
    assert value(samples, "agentkv_store_bytes") == store.bytes > 0


async def test_slots_and_queue_are_read_at_scrape_time(serve: Any) -> None:
    """While one request prefills on the only slot, the next ones wait: the gauges say so."""
    fake = FakeLlama(reply="fine", prefill_delay=1.0)
    http = await serve(fake, n_slots=1)
    runtime = http.runtime  # type: ignore[attr-defined]

    async def call(agent: str) -> None:
        r = await http.post("/v1/messages", json=BODY, headers={"x-agent-id": agent})
        assert r.status_code == 200

    async with anyio.create_task_group() as tg:
        for agent in ("a", "b", "c"):
            tg.start_soon(call, agent)
        await wait_for(lambda: runtime.dispatcher.queue_depth == 2)
        await anyio.sleep(0.2)
        samples = await scrape(http)
        assert value(samples, "agentkv_slots", state="prefilling") == 1
        assert value(samples, "agentkv_slots", state="idle") == 0
        assert value(samples, "agentkv_queue_depth") == 2
        assert value(samples, "agentkv_queue_longest_wait_seconds") >= 0.2
    samples = await scrape(http)
    assert value(samples, "agentkv_queue_depth") == 0
    assert value(samples, "agentkv_queue_longest_wait_seconds") == 0
    assert value(samples, "agentkv_queue_wait_seconds_count", priority="1") == 3


async def test_refused_requests_are_counted_by_error_type(serve: Any) -> None:
    """A request refused before it is queued is not a finished request, but it is counted."""
    http = await serve(FakeLlama(), max_queue=1)
    r = await http.post("/v1/messages", json={"model": "x", "messages": []})
    assert r.status_code == 400
    r = await http.post("/v1/messages", json=BODY, headers={"x-agent-priority": "9"})
    assert r.status_code == 400
    samples = await scrape(http)
    assert value(samples, "agentkv_refused_requests_total", type="invalid_request_error") == 2
    assert value(samples, "agentkv_requests_total", status="ok", priority="1") == 0


async def test_metrics_need_the_api_key_like_every_route(serve: Any) -> None:
    http = await serve(FakeLlama(), api_key="s3cret")
    r = await http.get("/metrics")
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    samples = await scrape(http, **{"x-api-key": "s3cret"})
    assert value(samples, "agentkv_queue_depth") == 0


async def test_labels_are_bounded_and_hold_no_agent_id(serve: Any) -> None:
    http = await serve(FakeLlama(reply="fine"))
    agents = [f"agent-{n}" for n in range(5)]
    for agent in agents:
        r = await http.post("/v1/messages", json=BODY, headers={"x-agent-id": agent})
        assert r.status_code == 200
    samples = await scrape(http)
    names = {label for _, labels in samples for label, _ in labels}
    assert names <= BOUNDED_LABELS
    values = {v for _, labels in samples for _, v in labels}
    assert not values & set(agents)


async def test_each_app_has_its_own_registry(serve: Any) -> None:
    """Two apps in one process count their own requests (no global registry)."""
    one = await serve(FakeLlama(reply="one"))
    two = await serve(FakeLlama(reply="two"))
    for _ in range(2):
        assert (await one.post("/v1/messages", json=BODY)).status_code == 200
    assert (await two.post("/v1/messages", json=BODY)).status_code == 200
    assert value(await scrape(one), "agentkv_requests_total", status="ok", priority="1") == 2
    assert value(await scrape(two), "agentkv_requests_total", status="ok", priority="1") == 1


async def test_engine_restarts_come_from_whoever_supervises_the_engine(serve: Any) -> None:
    from agentkv.runtime.status import EngineStatus

    http = await serve(FakeLlama())
    metrics = http.app.state.metrics  # type: ignore[attr-defined]
    assert isinstance(metrics, ServerMetrics)
    # By default: the supervisor's status that the client carries.
    status = EngineStatus()
    metrics.runtime.client.status = status
    status.new_generation()
    status.new_generation()
    assert value(await scrape(http), "agentkv_engine_restarts_total") == 2
    # Or whatever a program that supervises its engine itself says.
    restarts = [0]
    metrics.engine_restarts = lambda: restarts[0]
    restarts[0] = 3
    assert value(await scrape(http), "agentkv_engine_restarts_total") == 3


async def test_engine_restarts_of_a_pool_are_every_engines_summed(serve: Any) -> None:
    """In a pool of engines the runtime's client is the pool, which has no status of its own:
    the count is the sum of its engines' supervisors' (an upstream's counts none)."""
    from agentkv.runtime.client import LlamaSlotClient
    from agentkv.runtime.pool import EnginePool
    from agentkv.runtime.status import EngineStatus

    http = await serve(FakeLlama())
    metrics: ServerMetrics = http.app.state.metrics  # type: ignore[attr-defined]
    statuses = [EngineStatus(), EngineStatus()]
    pool = EnginePool(
        [
            LlamaSlotClient("http://a", status=statuses[0]),
            LlamaSlotClient("http://b", status=statuses[1]),
            LlamaSlotClient("http://c"),
        ],
        slots=[1, 1, 1],
    )
    own = metrics.runtime.client
    metrics.runtime.client = pool
    try:
        assert value(await scrape(http), "agentkv_engine_restarts_total") == 0
        statuses[0].new_generation()
        statuses[1].new_generation()
        statuses[1].new_generation()
        assert value(await scrape(http), "agentkv_engine_restarts_total") == 3
    finally:
        metrics.runtime.client = own
        await pool.aclose()


async def test_failures_retries_and_cache_misses_are_counted(serve: Any) -> None:
    """Error statuses, tool-call retries, suspensions, joined retries and a record's divergence
    feed their counters (records built by hand: the listener is what is tested)."""
    http = await serve(FakeLlama())
    metrics: ServerMetrics = http.app.state.metrics  # type: ignore[attr-defined]
    failed = RequestRecord(
        agent="a", priority=2, status=RequestStatus.FAILED, error_type="overloaded_error"
    )
    retried = RequestRecord(
        agent="b",
        priority=1,
        status="ok",
        slot=0,
        retried=True,
        suspended=2,
        attached=3,
        stopped="deadline",
    )
    missed = Diverged(
        agent="c",
        priority=1,
        status="ok",
        slot=1,
        divergence={"position": 812, "section": "tool 3 (Bash)", "seconds": 4.5},
    )
    for record in (failed, retried, missed):
        metrics.observe(record)
    samples = await scrape(http)
    assert value(samples, "agentkv_requests_total", status="overloaded_error", priority="2") == 1
    assert value(samples, "agentkv_requests_total", status="ok", priority="1") == 2
    assert value(samples, "agentkv_tool_call_retries_total") == 1
    assert value(samples, "agentkv_suspensions_total") == 2
    assert value(samples, "agentkv_joined_retries_total") == 2
    assert value(samples, "agentkv_stopped_requests_total", reason="deadline") == 1
    assert value(samples, "agentkv_queue_wait_seconds_count", priority="2") == 0
    assert value(samples, "agentkv_cache_miss_seconds_total", section="tool") == 4.5


async def test_every_metric_is_documented(serve: Any, tmp_path: Path) -> None:
    """docs/observability.md lists each series the server exposes (store on, so all of them)."""
    docs = (Path(__file__).parent.parent.parent / "docs" / "observability.md").read_text()
    http = await serve(FakeLlama(save_dir=tmp_path), store_dir=tmp_path)
    r = await http.get("/metrics")
    families = {family.name for family in text_string_to_metric_families(r.text)}
    families = {name for name in families if not name.endswith("_created")}
    assert len(families) > 30
    for name in families:
        counter = f"`{name}_total" in docs
        assert counter or f"`{name}`" in docs or f"`{name}{{" in docs, name


async def test_speculative_decoding_is_counted_drafted_and_accepted(serve: Any) -> None:
    """The engine's draft counts reach the request record, its log line and /metrics."""
    http = await serve(FakeLlama(reply="fine", drafts=(40, 31)), n_slots=1)
    for _ in range(2):
        r = await http.post("/v1/messages", json=BODY, headers={"x-agent-id": "coder"})
        assert r.status_code == 200
    after = await scrape(http)
    assert value(after, "agentkv_draft_tokens_total", kind="drafted") == 80
    assert value(after, "agentkv_draft_tokens_total", kind="accepted") == 62
    record = http.runtime.records()[-1]  # type: ignore[attr-defined]
    assert (record.draft_tokens, record.draft_accepted) == (40, 31)
    assert "drafts=31/40" in request_line(record)
    assert request_fields(record)["draft_accepted"] == 31


async def test_prepared_compactions_are_counted(serve: Any) -> None:
    """Claude Code's turn past its compaction point, then its compaction request (as captured):
    prepared, then served; another session's compaction request that differs is a miss."""
    from tests.runtime.test_prepared import compaction, engine, turn, window

    http = await serve(engine(), n_slots=1, ctx_per_slot=window())
    preparations = http.runtime.preparations  # type: ignore[attr-defined]
    changed = compaction()
    changed["messages"][-1]["content"] += "!"
    for session, second in (("one", compaction()), ("two", changed)):
        headers = {"x-claude-code-session-id": session}
        assert (await http.post("/v1/messages", json=turn(), headers=headers)).status_code == 200
        await wait_for(lambda: preparations.stats().waiting == 1)
        assert (await http.post("/v1/messages", json=second, headers=headers)).status_code == 200
    samples = await scrape(http)
    assert value(samples, "agentkv_prepared_compactions_total") == 2
    served = value(samples, "agentkv_prepared_compactions_served_total")
    assert served + value(samples, "agentkv_prepared_compactions_joined_total") == 1
    assert value(samples, "agentkv_prepared_compactions_missed_total", reason="differs") == 1
    assert value(samples, "agentkv_prepared_compactions_missed_total", reason="expired") == 0
    assert value(samples, "agentkv_prepared_compaction_wasted_tokens_total") > 0
    assert value(samples, "agentkv_prepared_compactions_waiting") == 0
    # the conversation after a prepared summary is computed once its reply is done, if it waits
    assert value(samples, "agentkv_prepared_heads_total") == preparations.stats().heads
