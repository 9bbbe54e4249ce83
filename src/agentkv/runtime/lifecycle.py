"""One request's whole life, in one place.

::

    Runtime.prepare(body, agent, priority)                      before any response is sent
        translate (400 naming the field) → the agent's compactions → prompt tokens
        → "prompt is too long" or compact now → cap max_tokens → the shareable head
    Runtime.submit(prepared) → Exchange                          queued (529 when full)
    Exchange, driven by a task of the runtime:
        message_start at once
        wait for a lease: the scheduler's order, the slot chosen by cost
        on the slot:
            park   the slot's present content, if worth it (slot save → prefix store)
            restore a saved state that holds more of the prompt (verified, else prefill)
            checkpoint  compute a long shareable head alone and save it for other agents
            stream the reply: engine chunks → SSEAssembler → Anthropic events
                bounded by the client's timeout; a degenerate loop is cut
            retry  once, constrained to a declared tool, when a tool call came out broken
        suspended by a more urgent request: save progress, queue again, resume later
        release the lease (always, synchronously), record the request
    Exchange.events(): replays what was emitted and follows it live, with keep-alives

An exchange belongs to the runtime, not to an HTTP connection: a client that goes away only
detaches, and a retry of the same request within ``retry_grace`` seconds joins the running
exchange instead of computing it again.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import anyio
import anyio.abc
import attrs

from agentkv._types import Lease, Source, Ticket
from agentkv.agents import AgentPlace
from agentkv.costs import CostModel
from agentkv.exceptions import (
    AgentKVError,
    EngineError,
    EngineResponseError,
    EngineRestartingError,
    EngineStreamBrokenError,
    EngineTimeoutError,
    EngineUnavailableError,
    PromptTooLongError,
)
from agentkv.fingerprint import PrefixFingerprinter, canonical_json
from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.compactor import Compactor
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.gateway import Checkpoint, Gateway
from agentkv.runtime.hints import EngineHints
from agentkv.runtime.pool import EnginePool
from agentkv.runtime.prefetch import Prefetcher
from agentkv.runtime.record import RequestRecord, RequestStatus, request_fields, request_line
from agentkv.runtime.status import EngineStatus
from agentkv.runtime.store import PrefixStore
from agentkv.runtime.tree import AgentTree
from agentkv.sse import RetryWithTools, SSEAssembler, accumulate
from agentkv.store import EntryKind, StoreIndex
from agentkv.tokens import Tokens, common_prefix
from agentkv.translate import EngineRequest, MessagesTranslator, first_difference, has_images

__all__ = [
    "Emitted",
    "Event",
    "Exchange",
    "Failed",
    "KeepAlive",
    "Prepared",
    "RequestRecord",
    "Runtime",
]

log = logging.getLogger("agentkv.runtime")

#: Seconds kept in hand before the client's timeout: the reply must be complete by then.
_DEADLINE_MARGIN = 10.0
#: Most agents whose totals the runtime keeps (the least recently seen are dropped).
_MAX_AGENTS = 256
_MAX_RECENT = 64


# -- values ----------------------------------------------------------------------------------


@attrs.frozen
class Prepared:
    """A validated request, ready to queue: what to send, its tokens and who asks."""

    agent: str
    priority: int
    engine: EngineRequest
    tokens: Tokens = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    #: Where the shareable head of the prompt ends (the stem's tokens), when it was measured.
    boundary: int | None = None
    #: Identifies a client's retry of the same request.
    key: str = ""


@attrs.frozen
class Emitted:
    """Anthropic stream events, in order."""

    events: list[dict[str, Any]]


@attrs.frozen
class KeepAlive:
    """Nothing happened for a while; a stream sends a ping."""


@attrs.frozen
class Failed:
    """The request ended with this error (after the events already emitted)."""

    error: AgentKVError


Event = Emitted | KeepAlive | Failed


# -- the exchange ---------------------------------------------------------------------------


@attrs.define(eq=False)
class Exchange:
    """One request on its way through queue, slot and engine; owned by the runtime."""

    runtime: Runtime
    prepared: Prepared
    ticket: Ticket
    assembler: SSEAssembler
    record: RequestRecord
    started: float
    _events: list[dict[str, Any]] = attrs.field(factory=list)
    _changed: anyio.Event = attrs.field(factory=anyio.Event)
    _failure: AgentKVError | None = None
    _done: bool = False
    _scope: anyio.CancelScope = attrs.field(factory=anyio.CancelScope)
    _subscribers: int = 0
    #: A client followed the reply to its end.
    _delivered: bool = False
    _orphaned_at: float | None = None
    finished_at: float | None = None
    #: The cached sequence that shared most with the prompt when it got its slot.
    _candidate: tuple[str, int, tuple[tuple[str, str], ...]] | None = None
    _prompt_ms: float = 0.0
    #: Store entries holding this request's saved progress (pinned until it ends).
    _suspended: list[str] = attrs.field(factory=list)
    #: The exact tokens a reply suspended mid-way left in its slot (prompt and reply so far).
    _resume_from: Tokens | None = None

    @property
    def done(self) -> bool:
        return self._done

    @property
    def failure(self) -> AgentKVError | None:
        return self._failure

    @property
    def cancelled(self) -> bool:
        return self._scope.cancel_called

    @property
    def joinable(self) -> bool:
        """A retry of this request may take it over: nobody receives it, it has not failed."""
        return (
            self._subscribers == 0
            and not self._delivered
            and self._failure is None
            and not self.cancelled
        )

    # -- subscribers ------------------------------------------------------------------------------

    async def events(self, ping_interval: float | None = None) -> AsyncIterator[Event]:
        """Everything emitted so far, then live events until the end; ``KeepAlive`` on silence.

        Leaving the iteration early (the client went away) detaches: with no client left, the
        exchange is cancelled after the runtime's ``retry_grace`` unless a retry joins it.
        """
        interval = self.runtime.config.ping_interval if ping_interval is None else ping_interval
        self._subscribers += 1
        self._orphaned_at = None
        sent = 0
        try:
            while True:
                if sent < len(self._events):
                    batch = self._events[sent:]
                    sent = len(self._events)
                    yield Emitted(batch)
                    continue
                if self._done:
                    if self._failure is not None:
                        yield Failed(self._failure)
                    self._delivered = True
                    return
                changed = self._changed
                with anyio.move_on_after(interval) as idle:
                    await changed.wait()
                if idle.cancelled_caught:
                    yield KeepAlive()
        finally:
            self._subscribers -= 1
            if self._subscribers == 0 and not self._done:
                self._orphaned_at = self.runtime.clock()
                self.runtime._orphaned(self)

    async def message(self) -> dict[str, Any]:
        """The whole reply as one Message (non-streaming); raises the error that ended it."""
        events: list[dict[str, Any]] = []
        async for item in self.events(ping_interval=3600):
            if isinstance(item, Emitted):
                events.extend(item.events)
            elif isinstance(item, Failed):
                raise item.error
        return accumulate(events)

    def cancel(self) -> None:
        """Stop the request now (the engine stops generating; the lease is released)."""
        self._scope.cancel()

    # -- producing --------------------------------------------------------------------------------

    def _emit(self, events: list[dict[str, Any]]) -> None:
        if events:
            self._events.extend(events)
            self._changed.set()
            self._changed = anyio.Event()

    async def drive(self) -> None:
        """Run the request to its end. Never raises; the outcome is in the events."""
        runtime = self.runtime
        try:
            with self._scope:
                self._emit(self.assembler.start())
                await self._run()
            if self._scope.cancelled_caught:
                self.record.advance(RequestStatus.CANCELLED)
                # Only a client that is still listening (agentkv is stopping) reads this.
                self._failure = EngineUnavailableError(
                    "the request was cancelled: agentkv is stopping"
                )
        except AgentKVError as exc:
            log.warning("request of agent %s failed: %s", self.prepared.agent, exc.message)
            self._failure = exc
            self.record.advance(RequestStatus.FAILED, exc.error_type)
        except Exception:
            log.exception("request of agent %s failed unexpectedly", self.prepared.agent)
            self._failure = AgentKVError("internal error in agentkv; see the server log")
            self.record.advance(RequestStatus.FAILED, "api_error")
        finally:
            self.runtime.gateway.withdraw(self.ticket)
            self._forget_progress()
            self.finished_at = runtime.clock()
            if self.record.total_s is None:
                self.record.total_s = round(self.finished_at - self.started, 4)
            usage = self.assembler.usage
            self.record.output_tokens = int(usage.get("output_tokens", 0) or 0)
            self._done = True
            self._changed.set()
            runtime._finished(self)

    async def _run(self) -> None:
        runtime = self.runtime
        ticket = self.ticket
        while True:
            lease = await runtime.gateway.wait(ticket)
            finished = await self._on_slot(lease)
            if finished:
                return
            # Suspended for a more urgent request: queue again, keeping the original arrival.
            self.record.suspended += 1
            self.record.advance(RequestStatus.SUSPENDED)
            ticket = self.ticket = runtime.gateway.submit(
                self.prepared.agent,
                self.prepared.priority,
                self.prepared.tokens,
                head=self.prepared.boundary,
                arrival=self.ticket.arrival,
            )

    async def _on_slot(self, lease: Lease) -> bool:
        """Use the leased slot; True when the request is finished, False when suspended."""
        runtime, record = self.runtime, self.record
        gateway = runtime.gateway
        record.slot = lease.slot
        record.dispatch_seq = gateway.dispatch_seq(lease)
        record.source = lease.placement.source.value
        record.planned_reuse = lease.placement.reuse
        record.queued_s = round(runtime.clock() - self.started, 4)
        record.advance(RequestStatus.RUNNING)
        self._candidate = gateway.best_source(self.prepared.tokens)
        holds: Tokens | None = None
        try:
            with anyio.CancelScope() as suspension:
                suspend = suspension.cancel if runtime.store is not None else None
                gateway.running(lease, self.prepared.priority, suspend)
                holds = await self._use_slot(lease)
            if not suspension.cancelled_caught:
                self._explain()
                return True
            holds = await self._save_progress(lease)
            return False
        finally:
            gateway.release(lease, holds=holds, sections=self.prepared.engine.sections)

    def _explain(self) -> None:
        """Record why the prompt was not all cached (when a notable part was computed)."""
        record = self.record
        if record.computed_tokens < 32:
            return
        divergence: dict[str, Any] = {
            "reused": record.cached_tokens,
            "computed": record.computed_tokens,
            "seconds": round(self._prompt_ms / 1000, 3),
        }
        candidate = self._candidate
        if candidate is None:
            divergence.update(position=0, section=None, candidate=None)
        else:
            described, shared, sections = candidate
            divergence.update(
                position=shared,
                section=first_difference(self.prepared.engine.sections, sections),
                candidate=described,
            )
        record.divergence = divergence

    async def _save_progress(self, lease: Lease) -> Tokens | None:
        """After a suspension: keep what the slot computed (the prompt so far, or the prompt
        and the reply so far), pinned in the store until the request ends."""
        store = self.runtime.store
        if store is None:
            return None
        try:
            entry = await store.save(lease.slot, EntryKind.SUSPENDED, agent=self.prepared.agent)
        except EngineError as exc:
            log.warning("could not save a suspended request's progress: %s", exc.message)
            return None
        if entry is None:
            return ()
        store.index.pin(entry.id)
        self._suspended.append(entry.id)
        self._resume_from = entry.tokens if self.assembler.generated_text else None
        self.runtime.gateway.slots.mark_stored(lease.slot, entry.id)
        return entry.tokens

    def _forget_progress(self) -> None:
        """The request ended: its saved progress is of no more use."""
        store = self.runtime.store
        for entry_id in self._suspended:
            if store is not None:
                store.index.unpin(entry_id)
                self.runtime.later(store.drop, entry_id)
        self._suspended.clear()

    async def _use_slot(self, lease: Lease) -> Tokens | None:
        """Prepare the slot (park, restore, checkpoint), then stream the reply."""
        runtime, record = self.runtime, self.record
        placement = lease.placement
        slot = lease.slot
        tokens = self.prepared.tokens
        store = runtime.store
        slots = runtime.gateway.slots
        if placement.park and store is not None and lease.evicted:
            previous = slots.table()[slot].sections
            parked = await runtime.guard_store(
                store.save(slot, EntryKind.CONTEXT, agent=lease.evicted_agent, sections=previous)
            )
            if parked is not None:
                record.parked = True
                slots.mark_stored(slot, parked.id)
        reuse = common_prefix(tokens, lease.evicted) if placement.source is not Source.STORE else 0
        if placement.source is Source.STORE and store is not None and placement.entry_id:
            entry = store.index.get(placement.entry_id)
            restored = None
            if entry is not None:
                started = runtime.clock()
                restored = await runtime.guard_store(store.restore(entry, slot))
                if restored is not None:
                    seconds = runtime.clock() - started
                    runtime.costs.restore.observe(entry.nbytes, seconds)
                    reuse = common_prefix(tokens, entry.tokens)
                    store.record_hit(
                        entry.id,
                        tokens_saved=reuse,
                        seconds_saved=max(0.0, runtime.costs.prefill.estimate(0, reuse) - seconds),
                    )
                    slots.set_content(slot, entry.tokens, stored=entry.id, sections=entry.sections)
            if restored is None:
                record.source = Source.NONE.value
                slots.invalidate(slot)
                reuse = 0
        checkpoint = runtime.gateway.checkpoint_of(lease)
        if checkpoint is not None:
            await self._checkpoint(lease, checkpoint)
        return await self._reply(lease)

    async def _checkpoint(self, lease: Lease, checkpoint: Checkpoint) -> None:
        """Compute the shareable head alone and save it, so that other agents restore it."""
        runtime = self.runtime
        gateway = runtime.gateway
        store = runtime.store
        if store is None:
            gateway.end_checkpoint(checkpoint)
            return
        try:
            async with runtime.client.prefill(checkpoint.tokens, slot=lease.slot) as chunks:
                async for chunk in chunks:
                    gateway.alive(lease)
                    progress = chunk.get("prompt_progress")
                    if isinstance(progress, Mapping):
                        done = int(progress.get("cache", 0)) + int(progress.get("processed", 0))
                        gateway.checkpoint_progress(checkpoint, done)
                    runtime.observe_timings(chunk.get("timings"))
            entry = None
            for _ in range(2):  # a save that failed is tried once more: others wait for it
                entry = await runtime.guard_store(
                    store.save(
                        lease.slot,
                        EntryKind.PREFIX,
                        agent=None,
                        sections=self.prepared.engine.sections,
                    )
                )
                if entry is not None or runtime.store is None:
                    break
            if entry is not None:
                gateway.slots.set_content(
                    lease.slot, entry.tokens, stored=entry.id, sections=entry.sections
                )
                self.record.checkpoint_tokens = entry.n_tokens
        except BaseException:
            gateway.end_checkpoint(checkpoint)
            raise
        if entry is not None:
            gateway.end_checkpoint(checkpoint)
        # Else the save failed, but this slot holds the head: whoever waits for it keeps waiting
        # until this request gives the slot back, and then reuses it there (Gateway.release).

    def _engine_body(self) -> dict[str, Any]:
        """The chat body for the engine, with generation bounded by the client's patience.

        A reply that was suspended mid-way continues: its text so far is the last (assistant)
        message, which llama-server extends instead of starting a new turn.
        """
        runtime, asm = self.runtime, self.assembler
        body = dict(self.prepared.engine.body)
        body["stream"] = True
        body["return_progress"] = True
        requested = int(body.get("max_tokens") or 1)
        so_far = asm.generated_text
        if so_far:
            asm.begin_continuation()
            prefill = _continuation_prefill(so_far)
            if prefill:
                body["messages"] = [*body["messages"], {"role": "assistant", "content": prefill}]
            requested -= asm.usage["output_tokens"]
        left = self.deadline - runtime.clock()
        affordable = int(max(1.0, left) * runtime.costs.decode.rate)
        body["max_tokens"] = max(1, min(requested, affordable))
        return body

    @property
    def deadline(self) -> float:
        """When the reply must be complete: the client's timeout, less a margin."""
        return self.started + self.runtime.config.client_timeout - _DEADLINE_MARGIN

    async def _reply(self, lease: Lease) -> Tokens:
        """Stream the reply into the assembler; one constrained retry for a broken tool call."""
        runtime, asm = self.runtime, self.assembler
        so_far = asm.generated_text
        body = self._engine_body()
        resumed = so_far and await self._resume_exactly(lease, body)
        if not resumed:
            # llama-server streams a continued reply's given beginning back first, then
            # generates the last, cut-off word again: the client has both already, so skip them.
            try:
                await self._relay(body, lease, echo=so_far)
            except EngineStreamBrokenError as exc:
                if asm.generated_text and not asm.continuable:
                    raise
                # The link broke mid-reply, not the engine: what it computed is in the slot, so
                # the same call again (continuing any text the client has) costs a few tokens.
                log.info("continuing a reply after the engine link broke: %s", exc.message)
                so_far = asm.generated_text
                await self._relay(self._engine_body(), lease, echo=so_far)
        if isinstance(asm.verdict(), RetryWithTools):
            # The reply tried to call a tool and got it wrong: ask once more, with decoding
            # constrained to a valid call of a declared tool.
            self.record.retried = True
            asm.begin_retry()
            plain = {**self.prepared.engine.body, "stream": True, "max_tokens": body["max_tokens"]}
            forced = runtime.translator.force_any_tool(self.prepared.engine, plain)
            await self._relay(forced, lease)
        self._emit(asm.finish(runtime.clock()))
        if self.record.status is RequestStatus.RUNNING:
            self.record.advance(RequestStatus.OK)
        return self.prepared.tokens

    async def _resume_exactly(self, lease: Lease, body: Mapping[str, Any]) -> bool:
        """Continue a reply suspended mid-way from the exact tokens its slot held (restored from
        the store): a raw ``/completion`` of those tokens, plus the few the client got that were
        not yet in the cache. Text re-tokenized is not what the model generated, and a small
        model continues it differently (or not at all). False when the saved tokens do not
        match; the caller then continues from the text."""
        saved, self._resume_from = self._resume_from, None
        prompt = self.prepared.tokens
        if saved is None or len(saved) <= len(prompt) or tuple(saved[: len(prompt)]) != prompt:
            return False  # no reply tokens were saved (or not this prompt's)
        client, so_far = self.runtime.client, self.assembler.generated_text
        try:
            cached_text = await client.detokenize(saved[len(prompt) :])
            if not so_far.startswith(cached_text):
                return False
            tail = so_far[len(cached_text) :]
            tail_tokens = await client.tokenize(tail) if tail else []
        except (EngineResponseError, EngineTimeoutError) as exc:
            log.info("resuming a reply from its text: %s", exc.message)
            return False
        payload: dict[str, Any] = {
            "prompt": [*saved, *tail_tokens],
            "n_predict": body["max_tokens"],
            "return_progress": True,
        }
        for name in _SAMPLING:
            if name in body:
                payload[name] = body[name]
        await self._relay(payload, lease, raw=True)
        return True

    async def _relay(
        self, body: dict[str, Any], lease: Lease, *, echo: str = "", raw: bool = False
    ) -> None:
        """One engine call: chunks in, Anthropic events out, until the engine ends, the client's
        deadline comes or the assembler asks to stop (a degenerate loop)."""
        runtime, asm, record = self.runtime, self.assembler, self.record
        config = runtime.config
        send, receive = anyio.create_memory_object_stream[dict[str, Any]](64)
        failure: list[AgentKVError] = []

        async def produce() -> None:
            try:
                if raw:
                    async with send, runtime.client.complete(body, slot=lease.slot) as chunks:
                        async for chunk in chunks:
                            await send.send(_as_chat_chunk(chunk))
                    return
                hints = self.hints()
                async with (
                    send,
                    runtime.client.stream(body, slot=lease.slot, hints=hints) as chunks,
                ):
                    async for chunk in chunks:
                        await send.send(chunk)
            except AgentKVError as exc:  # handed to the consumer, not wrapped in a group
                failure.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            async with receive:
                while True:
                    now = runtime.clock()
                    if now >= self.deadline:
                        # The client would give up before the reply ends: end it now, whole.
                        record.stopped = "deadline"
                        asm.feed({"choices": [{"delta": {}, "finish_reason": "length"}]}, now)
                        tg.cancel_scope.cancel()
                        break
                    wait = min(config.coalesce_seconds or 1.0, self.deadline - now)
                    with anyio.move_on_after(max(0.0, wait)):
                        try:
                            chunk = await receive.receive()
                        except anyio.EndOfStream:
                            break
                        now = runtime.clock()
                        runtime.gateway.alive(lease)
                        runtime.observe_timings(chunk.get("timings"))
                        if echo:
                            chunk, echo = _without_echo(chunk, echo)
                        if _generates(chunk):
                            runtime.gateway.decoding(
                                lease, suspendable=runtime.store is not None and asm.continuable
                            )
                            record.generated += 1
                        events = asm.feed(chunk, now)
                        if events:
                            if record.ttft_s is None:
                                record.ttft_s = round(now - self.started, 4)
                            self._emit(events)
                        self._account(chunk)
                        if asm.stop is not None:
                            # A degenerate loop: closing the stream stops llama-server generating.
                            record.stopped = asm.stop.reason
                            tg.cancel_scope.cancel()
                            break
                        continue
                    self._emit(asm.flush(runtime.clock()))
        if failure:
            raise failure[0]

    def hints(self) -> EngineHints:
        """What an engine that places requests itself is told about this one: its agent, that
        agent's parent in the tree, and the priority it runs at now."""
        record = self.record
        return EngineHints(agent=record.agent, priority=record.priority, parent=record.parent)

    def _account(self, chunk: Mapping[str, Any]) -> None:
        progress = chunk.get("prompt_progress")
        if isinstance(progress, Mapping):
            done = int(progress.get("cache", 0) or 0) + int(progress.get("processed", 0) or 0)
            self.record.prefilled = done
        timings = chunk.get("timings")
        if isinstance(timings, Mapping) and "prompt_n" in timings:
            self.record.computed_tokens += int(timings.get("prompt_n", 0))
            self._prompt_ms += float(timings.get("prompt_ms", 0.0) or 0.0)
            self.record.cached_tokens = max(
                self.record.cached_tokens, int(timings.get("cache_n", 0))
            )


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


def _as_chat_chunk(chunk: Mapping[str, Any]) -> dict[str, Any]:
    """A raw ``/completion`` chunk in the shape of a chat-completion chunk."""
    finish = None
    if chunk.get("stop"):
        finish = "length" if chunk.get("stop_type") == "limit" else "stop"
    out: dict[str, Any] = {
        "choices": [{"delta": {"content": chunk.get("content") or None}, "finish_reason": finish}]
    }
    for name in ("timings", "prompt_progress"):
        if name in chunk:
            out[name] = chunk[name]
    return out


def _continuation_prefill(text: str) -> str:
    """What a suspended reply resumes from: its text up to the last whitespace.

    The reply's own tokens are not kept, only its text, and the text re-tokenized at a cut in the
    middle of a word is not what the model generated: given "... 19 20" the default model ends
    the reply at once, given "... 19 " it goes on with "20 21". So the last word is generated
    again (and skipped, since the client has it).
    """
    cut = max(text.rfind(" "), text.rfind("\n"), text.rfind("\t"))
    return text[: cut + 1]


def _without_echo(chunk: dict[str, Any], echo: str) -> tuple[dict[str, Any], str]:
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


def _generates(chunk: Mapping[str, Any]) -> bool:
    """Whether an engine chunk carries output (not just the role, or prompt progress)."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
        if choice.get("finish_reason"):
            return True
    return False


# -- the runtime ------------------------------------------------------------------------------


def _request_key(agent: str, body: Mapping[str, Any]) -> str:
    """Two requests with this key are the same request: a client retried it."""
    stable = {k: v for k, v in body.items() if k != "stream"}
    return hashlib.sha256((agent + "\n" + canonical_json(stable)).encode()).hexdigest()[:32]


@attrs.define
class Runtime:
    """Everything between an Anthropic request and llama-server, for one engine.

    ``async with Runtime(client, config) as runtime:`` starts the background work (watchdog,
    compactions, store upkeep) and the exchanges; leaving it cancels what is still running.
    """

    client: LlamaSlotClient
    config: RuntimeConfig = attrs.field(factory=RuntimeConfig)
    #: The engine configuration the prefix store is bound to (model hash, build, context…).
    store_compat: str = ""
    clock: Callable[[], float] = time.monotonic
    translator: MessagesTranslator = attrs.field(init=False)
    fingerprinter: PrefixFingerprinter = attrs.field(init=False, factory=PrefixFingerprinter)
    costs: CostModel = attrs.field(init=False, factory=CostModel)
    gateway: Gateway = attrs.field(init=False)
    compactor: Compactor = attrs.field(init=False)
    tree: AgentTree = attrs.field(init=False)
    store: PrefixStore | None = attrs.field(init=False, default=None)
    #: Fan-out prefetch (with the agent tree and a store).
    prefetcher: Prefetcher | None = attrs.field(init=False, default=None)
    _tg: anyio.abc.TaskGroup | None = attrs.field(init=False, default=None)
    _exchanges: dict[str, Exchange] = attrs.field(init=False, factory=dict)
    _recent: list[RequestRecord] = attrs.field(init=False, factory=list)
    _agents: OrderedDict[str, dict[str, Any]] = attrs.field(init=False, factory=OrderedDict)
    _store_off: bool = attrs.field(init=False, default=False)
    _listeners: list[Callable[[RequestRecord], None]] = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        config = self.config
        self.translator = MessagesTranslator(
            session_layout=config.session_layout, limits=config.limits
        )
        index = None
        # An engine without slot files (one that places requests itself) has no store.
        if config.store_dir is not None and self.client.slot_files:
            index = StoreIndex(
                budget=config.store_budget,
                compat=self.store_compat,
                context_ttl=config.store_context_ttl,
            )
            self.store = PrefixStore(config.store_dir, self.client, index)
        self.gateway = Gateway(
            config,
            costs=self.costs,
            store=index,
            clock=self.clock,
        )
        self.tree = AgentTree(
            gateway=self.gateway,
            clock=self.clock,
            enabled=config.agent_tree,
            background_offset=config.background_agent_offset,
        )
        if config.agent_tree and self.store is not None:
            self.prefetcher = Prefetcher(
                submit=self.submit, available=self.gateway_available, split_min=config.split_min
            )
        self.compactor = Compactor(
            gateway=self.gateway,
            client=self.client,
            fingerprinter=self.fingerprinter,
            keep_recent=config.compact_keep_messages,
            clock=self.clock,
        )

    async def __aenter__(self) -> Runtime:
        if self.store is not None:
            refused = await self.store.open()
            if refused:
                log.info("prefix store: %d entries refused and deleted", len(refused))
        self._tg = await anyio.create_task_group().__aenter__()
        self._tg.start_soon(self.gateway.run_watchdog, self.config.watchdog_interval)
        self._tg.start_soon(self._upkeep)
        if self.client.status is not None:
            self._tg.start_soon(self._follow_engine_restarts, self.client.status)
        if isinstance(self.client, EnginePool):
            # Engines that go down leave placement; when they come back they rejoin, empty.
            self._tg.start_soon(self.client.watch, self.gateway.engine_changed)
        self.compactor.attach(self._tg)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.compactor.attach(None)
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)

    # -- preparing --------------------------------------------------------------------------------

    def place_agent(
        self, root: str, sub: str | None, priority: int, body: Mapping[str, Any]
    ) -> AgentPlace:
        """Which agent of the tree a request belongs to (``root``, or its sub-agent ``sub``) and
        the priority it runs at; pass both to :meth:`prepare`."""
        place = self.tree.place(root, sub, priority, body)
        if sub is None:
            # A coordinator's request may name the sub-agents its calls started: their records
            # finished before that was known.
            self.tree.relabel(self._recent)
        return place

    async def prepare(self, body: Mapping[str, Any], *, agent: str, priority: int) -> Prepared:
        """Validate and fit a Messages request; raises a 4xx :class:`AgentKVError` before any
        response starts (a prompt that cannot fit gets ``prompt is too long``)."""
        engine = await self._translate(body)
        return await self._fit(agent, priority, engine, _request_key(agent, body))

    async def _translate(self, body: Mapping[str, Any]) -> EngineRequest:
        """Translate for this engine: one that cannot see images gets notes or a 400 for them."""
        translator = self.translator
        if translator.limits.images and has_images(body) and not await self.client.accepts_images():
            translator = translator.text_only()
        return translator.translate(body)

    async def _fit(self, agent: str, priority: int, engine: EngineRequest, key: str) -> Prepared:
        config = self.config
        body = engine.body
        compacted = False
        if config.compaction:
            body, _, applied = self.compactor.store.rewrite(agent, body, self.fingerprinter)
            compacted = bool(applied)
        tokens = tuple(await self.client.prompt_tokens(body))
        ctx = config.ctx_per_slot
        requested = int(body.get("max_tokens") or 1)
        if ctx is not None and config.check_prompt_length:
            limit = ctx - min(requested, config.output_reserve)
            if len(tokens) > limit and config.compaction:
                # Too long as it stands: compact now, at the request's own priority. A background
                # compaction of this agent that is already running is waited for instead.
                await self.compactor.compact(
                    agent, body, len(tokens), priority=priority, background=False
                )
                body, _, applied = self.compactor.store.rewrite(
                    agent, engine.body, self.fingerprinter
                )
                compacted = bool(applied)
                tokens = tuple(await self.client.prompt_tokens(body))
            if len(tokens) > limit:
                raise PromptTooLongError(len(tokens), limit)
            threshold = config.compaction_threshold
            if config.compaction and threshold is not None and len(tokens) > threshold:
                self.compactor.schedule(agent, body, len(tokens))
            # Claude Code asks for up to 128000 output tokens; the slot holds only what is left.
            body = {**body, "max_tokens": max(1, min(requested, ctx - len(tokens)))}
        boundary = None if compacted else await self._boundary(engine, tokens)
        engine = attrs.evolve(engine, body=body)
        return Prepared(
            agent=agent, priority=priority, engine=engine, tokens=tokens, boundary=boundary, key=key
        )

    async def _boundary(self, engine: EngineRequest, tokens: Tokens) -> int | None:
        """Where the shareable head ends, measured only when it could matter: a long prompt of
        which little is cached anywhere."""
        if self.store is None or engine.stem_body is None:
            return None
        if len(tokens) - self.gateway_available(tokens) < self.config.split_min:
            return None
        stem = await self.client.prompt_tokens(engine.stem_body)
        return common_prefix(tokens, stem)

    def gateway_available(self, tokens: Tokens) -> int:
        return self.gateway._available(tokens)

    # -- submitting -------------------------------------------------------------------------------

    def submit(self, prepared: Prepared) -> Exchange:
        """Queue a prepared request and start it; a retry of a running request joins it."""
        if self._tg is None:
            raise RuntimeError("the runtime is not running (use `async with Runtime(...)`)")
        existing = self._exchanges.get(prepared.key)
        if existing is not None and existing.joinable:
            existing.record.attached += 1
            log.info(
                "agent %s retried a request that is %s; joining it",
                prepared.agent,
                "finished" if existing.done else "still running",
            )
            return existing
        ticket = self.gateway.submit(
            prepared.agent, prepared.priority, prepared.tokens, head=prepared.boundary
        )
        try:
            return self._start(prepared, ticket)
        except BaseException:
            self.gateway.withdraw(ticket)  # nothing will ever wait for it
            raise

    def _start(self, prepared: Prepared, ticket: Ticket) -> Exchange:
        assert self._tg is not None
        engine = prepared.engine
        assembler = SSEAssembler(
            message_id="msg_" + secrets.token_hex(12),
            model=engine.model,
            forced_tool=engine.forced_tool,
            tool_names=engine.tool_names,
            coalesce_chars=self.config.coalesce_chars,
            coalesce_seconds=self.config.coalesce_seconds,
            input_tokens_hint=len(prepared.tokens),
            tool_schemas=self._repairable_tools(engine),
        )
        exchange = Exchange(
            runtime=self,
            prepared=prepared,
            ticket=ticket,
            assembler=assembler,
            record=RequestRecord(
                agent=prepared.agent,
                priority=prepared.priority,
                ticket=ticket.id,
                prompt_tokens=len(prepared.tokens),
            ),
            started=ticket.arrival,
        )
        self.tree.label(exchange.record)
        self._exchanges[prepared.key] = exchange
        self._tg.start_soon(exchange.drive)
        return exchange

    def _repairable_tools(self, engine: EngineRequest) -> dict[str, Any] | None:
        """Declared tools for tool-call repair: auto mode only (forced calls are constrained)."""
        if not self.config.tool_repair or "tools" not in engine.body:
            return None
        tools = engine.request.tools or ()
        return {tool.name: tool.input_schema for tool in tools if tool.input_schema is not None}

    async def count_tokens(self, body: Mapping[str, Any]) -> int:
        """``count_tokens``: the prompt size of a Messages request, as the engine counts it."""
        body = dict(body)
        body.setdefault("max_tokens", 1)  # count_tokens takes none; the prompt does not change
        engine = await self._translate(body)
        return len(await self.client.prompt_tokens(engine.body))

    # -- bookkeeping ------------------------------------------------------------------------------

    def observe_timings(self, timings: Any) -> None:
        """Learn prefill and decode speeds from llama-server's ``timings``."""
        if not isinstance(timings, Mapping):
            return
        try:
            cache = int(timings.get("cache_n", 0))
            computed = int(timings.get("prompt_n", 0))
            prompt_ms = float(timings.get("prompt_ms", 0.0))
            predicted = int(timings.get("predicted_n", 0))
            predicted_ms = float(timings.get("predicted_ms", 0.0))
        except (TypeError, ValueError):
            return
        if computed > 1:
            self.costs.prefill.observe(cache, computed, prompt_ms / 1000)
        if predicted > 1:
            self.costs.decode.observe(predicted, predicted_ms / 1000)

    async def guard_store(self, work: Any) -> Any:
        """Run a store operation; None when it failed. Never fatal to the request, unless the
        engine is restarting (its slots are gone).

        A store the engine cannot serve (an error status) is switched off. A link that failed
        says nothing about the store: the store stays on."""
        try:
            return await work
        except EngineRestartingError:
            raise  # the slots are lost with the engine; the request is retried by the client
        except (EngineUnavailableError, EngineTimeoutError) as exc:
            # The link failed twice (the client already sent it once more): the request goes on
            # without the store this time — a failed restore prefills, a failed save keeps the
            # state in its slot.
            log.warning("a prefix store operation failed; going on without it: %s", exc.message)
            return None
        except EngineError as exc:
            if not self._store_off:
                log.warning("prefix store is off: llama-server cannot save slots (%s)", exc.message)
            self._store_off = True
            self.store = None
            self.gateway.store = None
            return None

    async def clear_store(self, *, agent: str | None = None) -> int:
        """Delete the prefix store's entries (every one, or one agent's) and their files; slots
        whose content they covered count as unsaved again. Returns how many were deleted."""
        if self.store is None:
            return 0
        removed = await self.store.clear(agent=agent)
        for entry_id in removed:
            self.gateway.slots.forget_entry(entry_id)
        log.info(
            "prefix store: %d entries deleted%s", len(removed), f" of {agent}" if agent else ""
        )
        return len(removed)

    def later(self, work: Callable[..., Any], *args: Any) -> None:
        """Run ``work(*args)`` in the background (best effort: dropped when stopping)."""
        if self._tg is not None:
            self._tg.start_soon(work, *args)

    def _orphaned(self, exchange: Exchange) -> None:
        """No client follows the exchange any more: cancel it unless a retry joins in time."""
        if self._tg is None:
            exchange.cancel()
            return
        self._tg.start_soon(self._cancel_if_still_orphaned, exchange)

    async def _cancel_if_still_orphaned(self, exchange: Exchange) -> None:
        await anyio.sleep(self.config.retry_grace)
        if not exchange.done and exchange._subscribers == 0:
            log.info("client of agent %s is gone; stopping its request", exchange.prepared.agent)
            exchange.cancel()

    def add_listener(self, listener: Callable[[RequestRecord], None]) -> None:
        """Call ``listener`` with the record of every request when it ends (metrics, logs)."""
        self._listeners.append(listener)

    def running(self) -> list[RequestRecord]:
        """The records of the requests queued or running now."""
        now = self.clock()
        records = []
        for exchange in self._exchanges.values():
            if exchange.done:
                continue
            record = exchange.record
            if record.ttft_s is not None:
                record.generating_s = round(now - exchange.started - record.ttft_s, 3)
            records.append(record)
        return records

    def _finished(self, exchange: Exchange) -> None:
        record = exchange.record
        calls = (
            self.tree.replied(record.agent, exchange._events) if exchange.failure is None else []
        )
        if self.prefetcher is not None:
            self._prefetch(exchange, calls)
        # A sub-agent may have been linked to its call since it started (its parent's request).
        self.tree.relabel([record])
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:  # a broken listener must not break the request path
                log.exception("request listener failed")
        self._recent.append(record)
        del self._recent[:-_MAX_RECENT]
        totals = self._agents.pop(record.agent, None) or {
            "requests": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
        }
        totals["requests"] += 1
        totals["prompt_tokens"] += record.prompt_tokens
        totals["cached_tokens"] += record.cached_tokens
        totals["priority"] = record.priority
        self._agents[record.agent] = totals
        while len(self._agents) > _MAX_AGENTS:
            self._agents.popitem(last=False)
        log.info("%s", request_line(record), extra={"agentkv_request": request_fields(record)})
        if self._tg is not None and exchange.failure is None:
            self._tg.start_soon(self._forget_later, exchange)
        else:
            self._exchanges.pop(exchange.prepared.key, None)

    def _prefetch(self, exchange: Exchange, calls: list[Any]) -> None:
        """Learn a sub-agent's head from its first request; prepare the heads of a fan-out."""
        assert self.prefetcher is not None
        record = exchange.record
        place = self.tree.describe(record.agent)
        self.prefetcher.observe(exchange.prepared, place, ok=exchange.failure is None)
        if calls and self._tg is not None:
            root = place.root if place is not None and place.root else record.agent
            self.prefetcher.fan_out(record.agent, root, calls, record.priority)

    async def _forget_later(self, exchange: Exchange) -> None:
        # A finished reply stays joinable for a while: a client that timed out just before it
        # ended retries, and gets the reply instead of a second computation.
        await anyio.sleep(self.config.retry_grace)
        if self._exchanges.get(exchange.prepared.key) is exchange:
            del self._exchanges[exchange.prepared.key]

    async def _follow_engine_restarts(self, status: EngineStatus) -> None:
        """A restarted engine's slots are all empty: forget what they held."""
        generation = status.generation
        while True:
            generation = await status.wait_generation(generation)
            for slot in range(self.config.n_slots):
                self.gateway.slots.invalidate(slot)
            log.info("engine restarted (generation %d): slot contents forgotten", generation)

    async def _upkeep(self) -> None:
        while True:
            await anyio.sleep(60)
            if self.store is not None:
                with contextlib.suppress(AgentKVError, OSError):
                    await self.store.expire()

    def records(self) -> list[RequestRecord]:
        """The most recent finished requests (the last 64), oldest first."""
        return list(self._recent)

    def table(self) -> dict[str, Any]:
        """The operator's view: slots, queue, store, agents, recent requests."""
        table = self.gateway.table()
        table["store"] = self.store.table() if self.store is not None else None
        table["compactions"] = self.compactor.store.table()
        if isinstance(self.client, EnginePool):
            table["engines"] = self.client.table()
        table["agents"] = dict(self._agents)
        self.tree.annotate(table)
        table["running"] = [r.view() for r in self.running()]
        table["recent"] = [r.view() for r in self._recent[-16:]]
        table["costs"] = {
            "prefill_tokens_per_s_at_0": round(self.costs.prefill.tokens_per_second(0, 1000), 1),
            "prefill_tokens_per_s_at_10k": round(
                self.costs.prefill.tokens_per_second(10_000, 1000), 1
            ),
            "decode_tokens_per_s": round(self.costs.decode.rate, 1),
            "restore_bytes_per_s": round(self.costs.restore.rate),
            "bytes_per_token": round(self.costs.bytes_per_token),
        }
        return table
