"""The multi-agent benchmark: the pure workload, its yardstick, and one quick real run."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import attrs
import pytest

from agentkv import MessagesTranslator
from agentkv_bench import cli
from agentkv_bench.metrics import parse_counters
from agentkv_bench.overhead import gateway_overhead
from agentkv_bench.report import percentile
from agentkv_bench.workload import (
    WorkloadSpec,
    build_workload,
    minimum_prefill,
    shared_prefix_len,
)


def test_same_seed_gives_the_same_workload() -> None:
    """A seed fixes every request byte for byte; another seed changes them."""
    spec = WorkloadSpec.quick(seed=7)
    first = build_workload(spec).canonical_order()
    assert json.dumps(first) == json.dumps(build_workload(spec).canonical_order())
    other = build_workload(attrs.evolve(spec, seed=8)).canonical_order()
    assert json.dumps(first) != json.dumps(other)


def test_workload_shape_matches_the_spec() -> None:
    """More agents than slots, one P0 coordinator, the rest P1–P2, shared system and tools."""
    spec = WorkloadSpec()
    workload = build_workload(spec)
    assert len(workload.agents) == spec.agents > spec.slots
    assert [a.priority for a in workload.agents].count(0) == 1
    assert {a.priority for a in workload.agents[1:]} <= {1, 2}
    assert len({a.name for a in workload.agents}) == spec.agents
    bodies = [body for _, _, body in workload.canonical_order()]
    assert len(bodies) == workload.n_requests == spec.agents * spec.turns
    assert all(b["system"] == bodies[0]["system"] for b in bodies)
    assert all(b["tools"] == bodies[0]["tools"] for b in bodies)
    assert all(b["max_tokens"] == spec.max_tokens and b["stream"] for b in bodies)


def test_each_turn_extends_the_previous_one() -> None:
    """Turn t+1 of an agent repeats turn t's messages and adds an assistant call and its result."""
    for agent in build_workload(WorkloadSpec()).agents:
        for before, after in zip(agent.requests, agent.requests[1:], strict=False):
            n = len(before["messages"])
            assert after["messages"][:n] == before["messages"]
            assistant, user = after["messages"][n:]
            assert assistant["role"] == "assistant"
            assert assistant["content"][-1]["type"] == "tool_use"
            assert user["content"][0] == {
                "type": "tool_result",
                "tool_use_id": assistant["content"][-1]["id"],
                "content": user["content"][0]["content"],
            }


def test_workload_requests_are_valid_messages_requests() -> None:
    """Every request passes agentkv's own request validation."""
    translator = MessagesTranslator()
    for _, _, body in build_workload(WorkloadSpec.quick()).canonical_order():
        assert translator.translate(body).body["messages"]


def test_minimum_prefill_counts_each_shared_prefix_once() -> None:
    """Each sequence costs what it does not share with the best earlier one."""
    system = [1, 2, 3, 4]
    a0 = [*system, 10, 11]
    b0 = [*system, 20]
    a1 = [*a0, 12, 13]
    sequences = [a0, b0, a1]
    expected = len(a0) + (len(b0) - len(system)) + (len(a1) - len(a0))
    assert minimum_prefill(sequences) == expected
    assert minimum_prefill([]) == 0
    assert minimum_prefill([a0, a0]) == len(a0)


def test_minimum_prefill_is_bounded_by_the_naive_sum() -> None:
    """No sharing means the minimum is everything; sharing never makes it exceed that."""
    unrelated = [[1, 2], [3, 4, 5], [6]]
    assert minimum_prefill(unrelated) == sum(map(len, unrelated))
    related = [[9, 1, 2], [9, 1, 3], [9, 4]]
    assert len(related[0]) <= minimum_prefill(related) < sum(map(len, related))
    assert shared_prefix_len([9, 1, 2], [9, 1, 3]) == 2


def test_percentile_interpolates() -> None:
    """Quantiles interpolate between ranks; p50 never exceeds p95."""
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0.0) == min(values)
    assert percentile(values, 1.0) == max(values)
    assert percentile(values, 0.5) == 2.5
    assert percentile([], 0.5) is None


def test_metric_reads_a_prometheus_counter() -> None:
    """Counters are read by exact sample name, so a name that is a prefix of another does not
    match, and a counter the engine did not report reads 0."""
    text = (
        "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
        "# TYPE llamacpp:prompt_tokens_total counter\n"
        "llamacpp:prompt_tokens_total 168\n"
        "# TYPE llamacpp:prompt_tokens_total_x counter\n"
        "llamacpp:prompt_tokens_total_x 5\n"
        "# TYPE llamacpp:kv_cache_usage_ratio gauge\n"
        "llamacpp:kv_cache_usage_ratio 0.25\n"
    )
    counters = parse_counters(
        text,
        {
            "computed": "llamacpp:prompt_tokens_total",
            "predicted": "llamacpp:tokens_predicted_total",
            "usage": "llamacpp:kv_cache_usage_ratio",
        },
    )
    assert counters == {"computed": 168, "predicted": 0, "usage": 0.25}


def test_gateway_overhead_against_a_fake_engine() -> None:
    """The micro-benchmark runs in-process and reports consistent, positive numbers."""
    result = anyio.run(lambda: gateway_overhead(requests=10, stream_chunks=200, idle_agents=20))
    assert 0 < result["direct_p50_ms"] <= result["direct_p99_ms"]
    assert 0 < result["agentkv_p50_ms"] <= result["agentkv_p99_ms"]
    assert result["engine_chunks_per_s"] > 0
    # A new prompt each time asks the engine to template and tokenize it: it adds more than the
    # same request again, whose answers are kept.
    assert result["new_prompt_requests"] == 5
    assert result["added_new_prompt_p50_ms"] is not None
    assert result["direct_cpu_p50_ms"] > 0
    assert result["agentkv_cpu_p50_ms"] > 0
    # The fake engine's words are not a loop: the whole reply is relayed, not cut short.
    assert result["stream_stopped"] is None
    # Coalescing merges deltas (16 characters, of words of about 5): fewer events leave than
    # chunks came in, but far more than a cut-off reply would give.
    assert result["stream_engine_chunks"] // 8 < result["sse_events_out"]
    assert result["sse_events_out"] <= result["stream_engine_chunks"] + 10
    assert result["agents_known"] >= 20
    # Finished requests are kept a moment for a client's retry, then only the agent remains.
    assert 0 < result["bytes_per_idle_agent"] < result["bytes_per_recent_request"]


@pytest.mark.engine
def test_quick_benchmark_report_is_consistent(tmp_path: Path) -> None:
    """A quick run of all three configurations writes a table, JSON and PNG that agree."""
    from tests._engine_fixture import locate_engine

    locate_engine()
    out = tmp_path / "bench"
    assert cli.main(["--quick", "--no-overhead", "--out", str(out)]) == 0
    report = json.loads((out / "benchmarks.json").read_text())
    assert (out / "benchmarks.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "benchmarks.txt").read_text().startswith("|")
    configs = {c["name"]: c for c in report["configs"]}
    assert set(configs) == {"plain", "tuned", "agentkv"}
    spec = WorkloadSpec.quick()
    minimum, naive = report["prefill_minimum"], report["prefill_naive"]
    assert 0 < minimum < naive
    for config in configs.values():
        assert config["errors"] == 0
        assert config["requests"] == spec.agents * spec.turns
        assert config["wall_s"] > 0
        assert config["output_tokens"] > 0
        # Every configuration sends the same prompts; the engine's count of them must agree with
        # the workload's own tokenization (llama-server's and agentkv's templating may differ a
        # little, hence the tolerance).
        assert abs(config["prompt_tokens_total"] - naive) <= 0.05 * naive
        # No cache can compute less than the minimum; allow for that small templating difference.
        assert config["prefill_computed"] >= 0.9 * minimum
        assert 0 <= config["cache_hit_ratio"] < 1
        for row in config["ttft"].values():
            assert 0 < row["ttft_p50_s"] <= row["ttft_p95_s"]
        assert config["longest_wait_s"] >= config["ttft_p95_s"]
