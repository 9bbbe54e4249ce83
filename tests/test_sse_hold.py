"""SSEAssembler in auto mode with tools: held text, its release, the retry verdict, and stops."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv import ANY_TOOL
from agentkv.anthropic_sse import accumulate
from agentkv.exceptions import SSEProtocolError
from agentkv.guard import RepetitionGuard
from agentkv.repair import extract_tool_calls
from agentkv.schema import validate
from agentkv.sse import ReplyComplete, RetryWithTools, SSEAssembler, StopRequest
from tests.test_sse import (
    assembler,
    done,
    our_view,
    reasoning,
    sdk_final_message,
    sdk_view,
    text,
    tool,
)

FIXTURES = Path(__file__).parent / "fixtures"
CORPUS_DIR = FIXTURES / "tool_calls"
TOOLS: dict[str, Any] = json.loads((CORPUS_DIR / "tools.json").read_text())
SCHEMAS: dict[str, Any] = {name: tool["input_schema"] for name, tool in TOOLS.items()}
CORPUS: list[dict[str, Any]] = [
    json.loads(line)
    for line in (CORPUS_DIR / "corpus.jsonl").read_text().splitlines()
    if line.strip()
]

Event = dict[str, Any]
READ = '{"name": "Read", "arguments": {"file_path": "/repo/a.py"}}'


def pieces(content: str, size: int) -> list[str]:
    return [content[i : i + size] for i in range(0, len(content), size)]


def stream(
    sse: SSEAssembler, contents: Iterable[str], *, now: float = 0.0, step: float = 0.0
) -> list[tuple[int, list[Event]]]:
    """Feed content pieces; for each, the characters fed so far and the events it gave."""
    fed, result = 0, []
    for content in contents:
        fed += len(content)
        result.append((fed, sse.feed(text(content), now)))
        now += step
    return result


def first_text_at(batches: Sequence[tuple[int, list[Event]]]) -> int | None:
    """How many characters had been fed when the first text reached the client."""
    for fed, events in batches:
        if any(e["type"] == "content_block_delta" and "text" in e["delta"] for e in events):
            return fed
    return None


def message_of(
    content: str,
    *,
    size: int = 3,
    tools: Mapping[str, Any] | None = None,
    finish: str = "stop",
    **options: Any,
) -> dict[str, Any]:
    sse = assembler(tool_schemas=tools or SCHEMAS, coalesce_chars=1, **options)
    events = sse.start()
    for _, batch in stream(sse, pieces(content, size)):
        events += batch
    events += sse.feed(done(finish), 0.0)
    return accumulate(events + sse.finish(0.0))


def texts(message: Mapping[str, Any]) -> str:
    return "".join(b["text"] for b in message["content"] if b["type"] == "text")


def calls(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [
        {"name": b["name"], "input": b["input"]}
        for b in message["content"]
        if b["type"] == "tool_use"
    ]


# -- what streams, what is held --------------------------------------------------------------------


def test_prose_before_a_tagged_call_streams_and_the_call_becomes_tool_use() -> None:
    """Prose streams at once; the <tool_call> after it is held and becomes a tool_use."""
    prose = "Let me look at the file first.\n"
    sse = assembler(tool_schemas=SCHEMAS, coalesce_chars=1)
    sse.start()
    batches = stream(sse, pieces(prose + f"<tool_call>\n{READ}\n</tool_call>", 4))
    assert first_text_at(batches) == 4
    streamed = "".join(
        e["delta"]["text"] for _, b in batches for e in b if e["type"] == "content_block_delta"
    )
    assert streamed == prose
    events = sse.finish(0.0)
    kinds = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert kinds == ["tool_use"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_a_code_fence_that_is_not_json_streams_once_its_line_is_complete() -> None:
    """```python cannot hold a call: it goes out as soon as its fence line is known."""
    reply = "```python\nprint('hi')\n```\n"
    sse = assembler(tool_schemas=SCHEMAS, coalesce_chars=1)
    sse.start()
    assert first_text_at(stream(sse, pieces(reply, 1))) == len("```python\n")


def test_a_call_of_a_declared_tool_is_held_to_its_end_however_long() -> None:
    """A Write whose content is far longer than hold_chars still becomes one tool_use."""
    content = "".join(f"line {i}: some text of the file\\n" for i in range(400))
    reply = f'{{"name": "Write", "arguments": {{"file_path": "/a.txt", "content": "{content}"}}}}'
    assert len(reply) > 10_000
    sse = assembler(tool_schemas=SCHEMAS, coalesce_chars=1)
    events = sse.start()
    batches = stream(sse, pieces(reply, 5), step=0.1)  # 2,000 chunks over 200 s
    assert first_text_at(batches) is None
    events += [e for _, b in batches for e in b]
    events += sse.flush(1000.0)
    message = accumulate(events + sse.finish(1000.0))
    assert calls(message) == [{"name": "Write", "input": json.loads(reply)["arguments"]}]


def test_a_wrong_call_is_held_for_the_retry_but_no_longer_than_hold_chars() -> None:
    """An unknown tool is kept for the retry; past hold_chars it is released and streams."""
    words = " ".join(f"word{i}" for i in range(600))
    reply = '{"name": "write_file", "arguments": {"text": "' + words
    sse = assembler(tool_schemas=SCHEMAS, coalesce_chars=1)
    sse.start()
    size = 7
    at = first_text_at(stream(sse, pieces(reply, size)))
    assert at is not None and sse.hold_chars < at <= sse.hold_chars + size
    short = assembler(tool_schemas=SCHEMAS)
    short.start()
    assert first_text_at(stream(short, pieces(reply[:300], size))) is None


def test_a_hold_ends_after_hold_seconds_even_without_new_text() -> None:
    """A held wrong call is released by flush once hold_seconds have passed since it began."""
    sse = assembler(tool_schemas=SCHEMAS, coalesce_chars=1, hold_seconds=15.0)
    sse.start()
    assert sse.feed(text('{"name": "weather", '), 100.0) == []
    assert sse.flush(114.9) == []
    events = sse.flush(115.0)
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == (
        '{"name": "weather", '
    )


def test_released_text_is_scanned_again_for_a_later_call() -> None:
    """A shell fence streams; the json fence after it (paired in order) becomes a call."""
    reply = "```bash\nls\n```\nThen:\n```json\n" + READ + "\n```"
    message = message_of(reply, size=2)
    assert calls(message) == [{"name": "Read", "input": {"file_path": "/repo/a.py"}}]
    assert texts(message) == "```bash\nls\n```\nThen:\n"


def test_a_tag_after_a_rejected_json_reply_is_still_found() -> None:
    """A reply that starts as a wrong bare call and then writes a good tag gives that call."""
    wrong = '{"name": "weather", "arguments": {"city": "Oslo"}} Oops, that is not a tool.\n'
    reply = wrong + "<tool_call>\n" + READ + "\n</tool_call>"
    sse = assembler(tool_schemas=SCHEMAS, coalesce_chars=1, hold_chars=60)
    events = sse.start()
    batches = stream(sse, pieces(reply, 4))
    at = first_text_at(batches)
    assert at is not None and 60 < at <= len(wrong)  # released past the bound, before the tag
    events += [e for _, batch in batches for e in batch]
    events += sse.feed(done("stop"), 0.0)
    message = accumulate(events + sse.finish(0.0))
    assert calls(message) == [{"name": "Read", "input": {"file_path": "/repo/a.py"}}]
    assert texts(message) == wrong


@given(
    st.sampled_from(["", "Sure.\n", "I will read it:\n\n"]),
    st.sampled_from(["bare", "fence", "tag"]),
    st.integers(min_value=1, max_value=40),
)
def test_a_valid_call_is_never_released_as_text(prose: str, shape: str, size: int) -> None:
    """However it is chunked, a valid call (after prose, where the shape allows) is a tool_use."""
    body = {
        "bare": READ,
        "fence": f"```json\n{READ}\n```",
        "tag": f"<tool_call>\n{READ}\n</tool_call>",
    }[shape]
    reply = body if shape == "bare" else prose + body
    message = message_of(reply, size=size)
    assert calls(message) == [{"name": "Read", "input": {"file_path": "/repo/a.py"}}]
    assert texts(message).strip() == ("" if shape == "bare" else prose.strip())


@given(st.text(alphabet="ab{}[]\"'`<>/:,\n _tolcaj", max_size=80), st.integers(1, 9))
def test_text_without_calls_comes_through_whole(reply: str, size: int) -> None:
    """Whatever is held and released, a reply without calls reaches the client as it was written
    (whitespace-only stretches before a held part may be left out)."""
    tools = {"get_weather": SCHEMAS["get_weather"]}
    if extract_tool_calls(reply, tools).calls:
        return
    message = message_of(reply, size=size, tools=tools)
    assert not calls(message)
    assert re.sub(r"\s", "", texts(message)) == re.sub(r"\s", "", reply)


# -- the corpus through the assembler --------------------------------------------------------------


def corpus_message(record: dict[str, Any], size: int) -> dict[str, Any]:
    tools = {name: SCHEMAS[name] for name in record["tools"]}
    return message_of(record["text"], size=size, tools=tools)


@pytest.mark.parametrize("size", [1, 4, 64])
def test_corpus_through_the_assembler(size: int) -> None:
    """Streamed in chunks, every valid call comes out unchanged, and no tool_use is emitted that
    the record does not intend or that fails its schema."""
    changed, invalid = [], []
    for record in CORPUS:
        emitted = calls(corpus_message(record, size))
        if record["kind"] == "valid" and emitted != record["expect"]["calls"]:
            changed.append(record["id"])
        for call in emitted:
            unintended = record["kind"] != "valid" and call not in record.get("intended", [])
            if unintended or validate(call["input"], SCHEMAS[call["name"]]):
                invalid.append(record["id"])
    assert (changed, invalid) == ([], [])
    assert sum(r["kind"] == "valid" for r in CORPUS) >= 40


def test_corpus_replies_that_are_not_calls_stream_before_they_end() -> None:
    """Held corpus replies that cannot be a call nor a retried attempt go out before the end."""
    for record_id in ("model-076", "hand-python-fence"):
        record = next(r for r in CORPUS if r["id"] == record_id)
        tools = {name: SCHEMAS[name] for name in record["tools"]}
        sse = assembler(tool_schemas=tools, coalesce_chars=1)
        sse.start()
        at = first_text_at(stream(sse, pieces(record["text"], 1)))
        assert at is not None and at < len(record["text"]) / 2, record_id


# -- the verdict and the retry ---------------------------------------------------------------------


def ended(content: Sequence[str], finish: str = "stop", **options: Any) -> SSEAssembler:
    sse = assembler(tool_schemas=SCHEMAS, **options)
    sse.start()
    for piece in content:
        sse.feed(text(piece), 0.0)
    sse.feed(done(finish), 0.0)
    return sse


@pytest.mark.parametrize(
    ("content", "finish", "expected"),
    [
        (["Just prose."], "stop", ReplyComplete),
        ([READ], "stop", ReplyComplete),
        (['{"name": "weather", "arguments": {"city": "Oslo"}}'], "stop", RetryWithTools),
        (['{"name": "Read", "arguments": {"path": "/a"}}'], "stop", RetryWithTools),
        (
            ["Let me check.\n<tool_call>\n", '{"name": "read"}\n</tool_call>'],
            "stop",
            RetryWithTools,
        ),
        (['{"name": "weather", "arguments": {"city": "Os'], "length", ReplyComplete),
        (["```python\nprint(1)\n```"], "stop", ReplyComplete),
    ],
)
def test_verdict(content: list[str], finish: str, expected: type) -> None:
    """A retry only for a held call written wrongly, in a reply that ended by itself."""
    sse = ended(content, finish)
    verdict = sse.verdict()
    assert type(verdict) is expected
    assert sse.verdict() == verdict  # asking changes nothing
    if isinstance(verdict, RetryWithTools):
        assert verdict.rejected and all(r.reason for r in verdict.rejected)


def test_the_retry_flow_replaces_a_wrong_call_by_a_valid_one() -> None:
    """verdict → begin_retry → the constrained reply → finish gives one tool_use, and usage adds
    up both replies; after the retry the verdict is final."""
    sse = assembler(tool_schemas=SCHEMAS)
    events = sse.start()
    events += sse.feed(text('{"name": "weather", "arguments": {"city": "Oslo"}}'), 0.0)
    events += sse.feed(done("stop", timings={"prompt_n": 30, "predicted_n": 12}), 0.0)
    assert isinstance(sse.verdict(), RetryWithTools)
    sse.begin_retry()
    assert sse.forced_tool is ANY_TOOL
    events += sse.feed(text('{"name": "get_weather", "arguments": {"city": "Oslo"}}'), 0.0)
    events += sse.feed(done("stop", timings={"prompt_n": 5, "cache_n": 25, "predicted_n": 14}), 0)
    assert sse.verdict() == ReplyComplete()
    with pytest.raises(SSEProtocolError):
        sse.begin_retry()
    message = accumulate(events + sse.finish(0.0))
    assert calls(message) == [{"name": "get_weather", "input": {"city": "Oslo"}}]
    assert texts(message) == ""
    usage = message["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (35, 25)
    assert usage["output_tokens"] == 26


def test_begin_retry_needs_the_retry_verdict() -> None:
    """begin_retry on a reply that does not warrant one breaks the protocol."""
    sse = ended(["Just prose."])
    with pytest.raises(SSEProtocolError):
        sse.begin_retry()
    done_sse = ended([READ])
    done_sse.finish(0.0)
    with pytest.raises(SSEProtocolError):
        done_sse.verdict()


# -- stopping a degenerate loop --------------------------------------------------------------------


def recorded_loop() -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = json.loads((FIXTURES / "degenerate_ok_loop.json").read_text())[
        "chunks"
    ]
    return chunks


def run_until_stop(
    sse: SSEAssembler, chunks: Iterable[Mapping[str, Any]]
) -> tuple[list[Event], int]:
    """Feed chunks as a runtime would: stop feeding once the assembler asks to stop."""
    events = sse.start()
    used = 0
    for chunk in chunks:
        events += sse.feed(chunk, 0.0)
        used += 1
        if sse.stop is not None:
            break
    return events, used


def test_the_recorded_loop_is_stopped_and_ends_as_a_normal_turn() -> None:
    """The default model's "ok ok ok" reply: the stream is stopped early, the message ends with
    end_turn (not max_tokens), usage is estimated, and the official SDK reads it."""
    chunks = recorded_loop()
    sse = assembler()
    events, used = run_until_stop(sse, chunks)
    assert isinstance(sse.stop, StopRequest)
    assert sse.stop.reason == "repetition" and sse.stop.where == "text"
    assert sse.stop.repetition.unit.strip() == "ok"
    assert used < len(chunks) * 3 // 4
    assert sse.feed(chunks[used], 0.0) == []  # a chunk still in flight is ignored
    assert sse.verdict() == ReplyComplete()
    events += sse.finish(0.0)
    message = accumulate(events)
    assert message["stop_reason"] == "end_turn"
    assert set(texts(message).split()) == {"ok"}
    assert message["usage"]["output_tokens"] == used - 1  # the first chunk carries no text
    assert sdk_view(sdk_final_message(events)) == our_view(message)


def test_a_loop_in_held_text_is_trimmed_to_one_copy() -> None:
    """A held reply that repeats one call is stopped; one copy is kept and becomes the call."""
    sse = assembler(tool_schemas=SCHEMAS)
    events, _ = run_until_stop(sse, [text(READ + "\n")] * 200)
    assert sse.stop is not None
    message = accumulate(events + sse.finish(0.0))
    assert calls(message) == [{"name": "Read", "input": {"file_path": "/repo/a.py"}}]
    assert message["stop_reason"] == "tool_use"


def test_a_looping_call_is_not_repaired_and_its_repetition_is_cut() -> None:
    """A Write whose content loops is stopped: it is not repaired into a call, and the text that
    was held back keeps one copy of the loop."""
    start = '{"name": "Write", "arguments": {"file_path": "/a.txt", "content": "'
    sse = assembler(tool_schemas=SCHEMAS)
    events, _ = run_until_stop(sse, [text(start), *[text("}}") for _ in range(1000)]])
    assert sse.stop is not None
    message = accumulate(events + sse.finish(0.0))
    assert calls(message) == []
    assert texts(message) == start + "}"
    assert message["stop_reason"] == "end_turn"


def test_looping_thinking_is_stopped() -> None:
    """A thinking loop stops the stream too; the thinking block still gets its signature."""
    sse = assembler()
    events, _ = run_until_stop(sse, [reasoning("Wait, let me reconsider. ")] * 200)
    assert sse.stop is not None and sse.stop.where == "thinking"
    message = accumulate(events + sse.finish(0.0))
    (block,) = message["content"]
    assert block["type"] == "thinking" and block["signature"]
    assert message["stop_reason"] == "end_turn"


def test_looping_forced_json_is_stopped_and_becomes_text() -> None:
    """Constrained decoding that loops on whitespace is stopped; the JSON so far is text."""
    sse = assembler(forced_tool="get_weather")
    events, _ = run_until_stop(sse, [text('{"city": "Paris"'), *[text("\n")] * 2000])
    assert sse.stop is not None
    message = accumulate(events + sse.finish(0.0))
    assert texts(message) == '{"city": "Paris"\n'


def test_looping_structured_tool_arguments_are_stopped() -> None:
    """Structured tool-call arguments that loop stop the stream; no tool_use is made of them."""
    sse = assembler(tool_schemas=SCHEMAS)
    first = tool(0, '{"command": "echo ', id="call_1", name="Bash")
    events, _ = run_until_stop(sse, [first, *[tool(0, "ha") for _ in range(1000)]])
    assert sse.stop is not None and sse.stop.where == "tool"
    message = accumulate(events + sse.finish(0.0))
    assert calls(message) == []
    assert texts(message) == '{"command": "echo ha'


def test_repetition_detection_can_be_switched_off() -> None:
    """Without a guard the whole loop passes through."""
    sse = assembler(repetition_guard=None)
    _, used = run_until_stop(sse, recorded_loop())
    assert sse.stop is None and used == len(recorded_loop())


def test_custom_thresholds() -> None:
    """The guard given is a template: its thresholds apply to each output."""
    sse = assembler(repetition_guard=RepetitionGuard(min_chars=40, min_repeats=4, check_every=8))
    _, used = run_until_stop(sse, [text("ab ")] * 100)
    assert sse.stop is not None and used <= 20
