"""The Responses API's request (``POST /v1/responses``, what Codex sends) as a Messages body.

Items are translated one by one, in order, and only ever appended to the conversation, so a
conversation that grows by items keeps a prompt that grows by appending too. Tools in a namespace
are flattened to ``namespace.name`` for the engine, a custom (free-form) tool takes one string, and
the tools OpenAI's servers run themselves are left out. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Final, Literal, TypeAlias

import attrs

from agentkv._convert import (
    AbsentIsNull,
    NonEmptyStr,
    PositiveInt,
    Strings,
    register_tagged,
    structure,
)
from agentkv.limits import RequestLimits, check_count
from agentkv.openai_request import (
    CUSTOM_INPUT,
    TEXT_JOIN,
    Arguments,
    Conversation,
    Function,
    ImageUrlPart,
    InputImage,
    InputText,
    NamedChoice,
    OpenAIBody,
    OpenAIRequest,
    OutputText,
    Parts,
    Refusal,
    TextFormat,
    ToolOrigin,
    check_text_format,
    content_blocks,
    declare_tools,
    engine_tool,
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

__all__ = ["responses_request"]

#: Responses tools that OpenAI's servers run themselves (search, files, code, images). A local
#: engine has none of them, and Codex declares ``web_search`` in every request, so they are left
#: out of the prompt instead of being refused: the model simply does not see them.
HostedToolType: TypeAlias = Literal[
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "web_search_2025_08_26",
    "file_search",
    "code_interpreter",
    "image_generation",
]

# -- the request's shapes --------------------------------------------------------------------------


@attrs.frozen
class FunctionTool(Function):
    type: Literal["function"] = "function"


@attrs.frozen
class CustomTool(AbsentIsNull):
    """A free-form tool: one string in; a grammar ``format`` is shown to the model."""

    name: NonEmptyStr
    description: str | None = None
    format: Any = None  # read leniently: only a grammar with a definition is used
    type: Literal["custom"] = "custom"


@attrs.frozen
class NamespaceTool(AbsentIsNull):
    """Tools under one name (Codex's ``multi_agent_v1``); a tool in it is a function by default."""

    name: NonEmptyStr
    tools: list[FunctionTool | CustomTool]
    type: Literal["namespace"] = "namespace"


@attrs.frozen
class HostedTool(AbsentIsNull):
    type: HostedToolType


ResponsesTool: TypeAlias = FunctionTool | CustomTool | NamespaceTool | HostedTool


UserPart: TypeAlias = InputText | InputImage | ImageUrlPart
AssistantPart: TypeAlias = OutputText | Refusal | InputText


@attrs.frozen
class SystemMessage(AbsentIsNull):
    role: Literal["system", "developer"]
    content: Parts[InputText] = None


@attrs.frozen
class UserMessage(AbsentIsNull):
    role: Literal["user"]
    content: Parts[UserPart] = None


@attrs.frozen
class AssistantMessage(AbsentIsNull):
    role: Literal["assistant"]
    content: Parts[AssistantPart] = None


Message: TypeAlias = SystemMessage | UserMessage | AssistantMessage


@attrs.frozen
class FunctionCall(AbsentIsNull):
    call_id: str
    name: NonEmptyStr
    arguments: Arguments
    namespace: str | None = None
    type: Literal["function_call"] = "function_call"


@attrs.frozen
class CustomToolCall(AbsentIsNull):
    call_id: str
    name: NonEmptyStr
    input: str
    namespace: str | None = None
    type: Literal["custom_tool_call"] = "custom_tool_call"


@attrs.frozen
class ToolOutput(AbsentIsNull):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: Parts[UserPart] = None


@attrs.frozen
class Reasoning(AbsentIsNull):
    """Reasoning shown earlier; read leniently (only text parts are kept), as it is only context."""

    content: Any = None
    summary: Any = None
    type: Literal["reasoning"] = "reasoning"


Item: TypeAlias = Message | FunctionCall | CustomToolCall | ToolOutput | Reasoning


@attrs.frozen
class TextOptions(AbsentIsNull):
    format: TextFormat | None = None


@attrs.frozen
class ResponsesRequest(OpenAIBody):
    """A ``POST /v1/responses`` body (the fields agentkv reads; see :class:`OpenAIBody`)."""

    instructions: str | None = None
    text: TextOptions | None = None
    reasoning: dict[str, Any] | None = None
    include: Strings | None = None
    store: bool | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | NamedChoice | None = None
    max_output_tokens: PositiveInt | None = None
    input: Annotated[str | list[Item] | None, "a list of items"] = None


def _unknown_tool(kind: Any, _: tuple[str, ...]) -> str:
    return (
        f"{shown(kind)} is not supported (function, custom and namespace tools are; "
        "hosted tools such as web_search are left out)"
    )


def _unknown_item(kind: Any, _: tuple[str, ...]) -> str:
    if kind == "item_reference":
        return "is not supported: agentkv keeps no items; send the item itself"
    return (
        f"{shown(kind)} is not supported (message, function_call, function_call_output, "
        "custom_tool_call, custom_tool_call_output and reasoning items are)"
    )


register_tagged(ResponsesTool, unknown=_unknown_tool)
register_tagged(
    FunctionTool | CustomTool,
    read=lambda v: v.get("type", "function"),
    unknown=lambda kind, _: (
        f"{shown(kind)} is not supported in a namespace (function and custom tools are)"
    ),
)
register_tagged(
    Message,
    key="role",
    unknown=lambda role, _: (
        f"{shown(role)} is not one of 'user', 'assistant', 'system', 'developer'"
    ),
)
register_tagged(
    Item,
    read=lambda v: "message" if v.get("type") is None and "role" in v else v.get("type"),
    unknown=_unknown_item,
    nested={"message": Message},
)
register_parts(InputText)
register_parts(UserPart)
register_parts(AssistantPart)
register_choice(str | NamedChoice | None, {"function": NamedChoice, "custom": NamedChoice})


def responses_request(body: Mapping[str, Any], limits: RequestLimits) -> OpenAIRequest:
    """A ``POST /v1/responses`` body as a Messages body."""
    refuse(body, _RESPONSES_REFUSED)
    request = structure(body, ResponsesRequest)
    model = required(request.model, "model")
    if request.text is not None:
        check_text_format(request.text.format, "text.format")
    tools, origins, tool_sources = declare_tools(
        request.tools or [], lambda entry, path: _responses_tools(entry, path, limits), limits
    )
    choice = tool_choice(request.tool_choice, origins)
    raw = request.input
    items = [UserMessage("user", raw)] if isinstance(raw, str) else required(raw, "input")
    instructions = [request.instructions] if request.instructions else []
    conversation = Conversation(instructions, ["instructions"] * len(instructions))
    limit = limits.max_messages
    read_conversation(
        items, _responses_item, path="input", what="item", limit=limit, conversation=conversation
    )
    max_tokens = request.max_output_tokens
    out = conversation.body(request, model=model, max_tokens=max_tokens, tools=tools, choice=choice)
    sources = {**conversation.sources, **tool_sources, "max_tokens": "max_output_tokens"}
    parallel = request.parallel_tool_calls
    echo = {
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": max_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": True if parallel is None else parallel,
        "previous_response_id": None,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": False,
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": None,
        "user": body.get("user"),
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
    }
    return OpenAIRequest(
        api="responses",
        body=out,
        model=model,
        stream=request.stream or False,
        tools=origins,
        echo=echo,
        sources=sources,
    )


_NO_STATE = (
    "is not supported: agentkv keeps no responses or conversations; send the whole "
    "conversation in `input` (as Codex does)"
)
_RESPONSES_REFUSED: Final = {
    "previous_response_id": _NO_STATE,
    "conversation": _NO_STATE,
    "prompt": "is not supported: agentkv has no stored prompt templates",
    "background": "is not supported: background responses need stored responses",
}


# -- tools -----------------------------------------------------------------------------------------


def _custom_tool(custom: CustomTool, engine_name: str) -> dict[str, Any]:
    text = custom.description or ""
    fmt = custom.format
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        definition = fmt.get("definition")
        if isinstance(definition, str) and definition:
            syntax = fmt.get("syntax") if isinstance(fmt.get("syntax"), str) else "grammar"
            text += f"\n\nThe input must follow this {syntax} grammar:\n{definition}"
    schema = {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string", "description": "the tool's whole input"}},
        "required": [CUSTOM_INPUT],
    }
    tool: dict[str, Any] = {"name": engine_name, "input_schema": schema}
    if text.strip():
        tool["description"] = text.strip()
    return tool


def _responses_tools(
    entry: ResponsesTool, path: str, limits: RequestLimits
) -> Iterator[tuple[dict[str, Any], ToolOrigin, str]]:
    members: list[tuple[FunctionTool | CustomTool, str | None, str]]
    if isinstance(entry, NamespaceTool):
        check_count(entry.tools, limits.max_tools, "tools", f"{path}.tools")
        members = [(sub, entry.name, f"{path}.tools[{j}]") for j, sub in enumerate(entry.tools)]
    elif isinstance(entry, FunctionTool | CustomTool):
        members = [(entry, None, path)]
    else:
        return  # a HostedTool is run by OpenAI's servers (see HostedToolType)
    for member, space, where in members:
        name = engine_tool(member.name, space)
        origin = ToolOrigin(member.name, namespace=space, custom=isinstance(member, CustomTool))
        if isinstance(member, CustomTool):
            yield _custom_tool(member, name), origin, where
        else:
            yield function_tool(member, name), origin, where


# -- items -----------------------------------------------------------------------------------------


def _responses_item(conversation: Conversation, item: Item, path: str) -> None:
    if isinstance(item, SystemMessage):
        conversation.system_text(text_of(content_blocks(item.content, f"{path}.content")), path)
    elif isinstance(item, UserMessage):
        conversation.add("user", content_blocks(item.content, f"{path}.content"), path)
    elif isinstance(item, AssistantMessage):
        conversation.assistant(content_blocks(item.content, f"{path}.content"), path)
    elif isinstance(item, FunctionCall | CustomToolCall):
        arguments = item.arguments if isinstance(item, FunctionCall) else {CUSTOM_INPUT: item.input}
        block = {
            "type": "tool_use",
            "id": item.call_id,
            "name": engine_tool(item.name, item.namespace),
            "input": arguments,
        }
        conversation.assistant([block], path)
    elif isinstance(item, ToolOutput):
        conversation.tool_result(item.call_id, item.output, path, f"{path}.output")
    else:
        texts: list[str] = []
        for parts, part_kind in ((item.content, "reasoning_text"), (item.summary, "summary_text")):
            if isinstance(parts, list):
                texts += [
                    p["text"]
                    for p in parts
                    if isinstance(p, dict)
                    and p.get("type") in (part_kind, "text")
                    and isinstance(p.get("text"), str)
                    and p["text"]
                ]
            if texts:
                break  # the full reasoning when there is one, else its summary
        if texts:
            conversation.assistant([{"type": "thinking", "thinking": TEXT_JOIN.join(texts)}], path)
