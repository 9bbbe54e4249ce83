"""SSEAssembler: llama-server chat chunks in, Anthropic Messages stream events out.

Pure, in the style of a sans-IO protocol machine: chunks (already parsed JSON) and the current time
go in, event dicts come out, and :func:`encode_event` frames them. :func:`accumulate` folds the
same events into the non-streaming Message, so both response modes share one code path.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs

from agentkv._types import ANY_TOOL, ForcedTool
from agentkv.exceptions import AgentKVError, EngineResponseError, SSEProtocolError
from agentkv.repair import extract_tool_calls, looks_like_call, repair_arguments

__all__ = ["SSEAssembler", "accumulate", "encode_event"]

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def encode_event(event: Mapping[str, Any]) -> bytes:
    """One SSE frame: ``event: <type>\\ndata: <json>\\n\\n``."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


@attrs.define
class _Streamed:
    """A text or thinking block: deltas are buffered and coalesced before they go out."""

    kind: Literal["text", "thinking"]
    opened: bool = False
    pending: str = ""
    pending_since: float = 0.0
    text: str = ""  # everything emitted so far (thinking: what the signature covers)


@attrs.define
class _ToolDraft:
    """A tool call being received; it is emitted whole once complete, so its JSON is known valid."""

    key: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@attrs.define
class SSEAssembler:
    """Turns one engine stream into one Anthropic message stream.

    Promises: the events it returns, in order, form a valid Messages stream (``index`` counts up
    from 0, every started block is stopped, no empty text block, every ``tool_use`` input is a JSON
    object); ``start`` comes first and ``finish`` last; a second ``finish`` or a ``feed`` outside
    that window raises :class:`SSEProtocolError`.
    """

    message_id: str = attrs.field(kw_only=True)
    model: str = attrs.field(kw_only=True)
    #: The tool the reply is constrained to call (its text is the input JSON), or
    #: :data:`~agentkv.ANY_TOOL` (its text is ``{"name", "arguments"}``); None for a free reply.
    forced_tool: ForcedTool | None = attrs.field(default=None, kw_only=True)
    tool_names: tuple[str, ...] = attrs.field(default=(), kw_only=True)
    coalesce_chars: int = attrs.field(default=16, kw_only=True)
    coalesce_seconds: float = attrs.field(default=0.05, kw_only=True)
    input_tokens_hint: int = attrs.field(default=0, kw_only=True)
    #: Declared tools (name -> input_schema) in ``auto`` mode, when tool-call repair is on: a
    #: reply that starts like a call written as text is held back and turned into tool_use blocks.
    tool_schemas: Mapping[str, Any] | None = attrs.field(default=None, kw_only=True)

    _state: Literal["new", "streaming", "done"] = attrs.field(default="new", init=False)
    _index: int = attrs.field(default=0, init=False)
    _current: _Streamed | _ToolDraft | None = attrs.field(default=None, init=False)
    _closed_tools: set[int] = attrs.field(factory=set, init=False)
    _forced_text: str = attrs.field(default="", init=False)
    _emitted_tool: bool = attrs.field(default=False, init=False)
    _finish_reason: str | None = attrs.field(default=None, init=False)
    _stop_sequence: str | None = attrs.field(default=None, init=False)
    _input_tokens: int | None = attrs.field(default=None, init=False)
    _cache_read: int = attrs.field(default=0, init=False)
    _output_tokens: int = attrs.field(default=0, init=False)
    _hold: Literal["undecided", "hold", "stream"] = attrs.field(default="undecided", init=False)
    _held: str = attrs.field(default="", init=False)
    _fallback: str | None = attrs.field(default=None, init=False)
    _usage_before_retry: tuple[int, int, int] = attrs.field(default=(0, 0, 0), init=False)

    def start(self) -> list[dict[str, Any]]:
        """``[message_start]``; send it as early as possible (it keeps clients from timing out)."""
        if self._state != "new":
            raise SSEProtocolError("start() called twice")
        self._state = "streaming"
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.input_tokens_hint,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": 0,
            },
        }
        return [{"type": "message_start", "message": message}]

    def feed(self, chunk: Mapping[str, Any], now: float) -> list[dict[str, Any]]:
        """The events one engine chunk gives (often none: deltas are coalesced)."""
        if self._state != "streaming":
            when = "before start" if self._state == "new" else "after finish"
            raise SSEProtocolError(f"engine chunk received {when}")
        error = chunk.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, Mapping) else str(error)
            raise EngineResponseError(f"engine stream error: {message}")
        out: list[dict[str, Any]] = []
        self._read_usage(chunk)
        choices = chunk.get("choices") or ()
        if choices:
            choice = choices[0]
            delta = choice.get("delta") or choice.get("message") or {}
            reasoning = delta.get("reasoning_content")
            if reasoning:
                self._append("thinking", reasoning, now, out)
            content = delta.get("content")
            if content:
                if self.forced_tool is not None:
                    self._forced_text += content
                elif self.tool_schemas and self._hold != "stream":
                    self._gate(content, now, out)
                else:
                    self._append("text", content, now, out)
            for call in delta.get("tool_calls") or ():
                self._tool_delta(call, out)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return out

    def flush(self, now: float) -> list[dict[str, Any]]:
        """Buffered deltas whose time bound has passed (call it on a timer between chunks)."""
        out: list[dict[str, Any]] = []
        current = self._current
        if (
            self._state == "streaming"
            and isinstance(current, _Streamed)
            and current.opened
            and current.pending
            and now - current.pending_since >= self.coalesce_seconds
        ):
            self._emit_pending(current, out)
        return out

    def finish(self, now: float) -> list[dict[str, Any]]:
        """Close the open block, then ``message_delta`` and ``message_stop``."""
        if self._state != "streaming":
            raise SSEProtocolError(
                f"finish() called {'before start' if self._state == 'new' else 'twice'}"
            )
        out: list[dict[str, Any]] = []
        self._close(out)
        if self.forced_tool is not None:
            self._emit_forced(out)
        elif self._held:
            self._emit_held(out)
        self._state = "done"
        out.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": self._stop_reason(), "stop_sequence": self._stop_sequence},
                "usage": self.usage,
            }
        )
        out.append({"type": "message_stop"})
        return out

    def begin_retry(self) -> None:
        """The held reply was a tool call that could not be recovered; a second engine reply,
        constrained to ``{"name", "arguments"}`` over the declared tools, follows. If that one
        does not parse either, the first reply is given as plain text."""
        if self._state != "streaming" or self._hold != "hold":
            raise SSEProtocolError("begin_retry() needs a held reply")
        usage = self.usage
        self._usage_before_retry = (
            usage["input_tokens"],
            usage["cache_read_input_tokens"],
            usage["output_tokens"],
        )
        self._input_tokens, self._cache_read, self._output_tokens = None, 0, 0
        self._fallback, self._held = self._held, ""
        self._finish_reason = None
        self.forced_tool = ANY_TOOL

    def ping(self) -> dict[str, Any]:
        """A keep-alive event; valid anywhere in the stream."""
        return {"type": "ping"}

    def error(self, exc: AgentKVError) -> dict[str, Any]:
        """The ``error`` event for a failure after the response has started."""
        return exc.to_anthropic()

    @property
    def usage(self) -> dict[str, int]:
        """Token counts so far: uncached prompt, cache reads and generated tokens."""
        uncached, cached, output = self._usage_before_retry
        if self._input_tokens is not None:
            uncached += self._input_tokens
        elif not uncached:
            uncached = self.input_tokens_hint
        return {
            "input_tokens": uncached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached + self._cache_read,
            "output_tokens": output + self._output_tokens,
        }

    # -- engine chunk parts ------------------------------------------------------------------

    def _read_usage(self, chunk: Mapping[str, Any]) -> None:
        timings = chunk.get("timings")
        usage = chunk.get("usage")
        if isinstance(timings, Mapping) and "prompt_n" in timings:
            self._input_tokens = int(timings["prompt_n"])
            self._cache_read = int(timings.get("cache_n", 0))
            self._output_tokens = int(timings.get("predicted_n", self._output_tokens))
        elif isinstance(usage, Mapping):
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
            self._input_tokens = int(usage.get("prompt_tokens", 0)) - cached
            self._cache_read = cached
            self._output_tokens = int(usage.get("completion_tokens", 0))
        # llama-server's native fields; the OpenAI-shaped stream carries them only in some builds
        # (or under `__verbose`), and they are the only way to tell a stop sequence from an EOS.
        for source in (chunk, chunk.get("__verbose") or {}):
            word = source.get("stopping_word")
            if isinstance(word, str) and word and source.get("stop_type", "word") == "word":
                self._stop_sequence = word

    def _append(
        self, kind: Literal["text", "thinking"], text: str, now: float, out: list[dict[str, Any]]
    ) -> None:
        current = self._current
        if not (isinstance(current, _Streamed) and current.kind == kind):
            self._close(out)
            current = self._current = _Streamed(kind)
        if not current.pending:
            current.pending_since = now
        current.pending += text
        if not current.opened:
            # Leading whitespace is held back: a block that never gets more than whitespace is
            # never opened (the API rejects whitespace-only text blocks when they are sent back).
            if not current.pending.strip():
                return
            self._open(_start_block(kind), out)
            current.opened = True
        if (
            len(current.pending) >= self.coalesce_chars
            or now - current.pending_since >= self.coalesce_seconds
        ):
            self._emit_pending(current, out)

    def _gate(self, content: str, now: float, out: list[dict[str, Any]]) -> None:
        """Auto mode with tools: hold a reply that starts like a call, stream anything else."""
        self._held += content
        if self._hold == "undecided":
            verdict = looks_like_call(self._held)
            if verdict is None:
                return
            if verdict:
                self._hold = "hold"
                return
            self._hold = "stream"
            text, self._held = self._held, ""
            self._append("text", text, now, out)

    def _emit_held(self, out: list[dict[str, Any]]) -> None:
        assert self.tool_schemas is not None
        # A reply cut off by the token limit is not repaired: a "fixed" half Write would write
        # half a file.
        found = extract_tool_calls(
            self._held, self.tool_schemas, repair=self._finish_reason != "length"
        )
        if not found.calls:
            self._emit_text(self._held, out)
            return
        self._emit_text(found.text, out)
        for call in found.calls:
            self._emit_tool("", call.name, json.dumps(call.input, ensure_ascii=False), out)

    def _tool_delta(self, call: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
        key = int(call.get("index", 0))
        current = self._current
        if not (isinstance(current, _ToolDraft) and current.key == key):
            if key in self._closed_tools:
                raise SSEProtocolError(f"tool call {key} continued after it was closed")
            self._close(out)
            current = self._current = _ToolDraft(key)
        current.id = current.id or str(call.get("id") or "")
        function = call.get("function") or {}
        current.name += function.get("name") or ""
        current.arguments += function.get("arguments") or ""

    # -- blocks --------------------------------------------------------------------------------

    def _open(self, block: dict[str, Any], out: list[dict[str, Any]]) -> None:
        out.append({"type": "content_block_start", "index": self._index, "content_block": block})

    def _stop(self, out: list[dict[str, Any]]) -> None:
        out.append({"type": "content_block_stop", "index": self._index})
        self._index += 1

    def _emit_pending(self, current: _Streamed, out: list[dict[str, Any]]) -> None:
        text, current.pending = current.pending, ""
        current.text += text
        if current.kind == "text":
            delta = {"type": "text_delta", "text": text}
        else:
            delta = {"type": "thinking_delta", "thinking": text}
        out.append({"type": "content_block_delta", "index": self._index, "delta": delta})

    def _close(self, out: list[dict[str, Any]]) -> None:
        """Close whatever block is current (block switches and finish flush first)."""
        current, self._current = self._current, None
        if isinstance(current, _Streamed) and current.opened:
            if current.pending:
                self._emit_pending(current, out)
            if current.kind == "thinking":
                # Clients echo the signature back with the thinking; it only has to be opaque
                # and stable, so a digest of the text serves.
                signature = hashlib.sha256(current.text.encode()).hexdigest()
                delta = {"type": "signature_delta", "signature": signature}
                out.append({"type": "content_block_delta", "index": self._index, "delta": delta})
            self._stop(out)
        elif isinstance(current, _ToolDraft):
            self._closed_tools.add(current.key)
            self._emit_tool(current.id, current.name, current.arguments, out)

    def _emit_tool(
        self, engine_id: str, name: str, arguments: str, out: list[dict[str, Any]]
    ) -> None:
        tool_input = _json_object(arguments) if name else None
        # Arguments cut off by the token limit are not repaired: a "fixed" half Write would write
        # half a file.
        cut = self._finish_reason == "length"
        if tool_input is None and not cut and self.tool_schemas and name in self.tool_schemas:
            tool_input = repair_arguments(name, arguments, self.tool_schemas[name])
        if tool_input is None:
            # Never a tool_use whose input the client cannot parse: show the model's text instead.
            self._emit_text(arguments, out)
            return
        tool_id = engine_id if engine_id.startswith("toolu_") else self._tool_id()
        self._open({"type": "tool_use", "id": tool_id, "name": name, "input": {}}, out)
        partial = json.dumps(tool_input, ensure_ascii=False)
        delta = {"type": "input_json_delta", "partial_json": partial}
        out.append({"type": "content_block_delta", "index": self._index, "delta": delta})
        self._stop(out)
        self._emitted_tool = True

    def _emit_text(self, text: str, out: list[dict[str, Any]]) -> None:
        if not text.strip():
            return
        self._open(_start_block("text"), out)
        delta = {"type": "text_delta", "text": text}
        out.append({"type": "content_block_delta", "index": self._index, "delta": delta})
        self._stop(out)

    def _emit_forced(self, out: list[dict[str, Any]]) -> None:
        text = self._forced_text
        if self.forced_tool is not ANY_TOOL:
            self._emit_tool("", self.forced_tool or "", text, out)
            return
        # Any-tool mode: the schema made the model write {"name": ..., "arguments": {...}}.
        call = _json_object(text)
        name = call.get("name") if call is not None else None
        arguments = call.get("arguments") if call is not None else None
        known = isinstance(name, str) and (not self.tool_names or name in self.tool_names)
        if call is None or not known or not isinstance(arguments, dict):
            self._emit_text(text if self._fallback is None else self._fallback, out)
            return
        self._emit_tool("", str(name), json.dumps(arguments, ensure_ascii=False), out)

    def _tool_id(self) -> str:
        # Derived from the message id and block index: unique per stream, and reproducible.
        digest = hashlib.sha256(f"{self.message_id}:{self._index}".encode()).hexdigest()
        return f"toolu_{digest[:24]}"

    def _stop_reason(self) -> str:
        if self._finish_reason == "length":
            return "max_tokens"
        if self._emitted_tool:
            return "tool_use"
        if self._stop_sequence is not None:
            return "stop_sequence"
        return "end_turn"


def _start_block(kind: Literal["text", "thinking"]) -> dict[str, Any]:
    if kind == "text":
        return {"type": "text", "text": ""}
    return {"type": "thinking", "thinking": "", "signature": ""}


def _json_object(text: str) -> dict[str, Any] | None:
    """``text`` parsed as a JSON object (blank means ``{}``), or None when it is not one."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
        json.dumps(value, allow_nan=False)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


_DELTA_FOR = {"text": "text_delta", "thinking": "thinking_delta", "tool_use": "input_json_delta"}


def accumulate(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Fold a complete event stream into the Anthropic Message JSON.

    Raises :class:`SSEProtocolError` on events out of order, a delta that does not fit its block,
    tool input that is not a JSON object, an ``error`` event, or a stream without ``message_stop``.
    """
    message: dict[str, Any] | None = None
    open_index: int | None = None
    json_buf = ""
    seen_delta = stopped = False
    for event in events:
        kind = event.get("type")
        if kind == "ping":
            continue
        if kind == "error":
            raise SSEProtocolError(f"stream ended with an error: {event.get('error')}")
        if stopped:
            raise SSEProtocolError(f"{kind} after message_stop")
        if message is None:
            if kind != "message_start":
                raise SSEProtocolError(f"{kind} before message_start")
            message = json.loads(json.dumps(event["message"]))
            message.setdefault("content", [])
            continue
        content: list[dict[str, Any]] = message["content"]
        if kind == "message_start":
            raise SSEProtocolError("message_start twice")
        if kind == "content_block_start":
            if open_index is not None or seen_delta:
                raise SSEProtocolError("content_block_start while a block is open or after the end")
            if event["index"] != len(content):
                raise SSEProtocolError(
                    f"content_block_start index {event['index']} != {len(content)}"
                )
            content.append(dict(event["content_block"]))
            open_index, json_buf = event["index"], ""
        elif kind == "content_block_delta":
            if open_index is None or event["index"] != open_index:
                raise SSEProtocolError(f"content_block_delta for block {event['index']} not open")
            block, delta = content[open_index], event["delta"]
            if delta["type"] == "signature_delta" and block["type"] == "thinking":
                block["signature"] = delta["signature"]
            elif delta["type"] != _DELTA_FOR.get(block["type"]):
                raise SSEProtocolError(f"{delta['type']} in a {block['type']} block")
            elif delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                json_buf += delta["partial_json"]
        elif kind == "content_block_stop":
            if open_index is None or event["index"] != open_index:
                raise SSEProtocolError(f"content_block_stop for block {event['index']} not open")
            block = content[open_index]
            if block["type"] == "tool_use" and json_buf:
                tool_input = _json_object(json_buf)
                if tool_input is None:
                    raise SSEProtocolError(f"tool_use input is not a JSON object: {json_buf!r}")
                block["input"] = tool_input
            open_index = None
        elif kind == "message_delta":
            if open_index is not None or seen_delta:
                raise SSEProtocolError("message_delta while a block is open, or twice")
            seen_delta = True
            message.update(event.get("delta") or {})
            message["usage"].update(event.get("usage") or {})
        elif kind == "message_stop":
            if not seen_delta:
                raise SSEProtocolError("message_stop before message_delta")
            stopped = True
        else:
            raise SSEProtocolError(f"unknown event type {kind!r}")
    if message is None or not stopped:
        raise SSEProtocolError("stream ended before message_stop")
    return message
