"""SSEAssembler: llama-server chat chunks in, the reply's typed events out.

A sans-IO protocol machine: parsed chunks and the current time go in, :mod:`agentkv.reply` events
come out, for each API's encoder. It also tells the runtime when to close the engine stream
(:attr:`SSEAssembler.stop`, on a degenerate loop) and, once the reply has ended, whether to ask
once more constrained to a valid call (:meth:`SSEAssembler.verdict`). The runtime's loop::

    events = asm.start()
    for chunk in engine_stream(body):          # close the stream as soon as asm.stop is set
        events += asm.feed(chunk, now())
        if asm.stop is not None:
            break
    if isinstance(asm.verdict(), RetryWithTools):
        asm.begin_retry()
        for chunk in engine_stream(translator.force_any_tool(request, body)):
            events += asm.feed(chunk, now())
            if asm.stop is not None:
                break
    events += asm.finish(now())

and ``asm.flush(now())`` on a timer between chunks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from agentkv._types import ANY_TOOL, ForcedTool
from agentkv.callscan import HoldGate
from agentkv.exceptions import EngineResponseError, SSEProtocolError
from agentkv.guard import Repetition, RepetitionGuard, cut_tail
from agentkv.repair import RejectedCandidate, extract_tool_calls, repair_arguments
from agentkv.reply import BlockClosed, BlockOpened, Delta, Ended, ReplyEvent, Started, Usage
from agentkv.schema import json_object

__all__ = [
    "DEFAULT_COALESCE_CHARS",
    "DEFAULT_COALESCE_SECONDS",
    "ReplyComplete",
    "RetryWithTools",
    "SSEAssembler",
    "StopRequest",
    "Verdict",
]


#: Text deltas are flushed after this many characters, or this many seconds (the runtime's
#: settings take their defaults from here).
DEFAULT_COALESCE_CHARS = 16
DEFAULT_COALESCE_SECONDS = 0.05


@attrs.frozen
class StopRequest:
    """The assembler asks the runtime to close the engine stream now, then call ``finish``.

    ``reason`` is why (today only ``"repetition"``); ``where`` is which output looped: the text,
    the thinking, or a structured tool call's arguments.
    """

    reason: Literal["repetition"]
    where: Literal["text", "thinking", "tool"]
    repetition: Repetition

    @property
    def message(self) -> str:
        """One line for logs."""
        return f"degenerate repetition in the {self.where}: {self.repetition.describe()}"


@attrs.frozen
class ReplyComplete:
    """:meth:`SSEAssembler.verdict`: the reply is final; call ``finish``."""


@attrs.frozen
class RetryWithTools:
    """:meth:`SSEAssembler.verdict`: the held reply tried to call a tool, and no valid call can be
    recovered from it. Call ``begin_retry``, send the same conversation constrained to a call of a
    declared tool (``MessagesTranslator.force_any_tool``), feed that stream, then ``finish``.
    ``rejected`` says what was wrong with each candidate (for logs)."""

    rejected: tuple[RejectedCandidate, ...]


#: What the runtime does once the engine's reply has ended.
Verdict = ReplyComplete | RetryWithTools


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
    """Turns one engine stream into one reply's events.

    Promises: the events it returns, in order, form a valid reply (:mod:`agentkv.reply`: ``index``
    counts up from 0, every opened block is closed, no empty text block, every tool call's input is
    a JSON object); ``start`` comes first and ``finish`` last; a second ``finish`` or a ``feed``
    outside that window raises :class:`SSEProtocolError`.

    With ``tool_schemas``, a :class:`~agentkv.callscan.HoldGate` holds text back from where a
    call written as text may start; what it holds at the end becomes tool_use blocks where it
    holds valid calls, and text otherwise.
    """

    message_id: str = attrs.field(kw_only=True)
    model: str = attrs.field(kw_only=True)
    #: The tool the reply is constrained to call (its text is the input JSON), or
    #: :data:`~agentkv.ANY_TOOL` (its text is ``{"name", "arguments"}``); None for a free reply.
    forced_tool: ForcedTool | None = attrs.field(default=None, kw_only=True)
    tool_names: tuple[str, ...] = attrs.field(default=(), kw_only=True)
    coalesce_chars: int = attrs.field(default=DEFAULT_COALESCE_CHARS, kw_only=True)
    coalesce_seconds: float = attrs.field(default=DEFAULT_COALESCE_SECONDS, kw_only=True)
    input_tokens_hint: int = attrs.field(default=0, kw_only=True)
    #: Declared tools (name -> input_schema) in ``auto`` mode, when tool-call repair is on.
    tool_schemas: Mapping[str, Any] | None = attrs.field(default=None, kw_only=True)
    #: The most characters, and seconds, held for a call that has not named a declared tool or
    #: cannot be valid (the longest wrongly written call in the corpus has 667 characters; at
    #: 1 token/s a call names its tool within 15 s). A valid call is held to its end.
    hold_chars: int = attrs.field(default=1024, kw_only=True)
    hold_seconds: float = attrs.field(default=15.0, kw_only=True)
    #: The thresholds for degenerate repetition in text, thinking and tool arguments (copied for
    #: each); None turns detection off.
    repetition_guard: RepetitionGuard | None = attrs.field(factory=RepetitionGuard, kw_only=True)

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
    _delta_chunks: int = attrs.field(default=0, init=False)
    _fallback: str | None = attrs.field(default=None, init=False)
    _earlier_usage: tuple[int, int, int] = attrs.field(default=(0, 0, 0), init=False)
    # The reply's text as the engine generated it, and whether anything but text came.
    _generated: list[str] = attrs.field(factory=list, init=False)
    _only_text: bool = attrs.field(default=True, init=False)
    _retried: bool = attrs.field(default=False, init=False)
    _stop: StopRequest | None = attrs.field(default=None, init=False)
    _guards: dict[str, RepetitionGuard] = attrs.field(factory=dict, init=False)
    # What holds back text that may be a call (auto mode with tools), made on first use.
    _gate: HoldGate | None = attrs.field(default=None, init=False)

    def start(self) -> list[ReplyEvent]:
        """``[Started]``; send it as early as possible (it keeps clients from timing out)."""
        if self._state != "new":
            raise SSEProtocolError("start() called twice")
        self._state = "streaming"
        return [Started(self.message_id, self.model, self.input_tokens_hint)]

    def feed(self, chunk: Mapping[str, Any], now: float) -> list[ReplyEvent]:
        """The events one engine chunk gives (often none: deltas are coalesced).

        Once :attr:`stop` is set, the content of further chunks (still in flight when the runtime
        closes the stream) is ignored; their usage counts are still read.
        """
        if self._state != "streaming":
            when = "before start" if self._state == "new" else "after finish"
            raise SSEProtocolError(f"engine chunk received {when}")
        error = chunk.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, Mapping) else str(error)
            raise EngineResponseError(f"engine stream error: {message}")
        out: list[ReplyEvent] = []
        self._read_usage(chunk)
        choices = chunk.get("choices") or ()
        if not choices or self._stop is not None:
            return out
        choice = choices[0]
        delta = choice.get("delta") or choice.get("message") or {}
        reasoning = delta.get("reasoning_content")
        content = delta.get("content")
        calls = delta.get("tool_calls") or ()
        if reasoning or content or calls:
            self._delta_chunks += 1
        if reasoning or calls:
            self._only_text = False
        if content:
            self._generated.append(content)
        if reasoning:
            self._append("thinking", reasoning, now, out)
            self._watch("thinking", reasoning)
        if content and self._stop is None:
            if self.forced_tool is not None:
                self._forced_text += content
            elif self.tool_schemas:
                self._gated(content, now, out)
            else:
                self._append("text", content, now, out)
            self._watch("text", content)
        for call in calls:
            if self._stop is None:
                self._tool_delta(call, out)
                self._watch("tool", str((call.get("function") or {}).get("arguments") or ""))
        if choice.get("finish_reason") and self._stop is None:
            self._finish_reason = choice["finish_reason"]
        return out

    def flush(self, now: float) -> list[ReplyEvent]:
        """Buffered deltas whose time bound has passed, and held text whose hold has run out
        (call it on a timer between chunks)."""
        out: list[ReplyEvent] = []
        if self._state != "streaming":
            return out
        if self._gate is not None and self._stop is None:
            for piece in self._gate.flush(now):
                self._append("text", piece, now, out)
        current = self._current
        if (
            isinstance(current, _Streamed)
            and current.opened
            and current.pending
            and now - current.pending_since >= self.coalesce_seconds
        ):
            self._emit_pending(current, out)
        return out

    @property
    def stop(self) -> StopRequest | None:
        """Set once the engine stream should be closed (see :class:`StopRequest`)."""
        return self._stop

    def verdict(self) -> Verdict:
        """What to do now that the engine's reply has ended (or was closed on :attr:`stop`).

        :class:`RetryWithTools` when the held text tried to call a tool and every candidate was
        rejected, the reply was neither cut off nor stopped, and there was no retry yet; else
        :class:`ReplyComplete`. It changes nothing: ask as often as you like.
        """
        if self._state != "streaming":
            raise SSEProtocolError("verdict() is only defined between start() and finish()")
        if (
            self._gate is None
            or not self._gate.holding
            or not self.tool_schemas
            or self.forced_tool is not None
            or self._retried
            or self._cut()
        ):
            return ReplyComplete()
        found = extract_tool_calls(self._gate.held, self.tool_schemas)
        if found.calls or not found.rejected:
            return ReplyComplete()
        return RetryWithTools(found.rejected)

    def begin_retry(self) -> None:
        """Start over on the constrained second reply, after a :class:`RetryWithTools` verdict:
        its chunks are fed as usual, and if they give no valid call either, ``finish`` gives the
        first reply's held text as text. Usage adds up both replies."""
        if self._state != "streaming" or not isinstance(self.verdict(), RetryWithTools):
            raise SSEProtocolError("begin_retry() needs a RetryWithTools verdict")
        self._next_engine_call(self.usage.output_tokens)
        self._fallback = self._gate.drop_held() if self._gate is not None else ""
        self._guards.pop("text", None)
        self.forced_tool = ANY_TOOL
        self._retried = True

    @property
    def continuable(self) -> bool:
        """Whether the reply so far can be continued by another engine call (see
        :meth:`begin_continuation`): plain text only, not forced, not stopped, not a retry."""
        return (
            self._state == "streaming"
            and self._only_text
            and self.forced_tool is None
            and self._stop is None
            and not self._retried
        )

    @property
    def generated_text(self) -> str:
        """The reply's text exactly as the engine generated it so far (held parts included)."""
        return "".join(self._generated)

    def begin_continuation(self) -> None:
        """A new engine call continues the reply from :attr:`generated_text` (the stream was cut:
        the request gave its slot up); its chunks are fed as if the stream had only paused. Usage
        adds up the calls, the cut one's output counted one token per chunk."""
        if not self.continuable:
            raise SSEProtocolError("begin_continuation() needs a plain-text reply in progress")
        self._next_engine_call(self.usage.output_tokens or self._delta_chunks)

    def _next_engine_call(self, output_tokens: int) -> None:
        """Keep the usage so far (with ``output_tokens``) and read the next call's afresh."""
        usage = self.usage
        self._earlier_usage = (usage.input_tokens, usage.cache_read_tokens, output_tokens)
        self._input_tokens, self._cache_read, self._output_tokens = None, 0, 0
        self._delta_chunks = 0
        self._finish_reason = None

    def finish(self, now: float) -> list[ReplyEvent]:
        """Close the open block, then ``Ended``.

        Held text becomes tool_use blocks where it holds valid calls, and text otherwise. A reply
        cut off by the token limit, or stopped, is not repaired: a "fixed" half Write would write
        half a file. After a stop, ``stop_reason`` is ``end_turn`` (``tool_use`` if a call was
        recovered), never ``max_tokens``: Claude Code answers that by asking the model to resume,
        which would only loop again.
        """
        if self._state != "streaming":
            raise SSEProtocolError(
                f"finish() called {'before start' if self._state == 'new' else 'twice'}"
            )
        out: list[ReplyEvent] = []
        if self._gate is not None:
            self._append("text", self._gate.take_pending(), now, out)
        self._close(out)
        if self.forced_tool is not None:
            self._emit_forced(out)
        elif self._gate is not None and self._gate.holding:
            self._emit_held(self._gate.held, out)
        self._state = "done"
        out.append(Ended(self._stop_reason(), self._stop_sequence, self.usage))
        return out

    @property
    def usage(self) -> Usage:
        """Token counts so far. A stream closed on :attr:`stop` ends without the engine's counts;
        its output is then counted one token per chunk, as llama-server streams."""
        uncached, cached, output = self._earlier_usage
        if self._input_tokens is not None:
            uncached += self._input_tokens
        elif not uncached:
            uncached = self.input_tokens_hint
        generated = self._output_tokens
        if not generated and self._stop is not None:
            generated = self._delta_chunks
        return Usage(uncached, cached + self._cache_read, output + generated)

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
        if "stopping_word" not in chunk and "__verbose" not in chunk:
            return  # a token's chunk, nearly every one
        for source in (chunk, chunk.get("__verbose") or {}):
            word = source.get("stopping_word")
            if isinstance(word, str) and word and source.get("stop_type", "word") == "word":
                self._stop_sequence = word

    def _append(
        self, kind: Literal["text", "thinking"], text: str, now: float, out: list[ReplyEvent]
    ) -> None:
        if not text:
            return
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
            out.append(BlockOpened(self._index, kind))
            current.opened = True
        if (
            len(current.pending) >= self.coalesce_chars
            or now - current.pending_since >= self.coalesce_seconds
        ):
            self._emit_pending(current, out)

    def _tool_delta(self, call: Mapping[str, Any], out: list[ReplyEvent]) -> None:
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

    # -- degenerate repetition -----------------------------------------------------------------

    def _watch(self, where: Literal["text", "thinking", "tool"], text: str) -> None:
        if self.repetition_guard is None or self._stop is not None or not text:
            return
        guard = self._guards.get(where)
        if guard is None:
            guard = self._guards[where] = attrs.evolve(self.repetition_guard)
        found = guard.feed(text)
        if found is not None:
            self._stop = StopRequest("repetition", where, found)
            self._trim(where, found)

    def _trim(self, where: str, found: Repetition) -> None:
        """Drop the repeated copies (all but the first) from what has not been sent yet."""
        period = found.period
        drop = found.length - period
        current = self._current
        if where == "text" and self.forced_tool is not None:
            self._forced_text, drop = cut_tail(self._forced_text, drop)
        elif where == "text" and self._gate is not None:
            drop = self._gate.trim(found)
        elif where == "tool" and isinstance(current, _ToolDraft):
            current.arguments, drop = cut_tail(current.arguments, drop)
            return
        if isinstance(current, _Streamed) and current.kind == where and drop > 0:
            current.pending, drop = cut_tail(current.pending, drop)

    # -- holding back what may be a call -------------------------------------------------------

    def _gated(self, text: str, now: float, out: list[ReplyEvent]) -> None:
        """Auto mode with tools: stream what cannot be a call, hold the rest (see HoldGate)."""
        if self._gate is None:
            self._gate = HoldGate(self.tool_schemas or {}, self.hold_chars, self.hold_seconds)
        for piece in self._gate.feed(text, now):
            self._append("text", piece, now, out)

    def _emit_held(self, held: str, out: list[ReplyEvent]) -> None:
        assert self.tool_schemas is not None
        found = extract_tool_calls(held, self.tool_schemas, repair=not self._cut())
        self._emit_text(found.text if found.calls else held, out)
        for call in found.calls:
            self._emit_tool("", call.name, json.dumps(call.input, ensure_ascii=False), out)

    def _cut(self) -> bool:
        """Whether the reply did not end by itself (token limit, or closed on a stop)."""
        return self._finish_reason == "length" or self._stop is not None

    # -- blocks --------------------------------------------------------------------------------

    def _stop_block(self, out: list[ReplyEvent]) -> None:
        out.append(BlockClosed(self._index))
        self._index += 1

    def _emit_pending(self, current: _Streamed, out: list[ReplyEvent]) -> None:
        text, current.pending = current.pending, ""
        current.text += text
        out.append(Delta(self._index, current.kind, text))

    def _close(self, out: list[ReplyEvent]) -> None:
        """Close whatever block is current (block switches and finish flush first)."""
        current, self._current = self._current, None
        if isinstance(current, _Streamed) and current.opened:
            if current.pending:
                self._emit_pending(current, out)
            if current.kind == "thinking":
                # Clients echo the signature back with the thinking; it only has to be opaque
                # and stable, so a digest of the text serves.
                signature = hashlib.sha256(current.text.encode()).hexdigest()
                out.append(Delta(self._index, "signature", signature))
            self._stop_block(out)
        elif isinstance(current, _ToolDraft):
            self._closed_tools.add(current.key)
            self._emit_tool(current.id, current.name, current.arguments, out)

    def _emit_tool(self, engine_id: str, name: str, arguments: str, out: list[ReplyEvent]) -> None:
        tool_input = json_object(arguments) if name else None
        cut = self._cut()  # cut-off arguments are not repaired
        if tool_input is None and not cut and self.tool_schemas and name in self.tool_schemas:
            tool_input = repair_arguments(name, arguments, self.tool_schemas[name])
        if tool_input is None:
            # Never a tool_use whose input the client cannot parse: show the model's text instead.
            self._emit_text(arguments, out)
            return
        tool_id = engine_id if engine_id.startswith("toolu_") else self._tool_id()
        out.append(BlockOpened(self._index, "tool_use", tool_id, name))
        out.append(Delta(self._index, "input", json.dumps(tool_input, ensure_ascii=False)))
        self._stop_block(out)
        self._emitted_tool = True

    def _emit_text(self, text: str, out: list[ReplyEvent]) -> None:
        if text.strip():
            out.append(BlockOpened(self._index, "text"))
            out.append(Delta(self._index, "text", text))
            self._stop_block(out)

    def _emit_forced(self, out: list[ReplyEvent]) -> None:
        text = self._forced_text
        if self.forced_tool is not ANY_TOOL:
            self._emit_tool("", self.forced_tool or "", text, out)
            return
        # Any-tool mode: the schema made the model write {"name": ..., "arguments": {...}}.
        call = json_object(text) or {}
        name, arguments = call.get("name"), call.get("arguments")
        known = isinstance(name, str) and (not self.tool_names or name in self.tool_names)
        if not known or not isinstance(arguments, dict):
            self._emit_text(text if self._fallback is None else self._fallback, out)
            return
        self._emit_tool("", str(name), json.dumps(arguments, ensure_ascii=False), out)

    def _tool_id(self) -> str:
        # Derived from the message id and block index: unique per stream, and reproducible.
        digest = hashlib.sha256(f"{self.message_id}:{self._index}".encode()).hexdigest()
        return f"toolu_{digest[:24]}"

    def _stop_reason(self) -> str:
        if self._stop is not None:
            return "tool_use" if self._emitted_tool else "end_turn"
        if self._finish_reason == "length":
            return "max_tokens"
        if self._emitted_tool:
            return "tool_use"
        if self._stop_sequence is not None:
            return "stop_sequence"
        return "end_turn"
