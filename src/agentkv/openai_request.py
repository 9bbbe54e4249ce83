"""What the Responses and Chat Completions translations share: the request value, the shapes both
use (parts, functions, tool choices), tools, and the conversation that becomes a Messages body.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Annotated, Any, Final, Literal, NewType, TypeAlias, TypeVar

import attrs

from agentkv._convert import AbsentIsNull, FieldError, NonEmptyStr, converter, register_tagged
from agentkv.exceptions import InvalidRequestError
from agentkv.limits import RequestLimits, check_count
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
    #: The Response object's fields after its ``status``, in order: mostly what the request set
    #: (instructions, tools, temperature, ...); ``output`` is replaced by a fresh list.
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


# -- shapes both bodies use ------------------------------------------------------------------------

T = TypeVar("T")
#: Message content: a string, or parts of the types ``T`` (None: no content).
Parts: TypeAlias = Annotated[str | list[T] | None, "a list of parts"]
#: A replayed call's ``arguments``: a JSON string of an object (the object itself is taken too).
Arguments = NewType("Arguments", dict[str, Any])


@attrs.frozen
class InputText(AbsentIsNull):
    text: str
    type: Literal["input_text"] = "input_text"


@attrs.frozen
class OutputText(AbsentIsNull):
    text: str
    type: Literal["output_text"] = "output_text"


@attrs.frozen
class Text(AbsentIsNull):
    """Chat Completions' text part."""

    text: str
    type: Literal["text"] = "text"


@attrs.frozen
class Refusal(AbsentIsNull):
    refusal: str
    type: Literal["refusal"] = "refusal"

    @property
    def text(self) -> str:
        return self.refusal


@attrs.frozen
class InputImage(AbsentIsNull):
    """An image by URL (``file_id`` is refused: no files are stored)."""

    image_url: str | None = None
    file_id: Any = None
    type: Literal["input_image"] = "input_image"


@attrs.frozen
class ImageUrl(AbsentIsNull):
    url: str | None = None


@attrs.frozen
class ImageUrlPart(AbsentIsNull):
    """Chat Completions' image part, ``{"type": "image_url", "image_url": {"url": ...}}``."""

    image_url: ImageUrl
    type: Literal["image_url"] = "image_url"


Part: TypeAlias = InputText | OutputText | Text | Refusal | InputImage | ImageUrlPart


@attrs.frozen
class Function(AbsentIsNull):
    """A function tool's declaration; ``parameters`` (a JSON schema) become its ``input_schema``."""

    name: NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] | None = None


@attrs.frozen
class NamedChoice(AbsentIsNull):
    """``tool_choice`` naming a function or custom tool (in ``namespace``)."""

    type: Literal["function", "custom"]
    name: str
    namespace: str | None = None


@attrs.frozen
class OpenAIBody(AbsentIsNull):
    """The fields both request bodies share (checked first, in this order)."""

    model: str | None = None
    stream: bool | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None


@attrs.frozen
class TextFormat(AbsentIsNull):
    """Responses' ``text.format`` and Chat Completions' ``response_format``: only text is served."""

    type: str | None = None


def register_parts(tp: Any) -> None:
    """Register ``tp`` as the parts one role's content may hold."""
    register_tagged(
        tp,
        unknown=lambda kind, tags: (
            f"{shown(kind)} is not supported here (accepted: {', '.join(tags)})"
        ),
    )


def register_choice(tp: Any, by_type: Mapping[str, type[Any]]) -> None:
    """Register ``tp`` as a ``tool_choice``: a mode (checked once the tools are known) or an object
    of the class ``by_type`` names."""

    def hook(value: Any, _: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        kind = value.get("type") if isinstance(value, dict) else None
        cls = by_type.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise FieldError(
                f"{shown(kind)} is not supported ('auto', 'none', 'required' and function "
                "choices are)"
            )
        return converter.structure(value, cls)

    converter.register_structure_hook(tp, hook)


def _arguments(value: Any, _: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise FieldError(f"expected a JSON string, got {json_type(value)}")
    if not value.strip():
        return {}
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        raise FieldError("is not valid JSON") from None
    if not isinstance(parsed, dict):
        raise FieldError(f"must be a JSON object, got {json_type(parsed)}")
    return parsed


converter.register_structure_hook(Arguments, _arguments)


# -- the request's own fields ----------------------------------------------------------------------


def refuse(body: Mapping[str, Any], refused: Mapping[str, str]) -> None:
    """Each field of ``refused`` that the body sets (to anything but false) is an error."""
    for name, why in refused.items():
        if body.get(name) not in (None, False):
            raise InvalidRequestError(why, name)


def required(value: T | None, name: str) -> T:
    """A top-level field that must be set (a presence check; its type is the converter's)."""
    if value is None:
        raise InvalidRequestError("is required", name)
    return value


def shown(value: Any) -> str:
    """A client's value in an error message: its repr, cut short (it may be megabytes long)."""
    text = repr(value) if not isinstance(value, str) or len(value) <= 200 else repr(value[:200])
    return text if len(text) <= 80 else text[:80] + "…"


def check_text_format(fmt: TextFormat | None, path: str) -> None:
    if fmt is not None and fmt.type != "text":
        raise InvalidRequestError(
            f"{shown(fmt.type)} is not supported; only plain text output is", f"{path}.type"
        )


# -- tools -----------------------------------------------------------------------------------------


def function_tool(function: Function, name: str) -> dict[str, Any]:
    """A function tool as a Messages tool named ``name`` for the engine."""
    described = {} if function.description is None else {"description": function.description}
    schema = function.parameters
    if schema is None:
        schema = {"type": "object", "properties": {}}
    return {"name": name, **described, "input_schema": schema}


def declare_tools(
    declared: Sequence[T],
    expand: Callable[[T, str], Iterable[tuple[dict[str, Any], ToolOrigin, str]]],
    limits: RequestLimits,
) -> tuple[list[dict[str, Any]], dict[str, ToolOrigin], dict[str, str]]:
    """The Messages tools: ``expand`` gives each entry of the body's ``tools`` (at its path) as
    ``(tool, origin, path)``, each declared once: its name must be new, and an error in it names
    ``path``. Returns the tools, their origins by name, and their sources."""
    check_count(declared, limits.max_tools, "tools", "tools")
    tools: list[dict[str, Any]] = []
    origins: dict[str, ToolOrigin] = {}
    sources: dict[str, str] = {}
    for i, entry in enumerate(declared):
        for tool, origin, path in expand(entry, f"tools[{i}]"):
            name = tool["name"]
            if name in origins:
                raise InvalidRequestError(f"declares the tool {shown(name)} a second time", path)
            sources[f"tools[{len(tools)}]"] = path
            tools.append(tool)
            origins[name] = origin
    check_count(tools, limits.max_tools, "tools", "tools")
    return tools, origins, sources


def tool_choice(
    choice: str | NamedChoice | None, origins: Mapping[str, ToolOrigin]
) -> dict[str, Any] | None:
    """``tool_choice`` as Messages has it (None: auto): ``auto``, ``none``, ``required``, or a
    function or custom tool by ``name`` (and ``namespace``). Chat Completions' own nested form is
    read in :mod:`agentkv.chat_translate`, which falls back to this."""
    if choice is None or choice == "auto":
        return None
    if choice == "none":
        return {"type": "none"}
    if choice == "required":
        if not origins:
            raise InvalidRequestError("'required' needs at least one tool", "tool_choice")
        return {"type": "any"}
    if isinstance(choice, str):
        raise InvalidRequestError(
            f"{shown(choice)} is not one of 'auto', 'none', 'required' or a function", "tool_choice"
        )
    engine = engine_tool(choice.name, choice.namespace)
    if engine not in origins:
        raise InvalidRequestError(f"tool {shown(choice.name)} is not in tools", "tool_choice.name")
    return {"type": "tool", "name": engine}


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
        self._merge_or_add("assistant", "assistant", blocks, path)

    def tool_result(
        self, call_id: str, content: str | Sequence[Part] | None, path: str, content_path: str
    ) -> None:
        """A tool's output; the results that follow one another merge into one user message."""
        output = content if isinstance(content, str) else content_blocks(content, content_path)
        block = {"type": "tool_result", "tool_use_id": call_id, "content": output}
        self._merge_or_add("results", "user", [block], path)

    def _merge_or_add(self, kind: str, role: str, blocks: list[dict[str, Any]], path: str) -> None:
        """Blocks into the last message if it is open for ``kind`` (a turn's parallel calls,
        their results), else a new message of ``role``, open for ``kind``."""
        if self._open != kind:
            self.add(role, list(blocks), path)
            self._open = kind
            return
        content = self.messages[-1]["content"]
        where = f"messages[{len(self.messages) - 1}]"
        for block in blocks:
            self.sources[f"{where}.content[{len(content)}]"] = path
            content.append(block)

    def body(
        self,
        request: OpenAIBody,
        *,
        model: str,
        max_tokens: int | None,
        tools: list[dict[str, Any]],
        choice: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """The Messages body: the conversation, its tools, and the sampling the OpenAI body sets."""
        out: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens or DEFAULT_MAX_TOKENS,
            "messages": self.messages,
            "stream": request.stream or False,
        }
        text = TEXT_JOIN.join(t for t in self.system if t)
        if text:
            out["system"] = text
            if len(self.system_sources) == 1:
                self.sources["system"] = self.system_sources[0]
        if tools:
            out["tools"] = tools
            choice = choice or {"type": "auto"}
            parallel = request.parallel_tool_calls
            if parallel is not None and choice["type"] != "none":
                choice = {**choice, "disable_parallel_tool_use": not parallel}
            out["tool_choice"] = choice
        elif choice is not None and choice["type"] != "none":
            raise InvalidRequestError("names a tool, but no tools are declared", "tool_choice")
        # ``temperature`` (0–2, as OpenAI allows) and ``top_p`` (0–1), passed to the engine.
        for name, value, high in (
            ("temperature", request.temperature, 2.0),
            ("top_p", request.top_p, 1.0),
        ):
            if value is not None:
                if not 0 <= value <= high:
                    raise InvalidRequestError(f"expected a number from 0 to {high:g}", name)
                out[name] = value
        return out


def read_conversation(
    items: Sequence[T],
    read: Callable[[Conversation, T, str], None],
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


def engine_tool(name: str, namespace: str | None) -> str:
    """The engine's name for a tool the client names ``name`` (in ``namespace``)."""
    return f"{namespace}.{name}" if namespace else name


def _image_block(url: str | None, path: str) -> dict[str, Any]:
    if not url:
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


def content_blocks(content: str | Sequence[Part] | None, path: str) -> list[dict[str, Any]]:
    """Message content (a string or parts the converter has checked against the role) as Messages
    text and image blocks; empty texts are dropped."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    blocks: list[dict[str, Any]] = []
    for k, part in enumerate(content or ()):
        if isinstance(part, InputImage):
            if part.file_id is not None and part.image_url is None:
                raise InvalidRequestError(
                    "file_id is not supported: agentkv stores no files; send image_url",
                    f"{path}[{k}].file_id",
                )
            blocks.append(_image_block(part.image_url, f"{path}[{k}].image_url"))
        elif isinstance(part, ImageUrlPart):
            blocks.append(_image_block(part.image_url.url, f"{path}[{k}].image_url.url"))
        elif part.text:
            blocks.append({"type": "text", "text": part.text})
    return blocks


def text_of(blocks: list[dict[str, Any]]) -> str:
    return TEXT_JOIN.join(b["text"] for b in blocks if b["type"] == "text")
