"""The relay's pure helpers: echo stripping, where a continuation resumes, raw chunks."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv.runtime.chunks import progress_timings, prompt_done
from agentkv.runtime.relay import as_chat_chunk, continuation_prefill, generates, without_echo


def chunk(content: str | None, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": content}, **extra}], "id": "c"}


def text_of(item: dict[str, Any]) -> str:
    return item["choices"][0]["delta"]["content"] or ""


def test_an_echo_split_over_chunks_is_skipped_and_the_rest_kept() -> None:
    """llama-server streams a continued reply's beginning back; the client has it already."""
    echo = "one two "
    out = []
    for piece in ("one", " tw", "o thr", "ee"):
        item, echo = without_echo(chunk(piece), echo)
        out.append(text_of(item))
    assert out == ["", "", "thr", "ee"]
    assert echo == ""


def test_a_chunk_without_text_leaves_the_echo_waiting() -> None:
    role = {"choices": [{"delta": {"role": "assistant"}}]}
    assert without_echo(role, "abc") == (role, "abc")
    progress = {"prompt_progress": {"processed": 3}}
    assert without_echo(progress, "abc") == (progress, "abc")


def test_other_fields_of_an_echoed_chunk_are_kept() -> None:
    item, echo = without_echo(chunk("hello", finish_reason=None), "hel")
    assert text_of(item) == "lo"
    assert item["id"] == "c"
    assert item["choices"][0]["index"] == 0
    assert echo == ""


def test_a_reply_that_does_not_start_with_its_echo_streams_as_is() -> None:
    original = chunk("something else")
    item, echo = without_echo(original, "one two")
    assert item is original
    assert echo == ""


@given(st.text(min_size=1), st.text(), st.lists(st.integers(1, 5), max_size=20))
def test_stripping_an_echo_leaves_exactly_what_follows_it(
    echo: str, rest: str, cuts: list[int]
) -> None:
    """However the stream is cut into chunks, the client sees the reply minus its echo."""
    stream, pieces, at = echo + rest, [], 0
    for size in [*cuts, len(echo + rest)]:
        pieces.append(stream[at : at + size])
        at += size
    left, seen = echo, ""
    for piece in pieces:
        if not piece:
            continue
        item, left = without_echo(chunk(piece), left)
        seen += text_of(item)
    assert seen == rest
    assert left == ""


@pytest.mark.parametrize(
    ("text", "resumes_from"),
    [
        ("1 2 3 19 20", "1 2 3 19 "),
        ("line one\nlast", "line one\n"),
        ("a\tb", "a\t"),
        ("word", ""),
        ("ends with space ", "ends with space "),
        ("", ""),
    ],
)
def test_a_continuation_resumes_after_the_last_whitespace(text: str, resumes_from: str) -> None:
    """The cut-off last word is generated again: re-tokenized mid-word is not what the model
    generated."""
    assert continuation_prefill(text) == resumes_from


def test_raw_completion_chunks_become_chat_chunks() -> None:
    """The raw adapter: content, the stop reason, progress and timings carried across."""
    assert as_chat_chunk({"content": "hi", "stop": False}) == {
        "choices": [{"delta": {"content": "hi"}, "finish_reason": None}]
    }
    last = as_chat_chunk(
        {"content": "", "stop": True, "stop_type": "limit", "timings": {"prompt_n": 3}}
    )
    assert last["choices"] == [{"delta": {"content": None}, "finish_reason": "length"}]
    assert last["timings"] == {"prompt_n": 3}
    assert as_chat_chunk({"stop": True, "stop_type": "eos"})["choices"][0]["finish_reason"] == (
        "stop"
    )
    progress = as_chat_chunk({"content": "", "prompt_progress": {"processed": 9}})
    assert progress["prompt_progress"] == {"processed": 9}
    assert not generates(progress)


def test_generates_tells_output_from_bookkeeping() -> None:
    assert generates(chunk("x"))
    assert generates({"choices": [{"delta": {"reasoning_content": "hm"}}]})
    assert generates({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]})
    assert generates({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    assert not generates({"choices": [{"delta": {"role": "assistant"}}]})
    assert not generates(chunk(""))
    assert not generates({"timings": {"prompt_n": 4}})


def test_prompt_progress_is_read_as_llama_server_sends_it() -> None:
    """Seen from the pinned llama-server (a 130-token prompt whose first 121 were cached): its
    ``processed`` counts the cached tokens too."""
    first = {"prompt_progress": {"total": 130, "cache": 121, "processed": 121, "time_ms": 0}}
    last = {"prompt_progress": {"total": 130, "cache": 121, "processed": 130, "time_ms": 121}}
    assert prompt_done(first) == 121 and prompt_done(last) == 130
    assert prompt_done(chunk("x")) is None
    assert progress_timings(last["prompt_progress"]) == {
        "cache_n": 121,
        "prompt_n": 9,
        "prompt_ms": 121.0,
    }
