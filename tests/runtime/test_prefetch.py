"""Fan-out prefetch on the fake engine: a reply ending in ``Agent`` calls prepares a known head."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Runtime
from agentkv.runtime.record import RequestRecord
from tests.fakes import FakeLlama, wait_for

pytestmark = pytest.mark.anyio

SUBAGENTS = Path(__file__).parent.parent / "fixtures" / "claude_code" / "subagents"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def capture(name: str) -> tuple[dict[str, Any], str | None]:
    data = json.loads((SUBAGENTS / name).read_text())
    return {**data["body"], "max_tokens": 8}, data["headers"].get("x-claude-code-agent-id")


def call_for(prompt: str) -> str:
    """The coordinator's reply: an ``Agent`` call, written as JSON text (repaired into a call)."""
    arguments = {
        "description": "Write the back end",
        "prompt": prompt,
        "subagent_type": "general-purpose",
        "run_in_background": False,
    }
    return json.dumps({"name": "Agent", "arguments": arguments})


def answer(body: dict[str, Any]) -> str:
    """Sub-agents answer in words; the coordinator always calls a sub-agent."""
    first = json.dumps(body["messages"][0])
    if "cc_is_subagent" in first:
        return "done"
    return call_for("Reply with the single word: back")


@asynccontextmanager
async def running(fake: FakeLlama, **config: Any) -> AsyncIterator[Runtime]:
    http = httpx.AsyncClient(transport=fake.transport(), base_url="http://engine")
    client = LlamaSlotClient("http://engine", http=http, connect_retries=0)
    async with http, Runtime(client, RuntimeConfig(**config)) as runtime:
        yield runtime


async def send(runtime: Runtime, name: str) -> dict[str, Any]:
    body, sub = capture(name)
    place = runtime.place_agent("coordinator", sub, 1, body)
    prepared = await runtime.prepare(body, agent=place.agent, priority=place.priority)
    return await runtime.submit(prepared).message()


def by_agent(runtime: Runtime) -> dict[str, RequestRecord]:
    return {r.agent: r for r in runtime.records()}


async def test_a_fan_out_prepares_a_head_seen_before_that_is_cached_nowhere(
    tmp_path: Path,
) -> None:
    """The coordinator's first fan-out teaches the head; when a later reply ends in an
    ``Agent`` call and the head is in no slot and not in the store, it is computed at once, at
    the coordinator's priority, and the sub-agent that follows restores it."""
    fake = FakeLlama(script=[answer] * 32, save_dir=tmp_path)
    async with running(fake, n_slots=1, store_dir=tmp_path, ctx_per_slot=65536) as runtime:
        first = await send(runtime, "fg_1_coordinator.json")
        assert first["stop_reason"] == "tool_use"
        assert first["content"][-1]["name"] == "Agent"
        # Nothing seen yet: nothing prefetched.
        assert "coordinator/prefetch" not in by_agent(runtime)
        await send(runtime, "fg_2_subagent_back.json")
        back = next(r for r in runtime.records() if r.parent == "coordinator")
        assert back.checkpoint_tokens is not None
        head = back.checkpoint_tokens

        # The coordinator's next turn takes the one slot (the sub-agent's context is parked), then
        # the store is emptied: the head is cached nowhere when the coordinator calls again.
        await send(runtime, "fg_4_continuation.json")
        assert "coordinator/prefetch" not in by_agent(runtime)  # the head was still stored
        assert await runtime.contents.clear() > 0
        computed = fake.computed
        reply = await send(runtime, "fg_4_continuation.json")
        assert reply["stop_reason"] == "tool_use"
        await wait_for(lambda: "coordinator/prefetch" in by_agent(runtime))
        prefetch = by_agent(runtime)["coordinator/prefetch"]
        assert prefetch.status == "ok"
        assert prefetch.priority == 1  # the coordinator's
        assert prefetch.checkpoint_tokens == head  # computed on its own and saved

        # The sub-agent then finds the head (in the slot the prefetch used, or the store).
        await send(runtime, "fg_3_subagent_front.json")
        front = [r for r in runtime.records() if r.parent == "coordinator"][-1]
        assert front.source in ("slot", "store")
        assert front.cached_tokens >= head
        assert front.computed_tokens < 64
        # The head was computed once after it left the store (by the prefetch).
        continuation = [r for r in runtime.records() if r.agent == "coordinator"][-1]
        assert fake.computed - computed < continuation.computed_tokens + head + 2 * 64


async def test_no_prefetch_for_a_head_that_is_cached(tmp_path: Path) -> None:
    """The head is still in the store: the sub-agents restore it on arrival, nothing is
    computed ahead of them."""
    fake = FakeLlama(script=[answer] * 32, save_dir=tmp_path)
    async with running(fake, n_slots=1, store_dir=tmp_path, ctx_per_slot=65536) as runtime:
        await send(runtime, "fg_1_coordinator.json")
        await send(runtime, "fg_2_subagent_back.json")
        await send(runtime, "fg_4_continuation.json")
        assert "coordinator/prefetch" not in by_agent(runtime)


async def test_no_prefetch_with_the_tree_off(tmp_path: Path) -> None:
    fake = FakeLlama(script=[answer] * 32, save_dir=tmp_path)
    async with running(fake, n_slots=1, store_dir=tmp_path, agent_tree=False) as runtime:
        assert runtime.tree.prefetcher is None
