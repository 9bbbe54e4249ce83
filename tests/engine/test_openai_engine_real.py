"""The OpenAI-compatible path end to end: Anthropic ingress → runtime → ``OpenAIEngineClient`` →
a real llama-server's ``/v1/chat/completions``, with the cache hit read back from ``usage``.

vLLM, SGLang and Dynamo cannot run here (no GPU); llama-server speaks the same OpenAI chat API,
so it stands in for "an engine that places requests itself": agentkv pins no slot, saves nothing,
and learns what the engine computed only from ``usage.prompt_tokens_details.cached_tokens``. The
engine has one slot, so that its own prefix cache serves the repeated head (with two, llama-server
launched by agentkv picks any idle slot: agentkv normally chooses).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv.runtime.adapters import OpenAIEngineClient
from agentkv.runtime.assemble import EngineSettings, assemble
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.engine import EngineConfig, LlamaServerProcess
from agentkv.runtime.lifecycle import Runtime
from agentkv_server import create_app
from tests._engine_fixture import locate_engine

pytestmark = [pytest.mark.engine, pytest.mark.anyio]

CTX = 2048
#: A head of about 150 tokens: long enough to see the engine's cache serve it, short enough
#: to prefill in seconds on a loaded 2-core machine.
SYSTEM = "You answer in one short sentence. " * 20


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def engine(
    anyio_backend: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LlamaServerProcess]:
    binary, model = locate_engine()
    root = tmp_path_factory.mktemp("openai-engine")
    config = EngineConfig(model=model, slots=1, ctx_per_slot=CTX, port=0, cache_ram_mib=0)
    # No API key: an engine reached with --upstream is asked without one.
    async with LlamaServerProcess(
        config, binary=binary, log_dir=root / "logs", startup_timeout=300, api_key=None
    ) as process:
        yield process


def question(words: str) -> dict[str, Any]:
    return {
        "model": "agentkv-local",
        "max_tokens": 4,
        "temperature": 0,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": words}],
    }


async def test_anthropic_requests_through_the_openai_path_record_the_engine_cache_hit(
    engine: LlamaServerProcess, tmp_path: Path
) -> None:
    """Two agents' requests with one head: both answered; the second one's record and
    ``/metrics`` say the engine's cache held most of its prompt, as its usage reported."""
    client = OpenAIEngineClient(engine.base_url, api_key=engine.api_key, read_timeout=300)
    # A store directory is asked for, but an engine without slot files gets no store.
    config = RuntimeConfig(n_slots=1, ctx_per_slot=CTX, store_dir=tmp_path / "store")
    async with client, Runtime(client, config) as runtime:
        assert runtime.store is None
        app = create_app(runtime)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://agentkv", timeout=600
        ) as http:
            replies = []
            for agent, words in (("alpha", "Name a colour."), ("beta", "Name a fruit.")):
                response = await http.post(
                    "/v1/messages", json=question(words), headers={"x-agent-id": agent}
                )
                assert response.status_code == 200, response.text
                replies.append(response.json())
            metrics = (await http.get("/metrics")).text
    first, second = runtime.records()
    assert [r.agent for r in (first, second)] == ["alpha", "beta"]
    assert all(r.status.value == "ok" for r in (first, second))
    assert all(reply["content"] and reply["content"][0]["type"] == "text" for reply in replies)
    # The engine's own report, through usage: the second prompt shares the system prompt.
    assert first.cached_tokens == 0 and first.computed_tokens > 100
    assert second.cached_tokens > 100
    assert second.computed_tokens < second.cached_tokens
    usage = replies[1]["usage"]
    assert usage["cache_read_input_tokens"] == second.cached_tokens
    assert usage["input_tokens"] == second.computed_tokens
    reused = next(
        line
        for line in metrics.splitlines()
        if line.startswith("agentkv_prompt_tokens_total") and 'kind="reused"' in line
    )
    assert float(reused.rsplit(" ", 1)[1]) == second.cached_tokens


async def test_assemble_reaches_another_engine_kind_through_its_adapter(
    engine: LlamaServerProcess, tmp_path: Path
) -> None:
    """``EngineSettings(engine_kind="openai")`` (``--engine-kind openai``): ``assemble`` builds
    the adapter, keeps ``--slots`` as requests at once (the engine has one slot), turns the
    store off although one was asked for, and a request through it is answered."""
    settings = EngineSettings(
        upstream=engine.base_url,
        engine_kind="openai",
        slots=3,
        ctx_per_slot=CTX,
        store_dir=tmp_path / "store",
    )
    async with assemble(settings) as built, built.runtime as runtime:
        assert isinstance(built.client, OpenAIEngineClient)
        assert built.engine.store_dir is None and runtime.store is None
        assert (runtime.config.n_slots, runtime.config.ctx_per_slot) == (3, CTX)
        assert built.client.model  # the first model the engine lists
        prepared = await runtime.prepare(question("Name a tree."), agent="gamma", priority=1)
        message = await runtime.submit(prepared).message()
    assert message["content"] and message["content"][0]["type"] == "text"
    (record,) = runtime.records()
    assert record.status.value == "ok" and record.agent == "gamma"
    assert not (tmp_path / "store").exists()
