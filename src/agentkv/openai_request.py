"""What the Responses and Chat Completions translations share: the request value, the field
readers, tools, and the conversation that becomes a Messages body.

:mod:`agentkv.responses_translate` and :mod:`agentkv.chat_translate` each read their own API's
body with these parts; :class:`~agentkv.openai_translate.OpenAITranslator` is the entry point.

Pure: no I/O, no clock. Errors are :class:`~agentkv.exceptions.InvalidRequestError` naming the
OpenAI field (``input[3].content[0].type``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal

import attrs

from agentkv.exceptions import InvalidRequestError
from agentkv.schema import json_type

__all__ = [
    "CUSTOM_INPUT",
    "DEFAULT_MAX_TOKENS",
    "Conversation",
    "OpenAIRequest",
    "ToolOrigin",
]

#: The reply length asked of the engine when the client sets none. The runtime caps it to what is
#: left of the slot's context, so a large value only means "as long as it fits".
DEFAULT_MAX_TOKENS: Final = 32000

#: The one string parameter a custom (free-form) tool's call carries, as the engine sees it.
CUSTOM_INPUT: Final = "input"

#: How text blocks are joined where one string is needed (system prompt, reasoning).
TEXT_JOIN: Final = "\n\n"
_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+);base64,(.*)$", re.DOTALL)


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


# -- the request's own fields ----------------------------------------------------------------------


def refuse(body: Mapping[str, Any], refused: Mapping[str, str]) -> None:
    """Each field of ``refused`` that the body sets (to anything but false) is an error."""
    for name, why in refused.items():
        if body.get(name) not in (None, False):
            raise InvalidRequestError(why, name)


def required_str(body: Mapping[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        raise InvalidRequestError("is required", name)
    if not isinstance(value, str):
        raise InvalidRequestError(f"expected a string, got {json_type(value)}", name)
    return value


def opt_str(body: Mapping[str, Any], name: str, prefix: str = "") -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"expected a string, got {json_type(value)}", prefix + name)
    return value


def opt_bool(body: Mapping[str, Any], name: str, prefix: str = "") -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(f"expected a boolean, got {json_type(value)}", prefix + name)
    return value


def opt_obj(body: Mapping[str, Any], name: str, prefix: str = "") -> dict[str, Any] | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise InvalidRequestError(f"expected an object, got {json_type(value)}", prefix + name)
    return value


def opt_positive_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequestError("expected a positive integer", name)
    return value


def shown(value: Any) -> str:
    """A client's value in an error message: its repr, cut short (it may be megabytes long)."""
    text = repr(value) if not isinstance(value, str) or len(value) <= 200 else repr(value[:200])
    return text if len(text) <= 80 else text[:80] + "…"


def check_count(items: Sequence[Any], limit: int, what: str, path: str) -> None:
    if len(items) > limit:
        raise InvalidRequestError(f"has {len(items)} {what}; the limit is {limit}", path)


def obj_at(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"expected an object, got {json_type(value)}", path)
    return value


def str_at(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"expected a string, got {json_type(value)}", path)
    return value


# -- tools -----------------------------------------------------------------------------------------


def function_tool(
    name: Any, description: Any, parameters: Any, path: str, name_path: str
) -> dict[str, Any]:
    """A function tool as a Messages tool (``parameters`` become its ``input_schema``)."""
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("expected a non-empty string", name_path)
    tool: dict[str, Any] = {"name": name}
    if description is not None:
        tool["description"] = str_at(description, f"{path}.description")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    tool["input_schema"] = obj_at(parameters, f"{path}.parameters")
    return tool


def add_tool(
    tools: list[dict[str, Any]],
    origins: dict[str, ToolOrigin],
    sources: dict[str, str],
    tool: dict[str, Any],
    origin: ToolOrigin,
    path: str,
) -> None:
    """Declare ``tool`` once: its name must be new, and an error in it names ``path``."""
    name = tool["name"]
    if name in origins:
        raise InvalidRequestError(f"declares the tool {shown(name)} a second time", path)
    sources[f"tools[{len(tools)}]"] = path
    tools.append(tool)
    origins[name] = origin


def _engine_name(origins: Mapping[str, ToolOrigin], name: str, namespace: str | None) -> str | None:
    engine = engine_tool(name, namespace)
    return engine if engine in origins else None


def tool_choice(raw: Any, origins: Mapping[str, ToolOrigin]) -> dict[str, Any] | None:
    """``tool_choice`` as Messages has it (None: auto): ``auto``, ``none``, ``required``, or a
    function or custom tool by ``name`` (and ``namespace``). Chat Completions' own nested form is
    read in :mod:`agentkv.chat_translate`, which falls back to this."""
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
            raise InvalidRequestError(f"tool {shown(name)} is not in tools", "tool_choice.name")
        return {"type": "tool", "name": engine}
    if isinstance(raw, str):
        raise InvalidRequestError(
            f"{shown(raw)} is not one of 'auto', 'none', 'required' or a function", "tool_choice"
        )
    kind = raw.get("type") if isinstance(raw, dict) else None
    raise InvalidRequestError(
        f"{shown(kind)} is not supported ('auto', 'none', 'required' and function choices are)",
        "tool_choice",
    )


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
class Conversation:
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
        text = TEXT_JOIN.join(t for t in self.system if t)
        if text:
            out["system"] = text
            if len(self.system_sources) == 1:
                self.sources["system"] = self.system_sources[0]
        return out


def read_conversation(
    items: Sequence[Any],
    read: Callable[[Conversation, Any, str], None],
    *,
    path: str,
    what: str,
    limit: int,
    conversation: Conversation | None = None,
) -> Conversation:
    """``items`` (the body's ``input`` or ``messages``), each read by ``read`` into one
    conversation; ``what`` names one item in errors (``"item"``, ``"message"``)."""
    if not items:
        raise InvalidRequestError(f"must hold at least one {what}", path)
    check_count(items, limit, f"{what}s", path)
    conversation = conversation if conversation is not None else Conversation()
    for i, item in enumerate(items):
        read(conversation, item, f"{path}[{i}]")
    if not conversation.messages:
        raise InvalidRequestError(f"holds no user, assistant or tool {what}", path)
    return conversation


def messages_body(
    conversation: Conversation,
    body: Mapping[str, Any],
    *,
    model: str,
    max_tokens: int | None,
    stream: bool,
    tools: list[dict[str, Any]],
    choice: dict[str, Any] | None,
    parallel: bool | None,
) -> dict[str, Any]:
    """The Messages body: the conversation, its tools, and the sampling the OpenAI body sets."""
    out = conversation.body(model, max_tokens or DEFAULT_MAX_TOKENS, stream)
    _apply_tools(out, tools, choice, parallel)
    _sampling(out, body)
    return out


def _sampling(out: dict[str, Any], body: Mapping[str, Any]) -> None:
    """``temperature`` (0–2, as OpenAI allows) and ``top_p`` (0–1), passed to the engine."""
    for name, high in (("temperature", 2.0), ("top_p", 1.0)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= high:
            raise InvalidRequestError(f"expected a number from 0 to {high:g}", name)
        out[name] = float(value)


def engine_tool(name: str, namespace: str | None) -> str:
    """The engine's name for a tool the client names ``name`` (in ``namespace``)."""
    return f"{namespace}.{name}" if namespace else name


def call_input(arguments: Any, path: str) -> dict[str, Any]:
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


def content_blocks(
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
        part = obj_at(part, part_path)
        kind = part.get("type")
        if isinstance(kind, str) and kind in allowed:
            key = allowed[kind]
            text = str_at(part.get(key), f"{part_path}.{key}")
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
            image = obj_at(part.get("image_url"), f"{part_path}.image_url")
            blocks.append(_image_block(image.get("url"), f"{part_path}.image_url.url"))
        else:
            accepted = ", ".join([*allowed, *(("input_image", "image_url") if images else ())])
            raise InvalidRequestError(
                f"{shown(kind)} is not supported here (accepted: {accepted})", f"{part_path}.type"
            )
    return blocks


def text_of(blocks: list[dict[str, Any]]) -> str:
    return TEXT_JOIN.join(b["text"] for b in blocks if b["type"] == "text")
