"""The Chat Completions request (``POST /v1/chat/completions``) as a Messages body.

Each message is translated on its own and appended, so a growing conversation keeps a prompt that
grows by appending; only tool results merge into one user turn. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from agentkv.exceptions import InvalidRequestError
from agentkv.limits import RequestLimits
from agentkv.openai_request import (
    Conversation,
    OpenAIRequest,
    ToolOrigin,
    add_tool,
    call_input,
    check_count,
    content_blocks,
    function_tool,
    messages_body,
    obj_at,
    opt_bool,
    opt_obj,
    opt_positive_int,
    read_conversation,
    refuse,
    required_str,
    shown,
    str_at,
    text_of,
    tool_choice,
)
from agentkv.schema import json_type

__all__ = ["chat_request"]


def chat_request(body: Mapping[str, Any], limits: RequestLimits) -> OpenAIRequest:
    """A ``POST /v1/chat/completions`` body as a Messages body."""
    refuse(body, _CHAT_REFUSED)
    model = required_str(body, "model")
    stream = opt_bool(body, "stream") or False
    include_usage = False
    options = opt_obj(body, "stream_options")
    if options is not None:
        include_usage = opt_bool(options, "include_usage", "stream_options.") or False
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise InvalidRequestError("only n=1 is supported (one choice per request)", "n")
    _check_response_format(body.get("response_format"))
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise InvalidRequestError('only ["text"] is supported', "modalities")
    tools, origins = _chat_tools(body.get("tools"), limits)
    choice = _chat_tool_choice(body.get("tool_choice"), origins)
    parallel = opt_bool(body, "parallel_tool_calls")
    max_tokens = opt_positive_int(body, "max_completion_tokens")
    max_tokens_from = "max_completion_tokens"
    if max_tokens is None:
        max_tokens = opt_positive_int(body, "max_tokens")
        max_tokens_from = "max_tokens"

    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequestError(
            "is required" if messages is None else f"expected a list, got {json_type(messages)}",
            "messages",
        )
    conversation = read_conversation(
        messages, _chat_message, path="messages", what="message", limit=limits.max_messages
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
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise InvalidRequestError("expected a string or a list of strings", "stop")
        if any(stop):
            out["stop_sequences"] = [s for s in stop if s]
    top_k = body.get("top_k")  # llama.cpp's extension, passed on as Messages has it
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise InvalidRequestError("expected a non-negative integer", "top_k")
        out["top_k"] = top_k
    sources = {
        **conversation.sources,
        **{f"tools[{i}]": f"tools[{i}]" for i in range(len(tools))},
        "max_tokens": max_tokens_from,
        "stop_sequences": "stop",
    }
    return OpenAIRequest(
        api="chat",
        body=out,
        model=model,
        stream=stream,
        tools=origins,
        include_usage=include_usage,
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


def _check_response_format(fmt: Any) -> None:
    if fmt is None:
        return
    kind = obj_at(fmt, "response_format").get("type")
    if kind != "text":
        raise InvalidRequestError(
            f"{shown(kind)} is not supported; only plain text output is", "response_format.type"
        )


# -- tools -----------------------------------------------------------------------------------------


def _chat_tools(
    raw: Any, limits: RequestLimits
) -> tuple[list[dict[str, Any]], dict[str, ToolOrigin]]:
    tools: list[dict[str, Any]] = []
    origins: dict[str, ToolOrigin] = {}
    if raw is None:
        return tools, origins
    if not isinstance(raw, list):
        raise InvalidRequestError(f"expected a list, got {json_type(raw)}", "tools")
    check_count(raw, limits.max_tools, "tools", "tools")
    for i, entry in enumerate(raw):
        path = f"tools[{i}]"
        entry = obj_at(entry, path)
        if entry.get("type") != "function":
            raise InvalidRequestError(
                f"{shown(entry.get('type'))} is not supported (function tools are)", f"{path}.type"
            )
        function = obj_at(entry.get("function"), f"{path}.function")
        tool = function_tool(
            function.get("name"),
            function.get("description"),
            function.get("parameters"),
            f"{path}.function",
            f"{path}.function.name",
        )
        add_tool(tools, origins, {}, tool, ToolOrigin(tool["name"]), path)
    return tools, origins


def _chat_tool_choice(raw: Any, origins: Mapping[str, ToolOrigin]) -> dict[str, Any] | None:
    if isinstance(raw, dict) and raw.get("type") == "function":
        function = obj_at(raw.get("function"), "tool_choice.function")
        name = function.get("name")
        if not isinstance(name, str):
            raise InvalidRequestError("expected a string", "tool_choice.function.name")
        if name not in origins:
            raise InvalidRequestError(
                f"tool {shown(name)} is not in tools", "tool_choice.function.name"
            )
        return {"type": "tool", "name": name}
    return tool_choice(raw, origins)


# -- messages --------------------------------------------------------------------------------------

_CHAT_TEXT_PARTS: Final = {"text": "text"}
_CHAT_ASSISTANT_PARTS: Final = {"text": "text", "refusal": "refusal"}


def _chat_message(
    conversation: Conversation,
    message: Any,
    path: str,
) -> None:
    message = obj_at(message, path)
    role = message.get("role")
    content = message.get("content")
    content_path = f"{path}.content"
    if role in ("system", "developer"):
        parts = content_blocks(content, content_path, _CHAT_TEXT_PARTS, images=False)
        conversation.system_text(text_of(parts), path)
    elif role == "user":
        conversation.add(
            "user", content_blocks(content, content_path, _CHAT_TEXT_PARTS, images=True), path
        )
    elif role == "assistant":
        blocks: list[dict[str, Any]] = []
        reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning})
        blocks += content_blocks(content, content_path, _CHAT_ASSISTANT_PARTS, images=False)
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise InvalidRequestError(
                    f"expected a list, got {json_type(calls)}", f"{path}.tool_calls"
                )
            for k, call in enumerate(calls):
                call_path = f"{path}.tool_calls[{k}]"
                call = obj_at(call, call_path)
                if call.get("type", "function") != "function":
                    raise InvalidRequestError(
                        f"{shown(call.get('type'))} is not supported (function calls are)",
                        f"{call_path}.type",
                    )
                function = obj_at(call.get("function"), f"{call_path}.function")
                name = function.get("name")
                if not isinstance(name, str) or not name:
                    raise InvalidRequestError(
                        "expected a non-empty string", f"{call_path}.function.name"
                    )
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": str_at(call.get("id"), f"{call_path}.id"),
                        "name": name,
                        "input": call_input(
                            function.get("arguments"), f"{call_path}.function.arguments"
                        ),
                    }
                )
        # Each assistant message is its own turn; only tool results merge.
        conversation.add("assistant", blocks, path)
    elif role == "tool":
        call_id = str_at(message.get("tool_call_id"), f"{path}.tool_call_id")
        if isinstance(content, str):
            result: str | list[dict[str, Any]] = content
        else:
            result = content_blocks(content, content_path, _CHAT_TEXT_PARTS, images=False)
        conversation.result(
            {"type": "tool_result", "tool_use_id": call_id, "content": result}, path
        )
    elif role == "function":
        raise InvalidRequestError(
            "'function' messages are not supported; use 'tool' messages", f"{path}.role"
        )
    else:
        raise InvalidRequestError(
            f"{shown(role)} is not one of 'system', 'developer', 'user', 'assistant', 'tool'",
            f"{path}.role",
        )
