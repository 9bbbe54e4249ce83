"""The Responses API's request (``POST /v1/responses``, what Codex sends) as a Messages body.

Items are translated one by one, in order, and only ever appended to the conversation, so a
conversation that grows by items keeps a prompt that grows by appending too. Tools in a namespace
are flattened to ``namespace.name`` for the engine, a custom (free-form) tool takes one string, and
the tools OpenAI's servers run themselves are left out. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from agentkv.exceptions import InvalidRequestError
from agentkv.limits import RequestLimits
from agentkv.openai_request import (
    CUSTOM_INPUT,
    TEXT_JOIN,
    Conversation,
    OpenAIRequest,
    ToolOrigin,
    add_tool,
    call_input,
    check_count,
    content_blocks,
    engine_tool,
    function_tool,
    messages_body,
    obj_at,
    opt_bool,
    opt_obj,
    opt_positive_int,
    opt_str,
    read_conversation,
    refuse,
    required_str,
    shown,
    str_at,
    text_of,
    tool_choice,
)
from agentkv.schema import json_type

__all__ = ["HOSTED_TOOL_TYPES", "responses_request"]

#: Responses tools that OpenAI's servers run themselves (search, files, code, images). A local
#: engine has none of them, and Codex declares ``web_search`` in every request, so they are left
#: out of the prompt instead of being refused: the model simply does not see them.
HOSTED_TOOL_TYPES: Final = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "code_interpreter",
        "image_generation",
    }
)


def responses_request(body: Mapping[str, Any], limits: RequestLimits) -> OpenAIRequest:
    """A ``POST /v1/responses`` body as a Messages body."""
    refuse(body, _RESPONSES_REFUSED)
    model = required_str(body, "model")
    stream = opt_bool(body, "stream") or False
    instructions = opt_str(body, "instructions")
    _check_text_format(body.get("text"))
    opt_obj(body, "reasoning")
    include = body.get("include")
    if include is not None and not (
        isinstance(include, list) and all(isinstance(x, str) for x in include)
    ):
        raise InvalidRequestError("expected a list of strings", "include")
    opt_bool(body, "store")
    tools, origins, tool_sources = _responses_tools(body.get("tools"), limits)
    choice = tool_choice(body.get("tool_choice"), origins)
    parallel = opt_bool(body, "parallel_tool_calls")
    max_tokens = opt_positive_int(body, "max_output_tokens")

    raw_input = body.get("input")
    if isinstance(raw_input, str):
        items: list[Any] = [{"type": "message", "role": "user", "content": raw_input}]
    elif isinstance(raw_input, list):
        items = raw_input
    elif raw_input is None:
        raise InvalidRequestError("is required", "input")
    else:
        raise InvalidRequestError(
            f"expected a string or a list of items, got {json_type(raw_input)}", "input"
        )
    conversation = Conversation()
    if instructions:
        conversation.system.append(instructions)
        conversation.system_sources.append("instructions")
    read_conversation(
        items,
        _responses_item,
        path="input",
        what="item",
        limit=limits.max_messages,
        conversation=conversation,
    )
    out = messages_body(
        conversation,
        body,
        model=model,
        max_tokens=max_tokens,
        stream=stream,
        tools=tools,
        choice=choice,
        parallel=parallel,
    )
    sources = {**conversation.sources, **tool_sources, "max_tokens": "max_output_tokens"}
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_tokens,
        "parallel_tool_calls": True if parallel is None else parallel,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "text": body.get("text") or {"format": {"type": "text"}},
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        "user": body.get("user"),
        "prompt_cache_key": body.get("prompt_cache_key"),
    }
    return OpenAIRequest(
        api="responses",
        body=out,
        model=model,
        stream=stream,
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


def _check_text_format(text: Any) -> None:
    if text is None:
        return
    text = obj_at(text, "text")
    fmt = text.get("format")
    if fmt is None:
        return
    kind = obj_at(fmt, "text.format").get("type")
    if kind != "text":
        raise InvalidRequestError(
            f"{shown(kind)} is not supported; only plain text output is", "text.format.type"
        )


# -- tools -----------------------------------------------------------------------------------------


def _custom_tool(raw: Mapping[str, Any], path: str, engine_name: str) -> dict[str, Any]:
    description = raw.get("description")
    text = str_at(description, f"{path}.description") if description is not None else ""
    fmt = raw.get("format")
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
    raw: Any, limits: RequestLimits
) -> tuple[list[dict[str, Any]], dict[str, ToolOrigin], dict[str, str]]:
    tools: list[dict[str, Any]] = []
    origins: dict[str, ToolOrigin] = {}
    sources: dict[str, str] = {}
    if raw is None:
        return tools, origins, sources
    if not isinstance(raw, list):
        raise InvalidRequestError(f"expected a list, got {json_type(raw)}", "tools")
    check_count(raw, limits.max_tools, "tools", "tools")
    for i, entry in enumerate(raw):
        path = f"tools[{i}]"
        entry = obj_at(entry, path)
        kind = entry.get("type")
        if kind == "function":
            tool = function_tool(
                entry.get("name"),
                entry.get("description"),
                entry.get("parameters"),
                path,
                f"{path}.name",
            )
            add_tool(tools, origins, sources, tool, ToolOrigin(tool["name"]), path)
        elif kind == "custom":
            name = entry.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidRequestError("expected a non-empty string", f"{path}.name")
            tool = _custom_tool(entry, path, name)
            add_tool(tools, origins, sources, tool, ToolOrigin(name, custom=True), path)
        elif kind == "namespace":
            space = entry.get("name")
            if not isinstance(space, str) or not space:
                raise InvalidRequestError("expected a non-empty string", f"{path}.name")
            inner = entry.get("tools")
            if not isinstance(inner, list):
                raise InvalidRequestError(
                    f"expected a list, got {json_type(inner)}", f"{path}.tools"
                )
            check_count(inner, limits.max_tools, "tools", f"{path}.tools")
            for j, sub in enumerate(inner):
                sub_path = f"{path}.tools[{j}]"
                sub = obj_at(sub, sub_path)
                name = sub.get("name")
                if not isinstance(name, str) or not name:
                    raise InvalidRequestError("expected a non-empty string", f"{sub_path}.name")
                engine_name = f"{space}.{name}"
                if sub.get("type") == "custom":
                    tool = _custom_tool(sub, sub_path, engine_name)
                    origin = ToolOrigin(name, namespace=space, custom=True)
                elif sub.get("type", "function") == "function":
                    tool = function_tool(
                        engine_name,
                        sub.get("description"),
                        sub.get("parameters"),
                        sub_path,
                        f"{sub_path}.name",
                    )
                    origin = ToolOrigin(name, namespace=space)
                else:
                    raise InvalidRequestError(
                        f"{shown(sub.get('type'))} is not supported in a namespace "
                        "(function and custom tools are)",
                        f"{sub_path}.type",
                    )
                add_tool(tools, origins, sources, tool, origin, sub_path)
        elif isinstance(kind, str) and kind in HOSTED_TOOL_TYPES:
            continue  # run by OpenAI's servers; nothing here can run it (see HOSTED_TOOL_TYPES)
        else:
            raise InvalidRequestError(
                f"{shown(kind)} is not supported (function, custom and namespace tools are; "
                f"hosted tools such as web_search are left out)",
                f"{path}.type",
            )
    check_count(tools, limits.max_tools, "tools", "tools")
    return tools, origins, sources


# -- items -----------------------------------------------------------------------------------------

_RESPONSES_USER_PARTS: Final = {"input_text": "text"}
_RESPONSES_ASSISTANT_PARTS: Final = {
    "output_text": "text",
    "refusal": "refusal",
    "input_text": "text",
}
_RESPONSES_SYSTEM_PARTS: Final = {"input_text": "text"}


def _responses_item(
    conversation: Conversation,
    item: Any,
    path: str,
) -> None:
    item = obj_at(item, path)
    kind = item.get("type")
    if kind is None and "role" in item:
        kind = "message"
    if kind == "message":
        role = item.get("role")
        content_path = f"{path}.content"
        if role in ("system", "developer"):
            parts = content_blocks(
                item.get("content"), content_path, _RESPONSES_SYSTEM_PARTS, images=False
            )
            conversation.system_text(text_of(parts), path)
        elif role == "user":
            parts = content_blocks(
                item.get("content"), content_path, _RESPONSES_USER_PARTS, images=True
            )
            conversation.add("user", parts, path)
        elif role == "assistant":
            parts = content_blocks(
                item.get("content"), content_path, _RESPONSES_ASSISTANT_PARTS, images=False
            )
            conversation.assistant(parts, path)
        else:
            raise InvalidRequestError(
                f"{shown(role)} is not one of 'user', 'assistant', 'system', 'developer'",
                f"{path}.role",
            )
    elif kind in ("function_call", "custom_tool_call"):
        call_id = str_at(item.get("call_id"), f"{path}.call_id")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("expected a non-empty string", f"{path}.name")
        namespace = item.get("namespace")
        if namespace is not None and not isinstance(namespace, str):
            raise InvalidRequestError("expected a string", f"{path}.namespace")
        if kind == "function_call":
            arguments = call_input(item.get("arguments"), f"{path}.arguments")
        else:
            arguments = {CUSTOM_INPUT: str_at(item.get("input"), f"{path}.input")}
        block = {
            "type": "tool_use",
            "id": call_id,
            "name": engine_tool(name, namespace),
            "input": arguments,
        }
        conversation.assistant([block], path)
    elif kind in ("function_call_output", "custom_tool_call_output"):
        call_id = str_at(item.get("call_id"), f"{path}.call_id")
        output = item.get("output")
        output_path = f"{path}.output"
        if isinstance(output, str):
            content: str | list[dict[str, Any]] = output
        else:
            content = content_blocks(output, output_path, _RESPONSES_USER_PARTS, images=True)
        conversation.result(
            {"type": "tool_result", "tool_use_id": call_id, "content": content}, path
        )
    elif kind == "reasoning":
        texts: list[str] = []
        for key, part_kind in (("content", "reasoning_text"), ("summary", "summary_text")):
            parts = item.get(key)
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
    elif kind == "item_reference":
        raise InvalidRequestError(
            "is not supported: agentkv keeps no items; send the item itself", f"{path}.type"
        )
    else:
        raise InvalidRequestError(
            f"{shown(kind)} is not supported (message, function_call, function_call_output, "
            "custom_tool_call, custom_tool_call_output and reasoning items are)",
            f"{path}.type",
        )
