"""/metrics on the real engine: the counters move after real requests, with llama-server's own
figures for the prompt tokens it reused and computed."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import Live

pytestmark = pytest.mark.engine

SYSTEM = "You are a careful reviewer on a shared project.\n" + "\n".join(
    f"Rule {i}: module m{i} keeps its public names in __all__ and has tests in tests/test_m{i}.py."
    for i in range(20)
)


def scrape(live: Live) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(f"{live.url}/metrics", timeout=30)
    assert r.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_move_after_real_requests(live: Live) -> None:
    before = scrape(live)
    seen = len(live.runtime.records())
    messages: list[dict[str, Any]] = []
    for turn in ("Name one risk of global state.", "And one way to avoid it?"):
        messages = [*messages, {"role": "user", "content": turn}]
        body = {
            "model": "agentkv-local",
            "max_tokens": 12,
            "temperature": 0,
            "system": SYSTEM,
            "messages": messages,
        }
        r = httpx.post(
            f"{live.url}/v1/messages",
            json=body,
            headers={"x-agent-id": "metrics-real", "x-agent-priority": "2"},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        reply = r.json()["content"][0]["text"]
        messages = [*messages, {"role": "assistant", "content": reply}]
    after = scrape(live)
    records = [r for r in live.runtime.records()[seen:] if r.agent == "metrics-real"]
    assert len(records) == 2 and all(r.status == "ok" for r in records)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("agentkv_requests_total", status="ok", priority="2") == 2
    assert moved("agentkv_ttft_seconds_count", priority="2") == 2
    assert moved("agentkv_request_duration_seconds_count", priority="2") == 2
    # llama-server's own cache_n and prompt_n: the second turn reuses the first one's prompt.
    reused = moved("agentkv_prompt_tokens_total", kind="reused")
    computed = moved("agentkv_prompt_tokens_total", kind="computed")
    assert reused == sum(r.cached_tokens for r in records)
    assert computed == sum(r.computed_tokens for r in records)
    assert records[1].cached_tokens > 300 and reused >= records[1].cached_tokens
    assert computed > 0
    assert moved("agentkv_output_tokens_total") == sum(r.output_tokens for r in records) > 0
    assert moved("agentkv_placements_total", source="slot") >= 1
    assert value(after, "agentkv_slots", state="idle") == 2
    assert value(after, "agentkv_decode_tokens_per_second") > 0
    assert value(after, "agentkv_prefill_tokens_per_second") > 0
    assert value(after, "agentkv_store_enabled") == 1


def test_a_changed_tool_description_is_reported_at_that_tool(live: Live) -> None:
    """Claude Code's tools (from a captured request), then the same request with one tool's
    description changed: the engine reuses the prompt up to that tool, and the record and the
    metrics name the tool where the prompts parted."""
    import json
    from pathlib import Path

    fixture = Path(__file__).parent.parent / "fixtures" / "claude_code_request.json"
    tools = json.loads(fixture.read_text())["tools"]
    names = [tool["name"] for tool in tools]
    changed_at = names.index("Write")
    body = {
        "model": "m",
        "max_tokens": 4,
        "system": SYSTEM,
        "tools": tools,
        "messages": [{"role": "user", "content": "List the files."}],
    }
    headers = {"x-agent-id": "tool-changer", "x-agent-priority": "1"}
    before = scrape(live)
    url = f"{live.url}/v1/messages"
    assert httpx.post(url, json=body, headers=headers, timeout=600).is_success
    edited = [dict(tool) for tool in tools]
    edited[changed_at]["description"] = "Writes a file to the local filesystem, replacing it."
    again = {**body, "tools": edited}
    assert httpx.post(url, json=again, headers=headers, timeout=600).is_success

    record = live.runtime.records()[-1]
    assert record.agent == "tool-changer" and record.divergence is not None, record
    assert record.divergence["section"] == f"tool {changed_at} (Write)", record.divergence
    # llama-server reused the prompt up to that tool and computed the rest.
    assert 0 < record.cached_tokens <= record.divergence["position"] + 4
    assert record.computed_tokens > 0
    after = scrape(live)
    grown = {
        key: after[key] - before.get(key, 0.0)
        for key in after
        if key[0].startswith("agentkv_cache_miss_seconds") and after[key] > before.get(key, 0.0)
    }
    assert any(dict(labels).get("section") == "tool" for _, labels in grown), grown
