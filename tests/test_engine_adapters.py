"""Contract tests of the vLLM, SGLang and Dynamo adapters against their recorded shapes.

Each engine is an ``httpx.MockTransport`` serving the replies in ``tests/fixtures/engines``
(written from the engines' own protocol definitions; see the README there). The tests check what
each adapter sends (the engine's own hint fields and headers, no llama-server fields) and what it
reads back (the cache hit in ``usage``, as the ``timings`` the runtime records).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv.exceptions import EngineError, EngineResponseError
from agentkv.runtime.adapters import (
    ADAPTERS,
    DynamoClient,
    OpenAIEngineClient,
    SGLangClient,
    VLLMClient,
    adapter,
    adapter_shape,
    estimated_tokens,
)
from agentkv.runtime.adapters.base import CHARS_PER_TOKEN, header_value
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.hints import EngineHints
from agentkv.runtime.lifecycle import Runtime

pytestmark = pytest.mark.anyio

FIXTURES = Path(__file__).parent / "fixtures" / "engines"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def shapes(kind: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{kind}.json").read_text())  # type: ignore[no-any-return]


def sse(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


class Engine:
    """A recorded engine: answers from its fixture and keeps every request it was sent."""

    def __init__(self, kind: str, *, stream: str = "stream") -> None:
        self.shapes = shapes(kind)
        self.stream_name = stream
        self.requests: list[httpx.Request] = []
        #: Replies to send before the fixture's, one per chat request: (status, JSON body).
        self.refusals: list[tuple[int, dict[str, Any]]] = []
        self.tokenize_status = 200

    def bodies(self, path: str = "/v1/chat/completions") -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests if r.url.path == path]

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json=self.shapes["models"])
        if path == "/health":
            return httpx.Response(200, json={})
        if path == "/tokenize":
            if self.tokenize_status != 200:
                return httpx.Response(self.tokenize_status, json={"detail": "Not Found"})
            return httpx.Response(200, json=self.shapes["tokenize"])
        if path == "/v1/chat/completions":
            if self.refusals:
                status, body = self.refusals.pop(0)
                return httpx.Response(status, json=body)
            if json.loads(request.content).get("stream"):
                return httpx.Response(
                    200,
                    content=sse(self.shapes[self.stream_name]),
                    headers={"content-type": "text/event-stream"},
                )
            return httpx.Response(200, json=self.shapes["chat"])
        return httpx.Response(404, json={"detail": "Not Found"})


@asynccontextmanager
async def connected(
    engine: Engine, cls: type[OpenAIEngineClient], **kwargs: Any
) -> AsyncIterator[OpenAIEngineClient]:
    http = httpx.AsyncClient(transport=httpx.MockTransport(engine.handler))
    async with http, cls("http://engine", http=http, connect_retries=0, **kwargs) as client:
        yield client


#: agentkv's engine body, as the runtime sends it (llama-server's own fields included).
BODY: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Say hello."},
    ],
    "max_tokens": 32,
    "stream": True,
    "return_progress": True,
    "tools": [
        {
            "type": "function",
            "function": {"name": "Read", "parameters": {"type": "object"}},
        }
    ],
    "tool_choice": "auto",
}

SUB = EngineHints(agent="sess-1/agent-7", priority=1, parent="sess-1")


async def streamed(client: OpenAIEngineClient, hints: EngineHints | None) -> list[dict[str, Any]]:
    async with client.stream(BODY, slot=1, hints=hints) as chunks:
        return [chunk async for chunk in chunks]


# -- what each adapter sends ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["vllm", "sglang", "dynamo"])
async def test_the_request_names_the_model_and_leaves_llama_server_out(kind: str) -> None:
    """No slot pinning, no prompt progress; the engine's model; usage asked for on the stream."""
    engine = Engine(kind)
    async with connected(engine, ADAPTERS[kind]) as client:
        await streamed(client, SUB)
    (body,) = engine.bodies()
    assert body["model"] == shapes(kind)["models"]["data"][0]["id"]
    for llama_only in ("id_slot", "cache_prompt", "return_progress"):
        assert llama_only not in body
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == BODY["messages"] and body["tools"] == BODY["tools"]


async def test_vllm_gets_the_priority_in_its_own_order() -> None:
    """vLLM: ``priority`` in the body, lower runs earlier, as agentkv's; no header."""
    engine = Engine("vllm")
    async with connected(engine, VLLMClient) as client:
        for priority in (0, 3):
            await streamed(client, EngineHints(agent="a", priority=priority))
    assert [b["priority"] for b in engine.bodies()] == [0, 3]
    chat = [r for r in engine.requests if r.url.path == "/v1/chat/completions"]
    assert not any(k.startswith(("x-smg", "x-dynamo")) for r in chat for k in r.headers)


async def test_sglang_gets_the_priority_turned_round_and_the_agent_as_routing_key() -> None:
    """SGLang: a higher ``priority`` runs first, so P0 is sent as 3; the agent is the
    ``X-SMG-Routing-Key`` its gateway keeps on one worker."""
    engine = Engine("sglang")
    async with connected(engine, SGLangClient) as client:
        await streamed(client, SUB)
        await streamed(client, EngineHints(agent="sess-2", priority=0))
    assert [b["priority"] for b in engine.bodies()] == [2, 3]
    chat = [r for r in engine.requests if r.url.path == "/v1/chat/completions"]
    assert [r.headers["x-smg-routing-key"] for r in chat] == ["sess-1/agent-7", "sess-2"]


async def test_dynamo_gets_agent_hints_and_the_session_tree_in_its_headers() -> None:
    """Dynamo: ``nvext.agent_hints.priority`` (higher is more urgent), the agent as
    ``x-dynamo-session-id``, its parent as ``x-dynamo-parent-session-id``."""
    engine = Engine("dynamo")
    async with connected(engine, DynamoClient) as client:
        await streamed(client, SUB)
        await streamed(client, EngineHints(agent="sess-2", priority=3))
    first, second = engine.bodies()
    assert first["nvext"] == {"agent_hints": {"priority": 2}}
    assert second["nvext"] == {"agent_hints": {"priority": 0}}
    chat = [r for r in engine.requests if r.url.path == "/v1/chat/completions"]
    assert chat[0].headers["x-dynamo-session-id"] == "sess-1/agent-7"
    assert chat[0].headers["x-dynamo-parent-session-id"] == "sess-1"
    assert chat[1].headers["x-dynamo-session-id"] == "sess-2"
    assert "x-dynamo-parent-session-id" not in chat[1].headers


async def test_without_hints_nothing_is_added() -> None:
    """A call without hints (the generic adapter, or a compaction) sends the body alone."""
    engine = Engine("dynamo")
    async with connected(engine, DynamoClient) as client:
        await streamed(client, None)
    (body,) = engine.bodies()
    assert "nvext" not in body and "priority" not in body
    (chat,) = [r for r in engine.requests if r.url.path == "/v1/chat/completions"]
    assert "x-dynamo-session-id" not in chat.headers


@pytest.mark.parametrize("refusal", ["priority_refused", "priority_refused_flat"])
async def test_vllm_without_priority_scheduling_stops_getting_priorities(refusal: str) -> None:
    """vLLM refuses a priority without ``--scheduling-policy priority`` (400): the request is
    sent again without it, and so is every later one."""
    engine = Engine("vllm")
    engine.refusals.append((400, shapes("vllm")[refusal]))
    async with connected(engine, VLLMClient) as client:
        first = await streamed(client, SUB)
        await streamed(client, SUB)
        assert not isinstance(client, VLLMClient) or not client.sends_priority
    bodies = engine.bodies()
    assert [("priority" in b) for b in bodies] == [True, False, False]
    assert any(c.get("choices") for c in first)


async def test_another_refusal_is_not_retried() -> None:
    """A 400 about anything else reaches the caller, sent once."""
    engine = Engine("vllm")
    engine.refusals.append((400, {"error": {"message": "max_tokens is too large", "code": 400}}))
    async with connected(engine, VLLMClient) as client:
        with pytest.raises(EngineResponseError, match="max_tokens is too large"):
            await streamed(client, SUB)
    assert len(engine.bodies()) == 1


@pytest.mark.parametrize(
    ("kind", "continues"), [("vllm", True), ("sglang", True), ("dynamo", False)]
)
async def test_a_reply_that_continues_extends_the_last_message(kind: str, continues: bool) -> None:
    """After a broken stream the runtime sends the reply so far as the last assistant message:
    vLLM and SGLang are asked to continue it rather than start a new turn."""
    engine = Engine(kind)
    body = {**BODY, "messages": [*BODY["messages"], {"role": "assistant", "content": "Hel"}]}
    async with (
        connected(engine, ADAPTERS[kind]) as client,
        client.stream(body, slot=None) as chunks,
    ):
        _ = [c async for c in chunks]
    (sent,) = engine.bodies()
    assert sent.get("continue_final_message", False) is continues
    assert sent.get("add_generation_prompt", True) is not continues


async def test_a_constrained_reply_names_its_schema() -> None:
    """OpenAI's ``json_schema`` response format needs a name; llama-server's body has none."""
    engine = Engine("vllm")
    schema = {"type": "object", "properties": {"name": {"const": "Read"}}}
    body = {**BODY, "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    async with connected(engine, VLLMClient) as client, client.stream(body, slot=0) as chunks:
        _ = [c async for c in chunks]
    (sent,) = engine.bodies()
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "reply", "schema": schema},
    }


# -- what each adapter reads back --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["vllm", "sglang", "dynamo"])
async def test_the_cache_hit_in_usage_becomes_the_timings_the_runtime_records(kind: str) -> None:
    """``usage.prompt_tokens_details.cached_tokens`` → ``cache_n``; the rest → ``prompt_n``."""
    usage = shapes(kind)["stream"][-1]["usage"]
    engine = Engine(kind)
    async with connected(engine, ADAPTERS[kind]) as client:
        chunks = await streamed(client, SUB)
    timings = chunks[-1]["timings"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert timings["cache_n"] == cached
    assert timings["prompt_n"] == usage["prompt_tokens"] - cached
    assert timings["predicted_n"] == usage["completion_tokens"]
    assert "prompt_ms" not in timings  # the time to the first token includes the engine's queue
    assert all("timings" not in c for c in chunks[:-1])


async def test_an_engine_that_reports_no_cache_counts_every_token_as_computed() -> None:
    """SGLang without ``--enable-cache-report``: no cached tokens claimed."""
    engine = Engine("sglang", stream="stream_without_cache_report")
    async with connected(engine, SGLangClient) as client:
        chunks = await streamed(client, SUB)
    timings = dict(chunks[-1]["timings"])
    timings.pop("predicted_ms", None)  # the decode time as measured here
    assert timings == {"prompt_n": 2048, "cache_n": 0, "predicted_n": 2}


@pytest.mark.parametrize("kind", ["vllm", "sglang", "dynamo"])
async def test_a_reply_not_streamed_carries_its_usage_as_timings(kind: str) -> None:
    """The compactor's calls are not streamed: their usage reads the same."""
    usage = shapes(kind)["chat"]["usage"]
    engine = Engine(kind)
    async with connected(engine, ADAPTERS[kind]) as client:
        reply = await client.chat({**BODY, "stream": False}, slot=0, hints=SUB)
    (sent,) = engine.bodies()
    assert sent["stream"] is False and "stream_options" not in sent
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert reply["timings"]["cache_n"] == cached
    assert reply["timings"]["prompt_n"] + cached == usage["prompt_tokens"]
    assert reply["choices"][0]["message"]["content"] == "A summary."


# -- the model, the prompt's tokens, and no slots ---------------------------------------------


@pytest.mark.parametrize(("kind", "length"), [("vllm", 32768), ("sglang", 32768), ("dynamo", None)])
async def test_the_model_and_its_context_come_from_the_model_list(
    kind: str, length: int | None
) -> None:
    engine = Engine(kind)
    async with connected(engine, ADAPTERS[kind]) as client:
        card = await client.describe()
        await client.describe()
    assert card.model == shapes(kind)["models"]["data"][0]["id"]
    assert card.max_model_len == length
    assert [r.url.path for r in engine.requests] == ["/v1/models"]


async def test_a_model_named_on_the_command_line_is_used_as_it_is() -> None:
    engine = Engine("dynamo")
    async with connected(engine, DynamoClient, model="other/model") as client:
        await streamed(client, SUB)
        card = await client.describe()
    assert engine.bodies()[0]["model"] == "other/model"
    assert card.model == "other/model" and card.max_model_len is None


async def test_vllm_tokenizes_the_chat_body_itself() -> None:
    """vLLM's ``/tokenize`` takes the chat body: the prompt's exact tokens."""
    engine = Engine("vllm")
    async with connected(engine, VLLMClient) as client:
        tokens = await client.prompt_tokens(BODY)
    assert tokens == shapes("vllm")["tokenize"]["tokens"]
    (request,) = engine.bodies("/tokenize")
    assert request == {
        "model": "Qwen/Qwen2.5-Coder-7B-Instruct",
        "messages": BODY["messages"],
        "tools": BODY["tools"],
        "add_generation_prompt": True,
    }


async def test_a_vllm_without_tokenize_falls_back_to_the_estimate() -> None:
    engine = Engine("vllm")
    engine.tokenize_status = 404
    async with connected(engine, VLLMClient) as client:
        first = await client.prompt_tokens(BODY)
        second = await client.prompt_tokens(BODY)
    assert first == second == estimated_tokens(BODY)
    assert len(engine.bodies("/tokenize")) == 1  # asked once


@pytest.mark.parametrize("kind", ["sglang", "dynamo"])
async def test_engines_that_do_not_tokenize_chat_bodies_are_estimated_without_a_call(
    kind: str,
) -> None:
    engine = Engine(kind)
    async with connected(engine, ADAPTERS[kind]) as client:
        tokens = await client.prompt_tokens(BODY)
    assert tokens == estimated_tokens(BODY)
    assert engine.requests == []


def test_the_estimate_counts_about_four_characters_a_token_and_keeps_shared_heads() -> None:
    """About one token per four characters of text; prompts that begin alike begin alike."""
    words = "def handler(request):\n    return compute(request.body)\n" * 40
    short = {"messages": [{"role": "user", "content": words}]}
    longer = {"messages": [*short["messages"], {"role": "assistant", "content": "Done."}]}
    assert abs(len(estimated_tokens(short)) - len(words) / CHARS_PER_TOKEN) < 10
    a, b = estimated_tokens(short), estimated_tokens(longer)
    assert b[: len(a) - 1] == a[:-1] and len(b) > len(a)
    other = {"messages": [{"role": "user", "content": "x" + words}]}
    assert estimated_tokens(other)[:2] != a[:2]  # the role tag, then the words


async def test_the_estimate_learns_the_engine_count_from_usage() -> None:
    """After a reply whose usage counted 2048 prompt tokens for a prompt of about 6000
    characters, that prompt is estimated at about 2048 tokens, not 1500."""
    engine = Engine("sglang")
    words = "Refactor the parser so that every error names its line. " * 107
    body = {**BODY, "messages": [{"role": "user", "content": words}]}
    async with connected(engine, SGLangClient) as client:
        before = len(await client.prompt_tokens(body))
        async with client.stream(body, slot=None, hints=SUB) as chunks:
            _ = [c async for c in chunks]
        after = len(await client.prompt_tokens(body))
    assert before == len(estimated_tokens(body))
    assert abs(before - 1536) < 40
    assert abs(after - 2048) <= 2


@pytest.mark.parametrize("kind", ["vllm", "sglang", "dynamo"])
async def test_there_are_no_slots_to_save_restore_or_pin(kind: str) -> None:
    """Slot files, raw completions and prefills are refused without a call to the engine."""
    engine = Engine(kind)
    async with connected(engine, ADAPTERS[kind]) as client:
        assert client.slot_files is False
        for call in (
            client.save_slot(0, "x.bin"),
            client.restore_slot(0, "x.bin"),
            client.erase_slot(0),
            client.slots(),
        ):
            with pytest.raises(EngineResponseError, match="places requests itself"):
                await call
        with pytest.raises(EngineResponseError, match="places requests itself"):
            async with client.prefill([1, 2, 3], slot=0):
                pass
        assert await client.accepts_images() is True
    assert engine.requests == []


async def test_errors_name_the_engine() -> None:
    """The client's error map speaks of llama-server; an adapter's errors name its engine."""
    engine = Engine("sglang")
    engine.refusals.append((500, {"error": {"message": "CUDA out of memory", "code": 500}}))
    async with connected(engine, SGLangClient) as client:
        with pytest.raises(EngineResponseError) as caught:
            await streamed(client, SUB)
    assert "SGLang chat completion failed with HTTP 500: CUDA out of memory" in caught.value.message
    assert "llama-server" not in caught.value.message

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    http = httpx.AsyncClient(transport=httpx.MockTransport(refuse))
    async with http, VLLMClient("http://gpu:8000", http=http, connect_retries=0, model="m") as vllm:
        with pytest.raises(EngineError, match="cannot reach vLLM") as unreachable:
            await streamed(vllm, SUB)
    assert "llama-server" not in str(unreachable.value)


def test_header_values_are_ascii() -> None:
    assert header_value("sess-1/agent-7") == "sess-1/agent-7"
    assert header_value("café…#0a1b").isascii()
    assert header_value("a\u2028b").isascii()


def test_every_client_implements_the_seam_on_its_own() -> None:
    """llama-server's client, the pool and the adapters each implement every call of the engine
    seam; an adapter holds the HTTP link, it is not a llama-server client."""
    from agentkv.runtime.client import LlamaSlotClient
    from agentkv.runtime.pool import EnginePool
    from agentkv.runtime.seam import Engine as Seam

    seam = {name for name in vars(Seam) if not name.startswith("_")}
    for cls in (LlamaSlotClient, EnginePool, OpenAIEngineClient):
        assert not [name for name in seam if not hasattr(cls, name)], cls
    assert not issubclass(OpenAIEngineClient, LlamaSlotClient)


def test_each_kind_has_its_adapter() -> None:
    assert {k: type(adapter(k, "http://e")) for k in ADAPTERS} == {
        "vllm": VLLMClient,
        "sglang": SGLangClient,
        "dynamo": DynamoClient,
        "openai": OpenAIEngineClient,
    }
    with pytest.raises(ValueError, match="no adapter"):
        adapter("llama", "http://e")


# -- the runtime on top of an adapter ------------------------------------------------------------


async def test_the_runtime_records_the_engine_cache_hit_and_hands_it_the_tree(
    tmp_path: Path,
) -> None:
    """A Messages request through the runtime on Dynamo: no store (even when asked for), the
    sub-agent's hints reach the engine, and the record says what the engine computed and what
    its cache held."""
    engine = Engine("dynamo")
    http = httpx.AsyncClient(transport=httpx.MockTransport(engine.handler))
    client = DynamoClient("http://engine", http=http, connect_retries=0)
    config = RuntimeConfig(n_slots=4, ctx_per_slot=32768, store_dir=tmp_path / "store")
    async with http, Runtime(client, config) as runtime:
        assert runtime.store is None
        records = []
        runtime.add_listener(records.append)
        body = {
            "model": "claude-x",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "Say hello."}],
        }
        place = runtime.place_agent("sess-1", "agent-7", 1, body)
        prepared = await runtime.prepare(body, agent=place.agent, priority=place.priority)
        message = await runtime.submit(prepared).message()
    assert "".join(b.get("text", "") for b in message["content"]) == "Hello there."
    usage = shapes("dynamo")["stream"][-1]["usage"]
    assert message["usage"]["cache_read_input_tokens"] == 7100
    assert message["usage"]["input_tokens"] == usage["prompt_tokens"] - 7100
    (record,) = records
    assert (record.cached_tokens, record.computed_tokens) == (7100, 25)
    (chat,) = [r for r in engine.requests if r.url.path == "/v1/chat/completions"]
    assert chat.headers["x-dynamo-session-id"] == "sess-1/agent-7"
    assert chat.headers["x-dynamo-parent-session-id"] == "sess-1"
    sent = json.loads(chat.content)
    assert sent["nvext"]["agent_hints"]["priority"] == 3 - place.priority
    assert not list(tmp_path.glob("store/*"))


# -- agentkv-server --engine-kind ----------------------------------------------------------------


def test_another_engine_kind_needs_an_upstream() -> None:
    """agentkv launches only llama-server: another kind without --upstream is refused."""
    from agentkv_server.cli import main

    with pytest.raises(SystemExit, match="needs --upstream"):
        main(["--engine-kind", "sglang"])


async def test_the_command_line_picks_the_adapter_its_model_and_the_context() -> None:
    """``--engine-kind vllm --model NAME``: the vLLM adapter for that model, with no store; the
    context comes from /v1/models unless ``--ctx-per-slot`` says otherwise; ``--slots`` stays as
    given."""
    from agentkv.runtime.assemble import EngineSettings, engine_shape, open_client, open_engine
    from agentkv_server.cli import _from_args, build_parser

    args = build_parser().parse_args(
        [
            "--upstream",
            "http://engine",
            "--engine-kind",
            "vllm",
            "--model",
            "Qwen/Qwen2.5-Coder-7B-Instruct",
            "--store-dir",
            "/nonexistent/store",
        ]
    )
    settings = _from_args(EngineSettings, args)
    assert settings.engine_kind == "vllm"
    async with open_engine(settings) as handle:
        assert handle.store_dir is None  # an engine that places requests itself has no store
        client = open_client(settings, handle)
    assert isinstance(client, VLLMClient) and client.model == "Qwen/Qwen2.5-Coder-7B-Instruct"
    await client.aclose()
    engine = Engine("vllm")
    http = httpx.AsyncClient(transport=httpx.MockTransport(engine.handler))
    client = VLLMClient("http://engine", http=http, connect_retries=0)
    async with http, client:
        assert await adapter_shape(client, 16, None) == (16, 32768)
        assert await adapter_shape(client, 16, 8192) == (16, 8192)
        # assemble's engine_shape reads an adapter's shape so, not from /slots.
        assert await engine_shape(client, 16, None) == (16, 32768)
    llama_settings = _from_args(EngineSettings, build_parser().parse_args(["--upstream", "x"]))
    async with open_engine(llama_settings) as handle:
        llama = open_client(llama_settings, handle)
    assert type(llama).__name__ == "LlamaSlotClient" and llama.slot_files
    await llama.aclose()


def test_engine_kind_is_one_generated_option() -> None:
    """``--engine-kind`` comes from ``EngineSettings``: its choices are the adapters' kinds, and
    an unknown kind is refused by the parser."""
    from agentkv_server.cli import build_parser

    parser = build_parser()
    flags = [a for a in parser._actions if "--engine-kind" in a.option_strings]
    assert len(flags) == 1
    assert list(flags[0].choices or ()) == ["llama", "dynamo", "openai", "sglang", "vllm"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--upstream", "x", "--engine-kind", "tgi"])


def test_the_banner_names_the_engine_and_what_slots_mean_there() -> None:
    from agentkv_server import logs

    fields = logs.startup_fields(
        engine="http://gpu-box:8000",
        engine_name="vLLM",
        launched=False,
        model="Qwen/Qwen2.5-Coder-7B-Instruct",
        slots=16,
        ctx_per_slot=32768,
        store=None,
        store_budget=None,
        url="http://127.0.0.1:8788",
        api_key=False,
        claude_code="",
    )
    block = logs.startup_block(fields)
    assert "vLLM at http://gpu-box:8000" in block
    assert "16 requests at once, placed by vLLM (32768 tokens each)" in block
    assert "llama-server" not in block


async def test_an_overlong_prompt_is_compacted_on_the_agents_own_worker() -> None:
    """Compaction works on an engine that places requests itself: the summary and the warm-up
    go to the engine with the agent's routing key (SGLang keeps them where its context is), and
    the request that follows fits."""
    engine = Engine("sglang")
    http = httpx.AsyncClient(transport=httpx.MockTransport(engine.handler))
    client = SGLangClient("http://engine", http=http, connect_retries=0)
    config = RuntimeConfig(n_slots=2, ctx_per_slot=1200, compact_keep_messages=2)
    turns: list[dict[str, Any]] = []
    for i in range(12):
        turns += [
            {"role": "user", "content": f"question {i} " + "detail " * 30},
            {"role": "assistant", "content": f"answer {i} " + "fact " * 30},
        ]
    body = {"model": "m", "max_tokens": 8, "messages": [*turns, {"role": "user", "content": "go"}]}
    async with http, Runtime(client, config) as runtime:
        assert len(await client.prompt_tokens(body)) > 1200  # too long as it stands
        prepared = await runtime.prepare(body, agent="coder", priority=1)
        await runtime.submit(prepared).message()
    chat = [r for r in engine.requests if r.url.path == "/v1/chat/completions"]
    summary, warm, reply = (json.loads(r.content) for r in chat)
    assert summary["stream"] is False and warm["max_tokens"] == 1
    assert all(r.headers["x-smg-routing-key"] == "coder" for r in chat)
    assert reply["messages"][-1]["content"] == "go"
    assert "question 0" not in json.dumps(reply["messages"])
