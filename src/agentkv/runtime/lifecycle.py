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
    EngineRestartingError,
    EngineTimeoutError,
    EngineUnavailableError,
    PromptTooLongError,
)
from agentkv.fingerprint import PrefixFingerprinter, canonical_json
from agentkv.runtime.broadcast import Broadcast, Emitted, Event, Failed, KeepAlive
from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.compactor import Compactor
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.gateway import Checkpoint, Gateway
from agentkv.runtime.record import RequestRecord, RequestStatus, request_fields, request_line
from agentkv.runtime.relay import Relay
from agentkv.runtime.status import EngineStatus
from agentkv.runtime.store import PrefixStore
from agentkv.runtime.tree import AgentTree
from agentkv.sse import SSEAssembler
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
    #: The replayable events and the clients following them.
    broadcast: Broadcast = attrs.field(init=False)
    #: The engine calls of the reply.
    relay: Relay = attrs.field(init=False)
    _done: bool = False
    _scope: anyio.CancelScope = attrs.field(factory=anyio.CancelScope)
    finished_at: float | None = None
    #: The cached sequence that shared most with the prompt when it got its slot.
    _candidate: tuple[str, int, tuple[tuple[str, str], ...]] | None = None
    #: Store entries holding this request's saved progress (pinned until it ends).
    _suspended: list[str] = attrs.field(factory=list)
    #: The exact tokens a reply suspended mid-way left in its slot (prompt and reply so far).
    _resume_from: Tokens | None = None

    def __attrs_post_init__(self) -> None:
        runtime = self.runtime
        self.broadcast = Broadcast(
            abandon=self._abandoned,
            grace=runtime.config.retry_grace,
            ping_interval=runtime.config.ping_interval,
            spawn=runtime.later,
            clock=runtime.clock,
        )
        self.relay = Relay(
            client=runtime.client,
            translator=runtime.translator,
            engine=self.prepared.engine,
            prompt=self.prepared.tokens,
            assembler=self.assembler,
            record=self.record,
            costs=runtime.costs,
            emit=self.broadcast.emit,
            started=self.started,
            client_timeout=runtime.config.client_timeout,
            coalesce_seconds=runtime.config.coalesce_seconds,
            clock=runtime.clock,
        )

    @property
    def done(self) -> bool:
        return self._done

    @property
    def failure(self) -> AgentKVError | None:
        return self.broadcast.failure

    @property
    def cancelled(self) -> bool:
        return self._scope.cancel_called

    @property
    def joinable(self) -> bool:
        """A retry of this request may take it over: nobody receives it, it has not failed."""
        broadcast = self.broadcast
        return (
            broadcast.followers == 0
            and not broadcast.delivered
            and broadcast.failure is None
            and not self.cancelled
        )

    # -- subscribers ------------------------------------------------------------------------------

    def events(self, ping_interval: float | None = None) -> AsyncIterator[Event]:
        """Everything emitted so far, then live events until the end; ``KeepAlive`` on silence.

        Leaving the iteration early (the client went away) detaches: with no client left, the
        exchange is cancelled after the runtime's ``retry_grace`` unless a retry joins it.
        """
        return self.broadcast.follow(ping_interval)

    async def message(self) -> dict[str, Any]:
        """The whole reply as one Message (non-streaming); raises the error that ended it."""
        return await self.broadcast.message()

    def cancel(self) -> None:
        """Stop the request now (the engine stops generating; the lease is released)."""
        self._scope.cancel()

    def _abandoned(self) -> None:
        log.info("client of agent %s is gone; stopping its request", self.prepared.agent)
        self.cancel()

    # -- producing --------------------------------------------------------------------------------

    def _emit(self, events: list[dict[str, Any]]) -> None:
        self.broadcast.emit(events)

    async def drive(self) -> None:
        """Run the request to its end. Never raises; the outcome is in the events."""
        runtime = self.runtime
        failure: AgentKVError | None = None
        try:
            with self._scope:
                self._emit(self.assembler.start())
                await self._run()
            if self._scope.cancelled_caught:
                self.record.advance(RequestStatus.CANCELLED)
                # Only a client that is still listening (agentkv is stopping) reads this.
                failure = EngineUnavailableError("the request was cancelled: agentkv is stopping")
        except AgentKVError as exc:
            log.warning("request of agent %s failed: %s", self.prepared.agent, exc.message)
            failure = exc
            self.record.advance(RequestStatus.FAILED, exc.error_type)
        except Exception:
            log.exception("request of agent %s failed unexpectedly", self.prepared.agent)
            failure = AgentKVError("internal error in agentkv; see the server log")
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
            self.broadcast.close(failure)
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
            "seconds": round(self.relay.prompt_ms / 1000, 3),
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
                    progress = chunk.get("prompt_progress")
                    if isinstance(progress, Mapping):
                        done = int(progress.get("cache", 0)) + int(progress.get("processed", 0))
                        gateway.checkpoint_progress(checkpoint, done)
                    runtime.costs.observe_timings(chunk.get("timings"))
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

    async def _reply(self, lease: Lease) -> Tokens:
        """Stream the reply (the relay), then end it; the slot then holds the prompt."""
        runtime, asm = self.runtime, self.assembler
        resume_from, self._resume_from = self._resume_from, None

        def on_output() -> None:
            suspendable = runtime.store is not None and asm.continuable
            runtime.gateway.decoding(lease, suspendable=suspendable)

        await self.relay.reply(lease.slot, resume_from=resume_from, on_output=on_output)
        self._emit(asm.finish(runtime.clock()))
        if self.record.status is RequestStatus.RUNNING:
            self.record.advance(RequestStatus.OK)
        return self.prepared.tokens


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
        if config.store_dir is not None:
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

    def later(self, work: Callable[..., Any], *args: Any) -> bool:
        """Run ``work(*args)`` in the background; False (dropped) when the runtime is stopping."""
        if self._tg is None:
            return False
        self._tg.start_soon(work, *args)
        return True

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
        if exchange.failure is None:
            self.tree.replied(record.agent, exchange.broadcast.emitted)
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
