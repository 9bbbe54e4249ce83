"""Cheap structural limits on a Messages request, checked before any engine work.

A request that passes the body reader is valid JSON, but it can still ask the engine for
unbounded work: 10,000 tools cost llama-server half a minute and gigabytes of memory to turn into a
grammar, and structuring 300,000 messages blocks the event loop for seconds. These checks count and
measure; none of them looks at more than the request already holds, so they cost microseconds for
a normal request.

The defaults are generous. A request of Claude Code 2.1 declares 21 tools (60 KB as JSON, the
largest schema 2.1 KB, the longest name 23 characters), nests 10 levels deep and carries a system
prompt of about 7,000 characters; a long session has a few hundred messages. The defaults are 17 to
30 times those figures (tools, schema and tools bytes, names), and the JSON depth limit of the body
reader is 6 times; they stop only requests no coding agent sends.

Two entry points: :func:`check_body` counts on the raw JSON *before* it is structured (so that
structuring itself stays cheap); :func:`check_limits` checks the structured request. Both raise
:class:`InvalidRequestError` naming the field. Pure: no I/O.
"""

from __future__ import annotations

import binascii
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
from cachetools import LRUCache, cached

from agentkv._anthropic import (
    Base64ImageSource,
    ContentBlock,
    ImageBlock,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolResultBlock,
)
from agentkv.exceptions import InvalidRequestError
from agentkv.fingerprint import canonical_json

__all__ = [
    "IMAGE_NOTE",
    "NO_IMAGES",
    "RequestLimits",
    "check_body",
    "check_count",
    "check_limits",
    "tool_key",
]

#: What a text-only engine answers to an image block in a user's own turn.
NO_IMAGES: Final = (
    "this model does not accept images (text-only); send the image's content as text instead"
)

#: What replaces an image inside a tool_result on a text-only engine, so that the agent goes on
#: (Claude Code's Read tool returns any image file, a screenshot, as such a block).
IMAGE_NOTE: Final = "[An image was here. This model cannot see images, so it was left out.]"

# llama-server reads these as 32-bit integers; a larger value would wrap around silently.
_INT32_MAX: Final = 2**31 - 1


@attrs.frozen
class RequestLimits:
    """Upper bounds on the shape of one Messages request (all counts inclusive)."""

    #: Conversation messages. A long Claude Code session holds a few hundred before compaction.
    max_messages: int = attrs.field(default=10_000, validator=attrs.validators.ge(1))
    #: Content blocks in one message, in ``system``, or in one tool_result. Claude Code sends a
    #: handful per message (one per parallel tool call).
    max_blocks: int = attrs.field(default=1_000, validator=attrs.validators.ge(1))
    #: Characters of text in all of system, messages and tool results together: about two million
    #: tokens, more than any engine's context holds, so refusing it loses nothing.
    max_text_chars: int = attrs.field(default=8_000_000, validator=attrs.validators.ge(1))
    #: Tools. Claude Code declares 21 of its own; MCP servers add tens more.
    max_tools: int = attrs.field(default=512, validator=attrs.validators.ge(1))
    #: Characters of one tool name (the Anthropic API allows 64 or 128, depending on the model).
    max_tool_name_chars: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    #: Bytes of one tool's ``input_schema`` as canonical JSON. Claude Code's largest is 2.1 KB.
    max_tool_schema_bytes: int = attrs.field(default=64 * 1024, validator=attrs.validators.ge(1))
    #: Bytes of all tools (names, descriptions and schemas) as canonical JSON. Claude Code's, with
    #: their long descriptions, come to 60 KB.
    max_tools_bytes: int = attrs.field(default=1024 * 1024, validator=attrs.validators.ge(1))
    #: Entries in ``stop_sequences``, and characters in one of them.
    max_stop_sequences: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    max_stop_sequence_chars: int = attrs.field(default=1_000, validator=attrs.validators.ge(1))
    #: Image blocks in one request, tool results included (the Anthropic API's own limit is 100).
    max_images: int = attrs.field(default=100, validator=attrs.validators.ge(1))
    #: Whether the engine accepts images at all. False makes an image in a user's turn a 400,
    #: and an image inside a tool_result a short note (:data:`IMAGE_NOTE`) in its place.
    images: bool = True


def check_body(body: Mapping[str, Any], limits: RequestLimits) -> None:
    """The counting limits on the raw JSON, before it is structured.

    Only lists are counted; a field of the wrong type is left for the structuring step to name.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        check_count(messages, limits.max_messages, "messages", "messages")
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                path = f"messages[{i}].content"
                check_count(content, limits.max_blocks, "content blocks", path)
                for j, block in enumerate(content):
                    inner = block.get("content") if isinstance(block, dict) else None
                    if isinstance(inner, list):  # a tool_result's own blocks
                        check_count(
                            inner, limits.max_blocks, "content blocks", f"{path}[{j}].content"
                        )
    system = body.get("system")
    if isinstance(system, list):
        check_count(system, limits.max_blocks, "content blocks", "system")
    tools = body.get("tools")
    if isinstance(tools, list):
        check_count(tools, limits.max_tools, "tools", "tools")
    stop = body.get("stop_sequences")
    if isinstance(stop, list):
        check_count(stop, limits.max_stop_sequences, "stop sequences", "stop_sequences")


def check_limits(request: MessagesRequest, limits: RequestLimits) -> None:
    """Every limit of ``limits`` on a structured request; the first one broken is raised."""
    check_count(request.messages, limits.max_messages, "messages", "messages")
    _check_tools(request, limits)
    stop = request.stop_sequences or []
    check_count(stop, limits.max_stop_sequences, "stop sequences", "stop_sequences")
    for i, sequence in enumerate(stop):
        _check_chars(sequence, limits.max_stop_sequence_chars, f"stop_sequences[{i}]")
    if request.max_tokens > _INT32_MAX:
        raise InvalidRequestError(f"must be at most {_INT32_MAX}", "max_tokens")
    if request.top_k is not None and not -_INT32_MAX <= request.top_k <= _INT32_MAX:
        raise InvalidRequestError(f"must be at most {_INT32_MAX} in magnitude", "top_k")
    _check_content(request, limits)


def check_count(items: Sequence[Any], limit: int, what: str, path: str) -> None:
    """At most ``limit`` ``items`` (``what`` names them in the error)."""
    if len(items) > limit:
        raise InvalidRequestError(f"has {len(items)} {what}; the limit is {limit}", path)


def _check_chars(text: str, limit: int, path: str) -> None:
    if len(text) > limit:
        raise InvalidRequestError(f"is {len(text)} characters; the limit is {limit}", path)


def _utf8_size(value: Any) -> int:
    # surrogatepass: a library caller may hand in strings the body reader would have refused.
    return len(canonical_json(value).encode("utf-8", "surrogatepass"))


def tool_key(tool: Tool) -> str:
    """Equal for two tools exactly when they are equal (plain JSON; cheaper than a digest)."""
    return json.dumps([tool.name, tool.description, tool.type, tool.input_schema], sort_keys=True)


#: The sizes of the tools checked lately (their schema, and the whole tool), by :func:`tool_key`:
#: every request of a client sends the same tools, and measuring them is most of a check.
_TOOL_SIZES: LRUCache[str, tuple[int, int]] = LRUCache(maxsize=256)


@cached(_TOOL_SIZES, key=tool_key)
def _tool_sizes(tool: Tool) -> tuple[int, int]:
    schema = 0 if tool.input_schema is None else _utf8_size(tool.input_schema)
    return schema, schema + _utf8_size([tool.name, tool.description, tool.type])


def _check_tools(request: MessagesRequest, limits: RequestLimits) -> None:
    tools = request.tools or []
    check_count(tools, limits.max_tools, "tools", "tools")
    seen: set[str] = set()
    total = 0
    for i, tool in enumerate(tools):
        if not tool.name:
            raise InvalidRequestError("must not be empty", f"tools[{i}].name")
        _check_chars(tool.name, limits.max_tool_name_chars, f"tools[{i}].name")
        if tool.name in seen:
            raise InvalidRequestError("tool names must be unique", f"tools[{i}].name")
        seen.add(tool.name)
        schema_size, tool_size = _tool_sizes(tool)
        if schema_size > limits.max_tool_schema_bytes:
            raise InvalidRequestError(
                f"is {schema_size} bytes as JSON; the limit is {limits.max_tool_schema_bytes}",
                f"tools[{i}].input_schema",
            )
        total += tool_size
        if total > limits.max_tools_bytes:
            raise InvalidRequestError(
                f"the tools up to this one come to {total} bytes as JSON; the limit for all "
                f"tools is {limits.max_tools_bytes}",
                f"tools[{i}]",
            )


def _check_content(request: MessagesRequest, limits: RequestLimits) -> None:
    """Block counts, total text, and images (their number, or any at all on a text-only engine)."""
    text = 0
    images = 0
    system = request.system
    if isinstance(system, str):
        text += len(system)
    elif system is not None:
        check_count(system, limits.max_blocks, "content blocks", "system")
        text += sum(len(block.text) for block in system)
    if text > limits.max_text_chars:
        raise InvalidRequestError(
            f"holds {text} characters of text; the limit is {limits.max_text_chars}", "system"
        )
    for i, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, str):
            text += len(content)
        else:
            path = f"messages[{i}].content"
            check_count(content, limits.max_blocks, "content blocks", path)
            for j, block in enumerate(content):
                block_text, block_images = _block(block, f"{path}[{j}]", limits)
                text += block_text
                images += block_images
                if images > limits.max_images:
                    raise InvalidRequestError(
                        f"the request has more than {limits.max_images} images (the limit)",
                        f"{path}[{j}]",
                    )
        if text > limits.max_text_chars:
            raise InvalidRequestError(
                f"the request's text comes to {text} characters by this message; the limit is "
                f"{limits.max_text_chars}",
                f"messages[{i}]",
            )


def _block(block: ContentBlock, path: str, limits: RequestLimits) -> tuple[int, int]:
    """(characters of text, image count) of one block; raises for an image on a text-only engine."""
    if isinstance(block, TextBlock):
        return len(block.text), 0
    if isinstance(block, ThinkingBlock):
        return len(block.thinking), 0
    if isinstance(block, ImageBlock):
        if not limits.images:
            raise InvalidRequestError(NO_IMAGES, path)
        _check_image(block, path)
        return 0, 1
    if isinstance(block, ToolResultBlock):
        content = block.content
        if content is None:
            return 0, 0
        if isinstance(content, str):
            return len(content), 0
        check_count(content, limits.max_blocks, "content blocks", f"{path}.content")
        text = images = 0
        for k, item in enumerate(content):
            if isinstance(item, ImageBlock):
                if limits.images:  # else it becomes a note, whatever it holds
                    _check_image(item, f"{path}.content[{k}]")
                images += 1
            else:
                text += len(item.text)
        return text, images
    return 0, 0


def _check_image(block: ImageBlock, path: str) -> None:
    """An image the engine will decode: its base64 data must be base64 (the engine would answer
    anything else with an error of its own, or a 500)."""
    source = block.source
    if not isinstance(source, Base64ImageSource):
        return
    if not source.data:
        raise InvalidRequestError("is empty; expected base64 image data", f"{path}.source.data")
    try:
        binascii.a2b_base64(source.data, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"is not valid base64 ({exc})", f"{path}.source.data") from None
