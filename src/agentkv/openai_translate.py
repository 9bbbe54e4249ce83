"""OpenAITranslator: OpenAI Responses and Chat Completions requests in, Messages bodies out.

agentkv has one request lifecycle, built around the Anthropic Messages API: queue, slot placement,
prefix store, compaction, tool repair and records all work on a Messages body. The OpenAI routes
therefore translate their body into exactly the Messages body that ``/v1/messages`` would take for
the same conversation, and the runtime never knows which API a request came in on. The reply comes
back as Anthropic events, which :mod:`agentkv.openai_sse` turns into the client's own stream.

Pure: no I/O, no clock. Each input item or message is translated on its own and only ever appended
to, so a conversation that grows by items keeps a prompt that grows by appending too, and the
engine's cache keeps hitting.

Errors are :class:`~agentkv.exceptions.InvalidRequestError` naming the OpenAI field
(``input[3].content[0].type``); the server writes them in the OpenAI error shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

import attrs

from agentkv.exceptions import InvalidRequestError
from agentkv.limits import RequestLimits
from agentkv.schema import json_type

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "HOSTED_TOOL_TYPES",
    "OpenAIRequest",
    "OpenAITranslator",
    "ToolOrigin",
]

#: The reply length asked of the engine when the client sets none. The runtime caps it to what is
#: left of the slot's context, so a large value only means "as long as it fits".
DEFAULT_MAX_TOKENS: Final = 32000

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

#: The one string parameter a custom (free-form) tool's call carries, as the engine sees it.
CUSTOM_INPUT: Final = "input"

_TEXT_JOIN: Final = "\n\n"
_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+);base64,(.*)$", re.DOTALL)
_ANY_OBJECT: Final[dict[str, Any]] = {"type": "object"}


@attrs.frozen
class ToolOrigin:
    """How a tool the engine knows by one name is shown to the client.

    Responses namespaces (Codex's ``multi_agent_v1``) are flattened to ``namespace.name`` for the
    engine; a call comes back with the two apart again. A custom (free-form) tool takes one string,
    which the engine sees as a function with a single ``input`` parameter.
    """

    name: str
    namespace: str | None = None
    custom: bool = False


@attrs.frozen
class OpenAIRequest:
    """An OpenAI request translated: the Messages ``body`` to prepare, and what the reply needs."""

    api: Literal["responses", "chat"]
    #: The Anthropic Messages body for ``Runtime.prepare``.
    body: dict[str, Any]
    model: str
    stream: bool
    #: Engine tool name -> how the client knows it.
    tools: Mapping[str, ToolOrigin] = attrs.field(factory=dict)
    #: Chat Completions ``stream_options.include_usage``: a last chunk with the usage.
    include_usage: bool = False
    #: Request fields the Responses object repeats (instructions, tools, temperature, ...).
    echo: Mapping[str, Any] = attrs.field(factory=dict)
    #: Where each Messages field came from in the OpenAI body (``messages[2]`` -> ``input[5]``),
    #: so that an error found later names what the client sent.
    sources: Mapping[str, str] = attrs.field(factory=dict)

    def relocate(self, path: str | None) -> str | None:
        """A Messages field path (``messages[2].content[0]``) as the client's (``input[5]``)."""
        if not path:
            return path
        head = path
        while head:
            source = self.sources.get(head)
            if source is not None:
                return source + path[len(head) :]
            cut = max(head.rfind("."), head.rfind("["))
            head = head[:cut] if cut > 0 else ""
        return path


@attrs.frozen
class OpenAITranslator:
    """Validates OpenAI request bodies and turns them into Messages bodies.

    ``limits`` are the runtime's own (see :mod:`agentkv.limits`); the item count is checked here
    before any item is read, the rest once the Messages body is prepared.
    """

    limits: RequestLimits = attrs.field(factory=RequestLimits)

    # -- /v1/responses -----------------------------------------------------------------------------

    def responses(self, body: Mapping[str, Any]) -> OpenAIRequest:
        """A ``POST /v1/responses`` body as a Messages body."""
        for name, why in _RESPONSES_REFUSED.items():
            if body.get(name) not in (None, False):
                raise InvalidRequestError(why, name)
        model = _required_str(body, "model")
        stream = _opt_bool(body, "stream") or False
        instructions = _opt_str(body, "instructions")
        _check_text_format(body.get("text"))
        _opt_obj(body, "reasoning")
        include = body.get("include")
        if include is not None and not (
            isinstance(include, list) and all(isinstance(x, str) for x in include)
        ):
            raise InvalidRequestError("expected a list of strings", "include")
        _opt_bool(body, "store")
        tools, origins, tool_sources = _responses_tools(body.get("tools"), self.limits)
        choice = _responses_tool_choice(body.get("tool_choice"), origins)
        parallel = _opt_bool(body, "parallel_tool_calls")
        max_tokens = _opt_positive_int(body, "max_output_tokens")

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
        if not items:
            raise InvalidRequestError("must hold at least one item", "input")
        _count(items, self.limits.max_messages, "items", "input")
        builder = _Conversation()
        if instructions:
            builder.system.append(instructions)
            builder.system_sources.append("instructions")
        for i, item in enumerate(items):
            _responses_item(builder, item, f"input[{i}]")
        if not builder.messages:
            raise InvalidRequestError("holds no user, assistant or tool item", "input")

        out = builder.body(model, max_tokens or DEFAULT_MAX_TOKENS, stream)
        _apply_tools(out, tools, choice, parallel)
        _sampling(out, body)
        sources = {**builder.sources, **tool_sources, "max_tokens": "max_output_tokens"}
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

    # -- /v1/chat/completions ----------------------------------------------------------------------

    def chat(self, body: Mapping[str, Any]) -> OpenAIRequest:
        """A ``POST /v1/chat/completions`` body as a Messages body."""
        for name, why in _CHAT_REFUSED.items():
            if body.get(name) not in (None, False):
                raise InvalidRequestError(why, name)
        model = _required_str(body, "model")
        stream = _opt_bool(body, "stream") or False
        include_usage = False
        options = _opt_obj(body, "stream_options")
        if options is not None:
            include_usage = _opt_bool(options, "include_usage", "stream_options.") or False
        n = body.get("n")
        if n is not None and (isinstance(n, bool) or n != 1):
            raise InvalidRequestError("only n=1 is supported (one choice per request)", "n")
        _check_response_format(body.get("response_format"))
        modalities = body.get("modalities")
        if modalities is not None and modalities != ["text"]:
            raise InvalidRequestError('only ["text"] is supported', "modalities")
        tools, origins = _chat_tools(body.get("tools"), self.limits)
        choice = _chat_tool_choice(body.get("tool_choice"), origins)
        parallel = _opt_bool(body, "parallel_tool_calls")
        max_tokens = _opt_positive_int(body, "max_completion_tokens")
        max_tokens_from = "max_completion_tokens"
        if max_tokens is None:
            max_tokens = _opt_positive_int(body, "max_tokens")
            max_tokens_from = "max_tokens"

        messages = body.get("messages")
        if not isinstance(messages, list):
            raise InvalidRequestError(
                "is required"
                if messages is None
                else f"expected a list, got {json_type(messages)}",
                "messages",
            )
        if not messages:
            raise InvalidRequestError("must hold at least one message", "messages")
        _count(messages, self.limits.max_messages, "messages", "messages")
        builder = _Conversation()
        for i, message in enumerate(messages):
            _chat_message(builder, message, f"messages[{i}]")
        if not builder.messages:
            raise InvalidRequestError("holds no user, assistant or tool message", "messages")

        out = builder.body(model, max_tokens or DEFAULT_MAX_TOKENS, stream)
        _apply_tools(out, tools, choice, parallel)
        _sampling(out, body)
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
            **builder.sources,
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


# -- what is refused, and why ----------------------------------------------------------------------

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
_CHAT_REFUSED: Final = {
    "functions": "is not supported; declare the functions in `tools`",
    "function_call": "is not supported; use `tool_choice`",
    "audio": "is not supported: the engine produces text only",
    "logprobs": "is not supported by agentkv",
    "prediction": "is not supported by agentkv",
    "web_search_options": "is not supported: the engine has no web search",
}


# -- small validators ------------------------------------------------------------------------------


def _required_str(body: Mapping[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        raise InvalidRequestError("is required", name)
    if not isinstance(value, str):
        raise InvalidRequestError(f"expected a string, got {json_type(value)}", name)
    return value


def _opt_str(body: Mapping[str, Any], name: str, prefix: str = "") -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"expected a string, got {json_type(value)}", prefix + name)
    return value


def _opt_bool(body: Mapping[str, Any], name: str, prefix: str = "") -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(f"expected a boolean, got {json_type(value)}", prefix + name)
    return value


def _opt_obj(body: Mapping[str, Any], name: str, prefix: str = "") -> dict[str, Any] | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise InvalidRequestError(f"expected an object, got {json_type(value)}", prefix + name)
    return value


def _opt_positive_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequestError("expected a positive integer", name)
    return value


def _shown(value: Any) -> str:
    """A client's value in an error message: its repr, cut short (it may be megabytes long)."""
    text = repr(value) if not isinstance(value, str) or len(value) <= 200 else repr(value[:200])
    return text if len(text) <= 80 else text[:80] + "…"


def _count(items: Sequence[Any], limit: int, what: str, path: str) -> None:
    if len(items) > limit:
        raise InvalidRequestError(f"has {len(items)} {what}; the limit is {limit}", path)


def _obj(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"expected an object, got {json_type(value)}", path)
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"expected a string, got {json_type(value)}", path)
    return value


def _sampling(out: dict[str, Any], body: Mapping[str, Any]) -> None:
    """``temperature`` (0–2, as OpenAI allows) and ``top_p`` (0–1), passed to the engine."""
    for name, high in (("temperature", 2.0), ("top_p", 1.0)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= high:
            raise InvalidRequestError(f"expected a number from 0 to {high:g}", name)
        out[name] = float(value)


def _check_text_format(text: Any) -> None:
    if text is None:
        return
    text = _obj(text, "text")
    fmt = text.get("format")
    if fmt is None:
        return
    kind = _obj(fmt, "text.format").get("type")
    if kind != "text":
        raise InvalidRequestError(
            f"{_shown(kind)} is not supported; only plain text output is", "text.format.type"
        )


def _check_response_format(fmt: Any) -> None:
    if fmt is None:
        return
    kind = _obj(fmt, "response_format").get("type")
    if kind != "text":
        raise InvalidRequestError(
            f"{_shown(kind)} is not supported; only plain text output is", "response_format.type"
        )


# -- tools -----------------------------------------------------------------------------------------


def _function_tool(
    name: Any, description: Any, parameters: Any, path: str, name_path: str
) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("expected a non-empty string", name_path)
    tool: dict[str, Any] = {"name": name}
    if description is not None:
        tool["description"] = _str(description, f"{path}.description")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    tool["input_schema"] = _obj(parameters, f"{path}.parameters")
    return tool


def _custom_tool(raw: Mapping[str, Any], path: str, engine_name: str) -> dict[str, Any]:
    description = raw.get("description")
    text = _str(description, f"{path}.description") if description is not None else ""
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


def _add_tool(
    tools: list[dict[str, Any]],
    origins: dict[str, ToolOrigin],
    sources: dict[str, str],
    tool: dict[str, Any],
    origin: ToolOrigin,
    path: str,
) -> None:
    name = tool["name"]
    if name in origins:
        raise InvalidRequestError(f"declares the tool {_shown(name)} a second time", path)
    sources[f"tools[{len(tools)}]"] = path
    tools.append(tool)
    origins[name] = origin


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
    _count(raw, limits.max_tools, "tools", "tools")
    for i, entry in enumerate(raw):
        path = f"tools[{i}]"
        entry = _obj(entry, path)
        kind = entry.get("type")
        if kind == "function":
            tool = _function_tool(
                entry.get("name"),
                entry.get("description"),
                entry.get("parameters"),
                path,
                f"{path}.name",
            )
            _add_tool(tools, origins, sources, tool, ToolOrigin(tool["name"]), path)
        elif kind == "custom":
            name = entry.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidRequestError("expected a non-empty string", f"{path}.name")
            tool = _custom_tool(entry, path, name)
            _add_tool(tools, origins, sources, tool, ToolOrigin(name, custom=True), path)
        elif kind == "namespace":
            space = entry.get("name")
            if not isinstance(space, str) or not space:
                raise InvalidRequestError("expected a non-empty string", f"{path}.name")
            inner = entry.get("tools")
            if not isinstance(inner, list):
                raise InvalidRequestError(
                    f"expected a list, got {json_type(inner)}", f"{path}.tools"
                )
            _count(inner, limits.max_tools, "tools", f"{path}.tools")
            for j, sub in enumerate(inner):
                sub_path = f"{path}.tools[{j}]"
                sub = _obj(sub, sub_path)
                name = sub.get("name")
                if not isinstance(name, str) or not name:
                    raise InvalidRequestError("expected a non-empty string", f"{sub_path}.name")
                engine_name = f"{space}.{name}"
                if sub.get("type") == "custom":
                    tool = _custom_tool(sub, sub_path, engine_name)
                    origin = ToolOrigin(name, namespace=space, custom=True)
                elif sub.get("type", "function") == "function":
                    tool = _function_tool(
                        engine_name,
                        sub.get("description"),
                        sub.get("parameters"),
                        sub_path,
                        f"{sub_path}.name",
                    )
                    origin = ToolOrigin(name, namespace=space)
                else:
                    raise InvalidRequestError(
                        f"{_shown(sub.get('type'))} is not supported in a namespace "
                        "(function and custom tools are)",
                        f"{sub_path}.type",
                    )
                _add_tool(tools, origins, sources, tool, origin, sub_path)
        elif isinstance(kind, str) and kind in HOSTED_TOOL_TYPES:
            continue  # run by OpenAI's servers; nothing here can run it (see HOSTED_TOOL_TYPES)
        else:
            raise InvalidRequestError(
                f"{_shown(kind)} is not supported (function, custom and namespace tools are; "
                f"hosted tools such as web_search are left out)",
                f"{path}.type",
            )
    _count(tools, limits.max_tools, "tools", "tools")
    return tools, origins, sources


def _chat_tools(
    raw: Any, limits: RequestLimits
) -> tuple[list[dict[str, Any]], dict[str, ToolOrigin]]:
    tools: list[dict[str, Any]] = []
    origins: dict[str, ToolOrigin] = {}
    if raw is None:
        return tools, origins
    if not isinstance(raw, list):
        raise InvalidRequestError(f"expected a list, got {json_type(raw)}", "tools")
    _count(raw, limits.max_tools, "tools", "tools")
    for i, entry in enumerate(raw):
        path = f"tools[{i}]"
        entry = _obj(entry, path)
        if entry.get("type") != "function":
            raise InvalidRequestError(
                f"{_shown(entry.get('type'))} is not supported (function tools are)", f"{path}.type"
            )
        function = _obj(entry.get("function"), f"{path}.function")
        tool = _function_tool(
            function.get("name"),
            function.get("description"),
            function.get("parameters"),
            f"{path}.function",
            f"{path}.function.name",
        )
        _add_tool(tools, origins, {}, tool, ToolOrigin(tool["name"]), path)
    return tools, origins


def _engine_name(origins: Mapping[str, ToolOrigin], name: str, namespace: str | None) -> str | None:
    engine = _engine_tool(name, namespace)
    return engine if engine in origins else None


def _responses_tool_choice(raw: Any, origins: Mapping[str, ToolOrigin]) -> dict[str, Any] | None:
    if raw is None or raw == "auto":
        return None
    if raw == "none":
        return {"type": "none"}
    if raw == "required":
        if not origins:
            raise InvalidRequestError("'required' needs at least one tool", "tool_choice")
        return {"type": "any"}
    if isinstance(raw, dict) and raw.get("type") in ("function", "custom"):
        name = raw.get("name")
        namespace = raw.get("namespace")
        if not isinstance(name, str):
            raise InvalidRequestError("expected a string", "tool_choice.name")
        if namespace is not None and not isinstance(namespace, str):
            raise InvalidRequestError("expected a string", "tool_choice.namespace")
        engine = _engine_name(origins, name, namespace)
        if engine is None:
            raise InvalidRequestError(f"tool {_shown(name)} is not in tools", "tool_choice.name")
        return {"type": "tool", "name": engine}
    if isinstance(raw, str):
        raise InvalidRequestError(
            f"{_shown(raw)} is not one of 'auto', 'none', 'required' or a function", "tool_choice"
        )
    kind = raw.get("type") if isinstance(raw, dict) else None
    raise InvalidRequestError(
        f"{_shown(kind)} is not supported ('auto', 'none', 'required' and function choices are)",
        "tool_choice",
    )


def _chat_tool_choice(raw: Any, origins: Mapping[str, ToolOrigin]) -> dict[str, Any] | None:
    if isinstance(raw, dict) and raw.get("type") == "function":
        function = _obj(raw.get("function"), "tool_choice.function")
        name = function.get("name")
        if not isinstance(name, str):
            raise InvalidRequestError("expected a string", "tool_choice.function.name")
        if name not in origins:
            raise InvalidRequestError(
                f"tool {_shown(name)} is not in tools", "tool_choice.function.name"
            )
        return {"type": "tool", "name": name}
    return _responses_tool_choice(raw, origins)


def _apply_tools(
    out: dict[str, Any],
    tools: list[dict[str, Any]],
    choice: dict[str, Any] | None,
    parallel: bool | None,
) -> None:
    if not tools:
        if choice is not None and choice["type"] != "none":
            raise InvalidRequestError("names a tool, but no tools are declared", "tool_choice")
        return
    out["tools"] = tools
    if choice is None:
        choice = {"type": "auto"}
    if parallel is not None and choice["type"] != "none":
        choice = {**choice, "disable_parallel_tool_use": not parallel}
    out["tool_choice"] = choice


# -- conversations ---------------------------------------------------------------------------------


@attrs.define
class _Conversation:
    """Messages built item by item: what merges into the last message, and where each came from."""

    system: list[str] = attrs.field(factory=list)
    system_sources: list[str] = attrs.field(factory=list)
    messages: list[dict[str, Any]] = attrs.field(factory=list)
    sources: dict[str, str] = attrs.field(factory=dict)
    # What the last message is: "assistant" (calls and reasoning merge into it), "results" (tool
    # results merge into it) or "closed".
    _open: str = "closed"

    def add(self, role: str, content: list[dict[str, Any]] | str, path: str) -> None:
        self.sources[f"messages[{len(self.messages)}]"] = path
        self.messages.append({"role": role, "content": content})
        self._open = "closed"

    def system_text(self, text: str, path: str) -> None:
        """A system or developer message: part of the system prompt until the conversation starts,
        then a mid-conversation note (as Claude Code sends one)."""
        if not self.messages:
            self.system.append(text)
            self.system_sources.append(path)
        elif text:
            self.add("system", text, path)

    def assistant(self, blocks: list[dict[str, Any]], path: str) -> None:
        if self._open == "assistant":
            self._merge(blocks, path)
        else:
            self.add("assistant", list(blocks), path)
            self._open = "assistant"

    def result(self, block: dict[str, Any], path: str) -> None:
        if self._open == "results":
            self._merge([block], path)
        else:
            self.add("user", [block], path)
            self._open = "results"

    def _merge(self, blocks: list[dict[str, Any]], path: str) -> None:
        """Blocks of another item in the last message (a turn's parallel calls, their results)."""
        content = self.messages[-1]["content"]
        where = f"messages[{len(self.messages) - 1}]"
        for block in blocks:
            self.sources[f"{where}.content[{len(content)}]"] = path
            content.append(block)

    def body(self, model: str, max_tokens: int, stream: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "messages": self.messages,
            "stream": stream,
        }
        text = _TEXT_JOIN.join(t for t in self.system if t)
        if text:
            out["system"] = text
            if len(self.system_sources) == 1:
                self.sources["system"] = self.system_sources[0]
        return out


def _engine_tool(name: str, namespace: str | None) -> str:
    """The engine's name for a tool the client names ``name`` (in ``namespace``)."""
    return f"{namespace}.{name}" if namespace else name


def _call_input(arguments: Any, path: str) -> dict[str, Any]:
    """A replayed call's ``arguments`` (a JSON string of an object) as the tool_use input."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        raise InvalidRequestError(f"expected a JSON string, got {json_type(arguments)}", path)
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        raise InvalidRequestError("is not valid JSON", path) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"must be a JSON object, got {json_type(value)}", path)
    return value


def _image_block(url: Any, path: str) -> dict[str, Any]:
    if not isinstance(url, str) or not url:
        raise InvalidRequestError("expected an image URL or a data: URL", path)
    found = _DATA_URL.match(url)
    if found is not None:
        media_type, data = found.groups()
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": media_type, "data": data},
        }
    if url.startswith("data:"):
        raise InvalidRequestError("a data: URL must be data:<type>;base64,<data>", path)
    if not url.startswith(("http://", "https://")):
        raise InvalidRequestError("expected an http(s) URL or a data: URL", path)
    return {"type": "image", "source": {"type": "url", "url": url}}


def _parts(
    content: Any, path: str, allowed: Mapping[str, str], *, images: bool
) -> list[dict[str, Any]]:
    """Message content (a string or a list of parts) as Messages text and image blocks.

    ``allowed`` maps a text part's type to the key that holds its text (``input_text`` ->
    ``text``, ``refusal`` -> ``refusal``).
    """
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    if content is None:
        return []
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"expected a string or a list of parts, got {json_type(content)}", path
        )
    blocks: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        part_path = f"{path}[{k}]"
        part = _obj(part, part_path)
        kind = part.get("type")
        if isinstance(kind, str) and kind in allowed:
            key = allowed[kind]
            text = _str(part.get(key), f"{part_path}.{key}")
            if text:
                blocks.append({"type": "text", "text": text})
        elif images and kind == "input_image":
            if part.get("file_id") is not None and part.get("image_url") is None:
                raise InvalidRequestError(
                    "file_id is not supported: agentkv stores no files; send image_url",
                    f"{part_path}.file_id",
                )
            blocks.append(_image_block(part.get("image_url"), f"{part_path}.image_url"))
        elif images and kind == "image_url":
            image = _obj(part.get("image_url"), f"{part_path}.image_url")
            blocks.append(_image_block(image.get("url"), f"{part_path}.image_url.url"))
        else:
            accepted = ", ".join([*allowed, *(("input_image", "image_url") if images else ())])
            raise InvalidRequestError(
                f"{_shown(kind)} is not supported here (accepted: {accepted})", f"{part_path}.type"
            )
    return blocks


def _text_of(blocks: list[dict[str, Any]]) -> str:
    return _TEXT_JOIN.join(b["text"] for b in blocks if b["type"] == "text")


_RESPONSES_USER_PARTS: Final = {"input_text": "text"}
_RESPONSES_ASSISTANT_PARTS: Final = {
    "output_text": "text",
    "refusal": "refusal",
    "input_text": "text",
}
_RESPONSES_SYSTEM_PARTS: Final = {"input_text": "text"}
_CHAT_TEXT_PARTS: Final = {"text": "text"}
_CHAT_ASSISTANT_PARTS: Final = {"text": "text", "refusal": "refusal"}


def _responses_item(
    conversation: _Conversation,
    item: Any,
    path: str,
) -> None:
    item = _obj(item, path)
    kind = item.get("type")
    if kind is None and "role" in item:
        kind = "message"
    if kind == "message":
        role = item.get("role")
        content_path = f"{path}.content"
        if role in ("system", "developer"):
            parts = _parts(item.get("content"), content_path, _RESPONSES_SYSTEM_PARTS, images=False)
            conversation.system_text(_text_of(parts), path)
        elif role == "user":
            parts = _parts(item.get("content"), content_path, _RESPONSES_USER_PARTS, images=True)
            conversation.add("user", parts, path)
        elif role == "assistant":
            parts = _parts(
                item.get("content"), content_path, _RESPONSES_ASSISTANT_PARTS, images=False
            )
            conversation.assistant(parts, path)
        else:
            raise InvalidRequestError(
                f"{_shown(role)} is not one of 'user', 'assistant', 'system', 'developer'",
                f"{path}.role",
            )
    elif kind in ("function_call", "custom_tool_call"):
        call_id = _str(item.get("call_id"), f"{path}.call_id")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("expected a non-empty string", f"{path}.name")
        namespace = item.get("namespace")
        if namespace is not None and not isinstance(namespace, str):
            raise InvalidRequestError("expected a string", f"{path}.namespace")
        if kind == "function_call":
            arguments = _call_input(item.get("arguments"), f"{path}.arguments")
        else:
            arguments = {CUSTOM_INPUT: _str(item.get("input"), f"{path}.input")}
        block = {
            "type": "tool_use",
            "id": call_id,
            "name": _engine_tool(name, namespace),
            "input": arguments,
        }
        conversation.assistant([block], path)
    elif kind in ("function_call_output", "custom_tool_call_output"):
        call_id = _str(item.get("call_id"), f"{path}.call_id")
        output = item.get("output")
        output_path = f"{path}.output"
        if isinstance(output, str):
            content: str | list[dict[str, Any]] = output
        else:
            content = _parts(output, output_path, _RESPONSES_USER_PARTS, images=True)
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
            conversation.assistant([{"type": "thinking", "thinking": _TEXT_JOIN.join(texts)}], path)
    elif kind == "item_reference":
        raise InvalidRequestError(
            "is not supported: agentkv keeps no items; send the item itself", f"{path}.type"
        )
    else:
        raise InvalidRequestError(
            f"{_shown(kind)} is not supported (message, function_call, function_call_output, "
            "custom_tool_call, custom_tool_call_output and reasoning items are)",
            f"{path}.type",
        )


def _chat_message(
    conversation: _Conversation,
    message: Any,
    path: str,
) -> None:
    message = _obj(message, path)
    role = message.get("role")
    content = message.get("content")
    content_path = f"{path}.content"
    if role in ("system", "developer"):
        parts = _parts(content, content_path, _CHAT_TEXT_PARTS, images=False)
        conversation.system_text(_text_of(parts), path)
    elif role == "user":
        conversation.add("user", _parts(content, content_path, _CHAT_TEXT_PARTS, images=True), path)
    elif role == "assistant":
        blocks: list[dict[str, Any]] = []
        reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning})
        blocks += _parts(content, content_path, _CHAT_ASSISTANT_PARTS, images=False)
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise InvalidRequestError(
                    f"expected a list, got {json_type(calls)}", f"{path}.tool_calls"
                )
            for k, call in enumerate(calls):
                call_path = f"{path}.tool_calls[{k}]"
                call = _obj(call, call_path)
                if call.get("type", "function") != "function":
                    raise InvalidRequestError(
                        f"{_shown(call.get('type'))} is not supported (function calls are)",
                        f"{call_path}.type",
                    )
                function = _obj(call.get("function"), f"{call_path}.function")
                name = function.get("name")
                if not isinstance(name, str) or not name:
                    raise InvalidRequestError(
                        "expected a non-empty string", f"{call_path}.function.name"
                    )
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": _str(call.get("id"), f"{call_path}.id"),
                        "name": name,
                        "input": _call_input(
                            function.get("arguments"), f"{call_path}.function.arguments"
                        ),
                    }
                )
        # Each assistant message is its own turn; only tool results merge.
        conversation.add("assistant", blocks, path)
    elif role == "tool":
        call_id = _str(message.get("tool_call_id"), f"{path}.tool_call_id")
        if isinstance(content, str):
            result: str | list[dict[str, Any]] = content
        else:
            result = _parts(content, content_path, _CHAT_TEXT_PARTS, images=False)
        conversation.result(
            {"type": "tool_result", "tool_use_id": call_id, "content": result}, path
        )
    elif role == "function":
        raise InvalidRequestError(
            "'function' messages are not supported; use 'tool' messages", f"{path}.role"
        )
    else:
        raise InvalidRequestError(
            f"{_shown(role)} is not one of 'system', 'developer', 'user', 'assistant', 'tool'",
            f"{path}.role",
        )
