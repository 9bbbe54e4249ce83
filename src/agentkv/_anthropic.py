"""attrs shapes of an Anthropic Messages API request: only the fields agentkv acts on (what else a
client sends, ``cache_control`` and the like, the converter in :mod:`agentkv._convert` drops).
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import attrs

__all__ = [
    "Base64ImageSource",
    "ContentBlock",
    "ImageBlock",
    "ImageSource",
    "Message",
    "MessagesRequest",
    "Metadata",
    "RedactedThinkingBlock",
    "TextBlock",
    "Thinking",
    "ThinkingBlock",
    "Tool",
    "ToolChoice",
    "ToolChoiceAny",
    "ToolChoiceAuto",
    "ToolChoiceNone",
    "ToolChoiceTool",
    "ToolResultBlock",
    "ToolResultContent",
    "ToolUseBlock",
    "UrlImageSource",
]


@attrs.frozen
class TextBlock:
    """``{"type": "text", "text": ...}``; may be empty on input (it is then dropped)."""

    text: str
    type: Literal["text"] = "text"


@attrs.frozen
class Base64ImageSource:
    """Inline image bytes, base64-encoded."""

    media_type: str
    data: str
    type: Literal["base64"] = "base64"


@attrs.frozen
class UrlImageSource:
    """An image the engine fetches (or rejects) by URL."""

    url: str
    type: Literal["url"] = "url"


ImageSource: TypeAlias = Base64ImageSource | UrlImageSource


@attrs.frozen
class ImageBlock:
    """``{"type": "image", "source": {...}}``."""

    source: ImageSource
    type: Literal["image"] = "image"


@attrs.frozen
class ToolUseBlock:
    """A tool call the assistant made earlier in the conversation."""

    id: str
    name: str
    input: dict[str, Any]
    type: Literal["tool_use"] = "tool_use"


ToolResultContent: TypeAlias = TextBlock | ImageBlock


@attrs.frozen
class ToolResultBlock:
    """The client's answer to a ``tool_use``; ``content`` is a string or text/image blocks."""

    tool_use_id: str
    content: str | list[ToolResultContent] | None = None
    is_error: bool | None = None
    type: Literal["tool_result"] = "tool_result"


@attrs.frozen
class ThinkingBlock:
    """Reasoning the assistant showed earlier; its ``signature`` is opaque and not checked."""

    thinking: str
    signature: str | None = None
    type: Literal["thinking"] = "thinking"


@attrs.frozen
class RedactedThinkingBlock:
    """Encrypted reasoning from the Anthropic API; nothing in it is readable by a local model."""

    data: str
    type: Literal["redacted_thinking"] = "redacted_thinking"


ContentBlock: TypeAlias = (
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
)


@attrs.frozen
class Message:
    """One conversation turn; role ``system`` is a mid-conversation note, as Claude Code sends."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


@attrs.frozen
class Tool:
    """A client tool; server tools (``type`` like ``web_search_20250305``) have no input_schema."""

    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None


@attrs.frozen
class ToolChoiceAuto:
    """The model may call any tool or none."""

    disable_parallel_tool_use: bool | None = None
    type: Literal["auto"] = "auto"


@attrs.frozen
class ToolChoiceAny:
    """The model must call one of the tools."""

    disable_parallel_tool_use: bool | None = None
    type: Literal["any"] = "any"


@attrs.frozen
class ToolChoiceTool:
    """The model must call the tool ``name``."""

    name: str
    disable_parallel_tool_use: bool | None = None
    type: Literal["tool"] = "tool"


@attrs.frozen
class ToolChoiceNone:
    """The model must not call tools."""

    type: Literal["none"] = "none"


ToolChoice: TypeAlias = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


@attrs.frozen
class Thinking:
    """``{"type": "enabled", "budget_tokens": N}``, ``{"type": "adaptive"}`` or ``disabled``.

    ``type`` stays a plain string so that modes the API adds later are accepted, not rejected.
    """

    type: str
    budget_tokens: int | None = None

    @property
    def wanted(self) -> bool:
        """Whether the client asked for reasoning at all."""
        return self.type != "disabled"


@attrs.frozen
class Metadata:
    """Request metadata. Claude Code puts a JSON string with ``session_id`` into ``user_id``."""

    user_id: str | None = None


@attrs.frozen
class MessagesRequest:
    """A parsed ``POST /v1/messages`` body (the fields agentkv uses)."""

    model: str
    messages: list[Message]
    max_tokens: int
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None
    thinking: Thinking | None = None
