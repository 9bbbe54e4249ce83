"""LlamaSlotClient against scripted upstream behaviour (httpx.MockTransport)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest

from agentkv.exceptions import (
    EngineError,
    EngineResponseError,
    EngineRestartingError,
    EngineStreamBrokenError,
    EngineTimeoutError,
    EngineUnavailableError,
)
from agentkv.runtime import error_map
from agentkv.runtime.client import LlamaSlotClient, map_httpx_error, wait_until_ready
from agentkv.runtime.status import EngineStatus

pytestmark = pytest.mark.anyio

BASE = "http://engine.test"
BODY: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

Handler = Callable[[httpx.Request], httpx.Response]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_client(handler: Handler, **kwargs: Any) -> LlamaSlotClient:
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    kwargs.setdefault("retry_backoff", 0.001)
    return LlamaSlotClient(BASE, http=http, **kwargs)


def sse(*events: Any, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events]
    if done:
        lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


def chunk(text: str, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
        **extra,
    }


COMPLETION = {
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}}],
    "timings": {"cache_n": 3, "prompt_n": 7, "predicted_n": 2},
}


async def collect(client: LlamaSlotClient, slot: int | None = 0) -> list[dict[str, Any]]:
    async with client.stream(BODY, slot=slot) as chunks:
        return [c async for c in chunks]


async def test_chat_sends_slot_and_cache_prompt() -> None:
    """A chat request carries id_slot, cache_prompt and stream=false next to the caller's body."""
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        sent.append(json.loads(request.content))
        return httpx.Response(200, json=COMPLETION)

    client = make_client(handler)
    reply = await client.chat(BODY, slot=1)
    assert reply["timings"]["cache_n"] == 3
    assert sent[0] == {**BODY, "id_slot": 1, "cache_prompt": True, "stream": False}


async def test_slot_none_means_any_slot() -> None:
    """slot=None is sent as id_slot -1 (llama-server picks an idle slot)."""
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, content=sse(chunk("a", "stop")))

    client = make_client(handler)
    await collect(client, slot=None)
    assert sent[0]["id_slot"] == -1
    assert sent[0]["stream"] is True
    assert sent[0]["cache_prompt"] is True


async def test_stream_yields_chunks_until_done() -> None:
    """The stream yields every data chunk in order, including the last one with timings."""
    events = [chunk("he"), chunk("llo"), chunk("", "stop", timings={"cache_n": 5, "prompt_n": 2})]

    client = make_client(lambda _: httpx.Response(200, content=sse(*events)))
    got = await collect(client)
    assert got == events
    assert got[-1]["timings"]["cache_n"] == 5


async def test_stream_ignores_comments_and_blank_lines() -> None:
    """SSE comments and blank keep-alive lines are not chunks."""
    body = b": keep-alive\n\n" + sse(chunk("x", "stop"))
    client = make_client(lambda _: httpx.Response(200, content=body))
    assert [c["choices"][0]["delta"]["content"] for c in await collect(client)] == ["x"]


async def test_refused_is_retried_then_unavailable() -> None:
    """A refused connection is retried connect_retries times, then EngineUnavailableError."""
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ConnectError("connection refused", request=request)

    client = make_client(handler, connect_retries=3)
    with pytest.raises(EngineUnavailableError, match="cannot reach"):
        await client.chat(BODY, slot=0)
    assert calls == 4


async def test_refused_then_up_succeeds() -> None:
    """A server that starts accepting connections after a refusal is reached on retry."""
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json=COMPLETION)

    client = make_client(handler)
    assert (await client.chat(BODY, slot=0))["choices"][0]["message"]["content"] == "hello"
    assert calls == 3


async def test_retry_is_bounded_in_time() -> None:
    """retry_seconds caps the retrying even when attempts remain."""
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ConnectError("refused", request=request)

    client = make_client(handler, connect_retries=1000, retry_seconds=0.3, retry_backoff=0.05)
    with anyio.fail_after(5):
        with pytest.raises(EngineUnavailableError):
            await client.chat(BODY, slot=0)
    assert 1 < calls < 1000


async def test_loading_503_then_ok_is_retried() -> None:
    """503 'Loading model' is retried and the request then succeeds."""
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            err = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
            return httpx.Response(503, json=err)
        return httpx.Response(200, content=sse(chunk("ok", "stop")))

    client = make_client(handler)
    got = await collect(client)
    assert got[0]["choices"][0]["delta"]["content"] == "ok"
    assert calls == 2


async def test_loading_forever_is_unavailable() -> None:
    """A server that stays in 503 gives EngineUnavailableError with its message."""
    err = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    client = make_client(lambda _: httpx.Response(503, json=err), connect_retries=2)
    with pytest.raises(EngineUnavailableError, match="Loading model") as info:
        await client.chat(BODY, slot=0)
    assert type(info.value) is EngineUnavailableError


async def test_read_timeout_is_engine_timeout() -> None:
    """A stalled engine (read timeout) becomes EngineTimeoutError, without retry."""
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ReadTimeout("timed out", request=request)

    client = make_client(handler)
    with pytest.raises(EngineTimeoutError):
        await client.chat(BODY, slot=0)
    assert calls == 1


class StallingStream(httpx.AsyncByteStream):
    """A body that sends some bytes, then stalls (read timeout) or breaks off."""

    def __init__(self, first: bytes, fail: Exception) -> None:
        self.first = first
        self.fail = fail
        self.closed = False

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        yield self.first
        raise self.fail

    async def aclose(self) -> None:
        self.closed = True


async def test_stall_mid_stream_is_engine_timeout_and_not_retried() -> None:
    """A read timeout after the first chunk raises EngineTimeoutError; nothing is resent."""
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        body = StallingStream(sse(chunk("a"), done=False), httpx.ReadTimeout("stalled"))
        return httpx.Response(200, stream=body)

    client = make_client(handler)
    seen: list[dict[str, Any]] = []
    with pytest.raises(EngineTimeoutError):
        async with client.stream(BODY, slot=0) as chunks:
            async for c in chunks:
                seen.append(c)
    assert len(seen) == 1
    assert calls == 1


async def test_connection_drop_mid_stream_is_not_retried() -> None:
    """A connection error after the stream started is an error, never a retry."""
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        fail = httpx.RemoteProtocolError("peer closed connection")
        return httpx.Response(200, stream=StallingStream(sse(chunk("a"), done=False), fail))

    client = make_client(handler)
    with pytest.raises(EngineResponseError, match="truncated"):
        await collect(client)
    assert calls == 1


async def test_truncated_stream_is_response_error() -> None:
    """A stream that ends without finish_reason and without [DONE] is reported as truncated."""
    body = sse(chunk("a"), chunk("b"), done=False)
    client = make_client(lambda _: httpx.Response(200, content=body))
    with pytest.raises(EngineResponseError, match="truncated"):
        await collect(client)


async def test_stream_with_finish_reason_but_no_done_is_complete() -> None:
    """A stream that reported finish_reason but lost [DONE] still ends normally."""
    body = sse(chunk("a"), chunk("", "stop"), done=False)
    client = make_client(lambda _: httpx.Response(200, content=body))
    assert len(await collect(client)) == 2


async def test_5xx_carries_llama_error_message() -> None:
    """A 500 with llama-server's error JSON becomes EngineResponseError with its message."""
    err = {"error": {"code": 500, "message": "failed to decode batch", "type": "server_error"}}
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(500, json=err)

    client = make_client(handler)
    with pytest.raises(EngineResponseError, match="failed to decode batch") as info:
        await collect(client)
    assert info.value.upstream_status == 500
    assert info.value.status == 500
    assert calls == 1


async def test_4xx_maps_to_invalid_request() -> None:
    """A 400 from llama-server is a client-side problem: status 400, its message kept."""
    err = {"error": {"code": 400, "message": "the request exceeds the available context size"}}
    client = make_client(lambda _: httpx.Response(400, json=err))
    with pytest.raises(EngineResponseError, match="exceeds the available context") as info:
        await client.chat(BODY, slot=0)
    assert info.value.upstream_status == 400
    assert info.value.status == 400
    assert info.value.error_type == "invalid_request_error"


async def test_error_without_json_keeps_body_text() -> None:
    """An error status with a plain-text body reports that text."""
    client = make_client(lambda _: httpx.Response(502, text="Bad Gateway from proxy"))
    with pytest.raises(EngineResponseError, match="Bad Gateway from proxy"):
        await client.chat(BODY, slot=0)


async def test_malformed_json_line_is_response_error() -> None:
    """A data line that is not JSON raises EngineResponseError."""
    body = sse(chunk("a"), done=False) + b'data: {"choices": [\n\n' + b"data: [DONE]\n\n"
    client = make_client(lambda _: httpx.Response(200, content=body))
    with pytest.raises(EngineResponseError, match="malformed JSON"):
        await collect(client)


async def test_malformed_json_reply_is_response_error() -> None:
    """A non-streaming reply that is not JSON raises EngineResponseError."""
    client = make_client(lambda _: httpx.Response(200, text="<html>oops</html>"))
    with pytest.raises(EngineResponseError, match="malformed JSON"):
        await client.chat(BODY, slot=0)


async def test_error_chunk_in_stream_is_response_error() -> None:
    """An error object sent inside the stream is raised with its message."""
    body = sse(chunk("a"), {"error": {"code": 500, "message": "slot is busy"}}, done=False)
    client = make_client(lambda _: httpx.Response(200, content=body))
    with pytest.raises(EngineResponseError, match="slot is busy"):
        await collect(client)


async def test_leaving_stream_early_closes_upstream() -> None:
    """Exiting the async-with after one chunk closes the upstream body."""
    body = StallingStream(sse(chunk("a"), done=False), httpx.ReadTimeout("never reached"))
    client = make_client(lambda _: httpx.Response(200, stream=body))
    async with client.stream(BODY, slot=0) as chunks:
        async for _ in chunks:
            break
    assert body.closed


async def test_cancelling_the_caller_closes_upstream() -> None:
    """Cancelling the task that reads the stream closes the upstream body."""

    class Endless(httpx.AsyncByteStream):
        closed = False

        async def __aiter__(self):  # type: ignore[no-untyped-def]
            yield sse(chunk("a"), done=False)
            await anyio.sleep_forever()
            yield b""  # pragma: no cover

        async def aclose(self) -> None:
            Endless.closed = True

    client = make_client(lambda _: httpx.Response(200, stream=Endless()))
    got_one = anyio.Event()

    async def reader() -> None:
        async with client.stream(BODY, slot=0) as chunks:
            async for _ in chunks:
                got_one.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await got_one.wait()
            tg.cancel_scope.cancel()
    assert Endless.closed


async def test_prompt_tokens_templates_then_tokenizes() -> None:
    """prompt_tokens templates the body, then tokenizes the prompt with special tokens."""
    sent: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        sent[request.url.path] = payload
        if request.url.path == "/apply-template":
            return httpx.Response(200, json={"prompt": "<|im_start|>user\nhi<|im_end|>\n"})
        return httpx.Response(200, json={"tokens": list(range(len(payload["content"].split())))})

    client = make_client(handler)
    assert await client.prompt_tokens(BODY) == [0, 1]
    assert sent["/apply-template"]["messages"] == BODY["messages"]
    assert sent["/tokenize"]["add_special"] is True
    assert sent["/tokenize"]["parse_special"] is True
    assert await client.tokenize("a b c") == [0, 1, 2]
    assert sent["/tokenize"]["add_special"] is False


async def test_prompt_tokens_asks_the_engine_once_per_question() -> None:
    """The same body again costs no call; another body costs its template, and its tokenizing
    only when the prompt is new; a different day asks the template again."""
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        calls.append(request.url.path)
        if request.url.path == "/apply-template":
            text = payload["messages"][-1]["content"]
            return httpx.Response(200, json={"prompt": "<|im_start|>user\n" + text.strip()})
        return httpx.Response(200, json={"tokens": [ord(c) for c in payload["content"]]})

    client = make_client(handler)
    first = await client.prompt_tokens(BODY)
    assert calls == ["/apply-template", "/tokenize"]
    assert await client.prompt_tokens(dict(BODY)) == first
    assert calls == ["/apply-template", "/tokenize"]
    # Another body whose prompt is the same: templated, not tokenized again.
    spaced = {**BODY, "messages": [{"role": "user", "content": " hi "}]}
    assert await client.prompt_tokens(spaced) == first
    assert calls == ["/apply-template", "/tokenize", "/apply-template"]
    stats = client.prompt_stats
    assert (stats.templates_kept, stats.templates_asked) == (1, 2)
    assert (stats.tokens_kept, stats.tokens_whole, stats.tokens_pieces) == (2, 1, 0)
    # The plain calls always ask the engine.
    await client.tokenize("a")
    assert calls[-1] == "/tokenize" and len(calls) == 4


async def test_prompt_tokens_asks_the_template_again_on_another_day(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Some chat templates write today's date: a kept prompt is for the day it was made."""
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/apply-template":
            return httpx.Response(200, json={"prompt": "<|im_start|>user\nhi"})
        return httpx.Response(200, json={"tokens": [1, 2]})

    client = make_client(handler)
    monkeypatch.setattr("agentkv.runtime.client.time.strftime", lambda fmt: "2026-12-02")
    await client.prompt_tokens(BODY)
    await client.prompt_tokens(BODY)
    monkeypatch.setattr("agentkv.runtime.client.time.strftime", lambda fmt: "2026-12-03")
    await client.prompt_tokens(BODY)
    assert calls == ["/apply-template", "/tokenize", "/apply-template"]


SPECIAL = {"<|im_start|>": 1, "<|im_end|>": 2}


def toy_tokenizer(content: str, add_special: bool, parse_special: bool, eos: bool) -> list[int]:
    """llama-server's way, in small: special tokens split the text first (when parsed), then a
    token per character; ``eos``: add_special also appends an end token (9)."""
    out: list[int] = []
    rest = content
    while rest:
        hits = [(rest.find(m), m) for m in SPECIAL if parse_special and rest.find(m) >= 0]
        where, marker = min(hits) if hits else (len(rest), "")
        out += [100 + ord(c) % 50 for c in rest[:where]]
        if marker:
            out.append(SPECIAL[marker])
        rest = rest[where + len(marker) :]
    return [*out, 9] if add_special and eos else out


def session_client(eos: bool) -> tuple[LlamaSlotClient, list[str]]:
    """A client whose engine templates ChatML and tokenizes as :func:`toy_tokenizer`; the list
    gets the text of each tokenize call."""
    tokenized: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        if request.url.path == "/apply-template":
            turns = [
                f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in payload["messages"]
            ]
            return httpx.Response(200, json={"prompt": "".join(turns) + "<|im_start|>assistant\n"})
        tokenized.append(payload["content"])
        tokens = toy_tokenizer(
            payload["content"], payload["add_special"], payload["parse_special"], eos
        )
        return httpx.Response(200, json={"tokens": tokens})

    return make_client(handler), tokenized


def growing_session(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be careful. " * 400}]
    bodies = []
    for n in range(turns):
        messages = [*messages, {"role": "user", "content": f"step {n}: " + "do it. " * 20}]
        bodies.append({"messages": messages, "max_tokens": 8})
        messages = [*messages, {"role": "assistant", "content": f"done {n}. " * 20}]
    return bodies


async def each_answer_is_the_whole_one(
    client: LlamaSlotClient, bodies: list[dict[str, Any]], *, eos: bool
) -> None:
    """Each body's prompt_tokens, in order, equal the toy tokenizer's answer for its prompt."""
    for body in bodies:
        tokens = await client.prompt_tokens(body)
        prompt = await client.apply_template(body)
        assert tokens == toy_tokenizer(prompt, True, True, eos=eos)


async def test_a_sessions_next_turn_is_tokenized_from_the_turn_before() -> None:
    """Each turn after the first sends only its end to be tokenized; the first three answers
    made so are checked against the whole prompt's tokens, and every answer equals them."""
    client, tokenized = session_client(eos=False)
    await each_answer_is_the_whole_one(client, growing_session(6), eos=False)
    assert (client.prompt_stats.tokens_pieces, client.prompt_stats.tokens_whole) == (5, 1)
    assert client._markers == SPECIAL
    whole = [t for t in tokenized if t.startswith("<|im_start|>system")]
    # The first turn, then three checks: the last two turns sent only their ends.
    assert len(whole) == 4
    assert all(len(t) < 1000 for t in tokenized[-2:])


async def test_pieces_that_differ_from_the_whole_answer_are_not_used_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine whose add_special also ends the prompt with a token: the first check finds
    the pieces wrong, the whole answer is used, and prompts are tokenized whole from then on."""
    client, tokenized = session_client(eos=True)
    await each_answer_is_the_whole_one(client, growing_session(4), eos=True)
    assert client._split_checks is None
    assert (client.prompt_stats.tokens_pieces, client.prompt_stats.tokens_whole) == (0, 4)
    assert "tokenizes a prompt differently from its pieces" in caplog.text
    assert tokenized[-1].startswith("<|im_start|>system")


async def test_only_strings_the_engine_parses_as_one_special_token_are_markers() -> None:
    """A candidate is a marker when it is one token parsed as special and other tokens when
    not; a tag that is plain text (several tokens) is not."""
    client, _ = session_client(eos=False)
    await client._learn_markers("<|im_start|>user <system-reminder> [INST] <|im_end|>")
    assert client._markers == SPECIAL
    assert client._not_markers == {"<system-reminder>", "[INST]"}


async def test_slot_actions_hit_the_slot_endpoints() -> None:
    """save/restore/erase POST to /slots/{id}?action=... with the filename."""
    seen: list[tuple[str, str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json=[{"id": 0, "is_processing": False}])
        seen.append(
            (request.url.path, request.url.params["action"], json.loads(request.content or b"{}"))
        )
        return httpx.Response(200, json={"id_slot": 0})

    client = make_client(handler)
    await client.save_slot(1, "a.bin")
    await client.restore_slot(1, "a.bin")
    await client.erase_slot(0)
    assert seen == [
        ("/slots/1", "save", {"filename": "a.bin"}),
        ("/slots/1", "restore", {"filename": "a.bin"}),
        ("/slots/0", "erase", {}),
    ]
    assert (await client.slots())[0]["id"] == 0


async def test_slot_action_error_reports_llama_message() -> None:
    """A failing slot restore reports llama-server's reason."""
    err = {"error": {"code": 400, "message": "failed to restore slot, file not found"}}
    client = make_client(lambda _: httpx.Response(400, json=err))
    with pytest.raises(EngineResponseError, match="file not found"):
        await client.restore_slot(0, "missing.bin")


async def test_health_states() -> None:
    """health() is True only for 200, False while loading or unreachable."""
    answers: list[Callable[[httpx.Request], httpx.Response]] = [
        lambda r: httpx.Response(200, json={"status": "ok"}),
        lambda r: httpx.Response(503, json={"error": {"message": "Loading model"}}),
    ]

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    results = [await make_client(a).health() for a in [*answers, refused]]
    assert results == [True, False, False]


async def test_wait_ready_reports_progress() -> None:
    """wait_ready polls through refused and loading states and reports each change."""
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise httpx.ConnectError("refused", request=request)
        if calls <= 3:
            return httpx.Response(503, json={"error": {"message": "Loading model"}})
        return httpx.Response(200, json={"status": "ok"})

    messages: list[str] = []
    client = make_client(handler)
    with anyio.fail_after(10):
        await client.wait_ready(10, on_progress=messages.append)
    assert len(messages) == 3
    assert "not accepting connections" in messages[0]
    assert "Loading model" in messages[1]
    assert "ready" in messages[2]


async def test_wait_ready_times_out() -> None:
    """wait_ready gives up after its timeout with the last state in the message."""
    err = {"error": {"message": "Loading model"}}
    client = make_client(lambda _: httpx.Response(503, json=err))
    with pytest.raises(EngineUnavailableError, match="Loading model"):
        await client.wait_ready(0.3)


async def test_owned_http_client_is_closed() -> None:
    """A client that created its own httpx client closes it on aclose; an injected one is kept."""
    own = LlamaSlotClient(BASE)
    await own.aclose()
    assert own._transport._http.is_closed
    injected = httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(200)))
    async with LlamaSlotClient(BASE, http=injected):
        pass
    assert not injected.is_closed
    await injected.aclose()


# -- the httpx error table ------------------------------------------------------------------------

#: What each httpx exception must become, decided here independently of the table in client.py.
#: Retryable "cannot reach" cases surface as EngineUnavailableError once the retries are spent.
INTENDED: dict[type[Exception], type[EngineError]] = {
    httpx.ConnectError: EngineUnavailableError,
    httpx.ConnectTimeout: EngineUnavailableError,
    httpx.PoolTimeout: EngineUnavailableError,
    httpx.ReadTimeout: EngineTimeoutError,
    httpx.WriteTimeout: EngineTimeoutError,
    httpx.TimeoutException: EngineTimeoutError,
    httpx.ReadError: EngineUnavailableError,
    httpx.WriteError: EngineUnavailableError,
    httpx.CloseError: EngineUnavailableError,
    httpx.NetworkError: EngineUnavailableError,
    httpx.RemoteProtocolError: EngineUnavailableError,
    httpx.LocalProtocolError: EngineError,
    httpx.ProtocolError: EngineUnavailableError,
    httpx.ProxyError: EngineUnavailableError,
    httpx.UnsupportedProtocol: EngineUnavailableError,
    httpx.TransportError: EngineUnavailableError,
    httpx.DecodingError: EngineResponseError,
    httpx.TooManyRedirects: EngineResponseError,
    httpx.RequestError: EngineError,
    httpx.HTTPStatusError: EngineResponseError,
    httpx.HTTPError: EngineError,
    httpx.InvalidURL: EngineUnavailableError,
    httpx.StreamError: EngineError,
    httpx.StreamConsumed: EngineError,
    httpx.StreamClosed: EngineError,
    httpx.ResponseNotRead: EngineError,
    httpx.RequestNotRead: EngineError,
}
#: Raised only by httpx.Cookies.get, never by sending a request.
NOT_FROM_REQUESTS = {httpx.CookieConflict}


def httpx_exception_classes() -> set[type[Exception]]:
    return {
        obj for obj in vars(httpx).values() if isinstance(obj, type) and issubclass(obj, Exception)
    }


def make_httpx_error(kind: type[Exception]) -> Exception:
    request = httpx.Request("POST", BASE + "/v1/chat/completions")
    if issubclass(kind, httpx.HTTPStatusError):
        return kind("boom", request=request, response=httpx.Response(500, request=request))
    if kind in (httpx.StreamConsumed, httpx.StreamClosed, httpx.ResponseNotRead):
        return kind()
    if kind is httpx.RequestNotRead:
        return kind()
    if issubclass(kind, httpx.RequestError):
        return kind("boom", request=request)
    return kind("boom")


def test_every_httpx_exception_is_classified() -> None:
    """Every exception class httpx exports is in the intended table (a new one fails here)."""
    assert httpx_exception_classes() - NOT_FROM_REQUESTS == set(INTENDED)


@pytest.mark.parametrize("kind", sorted(INTENDED, key=lambda k: k.__name__))
def test_httpx_exception_maps_to_intended_error(kind: type[Exception]) -> None:
    """Before a response: each httpx exception becomes its intended agentkv error."""
    error = map_httpx_error(make_httpx_error(kind), "chat completion", BASE, started=False)
    expected = INTENDED[kind]
    # The kinds that only steer the client's retries (never raised to a caller) count as their
    # public base.
    steering = (error_map.NotReadyError, error_map.DroppedError)
    public = type(error).__mro__[1] if type(error) in steering else type(error)
    assert public is expected
    assert "chat completion" in error.message
    assert BASE in error.message


@pytest.mark.parametrize("kind", sorted(INTENDED, key=lambda k: k.__name__))
async def test_httpx_exception_from_the_transport_is_mapped(kind: type[Exception]) -> None:
    """Raised by the transport, each httpx exception reaches the caller as its agentkv error,
    never as an httpx exception."""

    def handler(request: httpx.Request) -> httpx.Response:
        raise make_httpx_error(kind)

    client = make_client(handler, connect_retries=1)
    with pytest.raises(EngineError) as info:
        await client.chat(BODY, slot=0)
    assert type(info.value) is INTENDED[kind]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (httpx.ReadTimeout, EngineTimeoutError),
        (httpx.ReadError, EngineStreamBrokenError),
        (httpx.RemoteProtocolError, EngineStreamBrokenError),
        (httpx.DecodingError, EngineResponseError),
    ],
)
async def test_httpx_exception_mid_stream(kind: type[Exception], expected: type[Exception]) -> None:
    """After the first chunk, a lost connection is a truncated reply, a stall a timeout."""
    body = StallingStream(sse(chunk("a"), done=False), make_httpx_error(kind))
    client = make_client(lambda _: httpx.Response(200, stream=body))
    with pytest.raises(EngineError) as info:
        await collect(client)
    assert type(info.value) is expected
    if expected is EngineStreamBrokenError:
        assert "truncated" in info.value.message


# -- SSE parsing ----------------------------------------------------------------------------------


async def test_legacy_error_field_reports_the_engine_message() -> None:
    """An `error:` field (older llama-servers) raises the engine's own error, with its code."""
    body = sse(chunk("a"), done=False) + (
        b'error: {"code": 400, "message": "the request exceeds the available context size"}\n\n'
    )
    client = make_client(lambda _: httpx.Response(200, content=body))
    with pytest.raises(EngineResponseError, match="exceeds the available context") as info:
        await collect(client)
    assert info.value.status == 400


def test_event_parser_gives_the_same_events_however_the_text_is_cut() -> None:
    """The event-stream rules (CRLF, CR or LF; comments; joined data lines; one space dropped),
    the legacy ``error:`` field, and a last event without its blank line, at every cut."""
    from agentkv.runtime.chunks import EventParser

    text = (
        ': keep-alive\r\ndata: {"a": 1}\r\n\r\n'
        "event: note\rdata:one\rdata:  two\r\r"
        'error: {"code": 400}\n\nunknown: x\n\n'
        "data: [DONE]"
    )
    expected = [
        ("message", '{"a": 1}'),
        ("note", "one\n two"),
        ("error", '{"code": 400}'),
        ("message", "[DONE]"),
    ]
    whole = EventParser()
    assert [*whole.feed(text), *whole.close()] == expected
    for cut in range(len(text) + 1):
        for second in range(cut, len(text) + 1):
            parser = EventParser()
            events = [
                *parser.feed(text[:cut]),
                *parser.feed(text[cut:second]),
                *parser.feed(text[second:]),
                *parser.close(),
            ]
            assert events == expected, (cut, second)


async def test_crlf_and_split_chunks_are_parsed() -> None:
    """CRLF line ends and events split across network chunks parse like whole ones."""
    whole = sse(chunk("x"), chunk("y", "stop")).replace(b"\n", b"\r\n")

    class Dribble(httpx.AsyncByteStream):
        async def __aiter__(self):  # type: ignore[no-untyped-def]
            for i in range(0, len(whole), 7):
                yield whole[i : i + 7]

    client = make_client(lambda _: httpx.Response(200, stream=Dribble()))
    got = await collect(client)
    assert [c["choices"][0]["delta"]["content"] for c in got] == ["x", "y"]


async def test_last_event_without_blank_line_counts() -> None:
    """A final finishing chunk not followed by a blank line is still delivered."""
    body = f"data: {json.dumps(chunk('z', 'stop'))}".encode()
    client = make_client(lambda _: httpx.Response(200, content=body))
    assert len(await collect(client)) == 1


async def test_prefill_stream_ends_at_stop_true() -> None:
    """A /completion stream ends with `stop: true`; without it, it is truncated."""
    progress = {"prompt_progress": {"processed": 3, "total": 6}}
    final = {"content": "", "stop": True, "timings": {"prompt_n": 6}}
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/completion"
        sent.append(json.loads(request.content))
        return httpx.Response(200, content=sse(progress, final, done=False))

    client = make_client(handler)
    async with client.prefill([1, 2, 3, 4, 5, 6], slot=1) as chunks:
        got = [c async for c in chunks]
    assert got[-1]["timings"]["prompt_n"] == 6
    assert sent[0]["prompt"] == [1, 2, 3, 4, 5, 6]
    assert sent[0]["return_progress"] is True
    assert sent[0]["id_slot"] == 1

    client = make_client(lambda _: httpx.Response(200, content=sse(progress, done=False)))
    with pytest.raises(EngineResponseError, match="truncated"):
        async with client.prefill([1, 2], slot=0) as chunks:
            _ = [c async for c in chunks]


# -- the engine's key, supervision, templating limit ----------------------------------------------


async def test_api_key_is_sent_on_every_request() -> None:
    """With an api_key every request carries Authorization: Bearer; without, none does."""
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [1]})
        if request.url.path == "/slots":
            return httpx.Response(200, json=[])
        return httpx.Response(200, content=sse(chunk("a", "stop")))

    keyed = make_client(handler, api_key="k3y")
    await keyed.tokenize("a")
    await keyed.slots()
    await collect(keyed)
    assert seen == ["Bearer k3y"] * 3
    seen.clear()
    await make_client(handler).tokenize("a")
    assert seen == [None]


async def test_requests_fail_at_once_while_the_engine_restarts() -> None:
    """While the supervisor restarts the engine nothing is sent: 529 with retry-after."""
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(200, json=COMPLETION)

    status = EngineStatus()
    status.set_state("restarting", "llama-server exited with signal 9", retry_after=7.2)
    client = make_client(handler, status=status)
    with pytest.raises(EngineRestartingError) as info:
        await client.chat(BODY, slot=0)
    assert info.value.status == 529
    assert info.value.error_type == "overloaded_error"
    assert info.value.retry_after == 8
    assert "signal 9" in info.value.message
    assert calls == 0
    status.new_generation()
    assert (await client.chat(BODY, slot=0))["timings"]["cache_n"] == 3
    assert calls == 1


async def test_given_up_engine_is_unavailable_not_restarting() -> None:
    """After the supervisor gave up, requests get 503 engine unavailable (no retry-after)."""
    status = EngineStatus()
    status.set_state("unavailable", "failed 6 times")
    client = make_client(lambda _: httpx.Response(200, json=COMPLETION), status=status)
    with pytest.raises(EngineUnavailableError) as info:
        await client.chat(BODY, slot=0)
    assert type(info.value) is EngineUnavailableError
    assert info.value.retry_after is None


async def test_refusals_turn_into_restarting_once_the_supervisor_notices() -> None:
    """A refused connection retried while the supervisor starts a restart ends as 529."""
    status = EngineStatus()
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        status.set_state("restarting", "llama-server exited", retry_after=3)
        raise httpx.ConnectError("refused", request=request)

    client = make_client(handler, status=status, connect_retries=5)
    with pytest.raises(EngineRestartingError):
        await client.chat(BODY, slot=0)
    assert calls == 1


async def test_stream_broken_by_a_dying_engine_is_restarting() -> None:
    """A stream cut because the engine died reports the restart, once the supervisor sees it."""
    status = EngineStatus()

    async def die_soon() -> None:
        await anyio.sleep(0.05)
        status.set_state("restarting", "llama-server exited with signal 9", retry_after=2)

    body = StallingStream(sse(chunk("a"), done=False), httpx.RemoteProtocolError("closed"))
    client = make_client(lambda _: httpx.Response(200, stream=body), status=status)
    async with anyio.create_task_group() as tg:
        tg.start_soon(die_soon)
        with anyio.fail_after(5), pytest.raises(EngineRestartingError):
            await collect(client)


async def test_stream_broken_with_a_healthy_engine_stays_truncated() -> None:
    """A supervised engine that stays ready: a broken stream is still 'truncated'."""
    body = StallingStream(sse(chunk("a"), done=False), httpx.RemoteProtocolError("closed"))
    client = make_client(lambda _: httpx.Response(200, stream=body), status=EngineStatus())
    with anyio.fail_after(5), pytest.raises(EngineResponseError, match="truncated"):
        await collect(client)


async def test_engine_state_for_health() -> None:
    """engine_state: the supervisor's state when not ready, else one probe."""
    status = EngineStatus()
    client = make_client(lambda _: httpx.Response(200, json={"status": "ok"}), status=status)
    assert (await client.engine_state())[0] == "ready"
    status.set_state("restarting", "exited")
    assert await client.engine_state() == ("engine_restarting", "exited")
    status.set_state("unavailable", "gave up")
    assert await client.engine_state() == ("engine_unavailable", "gave up")
    down = make_client(lambda r: httpx.Response(503, json={"error": {"message": "Loading"}}))
    assert (await down.engine_state())[0] == "engine_unavailable"


async def test_templating_calls_are_limited() -> None:
    """At most templating_limit /tokenize and /apply-template calls are in flight at once."""
    running = peak = 0
    release = anyio.Event()
    two_running = anyio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        if running == 2:
            two_running.set()
        await release.wait()
        running -= 1
        if request.url.path == "/apply-template":
            return httpx.Response(200, json={"prompt": "p"})
        return httpx.Response(200, json={"tokens": [1, 2]})

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    client = LlamaSlotClient(BASE, http=http, templating_limit=2)
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(client.tokenize, "x")
            tg.start_soon(client.apply_template, BODY)
        with anyio.fail_after(5):
            await two_running.wait()
        await anyio.sleep(0.05)  # time for a third call to slip through, if it could
        assert running == 2
        release.set()
    assert peak == 2


async def test_cancelled_caller_never_sends_its_templating_call() -> None:
    """A caller that goes away while waiting for the limiter sends nothing."""
    sent: list[str] = []
    release = anyio.Event()
    first_sent = anyio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content)["content"])
        first_sent.set()
        await release.wait()
        return httpx.Response(200, json={"tokens": [1]})

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    client = LlamaSlotClient(BASE, http=http, templating_limit=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(client.tokenize, "first")
        with anyio.fail_after(5):
            await first_sent.wait()
        with anyio.move_on_after(0.1):
            await client.tokenize("abandoned")
        release.set()
    assert await client.tokenize("third") == [1]
    assert sent == ["first", "third"]


async def test_wait_until_ready_runs_the_check_each_time() -> None:
    """The shared readiness wait calls `check` before every probe and lets it fail the wait."""
    checks = 0

    def check() -> None:
        nonlocal checks
        checks += 1
        if checks == 3:
            raise RuntimeError("process exited")

    loading = httpx.Response(503, json={"error": {"message": "Loading model"}})
    http = httpx.AsyncClient(transport=httpx.MockTransport(lambda _: loading))
    with anyio.fail_after(5), pytest.raises(RuntimeError, match="process exited"):
        await wait_until_ready(http, BASE, timeout=10, check=check, interval=0.01)
    assert checks == 3


# -- the engine link: stale connections, drops and safe retries -----------------------------------

#: Every kind of engine call, as (name, call). Each is safe to send once more when its connection
#: closed before any byte of the reply arrived; all but chat are safe to repeat outright.
CALLS: dict[str, Callable[[LlamaSlotClient], Any]] = {
    "tokenize": lambda c: c.tokenize("hello"),
    "detokenize": lambda c: c.detokenize([1, 2]),
    "apply-template": lambda c: c.apply_template(BODY),
    "slots": lambda c: c.slots(),
    "props": lambda c: c.props(),
    "metrics": lambda c: c.metrics(),
    "save": lambda c: c.save_slot(0, "a.bin"),
    "restore": lambda c: c.restore_slot(0, "a.bin"),
    "erase": lambda c: c.erase_slot(0),
    "chat": lambda c: c.chat(BODY, slot=0),
    "stream": lambda c: collect(c),
    "prefill": lambda c: _drain(c.prefill([1, 2, 3], slot=0)),
    "completion": lambda c: _drain(c.complete({"prompt": [1, 2]}, slot=0)),
}
SAFE_CALLS = [name for name in CALLS if name not in ("chat", "stream", "completion")]


async def _drain(stream: Any) -> list[dict[str, Any]]:
    async with stream as chunks:
        return [c async for c in chunks]


def engine_reply(request: httpx.Request) -> httpx.Response:
    """A well-behaved llama-server for each kind of call."""
    path = request.url.path
    if path == "/health":
        return httpx.Response(200, json={"status": "ok"})
    if path == "/tokenize":
        return httpx.Response(200, json={"tokens": [1, 2]})
    if path == "/detokenize":
        return httpx.Response(200, json={"content": "hi"})
    if path == "/apply-template":
        return httpx.Response(200, json={"prompt": "<user>hi"})
    if path == "/slots":
        return httpx.Response(200, json=[{"id": 0}])
    if path == "/props":
        return httpx.Response(200, json={"modalities": {"vision": False}})
    if path == "/metrics":
        return httpx.Response(200, text="llamacpp:prompt_tokens_total 7\n")
    if path.startswith("/slots/"):
        return httpx.Response(200, json={"id_slot": 0, "n_saved": 2, "n_restored": 2})
    if path == "/v1/chat/completions":
        if json.loads(request.content).get("stream"):
            return httpx.Response(200, content=sse(chunk("a"), chunk("", finish="stop")))
        return httpx.Response(200, json=COMPLETION)
    if path == "/completion":
        last = {"content": "x", "stop": True, "timings": {"prompt_n": 3}}
        return httpx.Response(200, content=sse({"content": "", "stop": False}, last))
    return httpx.Response(404)


def dropped_before_reply(request: httpx.Request, kind: str) -> Exception:
    """What httpx raises when the connection closes before the reply: a pooled connection the
    server had closed (reused), or a new one reset."""
    if kind == "reused":
        return httpx.RemoteProtocolError("Server disconnected without sending a response.")
    return httpx.ReadError("[Errno 104] Connection reset by peer", request=request)


class Faulty:
    """A transport handler that fails the first ``times`` requests with ``fault``, then answers
    as llama-server would; it records every request it saw."""

    def __init__(self, fault: Callable[[httpx.Request], httpx.Response], times: int = 1) -> None:
        self.fault = fault
        self.times = times
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        if len(self.seen) <= self.times:
            return self.fault(request)
        return engine_reply(request)


@pytest.mark.parametrize("kind", ["reused", "fresh"])
@pytest.mark.parametrize("call", list(CALLS))
async def test_a_drop_before_the_reply_is_sent_once_more(call: str, kind: str) -> None:
    """Every kind of call whose connection closed before any reply byte is sent once more, on a
    new connection, and succeeds: the caller never hears of it."""

    def fault(request: httpx.Request) -> httpx.Response:
        raise dropped_before_reply(request, kind)

    handler = Faulty(fault)
    client = make_client(handler, connect_retries=0)
    await CALLS[call](client)
    assert len(handler.seen) == 2
    assert handler.seen[0].content == handler.seen[1].content
    assert client.link.resent == 1


@pytest.mark.parametrize("call", list(CALLS))
async def test_a_second_drop_is_reported_not_retried_forever(call: str) -> None:
    """Dropped twice in a row: the caller gets EngineUnavailableError after exactly two tries."""

    def fault(request: httpx.Request) -> httpx.Response:
        raise dropped_before_reply(request, "reused")

    handler = Faulty(fault, times=10)
    client = make_client(handler, connect_retries=3)
    with pytest.raises(EngineUnavailableError, match="also when sent again"):
        await CALLS[call](client)
    assert len(handler.seen) == 2


@pytest.mark.parametrize("call", list(CALLS))
async def test_refused_then_up_for_every_call(call: str) -> None:
    """A refused connection (engine starting) is retried with backoff for every kind of call."""

    def fault(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    handler = Faulty(fault, times=2)
    await CALLS[call](make_client(handler, connect_retries=3))
    assert len(handler.seen) == 3


@pytest.mark.parametrize("status", [502, 504])
@pytest.mark.parametrize("call", SAFE_CALLS)
async def test_a_gateway_error_on_a_safe_call_is_asked_once_more(call: str, status: int) -> None:
    """A 502/504 from something between agentkv and the engine: a safe call is sent again."""
    handler = Faulty(lambda _: httpx.Response(status, text="bad gateway"))
    await CALLS[call](make_client(handler, connect_retries=0))
    assert len(handler.seen) == 2


async def test_a_gateway_error_on_a_chat_is_not_repeated() -> None:
    """A chat completion may have run behind a 502: it is not sent again."""
    handler = Faulty(lambda _: httpx.Response(502, text="bad gateway"))
    with pytest.raises(EngineResponseError):
        await make_client(handler, connect_retries=0).chat(BODY, slot=0)
    assert len(handler.seen) == 1


@pytest.mark.parametrize("call", SAFE_CALLS)
async def test_a_safe_reply_broken_while_read_is_asked_once_more(call: str) -> None:
    """A safe call whose reply broke off half-way is asked for again and succeeds."""

    def fault(request: httpx.Request) -> httpx.Response:
        broken = StallingStream(b'{"tok', httpx.ReadError("[Errno 104] Connection reset"))
        return httpx.Response(200, stream=broken)

    handler = Faulty(fault)
    await CALLS[call](make_client(handler, connect_retries=0))
    assert len(handler.seen) == 2


async def test_a_chat_reply_broken_while_read_is_not_repeated() -> None:
    """A non-streamed chat whose reply broke off was computed: it is reported, not sent again."""

    def fault(request: httpx.Request) -> httpx.Response:
        broken = StallingStream(b'{"choi', httpx.ReadError("[Errno 104] Connection reset"))
        return httpx.Response(200, stream=broken)

    handler = Faulty(fault)
    with pytest.raises(EngineStreamBrokenError, match="truncated"):
        await make_client(handler, connect_retries=0).chat(BODY, slot=0)
    assert len(handler.seen) == 1


async def test_a_prefill_broken_mid_stream_is_computed_once_more() -> None:
    """A prefill is safe to repeat (the slot keeps what it computed): a stream broken part-way
    is asked for once more, and the caller sees the second stream's end."""

    def fault(request: httpx.Request) -> httpx.Response:
        first = sse({"content": "", "stop": False, "prompt_progress": {"processed": 1}}, done=False)
        return httpx.Response(200, stream=StallingStream(first, httpx.ReadError("reset")))

    handler = Faulty(fault)
    client = make_client(handler, connect_retries=0)
    chunks = await _drain(client.prefill([1, 2, 3], slot=0))
    assert chunks[-1]["stop"] is True
    assert len(handler.seen) == 2
    assert client.link.resent == 1


@pytest.mark.parametrize("call", ["stream", "completion"])
async def test_a_generation_broken_mid_stream_is_the_callers_to_continue(call: str) -> None:
    """A chat or completion stream cut after its first chunk is not sent again here (the caller
    has part of the reply): EngineStreamBrokenError, which the request lifecycle continues."""

    def fault(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=StallingStream(sse(chunk("a"), done=False), reset()))

    handler = Faulty(fault)
    with pytest.raises(EngineStreamBrokenError):
        await CALLS[call](make_client(handler, connect_retries=0))
    assert len(handler.seen) == 1


def reset() -> httpx.ReadError:
    return httpx.ReadError("[Errno 104] Connection reset by peer")


async def test_streams_ask_for_their_connection_to_be_closed() -> None:
    """A streamed request carries Connection: close, so that even a pooling client never sends
    another request on a connection llama-server may close after the stream; others do not."""
    handler = Faulty(lambda r: engine_reply(r), times=0)
    client = make_client(handler)
    await collect(client)
    await _drain(client.prefill([1], slot=0))
    await client.tokenize("x")
    closes = [r.headers.get("connection") for r in handler.seen]
    assert closes[:2] == ["close", "close"]
    assert closes[2] != "close"


async def test_the_clients_own_connections_safe_calls_share_one_streams_never() -> None:
    """Over real TCP, the client agentkv creates: the calls safe to repeat share one kept-alive
    connection; a chat completion, streamed or not, opens its own and closes it, so no call ever
    meets a connection a stream used; a kept connection the engine closed while it was idle costs
    nothing."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from agentkv.runtime.engine import free_port

    seen: list[tuple[str, int]] = []

    async def tokenize(request: Request) -> Response:
        assert request.client is not None
        seen.append(("tokenize", request.client.port))
        return JSONResponse({"tokens": [1, 2]})

    async def chat(request: Request) -> Response:
        assert request.client is not None
        seen.append(("chat", request.client.port))
        body = await request.json()
        if body["stream"]:
            return Response(sse(chunk("hi", "stop")), media_type="text/event-stream")
        return JSONResponse(COMPLETION)

    app = Starlette(
        routes=[
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )
    port = free_port()
    # The engine closes an idle connection after 0.3 s, sooner than the client lets one idle.
    config = uvicorn.Config(app, port=port, log_level="warning", timeout_keep_alive=0.3)
    server = uvicorn.Server(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        while not server.started:  # noqa: ASYNC110 - uvicorn exposes readiness only as a flag
            await anyio.sleep(0.01)
        async with LlamaSlotClient(f"http://127.0.0.1:{port}") as client:
            await client.tokenize("a")
            await collect(client)
            await client.tokenize("b")
            assert (await client.chat(BODY, slot=0))["choices"]
            await client.tokenize("c")
            await anyio.sleep(0.6)  # the engine has closed the kept connection by now
            await client.tokenize("d")
            assert client.link.resent <= 1
        server.should_exit = True
    tokenized = [port for what, port in seen if what == "tokenize"]
    chats = [port for what, port in seen if what == "chat"]
    assert tokenized[0] == tokenized[1] == tokenized[2] != tokenized[3]
    assert len(set(chats)) == 2 and not set(chats) & set(tokenized)


async def test_a_slow_engine_is_waited_for_not_retried() -> None:
    """An engine slower than usual (but within the read timeout) is simply waited for."""

    async def slow(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(0.2)
        return engine_reply(request)

    seen = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal seen
        seen += 1
        return await slow(request)

    client = LlamaSlotClient(BASE, http=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    for call in CALLS.values():
        await call(client)
    assert seen == len(CALLS)
    assert client.link.resent == 0


async def test_health_probe_survives_one_dropped_connection() -> None:
    """/health asked on a connection the server had closed is asked once more: still 'ready'."""
    handler = Faulty(lambda r: (_ for _ in ()).throw(dropped_before_reply(r, "reused")))
    client = make_client(handler)
    assert await client.health()
    assert len(handler.seen) == 2


async def test_accepts_images_asks_props_once() -> None:
    """accepts_images reads /props' modalities once; a server without /props is assumed to see."""
    handler = Faulty(lambda r: engine_reply(r), times=0)
    client = make_client(handler)
    assert await client.accepts_images() is False
    assert await client.accepts_images() is False
    assert [r.url.path for r in handler.seen] == ["/props"]
    old = make_client(lambda _: httpx.Response(404, json={"error": {"message": "not found"}}))
    assert await old.accepts_images() is True
