"""MessagesTranslator: an Anthropic Messages request in, a llama-server chat-completions body out.

Pure: no I/O, no clock. The same request always gives the same body, and the body for a
conversation's first ``k`` messages is a prefix of the body for its first ``k + 1`` — each message
is translated on its own — so llama-server's prompt cache and the prefix fingerprint both keep
hitting as a conversation grows.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from cachetools import LRUCache, cached

from agentkv._anthropic import (
    Base64ImageSource,
    ContentBlock,
    ImageBlock,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolResultContent,
    ToolUseBlock,
)
from agentkv._convert import structure
from agentkv._types import ANY_TOOL, ForcedTool
from agentkv.exceptions import InvalidRequestError
from agentkv.fingerprint import canonical_json
from agentkv.layout import (
    SessionFacts,
    facts_blocks,
    is_project_reminder,
    project_reminder_layout,
    split_memory_dir,
    split_note,
)
from agentkv.limits import IMAGE_NOTE, RequestLimits, check_body, check_limits, tool_key

__all__ = ["BILLING_HEADER_PREFIX", "EngineRequest", "MessagesTranslator", "has_images"]

#: Claude Code's first system block. It carries a ``cch=`` value that changes between requests in
#: some versions; it means nothing to a local model, and since it sits at the very start of the
#: prompt, any change to it would invalidate the whole cached prefix. So it is never sent.
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"

# Several text blocks in one turn are joined the way a reader would see separate paragraphs.
_TEXT_JOIN = "\n\n"

_ANY_SCHEMA: dict[str, Any] = {"type": "object"}


@attrs.frozen
class EngineRequest:
    """A request ready for llama-server, plus what later stages need to answer the client.

    ``stem_body`` is ``body`` without the words of its last user turn (None when it has none):
    the prompt it renders is the part of this request that other requests may share — the system
    prompt, the tools, the conversation so far and the session context — and its end is where a
    fresh agent's own tokens begin.
    """

    body: dict[str, Any]
    model: str
    stream: bool
    #: The tool the reply must call (constrained decoding), :data:`~agentkv.ANY_TOOL` for any of
    #: the declared tools, or None when the model may answer freely.
    forced_tool: ForcedTool | None
    tool_names: tuple[str, ...]
    thinking: bool
    request: MessagesRequest
    stem_body: dict[str, Any] | None = None
    #: The prompt's parts in the order they reach it, each as (label, digest): where two prompts
    #: part ways, in words a person can act on ("tool 3 (Bash)", "message 1 block 0").
    sections: tuple[tuple[str, str], ...] = ()


#: Text blocks that carry session context rather than the user's own words.
REMINDER_PREFIX = "<system-reminder>"


@attrs.frozen
class MessagesTranslator:
    """Parses and validates Messages requests and turns them into engine requests.

    ``session_layout`` (on by default) lays out a client's session context so that agents share
    it: a ``system`` message that follows a user's turn (Claude Code sends its ~9 KB environment
    note that way, after the user's first words) and the ``<system-reminder>`` blocks of that turn
    go *before* the user's words. Two fresh agents in one project then differ only at their last
    few tokens instead of at the user's words, ahead of the whole note. Each turn is still laid
    out on its own, so a growing conversation only ever appends to its prompt.

    ``limits`` bound the request's shape (tool count, schema size, ...); see :mod:`agentkv.limits`.
    """

    session_layout: bool = True
    limits: RequestLimits = attrs.field(factory=RequestLimits)

    def parse(self, body: Mapping[str, Any]) -> MessagesRequest:
        """Structure and validate a client body; errors name the field (``messages[1].role``).

        The counting limits are checked on the raw body first, so an oversized request costs no
        structuring; the rest once it is structured. Nothing here talks to the engine.
        """
        if isinstance(body, Mapping):
            check_body(body, self.limits)
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
        check_limits(request, self.limits)
        return request

    def to_engine(self, request: MessagesRequest) -> EngineRequest:
        """The llama-server body for a parsed request (no ``id_slot``: the client adds it)."""
        if not self.limits.images:
            request = _images_as_notes(request)
        tools = list(request.tools or ())
        tool_names = tuple(tool.name for tool in tools)
        choice = request.tool_choice

        forced: Tool | None = None
        if isinstance(choice, ToolChoiceTool):
            forced = next(tool for tool in tools if tool.name == choice.name)
        elif isinstance(choice, ToolChoiceAny) and len(tools) == 1:
            forced = tools[0]
        forced_tool: ForcedTool | None = forced.name if forced is not None else None
        if isinstance(choice, ToolChoiceAny) and forced is None:
            forced_tool = ANY_TOOL

        system, turns = _lay_out(request, self.session_layout)
        system_text = _TEXT_JOIN.join(text for _, text in system if text)
        head = [{"role": "system", "content": system_text}] if system_text else []
        messages = list(head)
        for turn in turns:
            messages.extend(_translate_turn(turn))
        stem = _stem(head, turns)

        body: dict[str, Any] = {"messages": messages}
        if forced_tool is not None:
            # Measured: the default small model ignores tool_choice="required" but obeys constrained
            # decoding. llama-server refuses a json_schema together with the grammar it builds
            # for `tools`, so here the tools are left out and the schema alone shapes the output.
            _constrain(body, messages, tools, forced)
        elif tools and not isinstance(choice, ToolChoiceNone):
            body["tools"] = [_tool(tool) for tool in tools if tool.input_schema is not None]
            if not body["tools"]:
                del body["tools"]
            elif isinstance(choice, ToolChoiceAuto):
                body["tool_choice"] = "auto"
                if choice.disable_parallel_tool_use is not None:
                    body["parallel_tool_calls"] = not choice.disable_parallel_tool_use

        stem_body = None if stem is None else {**body, "messages": stem}
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
            stem_body=stem_body,
            sections=_sections(system, tools, turns),
        )

    def translate(self, body: Mapping[str, Any]) -> EngineRequest:
        """``parse`` then ``to_engine``."""
        return self.to_engine(self.parse(body))

    def text_only(self) -> MessagesTranslator:
        """This translator for an engine that cannot see images: an image in a user's turn is a
        400 naming it; one inside a tool_result becomes :data:`~agentkv.limits.IMAGE_NOTE`."""
        return attrs.evolve(self, limits=attrs.evolve(self.limits, images=False))

    def force_any_tool(self, request: EngineRequest, body: Mapping[str, Any]) -> dict[str, Any]:
        """``body`` (an auto-mode engine body for ``request``) constrained to call one tool: the
        one retry after a reply that tried to call a tool but wrote it wrongly.

        The tools stay in the body with ``tool_choice: "none"``: the chat template renders them
        into the system prompt either way, so the retry's prompt is the request's own up to the
        note (without them it diverges at the system prompt: 48 s at Claude Code's depth on 2
        cores). llama-server refuses a grammar next to tools only while a tool may be chosen.
        """
        tools = [tool for tool in request.request.tools or () if tool.input_schema is not None]
        forced = {key: value for key, value in body.items() if key != "parallel_tool_calls"}
        forced["tool_choice"] = "none"
        messages = [dict(message) for message in body["messages"]]
        _constrain(forced, messages, tools, None)
        forced["messages"] = messages
        return forced


def has_images(body: Mapping[str, Any]) -> bool:
    """Whether a raw Messages body holds an image block anywhere a block can be (a cheap scan
    before parsing, to learn whether the engine's vision matters)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False

    def blocks(holder: Any) -> list[Any]:
        content = holder.get("content") if isinstance(holder, Mapping) else None
        return content if isinstance(content, list) else []

    return any(
        isinstance(b, Mapping) and b.get("type") == "image"
        for message in messages
        for block in blocks(message)
        for b in (block, *blocks(block))
    )


def _images_as_notes(request: MessagesRequest) -> MessagesRequest:
    """``request`` with every image inside a tool_result replaced by a short note (the limits
    have refused images anywhere else)."""

    def content(blocks: list[ToolResultContent]) -> list[ToolResultContent]:
        return [TextBlock(text=IMAGE_NOTE) if isinstance(b, ImageBlock) else b for b in blocks]

    def block(b: ContentBlock) -> ContentBlock:
        if isinstance(b, ToolResultBlock) and isinstance(b.content, list):
            return attrs.evolve(b, content=content(b.content))
        return b

    messages = [
        m if isinstance(m.content, str) else attrs.evolve(m, content=[block(b) for b in m.content])
        for m in request.messages
    ]
    return attrs.evolve(request, messages=messages)


def _system_texts(system: str | list[TextBlock] | None) -> list[tuple[str, str]]:
    """The system text as (label, text) parts, without Claude Code's billing line."""
    if system is None:
        return []
    if isinstance(system, str):
        return [("system", system)]
    return [
        (f"system block {k}", block.text)
        for k, block in enumerate(system)
        if not block.text.startswith(BILLING_HEADER_PREFIX)
    ]


def _blocks(content: str | Sequence[ContentBlock]) -> Sequence[ContentBlock]:
    return [TextBlock(text=content)] if isinstance(content, str) else content


@attrs.frozen
class _Turn:
    """A message as it reaches the prompt, with the session context laid out before it."""

    message: Message
    #: The message's own blocks, as (label, block); in session layout a human turn's reminders
    #: are in ``context`` instead.
    blocks: tuple[tuple[str, ContentBlock], ...]
    #: Session layout, human turns: the context that goes before the words, as (label, text):
    #: the system notes sent after the turn, its reminders, its session facts.
    context: tuple[tuple[str, str], ...] = ()


def _digest(value: Any) -> str:
    data = attrs.asdict(value) if attrs.has(type(value)) else value
    return hashlib.sha256(canonical_json(data).encode()).hexdigest()[:16]


#: Digests of the tools seen lately, by :func:`~agentkv.limits.tool_key`: every request of every
#: agent of one client sends the same tools (Claude Code's come to about 30 KB), so each is
#: digested once, not once per request.
_TOOL_DIGESTS: LRUCache[str, str] = LRUCache(maxsize=256)


@cached(_TOOL_DIGESTS, key=tool_key)
def _tool_digest(tool: Tool) -> str:
    return _digest(tool)


def _block_label(index: int, number: int, block: ContentBlock) -> str:
    label = f"message {index} block {number}"
    if isinstance(block, ToolUseBlock):
        return f"{label} (tool_use {block.name})"
    if isinstance(block, ToolResultBlock):
        return f"{label} (tool_result)"
    if _is_reminder(block):
        return f"{label} (reminder)"
    return label


def _lay_out(request: MessagesRequest, layout: bool) -> tuple[list[tuple[str, str]], list[_Turn]]:
    """The system text and the turns, in the order they reach the prompt.

    Session layout puts a human turn's context before its words, what more agents share first:
    the notes without their facts, the other reminders, the session's facts, the git status
    reminder, the project's facts (see :mod:`agentkv.layout`).
    """
    system = _system_texts(request.system)
    messages = request.messages
    memory_dir = None
    if layout and messages and _is_human_turn(messages[0]):
        # The memory directory leaves the system prompt only when the first turn can take it.
        split = split_memory_dir([text for _, text in system])
        if split is not None:
            texts, memory_dir = split
            system = [(label, text) for (label, _), text in zip(system, texts, strict=True)]
    turns: list[_Turn] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        numbered = [
            (_block_label(i, k, block), block) for k, block in enumerate(_blocks(message.content))
        ]
        if not (layout and _is_human_turn(message)):
            turns.append(_Turn(message, tuple(numbered)))
            i += 1
            continue
        facts = SessionFacts(memory_dir=memory_dir if i == 0 else None)
        notes: list[tuple[str, str]] = []
        j = i + 1
        while j < len(messages) and messages[j].role == "system":
            text = _TEXT_JOIN.join(_texts(_blocks(messages[j].content)))
            split_facts = split_note(text)
            if split_facts is not None:
                text, found = split_facts
                facts = facts.merge(found)
            text = _wrap_note(text)
            if text:
                notes.append((f"message {j} (system)", text))
            j += 1
        reminders = [(label, _text_of(b)) for label, b in numbered if _is_reminder(b)]
        shared = [(label, t) for label, t in reminders if not is_project_reminder(t)]
        own = [
            (label, project_reminder_layout(t) or t)
            for label, t in reminders
            if is_project_reminder(t)
        ]
        session, project = facts_blocks(facts)
        context = [*notes, *shared]
        if session is not None:
            context.append((f"message {i} (session facts)", session))
        context.extend(own)
        if project is not None:
            context.append((f"message {i} (project facts)", project))
        words = tuple((label, b) for label, b in numbered if not _is_reminder(b))
        turns.append(_Turn(message, words, tuple(context)))
        i = j
    return system, turns


def _sections(
    system: list[tuple[str, str]], tools: Sequence[Tool], turns: list[_Turn]
) -> tuple[tuple[str, str], ...]:
    """The prompt's parts in prompt order, as (label, digest) pairs: system text, tools, then
    each turn (in session layout a human turn's context before its words). Two prompts that
    part ways do so in the first section whose digest differs."""
    sections = [(label, _digest(text)) for label, text in system]
    sections.extend((f"tool {i} ({tool.name})", _tool_digest(tool)) for i, tool in enumerate(tools))
    for turn in turns:
        sections.extend((label, _digest(text)) for label, text in turn.context)
        sections.extend((label, _digest(block)) for label, block in turn.blocks)
    return tuple(sections)


def first_difference(
    mine: tuple[tuple[str, str], ...], theirs: tuple[tuple[str, str], ...]
) -> str | None:
    """The label of the first section where two prompts differ; None if one contains the other."""
    pairs = zip(mine, theirs, strict=False)
    return next((label for (label, digest), (_, other) in pairs if digest != other), None)


def _is_reminder(block: ContentBlock) -> bool:
    return isinstance(block, TextBlock) and block.text.lstrip().startswith(REMINDER_PREFIX)


def _text_of(block: ContentBlock) -> str:
    return block.text if isinstance(block, TextBlock) else ""


def _wrap_note(text: str) -> str:
    """A mid-conversation system note's text, wrapped the way Claude Code marks such notes."""
    if text and not text.lstrip().startswith(REMINDER_PREFIX):
        text = f"{REMINDER_PREFIX}\n{text}\n</system-reminder>"
    return text


def _is_human_turn(message: Message) -> bool:
    return message.role == "user" and not any(
        isinstance(b, ToolResultBlock) for b in _blocks(message.content)
    )


def _stem(head: list[dict[str, Any]], turns: list[_Turn]) -> list[dict[str, Any]] | None:
    """The engine messages of ``turns`` without the last human turn's own words, if it has any."""
    if not turns or not _is_human_turn(turns[-1].message):
        return None
    last = turns[-1]
    # Laid out, the turn's reminders are in its context; else they are among its blocks.
    context = [text for _, text in last.context]
    context += [_text_of(b) for _, b in last.blocks if _is_reminder(b)]
    words = [
        b
        for _, b in last.blocks
        if not _is_reminder(b) and not (isinstance(b, TextBlock) and not b.text)
    ]
    if not words:
        return None  # nothing but session context: no words to leave out
    stem = list(head)
    for earlier in turns[:-1]:
        stem.extend(_translate_turn(earlier))
    if context:
        stem.extend(_user([TextBlock(text=text) for text in context]))
    return stem


def _translate_turn(turn: _Turn) -> list[dict[str, Any]]:
    message = turn.message
    blocks = [block for _, block in turn.blocks]
    if message.role == "assistant":
        return [_assistant(blocks)]
    if message.role == "system":
        # A system note that follows no human turn becomes a user turn of its own. Many chat
        # templates accept a system message only at the start and raise otherwise, and merging it
        # into the head system prompt would rewrite text that is already cached.
        text = _wrap_note(_TEXT_JOIN.join(_texts(_blocks(message.content))))
        return [{"role": "user", "content": text}] if text else []
    return _user([*(TextBlock(text=text) for _, text in turn.context), *blocks])


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
        # Thinking and tool_use blocks are left out: only assistants think or call tools, and a
        # client replaying them in a user turn has nothing the model should read as user text.
    if parts:
        # Plain text stays a string: every chat template renders that, while typed parts are only
        # needed (and only accepted by multimodal builds) when an image is present.
        text_only = all(p["type"] == "text" for p in parts)
        content = _TEXT_JOIN.join(p["text"] for p in parts) if text_only else parts
        out.append({"role": "user", "content": content})
    elif not out:
        # An all-empty user turn still keeps its place, so roles keep alternating.
        out.append({"role": "user", "content": ""})
    return out


def _tool_result(block: ToolResultBlock) -> tuple[str, list[dict[str, Any]]]:
    content = block.content
    images: list[dict[str, Any]] = []
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        text = _TEXT_JOIN.join(_texts(content))
        images = [_image(b) for b in content if isinstance(b, ImageBlock)]
    if block.is_error:
        # The model must see that the tool failed, not mistake the message for output.
        text = f"Error: {text}" if text else "Error"
    return text, images


def _image(block: ImageBlock) -> dict[str, Any]:
    s = block.source
    url = f"data:{s.media_type};base64,{s.data}" if isinstance(s, Base64ImageSource) else s.url
    return {"type": "image_url", "image_url": {"url": url}}


def _tool(tool: Tool) -> dict[str, Any]:
    described = {"description": tool.description} if tool.description else {}
    function = {"name": tool.name, **described, "parameters": tool.input_schema or _ANY_SCHEMA}
    return {"type": "function", "function": function}


def _constrain(
    body: dict[str, Any], messages: list[dict[str, Any]], tools: Sequence[Tool], forced: Tool | None
) -> None:
    """Constrain ``body`` to one call: ``forced``'s input, else ``{"name", "arguments"}`` of one
    of ``tools``; a note at the end of ``messages`` says what the JSON means."""
    if forced is not None:
        schema = forced.input_schema or _ANY_SCHEMA
        head = f"Call the tool `{forced.name}` now. Reply with only its input as a JSON object."
        tools = [forced]
    else:
        schema = {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": tool.name},
                        "arguments": tool.input_schema or _ANY_SCHEMA,
                    },
                    "required": ["name", "arguments"],
                }
                for tool in tools
            ]
        }
        head = (
            "Call one of these tools now. Reply with only a JSON object "
            '{"name": <tool name>, "arguments": <its input>}.'
        )
    body["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
    # With `tools` left out of the body the model no longer sees what the tool is for; this note,
    # placed at the end where it costs no cached prefix, tells it what the JSON it writes means.
    listing = []
    for tool in tools:
        desc = (tool.description or "").strip().splitlines()
        listing.append(f"- {tool.name}: {desc[0]}" if desc else f"- {tool.name}")
    _append_user_note(messages, _wrap_note(head + "\n" + "\n".join(listing)))


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
