"""The Chat Completions request (``POST /v1/chat/completions``) as a Messages body.

Each message is translated on its own and appended, so a growing conversation keeps a prompt that
grows by appending; only tool results merge into one user turn. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, NewType, TypeAlias

import attrs

from agentkv._convert import (
    AbsentIsNull,
    FieldError,
    NonEmptyStr,
    PositiveInt,
    Strings,
    converter,
    register_tagged,
    structure,
)
from agentkv.exceptions import InvalidRequestError
from agentkv.limits import RequestLimits
from agentkv.openai_request import (
    Arguments,
    Conversation,
    Function,
    ImageUrlPart,
    InputImage,
    NamedChoice,
    OpenAIBody,
    OpenAIRequest,
    Parts,
    Refusal,
    Text,
    TextFormat,
    ToolOrigin,
    check_text_format,
    content_blocks,
    declare_tools,
    function_tool,
    read_conversation,
    refuse,
    register_choice,
    register_parts,
    required,
    shown,
    text_of,
    tool_choice,
)

__all__ = ["chat_request"]

#: ``stop``: a string or a list of strings, read as a list.
Stop = NewType("Stop", list[str])

# -- the request's shapes --------------------------------------------------------------------------


@attrs.frozen
class ChatTool(AbsentIsNull):
    function: Function
    type: Literal["function"] = "function"


@attrs.frozen
class ChoiceName(AbsentIsNull):
    name: str


@attrs.frozen
class FunctionChoice(AbsentIsNull):
    """``tool_choice`` naming a function: ``{"type": "function", "function": {"name": ...}}``."""

    function: ChoiceName
    type: Literal["function"] = "function"


@attrs.frozen
class CallFunction(AbsentIsNull):
    name: NonEmptyStr
    arguments: Arguments


@attrs.frozen
class ToolCall(AbsentIsNull):
    """A call the assistant made; ``type`` is ``function`` when left out."""

    function: CallFunction
    id: str
    type: Literal["function"] = "function"


UserPart: TypeAlias = Text | InputImage | ImageUrlPart
AssistantPart: TypeAlias = Text | Refusal


@attrs.frozen
class SystemMessage(AbsentIsNull):
    role: Literal["system", "developer"]
    content: Parts[Text] = None


@attrs.frozen
class UserMessage(AbsentIsNull):
    role: Literal["user"]
    content: Parts[UserPart] = None


@attrs.frozen
class AssistantMessage(AbsentIsNull):
    role: Literal["assistant"]
    content: Parts[AssistantPart] = None
    reasoning_content: Any = None  # read leniently: only a non-empty string is kept
    tool_calls: list[ToolCall] | None = None


@attrs.frozen
class ToolMessage(AbsentIsNull):
    role: Literal["tool"]
    tool_call_id: str
    content: Parts[Text] = None


ChatMessage: TypeAlias = SystemMessage | UserMessage | AssistantMessage | ToolMessage


@attrs.frozen
class StreamOptions(AbsentIsNull):
    include_usage: bool | None = None


@attrs.frozen
class ChatRequest(OpenAIBody):
    """A ``POST /v1/chat/completions`` body (the fields agentkv reads; see :class:`OpenAIBody`)."""

    stream_options: StreamOptions | None = None
    n: float | None = None
    response_format: TextFormat | None = None
    modalities: Strings | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | FunctionChoice | NamedChoice | None = None
    max_completion_tokens: PositiveInt | None = None
    max_tokens: PositiveInt | None = None
    messages: list[ChatMessage] | None = None
    stop: Stop | None = None
    top_k: int | None = None  # llama.cpp's extension, passed on as Messages has it


def _stop(value: Any, _: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        raise FieldError("expected a string or a list of strings")
    return value


def _unknown_role(role: Any, _: tuple[str, ...]) -> str:
    if role == "function":
        return "'function' messages are not supported; use 'tool' messages"
    return f"{shown(role)} is not one of 'system', 'developer', 'user', 'assistant', 'tool'"


converter.register_structure_hook(Stop, _stop)
register_tagged(
    ChatTool, unknown=lambda kind, _: f"{shown(kind)} is not supported (function tools are)"
)
register_tagged(
    ToolCall,
    read=lambda v: v.get("type", "function"),
    unknown=lambda kind, _: f"{shown(kind)} is not supported (function calls are)",
)
register_tagged(ChatMessage, key="role", unknown=_unknown_role)
register_parts(Text)
register_parts(UserPart)
register_parts(AssistantPart)
register_choice(
    str | FunctionChoice | NamedChoice | None, {"function": FunctionChoice, "custom": NamedChoice}
)


def chat_request(body: Mapping[str, Any], limits: RequestLimits) -> OpenAIRequest:
    """A ``POST /v1/chat/completions`` body as a Messages body."""
    refuse(body, _CHAT_REFUSED)
    if body.get("max_completion_tokens") is not None:
        body = {**body, "max_tokens": None}  # the older name, read only where the newer is unset
    request = structure(body, ChatRequest)
    model = required(request.model, "model")
    if request.n is not None and request.n != 1:
        raise InvalidRequestError("only n=1 is supported (one choice per request)", "n")
    check_text_format(request.response_format, "response_format")
    if request.modalities is not None and request.modalities != ["text"]:
        raise InvalidRequestError('only ["text"] is supported', "modalities")
    tools, origins, _ = declare_tools(request.tools or [], _chat_tool, limits)
    choice = _chat_tool_choice(request.tool_choice, origins)
    max_tokens = request.max_completion_tokens or request.max_tokens
    max_tokens_from = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    conversation = read_conversation(
        required(request.messages, "messages"),
        _chat_message,
        path="messages",
        what="message",
        limit=limits.max_messages,
    )
    out = conversation.body(request, model=model, max_tokens=max_tokens, tools=tools, choice=choice)
    if request.stop is not None and any(request.stop):
        out["stop_sequences"] = [s for s in request.stop if s]
    if request.top_k is not None:
        if request.top_k < 0:
            raise InvalidRequestError("expected a non-negative integer", "top_k")
        out["top_k"] = request.top_k
    sources = {
        **conversation.sources,
        "max_tokens": max_tokens_from,
        "stop_sequences": "stop",
    }
    options = request.stream_options
    return OpenAIRequest(
        api="chat",
        body=out,
        model=model,
        stream=request.stream or False,
        tools=origins,
        include_usage=bool(options and options.include_usage),
        sources=sources,
    )


_CHAT_REFUSED: Final = {
    "functions": "is not supported; declare the functions in `tools`",
    "function_call": "is not supported; use `tool_choice`",
    "audio": "is not supported: the engine produces text only",
    "logprobs": "is not supported by agentkv",
    "prediction": "is not supported by agentkv",
    "web_search_options": "is not supported: the engine has no web search",
}


# -- tools -----------------------------------------------------------------------------------------


def _chat_tool(entry: ChatTool, path: str) -> list[tuple[dict[str, Any], ToolOrigin, str]]:
    name = entry.function.name
    return [(function_tool(entry.function, name), ToolOrigin(name), path)]


def _chat_tool_choice(
    choice: str | FunctionChoice | NamedChoice | None, origins: Mapping[str, ToolOrigin]
) -> dict[str, Any] | None:
    if isinstance(choice, FunctionChoice):
        name = choice.function.name
        if name not in origins:
            raise InvalidRequestError(
                f"tool {shown(name)} is not in tools", "tool_choice.function.name"
            )
        return {"type": "tool", "name": name}
    return tool_choice(choice, origins)


# -- messages --------------------------------------------------------------------------------------


def _chat_message(conversation: Conversation, message: ChatMessage, path: str) -> None:
    content_path = f"{path}.content"
    if isinstance(message, SystemMessage):
        conversation.system_text(text_of(content_blocks(message.content, content_path)), path)
    elif isinstance(message, UserMessage):
        conversation.add("user", content_blocks(message.content, content_path), path)
    elif isinstance(message, AssistantMessage):
        blocks: list[dict[str, Any]] = []
        reasoning = message.reasoning_content
        if isinstance(reasoning, str) and reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning})
        blocks += content_blocks(message.content, content_path)
        for call in message.tool_calls or []:
            blocks.append(
                {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.function.name,
                    "input": call.function.arguments,
                }
            )
        # Each assistant message is its own turn; only tool results merge.
        conversation.add("assistant", blocks, path)
    else:
        conversation.tool_result(message.tool_call_id, message.content, path, content_path)
