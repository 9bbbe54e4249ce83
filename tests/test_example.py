"""examples/three_agents.py against a real llama-server, launched by the example's own code."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest

from agentkv.runtime.engine import EngineNotFoundError, find_llama_server
from agentkv.runtime.model import ModelNotFoundError, default_model_path

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "three_agents.py"


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("three_agents", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return _load_example()


@pytest.fixture(scope="module")
def report(example: ModuleType) -> Any:
    """One run of the example (it launches llama-server with the default model and stops it)."""
    try:
        find_llama_server()
        default_model_path()
    except (EngineNotFoundError, ModelNotFoundError) as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the example needs llama-server and the default model: {exc}")
        pytest.skip(f"no engine: {exc}")
    lines: list[str] = []
    # anyio.run in a sync fixture: the example owns its event loop from start to finish.
    result = anyio.run(functools.partial(example.main, None, echo=lines.append))
    assert lines, "the example printed nothing"
    return result


def test_every_request_finishes(report: Any, example: ModuleType) -> None:
    """Each agent's two turns run once each and end without an error."""
    done = sorted((r.agent, r.turn) for r in report.results)
    assert done == sorted((a.name, turn) for a in example.AGENTS for turn in (1, 2))
    assert [r.error for r in report.results if r.error is not None] == []
    assert all(r.prompt_n + r.cache_n > 0 for r in report.results)
    assert report.stats.acquired == len(report.results)


def test_every_lease_is_released(report: Any) -> None:
    """After the run every slot is idle: no refcount, no lease left behind."""
    assert report.free == report.n_slots
    assert [(row.refcount, row.lease_ids) for row in report.slots] == [(0, ())] * report.n_slots


def test_coordinator_goes_before_same_time_lower_priority(report: Any) -> None:
    """No request of lower priority that arrived with a coordinator request got a slot first."""
    pairs = [
        (first, other)
        for first in report.results
        if first.priority == 0
        for other in report.results
        if other.priority > 0 and other.arrival == first.arrival
    ]
    # Both turns: the coordinator arrives together with the two other agents.
    assert len(pairs) == 4
    assert [(f.dispatch_seq < o.dispatch_seq) for f, o in pairs] == [True] * len(pairs)


def test_second_turns_reuse_the_cache(report: Any) -> None:
    """Every agent's second turn takes more than half its prompt from a slot's KV cache."""
    second = {r.agent: r for r in report.results if r.turn == 2}
    shares = {agent: r.cache_n / (r.cache_n + r.prompt_n) for agent, r in second.items()}
    assert len(shares) == 3
    assert {agent: share > 0.5 for agent, share in shares.items()} == dict.fromkeys(shares, True)
