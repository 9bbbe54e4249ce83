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
    result = anyio.run(
        functools.partial(example.main, None, echo=lines.append, progress=lines.append)
    )
    assert lines, "the example printed nothing"
    return result


def test_every_request_finishes(report: Any, example: ModuleType) -> None:
    """Each agent's two turns run once each and end without an error."""
    agents = sorted(r.agent for r in report)
    assert agents == sorted(name for name in example.AGENTS for _ in (1, 2))
    assert [r.status for r in report] == ["ok"] * len(report)
    assert all(r.prompt_tokens > 0 and r.output_tokens > 0 for r in report)


def test_second_turns_reuse_the_shared_system_prompt(report: Any) -> None:
    """Every agent's second turn takes at least the shared system prompt from a slot's cache.

    Three agents take turns on two slots, so an agent often finds its own turn overwritten by
    another's: its context (about 100 tokens) is too small to be worth saving to the store
    (``park_min``), and recomputing it is cheaper. What every agent shares, the system prompt
    (49 tokens with the default model's chat template), is never computed again.
    """
    seen: dict[str, int] = {}
    second = []
    for record in report:
        seen[record.agent] = seen.get(record.agent, 0) + 1
        if seen[record.agent] == 2:
            second.append(record)
    assert len(second) == 3
    assert all(r.source == "slot" and r.cached_tokens >= 45 for r in second), second
