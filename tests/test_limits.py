"""Structural request limits (pure): each limit names its field, and real requests pass easily."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from agentkv import InvalidRequestError, MessagesTranslator
from agentkv.fingerprint import canonical_json
from agentkv.limits import (
    IMAGE_NOTE,
    NO_IMAGES,
    RequestLimits,
    check_body,
    check_limits,
    tool_key,
)

FIXTURE = Path(__file__).parent / "fixtures" / "claude_code_request.json"
BODY: dict[str, Any] = {
    "model": "m",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "hi"}],
}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}


def claude_code() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())  # type: ignore[no-any-return]


def refused(body: dict[str, Any], limits: RequestLimits | None = None) -> str:
    """The 400's message for ``body`` (the test fails if it is accepted)."""
    with pytest.raises(InvalidRequestError) as info:
        MessagesTranslator(limits=limits or RequestLimits()).parse(body)
    return info.value.message


def test_claude_code_request_passes_with_a_wide_margin() -> None:
    """A Claude Code request passes limits ten times tighter than the defaults."""
    body = claude_code()
    defaults = RequestLimits()
    tight = RequestLimits(
        max_messages=defaults.max_messages // 10,
        max_blocks=defaults.max_blocks // 10,
        max_text_chars=defaults.max_text_chars // 10,
        max_tools=defaults.max_tools // 10,
        max_tool_name_chars=defaults.max_tool_name_chars // 10,
        max_tool_schema_bytes=defaults.max_tool_schema_bytes // 10,
        max_tools_bytes=defaults.max_tools_bytes // 10,
        max_stop_sequences=defaults.max_stop_sequences // 10,
        max_stop_sequence_chars=defaults.max_stop_sequence_chars // 10,
        max_images=defaults.max_images // 10,
    )
    request = MessagesTranslator(limits=tight).parse(body)
    assert len(request.tools or ()) == len(body["tools"])
    # The margin is real: the request's largest schema is what the tight limit is measured on.
    largest = max(len(canonical_json(t["input_schema"]).encode()) for t in body["tools"])
    assert largest * 10 < defaults.max_tool_schema_bytes


@pytest.mark.parametrize(
    ("change", "limits", "needle"),
    [
        (
            lambda b: b.update(messages=[{"role": "user", "content": "x"}] * 11),
            RequestLimits(max_messages=10),
            "messages: has 11 messages; the limit is 10",
        ),
        (
            lambda b: b.update(
                messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * 6}]
            ),
            RequestLimits(max_blocks=5),
            "messages[0].content: has 6 content blocks; the limit is 5",
        ),
        (
            lambda b: b.update(system=[{"type": "text", "text": "x"}] * 6),
            RequestLimits(max_blocks=5),
            "system: has 6 content blocks",
        ),
        (
            lambda b: b.update(
                tools=[{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(4)]
            ),
            RequestLimits(max_tools=3),
            "tools: has 4 tools; the limit is 3",
        ),
        (
            lambda b: b.update(
                tools=[{"name": "big", "input_schema": {"type": "object", "x": "y" * 200}}]
            ),
            RequestLimits(max_tool_schema_bytes=100),
            "tools[0].input_schema: is ",
        ),
        (
            lambda b: b.update(
                tools=[
                    {"name": f"t{i}", "description": "d" * 60, "input_schema": {"type": "object"}}
                    for i in range(3)
                ]
            ),
            RequestLimits(max_tools_bytes=200),
            "tools[2]: the tools up to this one come to ",
        ),
        (
            lambda b: b.update(tools=[{"name": "n" * 30, "input_schema": {}}]),
            RequestLimits(max_tool_name_chars=20),
            "tools[0].name: is 30 characters; the limit is 20",
        ),
        (
            lambda b: b.update(tools=[{"name": "same"}, {"name": "same"}]),
            RequestLimits(),
            "tools[1].name: tool names must be unique",
        ),
        (
            lambda b: b.update(tools=[{"name": ""}]),
            RequestLimits(),
            "tools[0].name: must not be empty",
        ),
        (
            lambda b: b.update(stop_sequences=["a", "b", "c"]),
            RequestLimits(max_stop_sequences=2),
            "stop_sequences: has 3 stop sequences; the limit is 2",
        ),
        (
            lambda b: b.update(stop_sequences=["ok", "s" * 11]),
            RequestLimits(max_stop_sequence_chars=10),
            "stop_sequences[1]: is 11 characters; the limit is 10",
        ),
        (
            lambda b: b.update(max_tokens=2**31),
            RequestLimits(),
            "max_tokens: must be at most 2147483647",
        ),
        (
            lambda b: b.update(top_k=2**40),
            RequestLimits(),
            "top_k: must be at most 2147483647 in magnitude",
        ),
        (
            lambda b: b.update(system="s" * 11),
            RequestLimits(max_text_chars=10),
            "system: holds 11 characters of text; the limit is 10",
        ),
        (
            lambda b: b.update(
                messages=[
                    {"role": "user", "content": "12345"},
                    {"role": "assistant", "content": [{"type": "text", "text": "123456"}]},
                ]
            ),
            RequestLimits(max_text_chars=10),
            "messages[1]: the request's text comes to 11 characters",
        ),
        (
            lambda b: b.update(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t", "content": "r" * 11}
                        ],
                    }
                ]
            ),
            RequestLimits(max_text_chars=10),
            "messages[0]: the request's text comes to 11",
        ),
        (
            lambda b: b.update(messages=[{"role": "user", "content": [IMAGE, IMAGE, IMAGE]}]),
            RequestLimits(max_images=2),
            "messages[0].content[2]: the request has more than 2 images",
        ),
    ],
)
def test_each_limit_names_its_field(change: Any, limits: RequestLimits, needle: str) -> None:
    body = copy.deepcopy(BODY)
    change(body)
    assert needle in refused(body, limits)
    # The same body passes with the defaults, unless the case is about a default rule.
    if limits != RequestLimits():
        MessagesTranslator().parse(body)


def test_images_on_a_text_only_engine() -> None:
    """limits.images=False: an image in a user's turn is a 400 naming it; one inside a
    tool_result passes the limits (the translator puts a note in its place)."""
    text_only = RequestLimits(images=False)
    direct = {
        **BODY,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, IMAGE]}],
    }
    assert refused(direct, text_only) == f"messages[0].content[1]: {NO_IMAGES}"
    in_result = {
        **BODY,
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "shot"}, IMAGE],
                    }
                ],
            }
        ],
    }
    MessagesTranslator(limits=text_only).parse(in_result)
    # With images allowed (the default) both pass.
    MessagesTranslator().parse(direct)
    MessagesTranslator().parse(in_result)


def test_counts_are_checked_before_structuring() -> None:
    """check_body refuses 10,000 tools on the raw JSON, even ones structuring would reject."""
    body = {**BODY, "tools": [{"bogus": i} for i in range(10_000)]}
    with pytest.raises(InvalidRequestError, match=r"^tools: has 10000 tools; the limit is 512$"):
        check_body(body, RequestLimits())
    nested = {
        **BODY,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{}] * 3}],
            }
        ],
    }
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content\[0\]\.content: has 3"):
        check_body(nested, RequestLimits(max_blocks=2))
    # Wrong types are left alone here; structuring names them.
    check_body({"messages": "x", "tools": {"a": 1}, "system": 3}, RequestLimits())


def test_check_limits_on_a_structured_request() -> None:
    """check_limits works on a MessagesRequest built elsewhere (the library entry point)."""
    request = MessagesTranslator().parse(
        {**BODY, "tools": [{"name": f"t{i}", "input_schema": {}} for i in range(3)]}
    )
    check_limits(request, RequestLimits())
    with pytest.raises(InvalidRequestError, match="tools: has 3 tools"):
        check_limits(request, RequestLimits(max_tools=2))


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_tools"):
        RequestLimits(max_tools=0)
    assert attrs.evolve(RequestLimits(), images=False).images is False


def test_a_tool_result_image_becomes_a_note_on_a_text_only_engine() -> None:
    """The translator of a text-only engine puts a short note where a tool's image was, in the
    tool message itself, and sends no image part; with vision the image goes to the engine."""
    body = {
        **BODY,
        "messages": [
            {"role": "user", "content": "read it"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE]},
                    {"type": "text", "text": "what is in it?"},
                ],
            },
        ],
    }
    engine = MessagesTranslator().text_only().translate(body).body
    tool = next(m for m in engine["messages"] if m["role"] == "tool")
    assert tool["content"] == IMAGE_NOTE
    assert "image_url" not in json.dumps(engine)
    assert engine["messages"][-1] == {"role": "user", "content": "what is in it?"}
    seeing = MessagesTranslator().translate(body).body
    assert "image_url" in json.dumps(seeing)


@pytest.mark.parametrize("data", ["not base64!", "AAA", ""])
def test_image_data_that_is_not_base64_is_refused(data: str) -> None:
    """On an engine that sees images, image data that is not base64 is a 400 naming the field."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    body = {**BODY, "messages": [{"role": "user", "content": [image]}]}
    assert refused(body).startswith("messages[0].content[0].source.data: ")


def test_the_tools_kept_sizes_are_bounded() -> None:
    """The sizes of the tools seen lately are kept for at most 256 tools, however many arrive."""
    from agentkv import limits

    for n in range(300):
        body = {**BODY, "tools": [{"name": f"t{n}", "input_schema": {"type": "object"}}]}
        MessagesTranslator().translate(body)
    assert len(limits._TOOL_SIZES) == limits._TOOL_SIZES.maxsize == 256


def test_a_remembered_tool_is_still_checked_against_each_translators_limits() -> None:
    """The tools' sizes are remembered across requests, the verdict is not: the same tool passes
    one translator's limits and is refused by a stricter one, every time."""
    body = {**BODY, "tools": [{"name": "big", "input_schema": {"type": "object", "x": "y" * 200}}]}
    for _ in range(2):
        MessagesTranslator().translate(body)
        assert "tools[0].input_schema" in refused(body, RequestLimits(max_tool_schema_bytes=100))


def test_tools_that_differ_anywhere_have_different_keys_and_sections() -> None:
    """The memo's key tells tools apart by every field, so their sections differ too."""
    tools = [
        {"name": "t", "input_schema": {"type": "object"}},
        {"name": "t", "input_schema": {"type": "object", "required": []}},
        {"name": "t", "description": "d", "input_schema": {"type": "object"}},
        {"name": "u", "input_schema": {"type": "object"}},
    ]
    sections = {
        MessagesTranslator().translate({**BODY, "tools": [tool]}).sections[0][1] for tool in tools
    }
    assert len(sections) == len(tools)
    parsed = [MessagesTranslator().parse({**BODY, "tools": [tool]}).tools[0] for tool in tools]  # type: ignore[index]
    assert len({tool_key(tool) for tool in parsed}) == len(tools)
