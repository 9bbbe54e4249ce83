"""One request's reply: the engine calls that produce it, relayed into its events.

Between "the slot is ready" and "the reply is whole": the client's deadline, the echo a continued
reply streams back (skipped), the raw ``/completion`` that resumes a suspended reply from its
exact tokens, one call again after the link broke mid-reply, and one constrained retry for a
broken tool call. It writes only into the assembler, the request's record and its event log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from agentkv.costs import CostModel
from agentkv.exceptions import (
    AgentKVError,
    EngineResponseError,
    EngineStreamBrokenError,
    EngineTimeoutError,
)
from agentkv.reply import ReplyEvent
from agentkv.runtime.chunks import progress_timings, prompt_done
from agentkv.runtime.hints import EngineHints
from agentkv.runtime.record import RequestRecord
from agentkv.runtime.seam import Engine
from agentkv.sse import RetryWithTools, SSEAssembler
from agentkv.tokens import Tokens
from agentkv.translate import EngineRequest, MessagesTranslator

__all__ = [
    "DEADLINE_MARGIN",
    "Relay",
    "as_chat_chunk",
    "continuation_prefill",
    "generates",
    "without_echo",
]

log = logging.getLogger("agentkv.runtime")

#: Seconds kept in hand before the client's timeout: the reply must be complete by then.
DEADLINE_MARGIN = 10.0

#: Chat body fields that a raw /completion takes as they are.
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@attrs.define(eq=False)
class Relay:
    """The engine calls of one request's reply, on whatever slot it holds at the time.

    ``started`` is when the request arrived and ``client_timeout`` how long its client waits;
    ``emit`` takes the reply's events (:mod:`agentkv.reply`) as they come.
    """

    client: Engine
    translator: MessagesTranslator
    engine: EngineRequest
    prompt: Tokens = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    assembler: SSEAssembler
    record: RequestRecord
    costs: CostModel
    emit: Callable[[list[ReplyEvent]], None]
    started: float
    client_timeout: float
    #: Longest silence before the assembler's held deltas are flushed (None: one second).
    coalesce_seconds: float | None
    clock: Callable[[], float] = time.monotonic
    #: Milliseconds the engine spent computing this request's prompt, over all its calls.
    prompt_ms: float = 0.0
    #: Prompt tokens the engine's last call found cached (its ``cache_n``).
    last_cached: int = 0

    @property
    def deadline(self) -> float:
        """When the reply must be complete: the client's timeout, less a margin."""
        return self.started + self.client_timeout - DEADLINE_MARGIN

    async def reply(
        self, slot: int, *, resume_from: Tokens | None, on_chunk: Callable[[bool], None]
    ) -> None:
        """Stream the reply on ``slot`` into the assembler (continuing what a suspension cut
        off, from the exact tokens ``resume_from`` when the slot holds them); one constrained
        retry for a broken tool call. ``on_chunk(output)`` is called for every chunk the engine
        sends (it is alive); ``output`` says whether the chunk carries output (the request
        generates: its prompt is computed)."""
        asm = self.assembler
        so_far = asm.generated_text
        body = self.engine_body()
        resumed = bool(so_far) and await self._resume_exactly(slot, body, resume_from, on_chunk)
        if not resumed:
            # llama-server streams a continued reply's given beginning back first, then
            # generates the last, cut-off word again: the client has both already, so skip them.
            try:
                await self._relay(body, slot, on_chunk, echo=so_far)
            except EngineStreamBrokenError as exc:
                if asm.generated_text and not asm.continuable:
                    raise
                # The link broke mid-reply, not the engine: what it computed is in the slot, so
                # the same call again (continuing any text the client has) costs a few tokens.
                log.info("continuing a reply after the engine link broke: %s", exc.message)
                so_far = asm.generated_text
                await self._relay(self.engine_body(), slot, on_chunk, echo=so_far)
        if isinstance(asm.verdict(), RetryWithTools):
            # The reply tried to call a tool and got it wrong: ask once more, with decoding
            # constrained to a valid call of a declared tool.
            self.record.retry()
            asm.begin_retry()
            plain = {**self.engine.body, "stream": True, "max_tokens": body["max_tokens"]}
            forced = self.translator.force_any_tool(self.engine, plain)
            await self._relay(forced, slot, on_chunk)

    def engine_body(self) -> dict[str, Any]:
        """The chat body for the engine, with generation bounded by the client's patience.

        A reply that was suspended mid-way continues: its text so far is the last (assistant)
        message, which llama-server extends instead of starting a new turn.
        """
        asm = self.assembler
        body = {**self.engine.body, "stream": True, "return_progress": True}
        requested = int(body.get("max_tokens") or 1)
        so_far = asm.generated_text
        if so_far:
            asm.begin_continuation()
            prefill = continuation_prefill(so_far)
            if prefill:
                body["messages"] = [*body["messages"], {"role": "assistant", "content": prefill}]
            requested -= asm.usage.output_tokens
        left = self.deadline - self.clock()
        affordable = int(max(1.0, left) * self.costs.decode.rate)
        body["max_tokens"] = max(1, min(requested, affordable))
        return body

    async def _resume_exactly(
        self,
        slot: int,
        body: Mapping[str, Any],
        saved: Tokens | None,
        on_chunk: Callable[[bool], None],
    ) -> bool:
        """Continue a reply suspended mid-way from the exact tokens its slot held (restored from
        the store): a raw ``/completion`` of those tokens, plus the few the client got that were
        not yet in the cache. Text re-tokenized is not what the model generated, and a small
        model continues it differently (or not at all). False when the saved tokens do not
        match; the caller then continues from the text."""
        prompt = self.prompt
        if saved is None or len(saved) <= len(prompt) or tuple(saved[: len(prompt)]) != prompt:
            return False  # no reply tokens were saved (or not this prompt's)
        client, so_far = self.client, self.assembler.generated_text
        try:
            cached_text = await client.detokenize(saved[len(prompt) :])
            if not so_far.startswith(cached_text):
                return False
            tail = so_far[len(cached_text) :]
            tail_tokens = await client.tokenize(tail) if tail else []
        except (EngineResponseError, EngineTimeoutError) as exc:
            log.info("resuming a reply from its text: %s", exc.message)
            return False
        payload = {
            "prompt": [*saved, *tail_tokens],
            "n_predict": body["max_tokens"],
            "return_progress": True,
            **{name: body[name] for name in _SAMPLING if name in body},
        }
        await self._relay(payload, slot, on_chunk, raw=True)
        return True

    async def _relay(
        self,
        body: dict[str, Any],
        slot: int,
        on_chunk: Callable[[bool], None],
        *,
        echo: str = "",
        raw: bool = False,
    ) -> None:
        """One engine call: chunks in, reply events out, until the engine ends, the client's
        deadline comes or the assembler asks to stop (a degenerate loop)."""
        asm, record, client = self.assembler, self.record, self.client
        # What an engine that places requests itself is told about this one: its agent, that
        # agent's parent in the tree, and the priority it runs at now.
        hints = EngineHints(agent=record.agent, priority=record.priority, parent=record.parent)
        send, receive = anyio.create_memory_object_stream[dict[str, Any]](64)
        failure: list[AgentKVError] = []
        #: The call's last prompt progress, and whether its timings came (a call stopped here,
        #: by the deadline or a degenerate loop, ends before the engine sends them).
        seen: dict[str, Any] = {"progress": None, "timed": False}

        async def produce() -> None:
            try:
                async with (
                    send,
                    client.complete(body, slot=slot)
                    if raw
                    else client.stream(body, slot=slot, hints=hints) as chunks,
                ):
                    async for chunk in chunks:
                        await _hand_over(send, as_chat_chunk(chunk) if raw else chunk)
            except AgentKVError as exc:  # handed to the consumer, not wrapped in a group
                failure.append(exc)
            except anyio.BrokenResourceError:
                # The consumer stopped reading (the deadline, a degenerate loop) and closed its
                # end while this task held a chunk: its cancellation is on the way, and handing
                # a chunk over is no checkpoint, so it would not arrive before this error.
                return

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            async with receive:
                while True:
                    now = self.clock()
                    if now >= self.deadline:
                        # The client would give up before the reply ends: end it now, whole.
                        record.stop("deadline")
                        asm.feed({"choices": [{"delta": {}, "finish_reason": "length"}]}, now)
                        tg.cancel_scope.cancel()
                        break
                    wait = min(self.coalesce_seconds or 1.0, self.deadline - now)
                    try:
                        chunk = await _next_chunk(receive, wait)
                    except anyio.EndOfStream:
                        break
                    if chunk is None:  # silence: flush what is due
                        self.emit(asm.flush(self.clock()))
                        continue
                    now = self.clock()
                    self.costs.observe_timings(chunk.get("timings"))
                    if echo:
                        chunk, echo = without_echo(chunk, echo)
                    output = generates(chunk)
                    on_chunk(output)
                    if output:
                        record.output_chunk()
                    events = asm.feed(chunk, now)
                    if events:
                        record.first_event(now - self.started)
                        self.emit(events)
                    self._account(chunk, seen)
                    if asm.stop is not None:
                        # A degenerate loop: closing the stream stops llama-server generating.
                        record.stop(asm.stop.reason)
                        log.warning("agent %s: %s", record.agent, asm.stop.message)
                        tg.cancel_scope.cancel()
                        break
        progress = seen["progress"]
        if not seen["timed"] and isinstance(progress, Mapping):
            # Stopped before its timings: what the prompt progress said it cached and computed.
            self._account({"timings": progress_timings(progress)}, seen)
        if failure:
            raise failure[0]

    def _account(self, chunk: Mapping[str, Any], seen: dict[str, Any]) -> None:
        done = prompt_done(chunk)
        if done is not None:
            self.record.progress(done)
            seen["progress"] = chunk["prompt_progress"]
        timings = chunk.get("timings")
        if isinstance(timings, Mapping) and "prompt_n" in timings:
            seen["timed"] = True
            self.prompt_ms += float(timings.get("prompt_ms", 0.0) or 0.0)
            self.last_cached = self.record.account(timings)


async def _hand_over(send: MemoryObjectSendStream[dict[str, Any]], chunk: dict[str, Any]) -> None:
    """Pass a chunk to the relay: at once while its buffer has room, else wait for room.

    No trip through the event loop per chunk: the relay then takes what one read of the engine's
    stream gave in one go, and the client gets those events in one write.
    """
    try:
        send.send_nowait(chunk)
    except anyio.WouldBlock:
        await send.send(chunk)


async def _next_chunk(
    receive: MemoryObjectReceiveStream[dict[str, Any]], wait: float
) -> dict[str, Any] | None:
    """The next chunk: at once when one is waiting, else within ``wait`` seconds (None: none
    came). Raises ``anyio.EndOfStream`` after the last one. Only an empty buffer costs a timeout
    scope."""
    try:
        return receive.receive_nowait()
    except anyio.WouldBlock:
        pass
    with anyio.move_on_after(max(0.0, wait)):
        return await receive.receive()
    return None


# -- pure helpers -----------------------------------------------------------------------------


def as_chat_chunk(chunk: Mapping[str, Any]) -> dict[str, Any]:
    """A raw ``/completion`` chunk in the shape of a chat-completion chunk."""
    finish = None
    if chunk.get("stop"):
        finish = "length" if chunk.get("stop_type") == "limit" else "stop"
    choice = {"delta": {"content": chunk.get("content") or None}, "finish_reason": finish}
    passed = {name: chunk[name] for name in ("timings", "prompt_progress") if name in chunk}
    return {"choices": [choice], **passed}


def continuation_prefill(text: str) -> str:
    """What a suspended reply resumes from: its text up to the last whitespace.

    The reply's own tokens are not kept, only its text, and the text re-tokenized at a cut in the
    middle of a word is not what the model generated: given "... 19 20" the default model ends
    the reply at once, given "... 19 " it goes on with "20 21". So the last word is generated
    again (and skipped, since the client has it).
    """
    cut = max(text.rfind(" "), text.rfind("\n"), text.rfind("\t"))
    return text[: cut + 1]


def without_echo(chunk: dict[str, Any], echo: str) -> tuple[dict[str, Any], str]:
    """``chunk`` without the part of ``echo`` (a continued reply's given beginning, which
    llama-server streams back) it starts with; and what of ``echo`` is still to come."""
    choices: list[dict[str, Any]] = list(chunk.get("choices") or [])
    delta = (choices[0].get("delta") or {}) if choices else {}
    content = delta.get("content")
    if not isinstance(content, str) or not content:
        return chunk, echo
    if echo.startswith(content):
        rest, echo = "", echo[len(content) :]
    elif content.startswith(echo):
        rest, echo = content[len(echo) :], ""
    else:
        log.warning("a continued reply did not start with its own beginning; streaming it as is")
        return chunk, ""
    choice = {**choices[0], "delta": {**delta, "content": rest or None}}
    return {**chunk, "choices": [choice, *choices[1:]]}, echo


def generates(chunk: Mapping[str, Any]) -> bool:
    """Whether an engine chunk carries output (not just the role, or prompt progress)."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
        if choice.get("finish_reason"):
            return True
    return False
