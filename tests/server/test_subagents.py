"""Claude Code's sub-agents through the whole server: captured requests on a fake engine."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentkv.snapshot import structure_snapshot
from agentkv_server import status
from tests.fakes import FakeLlama, served

pytestmark = pytest.mark.anyio

SUBAGENTS = Path(__file__).parent.parent / "fixtures" / "claude_code" / "subagents"
KEEP = ("x-agent-id", "x-agent-priority", "x-claude-code-session-id", "x-claude-code-agent-id")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def capture(name: str) -> tuple[dict[str, Any], dict[str, str]]:
    data = json.loads((SUBAGENTS / name).read_text())
    body = {**data["body"], "max_tokens": 16}
    return body, {k: v for k, v in data["headers"].items() if k in KEEP}


async def post(http: Any, name: str) -> dict[str, Any]:
    body, headers = capture(name)
    response = await http.post("/v1/messages", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return dict(response.json()) if not body.get("stream") else {}


def sub(name: str) -> str:
    return "coordinator/" + capture(name)[1]["x-claude-code-agent-id"]


def metric(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


async def test_a_captured_fan_out_is_a_tree_of_three(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Coordinator, then two sub-agents named by their call's description, in every view."""
    caplog.set_level(logging.INFO, logger="agentkv.runtime")
    fake = FakeLlama(reply="done", save_dir=tmp_path)
    async with served(fake, store_dir=tmp_path) as http:
        await post(http, "fg_1_coordinator.json")
        async with anyio.create_task_group() as tg:
            tg.start_soon(post, http, "fg_2_subagent_back.json")
            tg.start_soon(post, http, "fg_3_subagent_front.json")
        await post(http, "fg_4_continuation.json")
        table = (await http.get("/agentkv/slots")).json()
        metrics = (await http.get("/metrics")).text

    back, front = sub("fg_2_subagent_back.json"), sub("fg_3_subagent_front.json")
    rows = {row["agent"]: row for row in table["tree"]}
    assert table["tree"][0]["agent"] == "coordinator"
    assert set(rows) == {"coordinator", back, front}
    assert rows[back]["description"] == "Write the back end"
    assert rows[front]["description"] == "Write the front end"
    assert rows[back]["parent"] == rows[front]["parent"] == "coordinator"
    assert rows[back]["background"] is False

    records = {r["agent"]: r for r in table["recent"]}
    for child, what in ((back, "Write the back end"), (front, "Write the front end")):
        record = records[child]
        assert record["parent"] == "coordinator"
        assert record["description"] == what  # learnt from the continuation, afterwards
        assert record["waited_on"] is True
        assert record["priority"] == 1
    assert records["coordinator"]["parent"] is None

    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
    sub_lines = [line for line in lines if "parent=coordinator" in line]
    assert len(sub_lines) == 2 and all("waited_on" in line for line in sub_lines), lines
    assert metric(metrics, "agentkv_subagent_requests_total", waited_on="true") == 2
    assert metric(metrics, "agentkv_agents", kind="coordinator") == 1
    assert metric(metrics, "agentkv_agents", kind="subagent_waited_on") == 2

    text = status.render(structure_snapshot(table))
    tree = text.split("agents (3)")[1].split("\n\n")[0]
    assert "coordinator" in tree and "└ " in tree and "Write the front end" in tree


async def test_background_subagents_run_one_level_less_urgent(tmp_path: Path) -> None:
    """The coordinator went on at once (background calls): its sub-agents run at priority 2."""
    fake = FakeLlama(reply="done", save_dir=tmp_path)
    async with served(fake, store_dir=tmp_path) as http:
        await post(http, "bg_1_coordinator.json")
        await post(http, "bg_2_coordinator_next.json")
        await post(http, "bg_3_subagent.json")
        await post(http, "bg_4_subagent.json")
        table = (await http.get("/agentkv/slots")).json()
    subs = [r for r in table["recent"] if r["parent"] == "coordinator"]
    assert len(subs) == 2
    assert all(r["priority"] == 2 and r["waited_on"] is False for r in subs), subs
    assert all(r["priority"] == 1 for r in table["recent"] if r["agent"] == "coordinator")


async def test_with_the_tree_off_a_subagent_is_its_sessions_agent(tmp_path: Path) -> None:
    fake = FakeLlama(reply="done")
    async with served(fake, agent_tree=False) as http:
        await post(http, "fg_1_coordinator.json")
        await post(http, "fg_2_subagent_back.json")
        table = (await http.get("/agentkv/slots")).json()
    assert {r["agent"] for r in table["recent"]} == {"coordinator"}
    assert table["tree"] == []
    assert all(r["parent"] is None for r in table["recent"])


async def test_offset_zero_keeps_background_subagents_at_the_parents_priority(
    tmp_path: Path,
) -> None:
    fake = FakeLlama(reply="done")
    async with served(fake, background_agent_offset=0) as http:
        await post(http, "bg_1_coordinator.json")
        await post(http, "bg_2_coordinator_next.json")
        await post(http, "bg_3_subagent.json")
        table = (await http.get("/agentkv/slots")).json()
    (record,) = [r for r in table["recent"] if r["parent"]]
    assert record["priority"] == 1 and record["waited_on"] is False


async def test_the_coordinators_context_outlives_its_subagents_and_the_shared_head_is_computed_once(
    tmp_path: Path,
) -> None:
    """Two sub-agents take both slots; the coordinator's continuation still reuses its context
    (parked, then restored), and the sub-agents' common head is computed once."""
    fake = FakeLlama(reply="done", save_dir=tmp_path, prefill_delay=0.2)
    async with served(fake, store_dir=tmp_path, split_min=256, park_min=10**6) as http:
        await post(http, "fg_1_coordinator.json")
        before = fake.computed
        async with anyio.create_task_group() as tg:
            tg.start_soon(post, http, "fg_2_subagent_back.json")
            await anyio.sleep(0.05)
            tg.start_soon(post, http, "fg_3_subagent_front.json")
        subagents = fake.computed - before
        await post(http, "fg_4_continuation.json")
        table = (await http.get("/agentkv/slots")).json()
    records = [r for r in table["recent"] if r["agent"] == "coordinator"]
    first, continuation = records[0], records[-1]
    # park_min is out of reach: only the coordinator being waited for got its context parked.
    assert any(r.get("parked") for r in table["recent"] if r["parent"]), table["recent"]
    assert continuation["cached_tokens"] >= first["prompt_tokens"] - 1, continuation
    back = next(r for r in table["recent"] if r["description"] == "Write the back end")
    # Both sub-agents' prompts, less one copy of the head they share.
    assert subagents < 2 * back["prompt_tokens"] - 0.5 * back["prompt_tokens"], (
        subagents,
        back["prompt_tokens"],
    )


async def test_a_fork_is_served_from_its_coordinators_state(tmp_path: Path) -> None:
    """A fork's prompt is the coordinator's conversation and more: it reuses the coordinator's
    cached context instead of computing it again."""
    fake = FakeLlama(reply="done", save_dir=tmp_path)
    async with served(fake, store_dir=tmp_path) as http:
        await post(http, "bg_1_coordinator.json")  # the same project and prompt as the fork's
        await post(http, "fork_2_subagent.json")
        table = (await http.get("/agentkv/slots")).json()
    coordinator = next(r for r in table["recent"] if r["agent"] == "coordinator")
    fork = next(r for r in table["recent"] if r["parent"] == "coordinator")
    assert fork["cached_tokens"] >= 0.9 * coordinator["prompt_tokens"], (fork, coordinator)
