"""MessagesTranslator: an Anthropic Messages request in, a llama-server chat-completions body out.

Pure: no I/O, no clock. The same request always gives the same body, and the body for a
conversation's first ``k`` messages is a prefix of the body for its first ``k + 1`` — each message
is translated on its own — so llama-server's prompt cache and the prefix fingerprint both keep
hitting as a conversation grows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from agentkv._anthropic import (
    Base64ImageSource,
    ContentBlock,
    ImageBlock,
    Message,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from agentkv._convert import structure
from agentkv._types import ANY_TOOL, ForcedTool
from agentkv.exceptions import InvalidRequestError

__all__ = ["BILLING_HEADER_PREFIX", "EngineRequest", "MessagesTranslator"]

#: Claude Code's first system block. It carries a ``cch=`` value that changes between requests in
#: some versions; it means nothing to a local model, and since it sits at the very start of the
#: prompt, any change to it would invalidate the whole cached prefix. So it is never sent.
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"

# Several text blocks in one turn are joined the way a reader would see separate paragraphs.
_TEXT_JOIN = "\n\n"

_ANY_SCHEMA: dict[str, Any] = {"type": "object"}


@attrs.frozen
class EngineRequest:
    """A request ready for llama-server, plus what later stages need to answer the client."""

    body: dict[str, Any]
    model: str
    stream: bool
    #: The tool the reply must call (constrained decoding), :data:`~agentkv.ANY_TOOL` for any of
    #: the declared tools, or None when the model may answer freely.
    forced_tool: ForcedTool | None
    tool_names: tuple[str, ...]
    thinking: bool
    request: MessagesRequest


@attrs.frozen
class MessagesTranslator:
    """Parses and validates Messages requests and turns them into engine requests."""

    def parse(self, body: Mapping[str, Any]) -> MessagesRequest:
        """Structure and validate a client body; errors name the field (``messages[1].role``)."""
        request = structure(body, MessagesRequest)
        if request.max_tokens < 1:
            raise InvalidRequestError("must be a positive integer", "max_tokens")
        if not request.messages:
            raise InvalidRequestError("at least one message is required", "messages")
        names = {tool.name for tool in request.tools or ()}
        choice = request.tool_choice
        if isinstance(choice, ToolChoiceTool) and choice.name not in names:
            raise InvalidRequestError(f"tool {choice.name!r} is not in tools", "tool_choice.name")
        if isinstance(choice, ToolChoiceAny) and not names:
            raise InvalidRequestError("'any' needs at least one tool", "tool_choice.type")
        return request

    def to_engine(self, request: MessagesRequest) -> EngineRequest:
        """The llama-server body for a parsed request (no ``id_slot``: the client adds it)."""
        tools = list(request.tools or ())
        tool_names = tuple(tool.name for tool in tools)
        choice = request.tool_choice

        forced: Tool | None = None
        forced_tool: ForcedTool | None = None
        if isinstance(choice, ToolChoiceTool):
            forced = next(tool for tool in tools if tool.name == choice.name)
            forced_tool = forced.name
        elif isinstance(choice, ToolChoiceAny):
            if len(tools) == 1:
                forced, forced_tool = tools[0], tools[0].name
            else:
                forced_tool = ANY_TOOL

        messages = _system_messages(request.system)
        for message in request.messages:
            messages.extend(_translate_message(message))

        body: dict[str, Any] = {"messages": messages}
        if forced_tool is not None:
            # Measured: the default small model ignores tool_choice="required" but obeys constrained
            # decoding. llama-server refuses a json_schema together with the grammar it builds
            # for `tools`, so here the tools are left out and the schema alone shapes the output.
            if forced is not None:
                schema = forced.input_schema or _ANY_SCHEMA
                note = _forced_note([forced], single=True)
            else:
                schema = {"oneOf": [_named_call_schema(tool) for tool in tools]}
                note = _forced_note(tools, single=False)
            body["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
            _append_user_note(messages, note)
        elif tools and not isinstance(choice, ToolChoiceNone):
            body["tools"] = [_tool(tool) for tool in tools if tool.input_schema is not None]
            if not body["tools"]:
                del body["tools"]
            elif isinstance(choice, ToolChoiceAuto):
                body["tool_choice"] = "auto"
                if choice.disable_parallel_tool_use is not None:
                    body["parallel_tool_calls"] = not choice.disable_parallel_tool_use

        body["max_tokens"] = request.max_tokens
        body["stream"] = request.stream
        if request.stream:
            # Usage on the last chunk is the fallback when a server build omits `timings`.
            body["stream_options"] = {"include_usage": True}
        if request.stop_sequences:
            body["stop"] = list(request.stop_sequences)
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(request, name)
            if value is not None:
                body[name] = value

        return EngineRequest(
            body=body,
            model=request.model,
            stream=request.stream,
            forced_tool=forced_tool,
            tool_names=tool_names,
            thinking=request.thinking is not None and request.thinking.wanted,
            request=request,
        )

    def translate(self, body: Mapping[str, Any]) -> EngineRequest:
        """``parse`` then ``to_engine``."""
        return self.to_engine(self.parse(body))

    def force_any_tool(self, request: EngineRequest, body: Mapping[str, Any]) -> dict[str, Any]:
        """``body`` (an auto-mode engine body for ``request``) constrained to call one tool.

        Used for the one retry after a reply that tried to call a tool but wrote it wrongly: the
        same conversation, with the JSON schema ``{"name", "arguments"}`` over the declared tools.
        """
        tools = [tool for tool in request.request.tools or () if tool.input_schema is not None]
        forced = {
            key: value
            for key, value in body.items()
            if key not in ("tools", "tool_choice", "parallel_tool_calls")
        }
        messages = [dict(message) for message in body["messages"]]
        schema = {"oneOf": [_named_call_schema(tool) for tool in tools]}
        forced["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
        _append_user_note(messages, _forced_note(tools, single=False))
        forced["messages"] = messages
        return forced


def _system_messages(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        texts = [system]
    else:
        texts = [block.text for block in system if not block.text.startswith(BILLING_HEADER_PREFIX)]
    text = _TEXT_JOIN.join(t for t in texts if t)
    return [{"role": "system", "content": text}] if text else []


def _blocks(content: str | Sequence[ContentBlock]) -> Sequence[ContentBlock]:
    return [TextBlock(text=content)] if isinstance(content, str) else content


def _translate_message(message: Message) -> list[dict[str, Any]]:
    blocks = _blocks(message.content)
    if message.role == "assistant":
        return [_assistant(blocks)]
    if message.role == "system":
        # A mid-conversation system note (Claude Code sends these) becomes a user turn wrapped the
        # way Claude Code itself marks such notes. Many chat templates accept a system message only
        # at the start and raise otherwise, and merging it into the head system prompt or into a
        # neighbouring turn would rewrite text that is already cached: every message maps to its
        # own engine message so that a growing conversation only ever appends.
        text = _TEXT_JOIN.join(_texts(blocks))
        if not text:
            return []
        if not text.lstrip().startswith("<system-reminder>"):
            text = f"<system-reminder>\n{text}\n</system-reminder>"
        return [{"role": "user", "content": text}]
    return _user(blocks)


def _texts(blocks: Sequence[ContentBlock]) -> list[str]:
    return [b.text for b in blocks if isinstance(b, TextBlock) and b.text]


def _assistant(blocks: Sequence[ContentBlock]) -> dict[str, Any]:
    text = _TEXT_JOIN.join(_texts(blocks))
    reasoning = _TEXT_JOIN.join(
        b.thinking for b in blocks if isinstance(b, ThinkingBlock) and b.thinking
    )
    calls = [
        {
            "id": b.id,
            "type": "function",
            "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)},
        }
        for b in blocks
        if isinstance(b, ToolUseBlock)
    ]
    # A turn that only calls tools has null content, as in the OpenAI format.
    out: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if reasoning:
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = calls
    # redacted_thinking is encrypted for Anthropic's models; a local model cannot use it.
    return out


def _user(blocks: Sequence[ContentBlock]) -> list[dict[str, Any]]:
    """Tool results first (as ``tool`` messages), then the rest of the turn as one user message."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            text, images = _tool_result(block)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
            # Tool messages carry text only; images a tool returned follow in the user turn.
            parts.extend(images)
        elif isinstance(block, TextBlock):
            if block.text:
                parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append(_image(block))
        elif isinstance(block, ThinkingBlock | RedactedThinkingBlock | ToolUseBlock):
            # Only assistants think or call tools; a client replaying them in a user turn has
            # nothing the model should read as user text.
            continue
    if parts:
        out.append({"role": "user", "content": _content(parts)})
    elif not out:
        # An all-empty user turn still keeps its place, so roles keep alternating.
        out.append({"role": "user", "content": ""})
    return out


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    # Plain text stays a string: every chat template renders that, while typed parts are only
    # needed (and only accepted by multimodal builds) when an image is present.
    if all(p["type"] == "text" for p in parts):
        return _TEXT_JOIN.join(p["text"] for p in parts)
    return parts


def _tool_result(block: ToolResultBlock) -> tuple[str, list[dict[str, Any]]]:
    content = block.content
    images: list[dict[str, Any]] = []
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = _TEXT_JOIN.join(b.text for b in content if isinstance(b, TextBlock) and b.text)
        images = [_image(b) for b in content if isinstance(b, ImageBlock)]
    if block.is_error:
        # The model must see that the tool failed, not mistake the message for output.
        text = f"Error: {text}" if text else "Error"
    return text, images


def _image(block: ImageBlock) -> dict[str, Any]:
    source = block.source
    if isinstance(source, Base64ImageSource):
        url = f"data:{source.media_type};base64,{source.data}"
    else:
        url = source.url
    return {"type": "image_url", "image_url": {"url": url}}


def _tool(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema or _ANY_SCHEMA
    return {"type": "function", "function": function}


def _named_call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            "arguments": tool.input_schema or _ANY_SCHEMA,
        },
        "required": ["name", "arguments"],
    }


def _forced_note(tools: Sequence[Tool], *, single: bool) -> str:
    # With `tools` left out of the body the model no longer sees what the tool is for; this note,
    # placed at the end where it costs no cached prefix, tells it what the JSON it writes means.
    lines = []
    for tool in tools:
        desc = (tool.description or "").strip().splitlines()
        lines.append(f"- {tool.name}: {desc[0]}" if desc else f"- {tool.name}")
    if single:
        head = f"Call the tool `{tools[0].name}` now. Reply with only its input as a JSON object."
    else:
        head = (
            "Call one of these tools now. Reply with only a JSON object "
            '{"name": <tool name>, "arguments": <its input>}.'
        )
    return "<system-reminder>\n" + head + "\n" + "\n".join(lines) + "\n</system-reminder>"


def _append_user_note(messages: list[dict[str, Any]], note: str) -> None:
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "user":
        content = last["content"]
        if isinstance(content, str):
            last["content"] = f"{content}{_TEXT_JOIN}{note}" if content else note
        else:
            last["content"] = [*content, {"type": "text", "text": note}]
    else:
        messages.append({"role": "user", "content": note})
