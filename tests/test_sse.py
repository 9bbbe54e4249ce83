"""SSEAssembler, accumulate and encode_event: engine chunks → Anthropic stream events."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest
from hypothesis import given
from hypothesis import strategies as st
from syrupy.assertion import SnapshotAssertion
from syrupy.extensions.json import JSONSnapshotExtension

from agentkv import ANY_TOOL
from agentkv.anthropic_sse import accumulate, anthropic_events, encode_event
from agentkv.exceptions import EngineResponseError, SSEProtocolError
from agentkv.reply import Usage
from agentkv.sse import SSEAssembler

FIXTURES = Path(__file__).parent / "fixtures"

Event = dict[str, Any]


@pytest.fixture
def snapshot_json(snapshot: SnapshotAssertion) -> SnapshotAssertion:
    return snapshot.use_extension(JSONSnapshotExtension)


def delta(**fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


def text(content: str) -> dict[str, Any]:
    return delta(content=content)


def reasoning(content: str) -> dict[str, Any]:
    return delta(reasoning_content=content)


def tool(index: int, arguments: str, *, id: str = "", name: str = "") -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if id:
        call["id"] = id
        call["type"] = "function"
    if name:
        call["function"]["name"] = name
    return delta(tool_calls=[call])


def done(reason: str, **extra: Any) -> dict[str, Any]:
    chunk: dict[str, Any] = {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}
    chunk.update(extra)
    return chunk


class MessagesAssembler(SSEAssembler):
    """The assembler with its events encoded as the Messages route encodes them (the shape these
    tests read, and the one the SDK checks)."""

    def start(self) -> list[Any]:
        return anthropic_events(super().start())

    def feed(self, chunk: Mapping[str, Any], now: float) -> list[Any]:
        return anthropic_events(super().feed(chunk, now))

    def flush(self, now: float) -> list[Any]:
        return anthropic_events(super().flush(now))

    def finish(self, now: float) -> list[Any]:
        return anthropic_events(super().finish(now))


def assembler(**options: Any) -> SSEAssembler:
    options.setdefault("message_id", "msg_test")
    options.setdefault("model", "local-model")
    return MessagesAssembler(**options)


def run(chunks: Iterable[Mapping[str, Any]], *, step: float = 0.0, **options: Any) -> list[Event]:
    """Feed every chunk (time advancing by ``step``) and finish."""
    sse = assembler(**options)
    events = sse.start()
    now = 0.0
    for chunk in chunks:
        events += sse.feed(chunk, now)
        now += step
    events += sse.finish(now)
    return events


def sdk_final_message(events: Sequence[Mapping[str, Any]]) -> anthropic.types.Message:
    """Let the official SDK parse the SSE bytes over HTTP and accumulate the message."""
    payload = b"".join(encode_event(event) for event in events)

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=payload)

    http = httpx2.Client(transport=httpx2.MockTransport(handler))
    client = anthropic.Anthropic(
        api_key="test", base_url="http://agentkv.test", http_client=http, max_retries=0
    )
    with client.messages.stream(
        model="local-model", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        message = stream.get_final_message()
    client.close()
    return message


def sdk_view(message: anthropic.types.Message) -> dict[str, Any]:
    """The SDK's message reduced to the fields agentkv produces."""
    blocks = []
    for block in message.content:
        if block.type == "text":
            blocks.append({"type": "text", "text": block.text})
        elif block.type == "thinking":
            blocks.append(
                {"type": "thinking", "thinking": block.thinking, "signature": block.signature}
            )
        elif block.type == "tool_use":
            blocks.append(
                {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
            )
    usage = message.usage
    return {
        "id": message.id,
        "content": blocks,
        "stop_reason": message.stop_reason,
        "stop_sequence": message.stop_sequence,
        "usage": {
            "input_tokens": usage.input_tokens,
            "cache_creation_input_tokens": usage.cache_creation_input_tokens,
            "cache_read_input_tokens": usage.cache_read_input_tokens,
            "output_tokens": usage.output_tokens,
        },
    }


def our_view(message: Mapping[str, Any]) -> dict[str, Any]:
    return {key: message[key] for key in ("id", "content", "stop_reason", "stop_sequence", "usage")}


def block_indexes(events: Iterable[Mapping[str, Any]]) -> list[int]:
    return [e["index"] for e in events if e["type"] == "content_block_start"]


TIMINGS = {"cache_n": 2009, "prompt_n": 10, "predicted_n": 61, "prompt_ms": 220.5}


# -- snapshots and the official SDK ----------------------------------------------------------


def test_llama_stream_snapshot(snapshot_json: SnapshotAssertion) -> None:
    """A recorded-shape llama-server stream gives the event sequence pinned in the snapshot."""
    chunks = json.loads((FIXTURES / "llama_stream_tool_call.json").read_text())
    events = run(chunks, step=0.01)
    assert {"events": events, "message": accumulate(events)} == snapshot_json


def test_forced_tool_snapshot(snapshot_json: SnapshotAssertion) -> None:
    """A forced-tool stream (JSON text from constrained decoding) pinned in the snapshot."""
    pieces = ['{"ci', 'ty": "Pa', 'ris"}']
    events = run([*map(text, pieces), done("stop", timings=TIMINGS)], forced_tool="get_weather")
    assert events == snapshot_json


def test_sdk_accumulates_text_and_tool_use() -> None:
    """The official SDK rebuilds the same message (text, tool input, usage) from our SSE bytes."""
    chunks = json.loads((FIXTURES / "llama_stream_tool_call.json").read_text())
    events = run(chunks, step=0.01)
    ours = accumulate(events)
    theirs = sdk_view(sdk_final_message(events))
    assert theirs == our_view(ours)
    assert [b["type"] for b in ours["content"]] == ["thinking", "text", "tool_use"]
    assert ours["content"][2]["input"] == {
        "file_path": "/home/dev/project/src/parser.py",
        "old_string": "        return\n",
        "new_string": "        return []\n",
    }
    assert ours["stop_reason"] == "tool_use"
    assert ours["usage"] == {
        "input_tokens": 10,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 2009,
        "output_tokens": 61,
    }


def test_sdk_accumulates_thinking() -> None:
    """A thinking block with its signature survives the SDK's accumulator."""
    chunks = [reasoning("Let me "), reasoning("think."), text("Answer."), done("stop")]
    events = run(chunks, coalesce_chars=1)
    theirs = sdk_view(sdk_final_message(events))
    assert theirs == our_view(accumulate(events))
    thinking = theirs["content"][0]
    assert thinking["thinking"] == "Let me think."
    assert thinking["signature"]
    assert theirs["content"][1] == {"type": "text", "text": "Answer."}


def test_sdk_accumulates_forced_tool() -> None:
    """A forced-tool stream reaches the SDK as one tool_use block with the parsed input."""
    pieces = ['{"ci', 'ty": "Pa', 'ris"}']
    events = run([*map(text, pieces), done("stop")], forced_tool="get_weather")
    theirs = sdk_view(sdk_final_message(events))
    assert theirs == our_view(accumulate(events))
    (block,) = theirs["content"]
    assert block["name"] == "get_weather"
    assert block["input"] == {"city": "Paris"}
    assert block["id"].startswith("toolu_")
    assert theirs["stop_reason"] == "tool_use"


# -- event order and blocks ------------------------------------------------------------------


def test_event_order() -> None:
    """message_start, then start/delta*/stop per block, then message_delta and message_stop."""
    events = run([reasoning("hmm"), text("hi"), tool(0, "{}", id="call_1", name="Read")])
    kinds = [e["type"] for e in events]
    assert kinds == [
        "message_start",
        *["content_block_start", "content_block_delta", "content_block_delta"],
        "content_block_stop",
        *["content_block_start", "content_block_delta", "content_block_stop"],
        *["content_block_start", "content_block_delta", "content_block_stop"],
        "message_delta",
        "message_stop",
    ]
    assert block_indexes(events) == [0, 1, 2]
    signature = events[3]["delta"]
    assert signature["type"] == "signature_delta" and signature["signature"]


def test_empty_output_has_no_content_block() -> None:
    """A model that produced nothing (or only whitespace) gives an empty content list."""
    for chunks in ([], [text(""), done("stop")], [text("\n\n"), text(" "), done("stop")]):
        message = accumulate(run(chunks))
        assert message["content"] == []
        assert message["stop_reason"] == "end_turn"


def test_leading_whitespace_kept_when_text_follows() -> None:
    """Whitespace held back before a block opens is not lost once real text arrives."""
    message = accumulate(run([text("\n"), text("  x")]))
    assert message["content"] == [{"type": "text", "text": "\n  x"}]


def test_tool_use_ids() -> None:
    """Engine ids starting with toolu_ are kept; others are replaced by generated toolu_ ids."""
    events = run(
        [
            tool(0, '{"a": 1}', id="toolu_keep", name="A"),
            tool(1, '{"b": 2}', id="call_abc", name="B"),
            done("tool_calls"),
        ]
    )
    blocks = accumulate(events)["content"]
    assert blocks[0]["id"] == "toolu_keep"
    assert blocks[1]["id"].startswith("toolu_") and blocks[1]["id"] != "toolu_keep"
    assert [b["input"] for b in blocks] == [{"a": 1}, {"b": 2}]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert all(s["input"] == {} for s in starts)


def test_tool_call_with_invalid_json_becomes_text() -> None:
    """A tool call whose arguments are not a JSON object is shown as text, never as tool_use."""
    message = accumulate(run([tool(0, '{"a": ', id="call_1", name="A"), done("tool_calls")]))
    assert message["content"] == [{"type": "text", "text": '{"a": '}]
    assert message["stop_reason"] == "end_turn"


def test_tool_call_resumed_after_close_rejected() -> None:
    """Arguments for a tool call that was already closed break the stream's rules."""
    sse = assembler()
    sse.start()
    sse.feed(tool(0, "{}", id="call_1", name="A"), 0.0)
    sse.feed(text("x"), 0.0)
    with pytest.raises(SSEProtocolError):
        sse.feed(tool(0, "{}"), 0.0)


# -- forced tools ----------------------------------------------------------------------------


def test_forced_tool_invalid_json_becomes_text() -> None:
    """Forced-tool output that does not parse is sent as text with stop_reason end_turn."""
    message = accumulate(run([text("I cannot do that")], forced_tool="get_weather"))
    assert message["content"] == [{"type": "text", "text": "I cannot do that"}]
    assert message["stop_reason"] == "end_turn"


def test_forced_tool_truncated_is_max_tokens() -> None:
    """Forced JSON cut off by the token limit is text with stop_reason max_tokens."""
    message = accumulate(run([text('{"city": "Pa'), done("length")], forced_tool="get_weather"))
    assert message["content"][0]["type"] == "text"
    assert message["stop_reason"] == "max_tokens"


def test_forced_any_tool() -> None:
    """In any-tool mode the {name, arguments} JSON becomes a tool_use of that tool."""
    call = json.dumps({"name": "get_time", "arguments": {"tz": "UTC"}})
    options = {"forced_tool": ANY_TOOL, "tool_names": ("get_weather", "get_time")}
    message = accumulate(run([text(call[:7]), text(call[7:]), done("stop")], **options))
    (block,) = message["content"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_time", {"tz": "UTC"})
    assert message["stop_reason"] == "tool_use"


def test_forced_any_tool_unknown_name_is_text() -> None:
    """In any-tool mode a name outside tool_names is not turned into a tool_use."""
    call = json.dumps({"name": "rm_rf", "arguments": {}})
    message = accumulate(run([text(call)], forced_tool=ANY_TOOL, tool_names=("get_time",)))
    assert message["content"] == [{"type": "text", "text": call}]


def test_forced_tool_keeps_thinking_first() -> None:
    """Reasoning during a forced call is its own thinking block before the tool_use."""
    chunks = [reasoning("plan"), text('{"city": "Oslo"}'), done("stop")]
    blocks = accumulate(run(chunks, forced_tool="get_weather"))["content"]
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"]


# -- stop reasons and usage ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunks", "reason", "sequence"),
    [
        ([text("a"), done("stop")], "end_turn", None),
        ([text("a"), done("length")], "max_tokens", None),
        ([tool(0, "{}", id="c", name="A"), done("tool_calls")], "tool_use", None),
        ([text("a"), done("stop", stop_type="word", stopping_word="END")], "stop_sequence", "END"),
        ([text("a"), done("stop", __verbose={"stopping_word": "###"})], "stop_sequence", "###"),
        ([text("a"), done("stop", stop_type="eos", stopping_word="")], "end_turn", None),
    ],
)
def test_stop_reasons(chunks: list[dict[str, Any]], reason: str, sequence: str | None) -> None:
    """Engine finish reasons map to Anthropic stop reasons (stop words to stop_sequence)."""
    message_delta = next(e for e in run(chunks) if e["type"] == "message_delta")
    assert message_delta["delta"] == {"stop_reason": reason, "stop_sequence": sequence}


def test_usage_from_timings() -> None:
    """Usage comes from timings: prompt_n uncached, cache_n read from cache, predicted_n out."""
    sse = assembler(input_tokens_hint=2019)
    start = sse.start()[0]
    assert start["message"]["usage"]["input_tokens"] == 2019
    sse.feed(text("hi"), 0.0)
    sse.feed(done("stop", timings=TIMINGS), 0.0)
    assert sse.usage == Usage(input_tokens=10, cache_read_tokens=2009, output_tokens=61)
    message_delta = sse.finish(0.0)[-2]
    assert message_delta["usage"] == {
        "input_tokens": 10,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 2009,
        "output_tokens": 61,
    }


def test_usage_falls_back_to_openai_usage() -> None:
    """Without timings, OpenAI usage fields give the counts (cached tokens subtracted)."""
    usage = {
        "prompt_tokens": 300,
        "completion_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 256},
    }
    message = accumulate(run([text("x"), {"choices": [], "usage": usage}]))
    assert message["usage"] == {
        "input_tokens": 44,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 256,
        "output_tokens": 7,
    }


def test_non_streaming_message_shape() -> None:
    """A non-streaming engine reply fed as one chunk accumulates to a full Message JSON."""
    reply = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi!"},
                "finish_reason": "stop",
            }
        ],
        "timings": TIMINGS,
    }
    message = accumulate(run([reply]))
    assert message == {
        "id": "msg_test",
        "type": "message",
        "role": "assistant",
        "model": "local-model",
        "content": [{"type": "text", "text": "Hi!"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 10,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 2009,
            "output_tokens": 61,
        },
    }


# -- coalescing ------------------------------------------------------------------------------


def text_deltas(events: Iterable[Mapping[str, Any]]) -> list[str]:
    return [
        e["delta"]["text"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"
    ]


def test_coalesce_by_size() -> None:
    """Tiny deltas are held until coalesce_chars characters are pending."""
    sse = assembler(coalesce_chars=4, coalesce_seconds=10.0)
    sse.start()
    out = []
    for piece in "abcdefghij":
        out += sse.feed(text(piece), 0.0)
    assert text_deltas(out) == ["abcd", "efgh"]
    assert text_deltas(sse.finish(0.0)) == ["ij"]


def test_coalesce_by_time_and_flush() -> None:
    """flush(now) emits pending text once coalesce_seconds have passed since it was buffered."""
    sse = assembler(coalesce_chars=100, coalesce_seconds=0.05)
    sse.start()
    assert text_deltas(sse.feed(text("ab"), 1.0)) == []
    assert sse.flush(1.04) == []
    assert text_deltas(sse.flush(1.05)) == ["ab"]
    assert sse.flush(2.0) == []
    sse.feed(text("c"), 3.0)
    assert text_deltas(sse.feed(text("d"), 3.06)) == ["cd"]


def test_block_switch_flushes_first() -> None:
    """Pending thinking is emitted, signed and stopped before a text block starts."""
    sse = assembler(coalesce_chars=100, coalesce_seconds=10.0)
    sse.start()
    assert sse.feed(reasoning("deep"), 0.0)[0]["type"] == "content_block_start"
    out = sse.feed(text("ok"), 0.0)
    assert [(e["type"], e.get("delta", {}).get("type")) for e in out] == [
        ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
        ("content_block_start", None),
    ]


# -- lifecycle, ping, error, encoding --------------------------------------------------------


def test_lifecycle_misuse_rejected() -> None:
    """feed before start, start twice, feed after finish and finish twice all raise."""
    sse = assembler()
    with pytest.raises(SSEProtocolError):
        sse.feed(text("x"), 0.0)
    sse.start()
    with pytest.raises(SSEProtocolError):
        sse.start()
    sse.finish(0.0)
    with pytest.raises(SSEProtocolError):
        sse.feed(text("x"), 0.0)
    with pytest.raises(SSEProtocolError):
        sse.finish(0.0)


def test_engine_error_chunk_raises() -> None:
    """An error object in the engine stream raises EngineResponseError."""
    sse = assembler()
    sse.start()
    with pytest.raises(EngineResponseError, match="context overflow"):
        sse.feed({"error": {"code": 500, "message": "context overflow"}}, 0.0)


def test_encode_event() -> None:
    """Frames are `event: <type>`, `data: <json>` and a blank line, UTF-8 encoded."""
    event = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "é"},
    }
    frame = encode_event(event)
    head, data, rest = frame.split(b"\n", 2)
    assert head == b"event: content_block_delta"
    assert json.loads(data.removeprefix(b"data: ")) == event
    assert rest == b"\n"


def test_sdk_accepts_pings_anywhere() -> None:
    """Pings between any two events do not disturb the SDK or accumulate."""
    events = run([text("hello"), done("stop")])
    with_pings = [p for e in events for p in (e, {"type": "ping"})]
    assert accumulate(with_pings) == accumulate(events)
    assert sdk_view(sdk_final_message(with_pings)) == our_view(accumulate(events))


# -- accumulate rejects broken streams ------------------------------------------------------

_START = {
    "type": "message_start",
    "message": {
        "id": "msg_x",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    },
}
_TEXT_START = {
    "type": "content_block_start",
    "index": 0,
    "content_block": {"type": "text", "text": ""},
}
_TEXT_DELTA = {
    "type": "content_block_delta",
    "index": 0,
    "delta": {"type": "text_delta", "text": "a"},
}
_STOP0 = {"type": "content_block_stop", "index": 0}
_MDELTA = {
    "type": "message_delta",
    "delta": {"stop_reason": "end_turn"},
    "usage": {"output_tokens": 1},
}
_MSTOP = {"type": "message_stop"}
_TOOL_START = {
    "type": "content_block_start",
    "index": 0,
    "content_block": {"type": "tool_use", "id": "toolu_1", "name": "A", "input": {}},
}


@pytest.mark.parametrize(
    "events",
    [
        [_TEXT_START, _STOP0, _MDELTA, _MSTOP],
        [_START, _START],
        [_START, _TEXT_DELTA],
        [_START, _TEXT_START, _TEXT_START],
        [_START, {**_TEXT_START, "index": 1}],
        [_START, _TEXT_START, {**_TEXT_DELTA, "index": 1}],
        [_START, _TEXT_START, _MDELTA],
        [_START, _TEXT_START, _STOP0, _MSTOP],
        [_START, _TEXT_START, _STOP0, _MDELTA],
        [_START, _TEXT_START, _STOP0, _MDELTA, _MSTOP, _TEXT_START],
        [_START, _TEXT_START, _STOP0, _MDELTA, _MDELTA, _MSTOP],
        [
            _START,
            _TEXT_START,
            {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta"}},
        ],
        [
            _START,
            _TOOL_START,
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": "[1]"},
            },
            _STOP0,
        ],
        [_START, {"type": "error", "error": {"type": "api_error", "message": "boom"}}],
        [_START, {"type": "surprise"}],
    ],
)
def test_accumulate_rejects_broken_streams(events: list[Event]) -> None:
    """Out-of-order events, mismatched deltas, bad tool input and errors raise SSEProtocolError."""
    with pytest.raises(SSEProtocolError):
        accumulate(events)


def test_accumulate_minimal_stream() -> None:
    """The smallest valid stream accumulates; message_delta usage overwrites message_start's."""
    message = accumulate([_START, _TEXT_START, _TEXT_DELTA, _STOP0, _MDELTA, _MSTOP])
    assert message["content"] == [{"type": "text", "text": "a"}]
    assert message["usage"] == {"input_tokens": 0, "output_tokens": 1}
    assert message["stop_reason"] == "end_turn"


# -- laws ------------------------------------------------------------------------------------

_settings = {
    "coalesce_chars": st.integers(min_value=0, max_value=20),
    "coalesce_seconds": st.floats(min_value=0.0, max_value=0.2),
}


@given(
    st.lists(st.text(max_size=8), max_size=20),
    st.integers(min_value=0, max_value=20),
    st.floats(min_value=0.0, max_value=0.2),
    st.floats(min_value=0.0, max_value=0.1),
)
def test_any_split_of_text_accumulates_to_concatenation(
    pieces: list[str], chars: int, seconds: float, step: float
) -> None:
    """However the text is chunked and coalesced, the accumulated text is the concatenation."""
    events = run(map(text, pieces), step=step, coalesce_chars=chars, coalesce_seconds=seconds)
    whole = "".join(pieces)
    content = accumulate(events)["content"]
    expected = [{"type": "text", "text": whole}] if whole.strip() else []
    assert content == expected
    assert all(d for d in text_deltas(events))


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(
    st.dictionaries(st.text(max_size=6), _json_values, max_size=4),
    st.lists(st.integers(min_value=0, max_value=200), max_size=6),
)
def test_tool_args_split_anywhere_parse_to_same_object(
    tool_input: dict[str, Any], cuts: list[int]
) -> None:
    """Tool arguments split at any points give partial_json that parses to the same object."""
    arguments = json.dumps(tool_input, ensure_ascii=False)
    bounds = sorted({min(c, len(arguments)) for c in cuts} | {0, len(arguments)})
    pieces = [arguments[a:b] for a, b in itertools.pairwise(bounds)]
    chunks = [tool(0, pieces[0] if pieces else "", id="call_1", name="T")]
    chunks += [tool(0, piece) for piece in pieces[1:]]
    events = run([*chunks, done("tool_calls")])
    partial = "".join(
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    )
    assert json.loads(partial) == tool_input
    assert accumulate(events)["content"][0]["input"] == tool_input


_chunk = st.one_of(
    st.text(max_size=5).map(text),
    st.text(max_size=5).map(reasoning),
    st.builds(
        lambda i, args: tool(i, args, id=f"call_{i}", name="T"),
        st.integers(min_value=0, max_value=3),
        st.sampled_from(["{}", '{"a": 1}', "{", ""]),
    ),
)


@given(st.lists(_chunk, max_size=12), st.integers(min_value=0, max_value=10))
def test_any_chunk_mix_gives_a_valid_stream(chunks: list[dict[str, Any]], chars: int) -> None:
    """Any mix of chunks gives indexes 0, 1, 2, … and a stream the reducer accepts."""
    sse = assembler(coalesce_chars=chars)
    events = sse.start()
    for chunk in chunks:
        try:
            events += sse.feed(chunk, 0.0)
        except SSEProtocolError:
            return  # a tool call resumed after it closed: rejected, by design
    events += sse.finish(0.0)
    indexes = block_indexes(events)
    assert indexes == list(range(len(indexes)))
    message = accumulate(events)
    assert len(message["content"]) == len(indexes)
    for block in message["content"]:
        if block["type"] == "text":
            assert block["text"].strip()
        if block["type"] == "tool_use":
            assert isinstance(block["input"], dict)


WEATHER_SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    }
}


def test_call_written_as_text_becomes_tool_use() -> None:
    """In auto mode, a reply that is a call written as JSON text is emitted as tool_use."""
    chunks = [
        text('{"name": "get_weather", '),
        text('"arguments": {"city": "Paris"},}'),
        done("stop"),
    ]
    message = accumulate(run(chunks, tool_schemas=WEATHER_SCHEMAS))
    assert message["content"] == [
        {
            "type": "tool_use",
            "id": message["content"][0]["id"],
            "name": "get_weather",
            "input": {"city": "Paris"},
        }
    ]
    assert message["content"][0]["id"].startswith("toolu_")
    assert message["stop_reason"] == "tool_use"


def test_prose_still_streams_when_tools_are_declared() -> None:
    """A reply that cannot be a call is streamed as it comes, not held."""
    sse = assembler(tool_schemas=WEATHER_SCHEMAS, coalesce_chars=1)
    sse.start()
    events = sse.feed(text("  It is "), 0.0)
    assert [e["type"] for e in events] == ["content_block_start", "content_block_delta"]
    assert sse.feed(text("sunny."), 0.0)[0]["delta"]["text"] == "sunny."


def test_unrecoverable_call_stays_text_and_a_retry_can_replace_it() -> None:
    """A held call naming an unknown tool stays text; after begin_retry a valid call wins."""
    bad = '{"name": "weather", "arguments": {"city": "Paris"}}'
    assert accumulate(run([text(bad), done("stop")], tool_schemas=WEATHER_SCHEMAS))["content"] == [
        {"type": "text", "text": bad}
    ]
    sse = assembler(tool_schemas=WEATHER_SCHEMAS, tool_names=("get_weather",))
    events = sse.start() + sse.feed(text(bad), 0.0)
    events += sse.feed(done("stop", timings={"prompt_n": 30, "cache_n": 0, "predicted_n": 12}), 0)
    sse.begin_retry()
    retry = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    events += sse.feed(text(retry), 0.0)
    events += sse.feed(done("stop", timings={"prompt_n": 5, "cache_n": 25, "predicted_n": 14}), 0)
    message = accumulate(events + sse.finish(1.0))
    assert [b["type"] for b in message["content"]] == ["tool_use"]
    assert message["content"][0]["input"] == {"city": "Paris"}
    assert message["usage"]["input_tokens"] == 35
    assert message["usage"]["cache_read_input_tokens"] == 25
    assert message["usage"]["output_tokens"] == 26


def test_failed_retry_falls_back_to_the_first_reply_as_text() -> None:
    """If the constrained retry does not give a call either, the first reply comes back as text."""
    bad = '{"name": "weather", "arguments": {}}'
    sse = assembler(tool_schemas=WEATHER_SCHEMAS, tool_names=("get_weather",))
    events = sse.start() + sse.feed(text(bad), 0.0) + sse.feed(done("stop"), 0.0)
    sse.begin_retry()
    events += sse.feed(text('{"name": "nope"'), 0.0) + sse.feed(done("length"), 0.0)
    message = accumulate(events + sse.finish(1.0))
    assert message["content"] == [{"type": "text", "text": bad}]


def test_call_cut_off_by_the_token_limit_is_not_repaired() -> None:
    """A truncated call is not completed by repair: it stays text, with stop_reason max_tokens."""
    cut = '{"name": "get_weather", "arguments": {"city": "Par'
    message = accumulate(run([text(cut), done("length")], tool_schemas=WEATHER_SCHEMAS))
    assert message["content"] == [{"type": "text", "text": cut}]
    assert message["stop_reason"] == "max_tokens"


def test_structured_call_cut_off_by_the_token_limit_is_not_repaired() -> None:
    """Structured arguments cut by max_tokens stay text, although a repair could close them."""
    cut = '{"city": "Par'
    chunks = [tool(0, cut, id="call_1", name="get_weather"), done("length")]
    message = accumulate(run(chunks, tool_schemas=WEATHER_SCHEMAS))
    assert message["content"] == [{"type": "text", "text": cut}]
    assert message["stop_reason"] == "max_tokens"
    repaired = accumulate(run([*chunks[:1], done("tool_calls")], tool_schemas=WEATHER_SCHEMAS))
    assert repaired["content"][0]["input"] == {"city": "Par"}
