"""One request's whole life: the script, each step done by the part that owns it.

::

    Runtime.prepare(body, agent, priority)        before any response is sent    admission
        translate, compact, count, fit to the slot, measure the shareable head
    Runtime.submit(prepared) → Exchange            queued (529 when full)         dispatcher
    Exchange.drive(), a task of the runtime:
        message_start at once                                                     broadcast
        wait for a lease: the scheduler's order, the slot chosen by cost          dispatcher
        on the slot:                                                              contents
            park        the slot's present content, if worth it (save → store)
            restore     a saved state holding more of the prompt (verified, else prefill)
            checkpoint  compute a long shareable head alone and save it for others
        the reply: engine chunks → SSEAssembler → reply events                    relay
            bounded by the client's timeout; a degenerate loop is cut
            once more, constrained to a declared tool, when a tool call broke
        suspended by a more urgent request: save progress, queue again, resume    contents
        release the lease (always, synchronously), record the request     dispatcher, record
    Exchange.events(): replays what was emitted and follows it live               broadcast

An exchange belongs to the runtime, not to an HTTP connection: a client that goes away only
detaches, and a retry of the same request within ``retry_grace`` seconds joins the running
exchange instead of computing it again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import anyio
import anyio.abc
import attrs

from agentkv._types import Lease, Ticket
from agentkv.agents import AgentPlace
from agentkv.costs import CostModel
from agentkv.exceptions import AgentKVError, EngineUnavailableError
from agentkv.fingerprint import PrefixFingerprinter
from agentkv.reply import ReplyEvent
from agentkv.runtime.admission import Admission, Prepared
from agentkv.runtime.broadcast import Broadcast, Emitted, Event, Failed, KeepAlive
from agentkv.runtime.compactor import Compactor
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.contents import SlotContents
from agentkv.runtime.dispatcher import Dispatcher
from agentkv.runtime.joinable import Joinable
from agentkv.runtime.prefetch import Prefetcher
from agentkv.runtime.prepared import Preparations, claude_config_dir
from agentkv.runtime.record import RequestHistory, RequestRecord, RequestStatus
from agentkv.runtime.relay import Relay
from agentkv.runtime.seam import Engine
from agentkv.runtime.store import PrefixStore
from agentkv.runtime.tree import AgentTree
from agentkv.snapshot import RuntimeSnapshot
from agentkv.sse import SSEAssembler
from agentkv.tokens import Tokens
from agentkv.translate import MessagesTranslator

__all__ = ["Emitted", "Exchange", "Failed", "KeepAlive", "Prepared", "Runtime"]

log = logging.getLogger("agentkv.runtime")


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
    #: Background work (a prepared compaction nobody has asked for yet), until :meth:`claim`.
    background: bool = attrs.field(default=False, kw_only=True)
    #: The urgency it runs at: its request's, or the client's that claimed it.
    priority: int = attrs.field(init=False)
    #: The replayable events and the clients following them.
    broadcast: Broadcast = attrs.field(init=False)
    #: The engine calls of the reply.
    relay: Relay = attrs.field(init=False)
    _scope: anyio.CancelScope = attrs.field(factory=anyio.CancelScope)
    #: Store entries holding this request's saved progress (pinned until it ends).
    _suspended: list[str] = attrs.field(factory=list)
    #: The exact tokens a reply suspended mid-way left in its slot (prompt and reply so far).
    _resume_from: Tokens | None = None
    #: Milliseconds the engine spent computing a head of the prompt on its own first.
    _head_ms: float = 0.0
    #: As background work, it was stopped to give its slot to an agent's request.
    _gave_way: bool = False

    def __attrs_post_init__(self) -> None:
        runtime = self.runtime
        config = runtime.config
        self.priority = self.prepared.priority
        self.broadcast = Broadcast(
            self._abandoned, config.retry_grace, config.ping_interval, runtime.later, runtime.clock
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
            client_timeout=config.client_timeout,
            coalesce_seconds=config.coalesce_seconds,
            clock=runtime.clock,
        )

    @property
    def done(self) -> bool:
        return self.broadcast.closed

    @property
    def failure(self) -> AgentKVError | None:
        return self.broadcast.failure

    @property
    def gave_way(self) -> bool:
        """It was background work, stopped to give its slot to an agent's request."""
        return self._gave_way

    @property
    def emitted(self) -> tuple[ReplyEvent, ...]:
        """The reply's events emitted so far."""
        return tuple(self.broadcast.emitted)

    @property
    def joinable(self) -> bool:
        """A retry of this request may take it over: nobody receives it, it has not failed."""
        return self.broadcast.unclaimed and not self._scope.cancel_called

    def events(self, ping_interval: float | None = None) -> AsyncIterator[Event]:
        """The reply's events for one client (:meth:`Broadcast.follow`): with no client left, the
        exchange is cancelled after ``retry_grace`` unless a retry joins it."""
        return self.broadcast.follow(ping_interval)

    async def message(self) -> dict[str, Any]:
        """The whole reply as one Message (non-streaming); raises the error that ended it."""
        return await self.broadcast.message()

    def cancel(self) -> None:
        """Stop the request now (the engine stops generating; the lease is released)."""
        self._scope.cancel()

    def claim(self, priority: int) -> None:
        """A client asked for exactly this request, prepared as background work: from now on it
        is that client's request, at its ``priority``."""
        if not self.background:
            return
        self.background = False
        self.priority = priority
        if not self.done:
            self.runtime.dispatcher.promote(self.ticket, priority)

    def _give_way(self) -> None:
        self._gave_way = True
        self.cancel()

    def _abandoned(self) -> None:
        log.info("client of agent %s is gone; stopping its request", self.prepared.agent)
        self.cancel()

    # -- the steps --------------------------------------------------------------------------------

    async def drive(self) -> None:
        """Run the request to its end. Never raises; the outcome is in the events."""
        runtime = self.runtime
        failure: AgentKVError | None = None
        try:
            with self._scope:
                self.broadcast.emit(self.assembler.start())
                await self._run()
            if self._scope.cancelled_caught:
                self.record.advance(RequestStatus.CANCELLED)
                # Only a client that is still listening (agentkv is stopping) reads this.
                failure = EngineUnavailableError(
                    "the prepared request gave its slot to an agent's request"
                    if self._gave_way
                    else "the request was cancelled: agentkv is stopping"
                )
        except AgentKVError as exc:
            log.warning("request of agent %s failed: %s", self.prepared.agent, exc.message)
            failure = exc
            self.record.advance(RequestStatus.FAILED, exc.error_type)
        except Exception:
            log.exception("request of agent %s failed unexpectedly", self.prepared.agent)
            failure = AgentKVError("internal error in agentkv; see the server log")
            self.record.advance(RequestStatus.FAILED, "api_error")
        finally:
            self.runtime.dispatcher.withdraw(self.ticket)
            runtime.contents.forget_progress(self._suspended)
            self._suspended.clear()
            self.record.ended(runtime.clock() - self.started, self.assembler.usage)
            self.broadcast.close(failure)

    async def _run(self) -> None:
        runtime = self.runtime
        ticket = self.ticket
        while True:
            lease = await runtime.dispatcher.wait(ticket)
            finished = await self._on_slot(lease)
            if finished:
                return
            # Suspended for a more urgent request: queue again, keeping the original arrival.
            self.record.advance(RequestStatus.SUSPENDED)  # counts the suspension
            ticket = self.ticket = runtime.dispatcher.requeue(
                ticket, priority=self.priority, background=self.background
            )

    async def _on_slot(self, lease: Lease) -> bool:
        """Use the leased slot; True when the request is finished, False when suspended."""
        runtime, record = self.runtime, self.record
        dispatcher = runtime.dispatcher
        placement, queued_s = lease.placement, runtime.clock() - self.started
        seq = dispatcher.dispatch_seq(lease)
        record.leased(lease.slot, placement.source.value, placement.reuse, seq, queued_s)
        # The cached sequence that shares most with the prompt now, to explain a miss by.
        candidate = dispatcher.best_source(self.prepared.tokens)
        holds: Tokens | None = None
        try:
            with anyio.CancelScope() as suspension:
                suspend = suspension.cancel if runtime.contents.enabled else None
                give_up = self._give_way if self.background else None
                dispatcher.declare_running(lease, self.priority, suspend, give_up)
                holds = await self._use_slot(lease)
            if not suspension.cancelled_caught:
                sections = self.prepared.engine.sections
                seconds = (self.relay.prompt_ms + self._head_ms) / 1000
                record.explain(seconds, sections, candidate)
                return True
            holds, entry = await runtime.contents.save_progress(lease.slot, self.prepared.agent)
            if entry is not None:
                self._suspended.append(entry.id)
                self._resume_from = entry.tokens if self.assembler.generated_text else None
            return False
        finally:
            dispatcher.release(lease, holds=holds, sections=self.prepared.engine.sections)

    async def _use_slot(self, lease: Lease) -> Tokens | None:
        """Prepare the slot (park, restore, checkpoint), then stream the reply."""
        runtime, record = self.runtime, self.record
        contents = runtime.contents
        if await contents.park(lease):
            record.parked_slot()
        if await contents.restore(lease, self.prepared.tokens) is False:
            record.restored_nothing()
        checkpoint = runtime.dispatcher.checkpoint_of(lease)
        if checkpoint is not None:
            entry = await contents.checkpoint(
                lease, checkpoint, self.prepared.engine.sections, self._head_computed
            )
            if entry is not None:
                record.checkpointed(entry.n_tokens)
        return await self._reply(lease)

    def _head_computed(self, timings: Mapping[str, Any]) -> None:
        self.record.head_computed(timings)
        self._head_ms += float(timings.get("prompt_ms", 0.0) or 0.0)

    async def _reply(self, lease: Lease) -> Tokens:
        """Stream the reply (the relay), then end it; the slot then holds the prompt (after a
        constrained retry, the part of it the retry found cached)."""
        runtime, asm = self.runtime, self.assembler
        resume_from, self._resume_from = self._resume_from, None

        def on_chunk(output: bool) -> None:
            # The watchdog leaves a lease alone while it progresses.
            runtime.dispatcher.note_progress(lease)
            if output:
                suspendable = runtime.contents.enabled and asm.continuable
                runtime.dispatcher.note_decoding(lease, suspendable=suspendable)

        await self.relay.reply(lease.slot, resume_from=resume_from, on_chunk=on_chunk)
        self.broadcast.emit(asm.finish(runtime.clock()))
        if self.record.status is RequestStatus.RUNNING:
            self.record.advance(RequestStatus.OK)
        if self.record.retried:
            # A constrained retry computed another prompt on the slot: this one up to the note
            # it added, which is what the engine found cached for it. Recording the whole prompt
            # would place a next request there as a hit that computes from the note on.
            return self.prepared.tokens[: self.relay.last_cached]
        return self.prepared.tokens


# -- the runtime ------------------------------------------------------------------------------


@attrs.define
class Runtime:
    """Everything between an Anthropic request and llama-server, for one engine.

    ``async with Runtime(client, config) as runtime:`` starts the background work (watchdog,
    compactions, store upkeep) and the exchanges; leaving it cancels what is still running.
    """

    client: Engine
    config: RuntimeConfig = attrs.field(factory=RuntimeConfig)
    #: The engine configuration the prefix store is bound to (model hash, build, context…).
    store_compat: str = ""
    clock: Callable[[], float] = time.monotonic
    translator: MessagesTranslator = attrs.field(init=False)
    fingerprinter: PrefixFingerprinter = attrs.field(init=False, factory=PrefixFingerprinter)
    #: Prices prefill, decode, save and restore; it learns from every reply.
    costs: CostModel = attrs.field(factory=CostModel, kw_only=True)
    #: A second, small engine that writes agentkv's own summaries (``--compaction-model``);
    #: None: the agents' engine writes them, on a slot of the background lane.
    summarizer: Engine | None = attrs.field(default=None, kw_only=True)
    #: The queue and the leases.
    dispatcher: Dispatcher = attrs.field(init=False)
    #: The one writer of slot contents, and the prefix store's owner.
    contents: SlotContents = attrs.field(init=False)
    compactor: Compactor = attrs.field(init=False)
    tree: AgentTree = attrs.field(init=False)
    admission: Admission = attrs.field(init=False)
    #: The requests that ended.
    history: RequestHistory = attrs.field(init=False, factory=RequestHistory)
    _tg: anyio.abc.TaskGroup | None = attrs.field(init=False, default=None)
    #: The exchanges a client's retry may join (running, or finished within retry_grace).
    joinable: Joinable[Exchange] = attrs.field(init=False)
    #: Claude Code's compactions prepared in idle time, waiting for their requests.
    preparations: Preparations[Exchange] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        config = self.config
        self.joinable = Joinable(config.retry_grace, self.clock)
        self.translator = MessagesTranslator(
            session_layout=config.session_layout, limits=config.limits
        )
        # The store's index and the warm agents are owned by parts built next: readers, then.
        self.dispatcher = Dispatcher(
            config,
            costs=self.costs,
            clock=self.clock,
            store_index=lambda: self.contents.index(),
            warm=(lambda: self.tree.warm()) if config.agent_tree else None,
        )
        self.contents = SlotContents.create(
            self.dispatcher, self.client, self.costs, self.store_compat, self.clock, self.later
        )
        self.tree = AgentTree(
            self.dispatcher,
            self.clock,
            config.agent_tree,
            config.background_agent_offset,
            prefetcher=(
                Prefetcher(self.submit, self.dispatcher.available, config.split_min)
                if config.agent_tree and self.store is not None
                else None
            ),
        )
        self.compactor = Compactor(
            dispatcher=self.dispatcher,
            client=self.client,
            fingerprinter=self.fingerprinter,
            summarizer=self.summarizer,
            keep_recent=config.compact_keep_messages,
            clock=self.clock,
        )
        self.admission = Admission(
            config, self.client, self.translator, self.compactor, self.dispatcher, self.contents
        )
        self.preparations = Preparations(
            prepare=lambda body, agent, priority: self.prepare(
                body, agent=agent, priority=priority
            ),
            start=self._submit_background,
            later=self.later,
            window=config.ctx_per_slot,
            enabled=config.prepare_compaction,
            wait=config.prepared_wait,
            clock=self.clock,
            config_dir=config.claude_config_dir or claude_config_dir(),
        )

    @property
    def store(self) -> PrefixStore | None:
        """The prefix store while it is on (to read: :attr:`contents` owns it)."""
        return self.contents.store

    async def __aenter__(self) -> Runtime:
        await self.contents.open()
        self._tg = await anyio.create_task_group().__aenter__()
        self._tg.start_soon(self.dispatcher.run_watchdog, self.config.watchdog_interval)
        self._tg.start_soon(self.contents.run_upkeep, 60.0)
        if self.client.status is not None:
            self._tg.start_soon(self.contents.follow_engine_restarts, self.client.status)
        # A pool's engines that go down leave placement; when they come back they rejoin, empty.
        self._tg.start_soon(self.client.watch, self.contents.engine_changed)
        self.compactor.attach(self._tg)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.compactor.attach(None)
        if self.config.stop_save > 0:  # agents' latest contexts outlive the process
            await self.contents.save_at_stop(self.config.stop_save)
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)

    def place_agent(
        self, root: str, sub: str | None, priority: int, body: Mapping[str, Any]
    ) -> AgentPlace:
        """Which agent of the tree a request belongs to (``root``, or its sub-agent ``sub``) and
        the priority it runs at; pass both to :meth:`prepare`."""
        place = self.tree.place(root, sub, priority, body)
        if sub is None:  # it may name the sub-agents its calls started, whose records ended
            self.tree.relabel(self.history.records())
        return place

    async def prepare(self, body: Mapping[str, Any], *, agent: str, priority: int) -> Prepared:
        """Validate and fit a Messages request (:meth:`Admission.prepare`)."""
        return await self.admission.prepare(body, agent=agent, priority=priority)

    def submit(self, prepared: Prepared) -> Exchange:
        """Queue a prepared request and start it; a retry of a running request joins it."""
        if self._tg is None:
            raise RuntimeError("the runtime is not running (use `async with Runtime(...)`)")
        existing = self.joinable.get(prepared.key)
        retry = existing is not None and existing.joinable
        claimed = self.preparations.claim(prepared, retry=retry)
        if claimed is not None:
            # The client's own retry of it joins it from now on, as for any request.
            if claimed.done:
                self.joinable.ended(prepared.key, claimed, keep=True)
            else:
                self.joinable.add(prepared.key, claimed)
            return claimed
        if existing is not None and existing.joinable:
            existing.record.attach()
            log.info(
                "agent %s retried a request that is %s; joining it",
                prepared.agent,
                "finished" if existing.done else "still running",
            )
            return existing
        return self._start(prepared, head=prepared.boundary)

    def _submit_background(self, prepared: Prepared, *, head: bool = False) -> Exchange:
        """Queue ``prepared`` as background work (a prepared compaction), held by
        :attr:`preparations` until a client claims it. ``head``: its shareable head is computed
        and saved first, as for a long uncached head of an agent's request."""
        return self._start(prepared, head=prepared.boundary if head else None, background=True)

    def _start(self, prepared: Prepared, *, head: int | None, background: bool = False) -> Exchange:
        ticket = self.dispatcher.submit(
            prepared.agent, prepared.priority, prepared.tokens, head=head, background=background
        )
        try:
            assert self._tg is not None
            assembler = self.admission.assembler(prepared)
            record = RequestRecord(
                agent=prepared.agent,
                priority=prepared.priority,
                ticket=ticket.id,
                prompt_tokens=len(prepared.tokens),
            )
            exchange = Exchange(
                self,
                prepared,
                ticket,
                assembler,
                record,
                started=ticket.arrival,
                background=background,
            )
            self.tree.label(record)
            if not background:
                self.joinable.add(prepared.key, exchange)
            self._tg.start_soon(self._drive, exchange)
            return exchange
        except BaseException:
            self.dispatcher.withdraw(ticket)  # nothing will ever wait for it
            raise

    async def _drive(self, exchange: Exchange) -> None:
        try:
            await exchange.drive()
        finally:
            ok, running = exchange.failure is None, self._tg is not None
            self.tree.ended(exchange.prepared, exchange.broadcast.emitted, ok=ok, running=running)
            # A sub-agent may have been linked to its call since it started (its parent's request).
            self.tree.relabel([exchange.record])
            self.history.add(exchange.record)
            if not exchange.background:  # a claimed one, or any other
                self.joinable.ended(exchange.prepared.key, exchange, keep=ok and running)
            self.preparations.ended(exchange, ok=ok, running=running)

    def later(self, work: Callable[..., Any], *args: Any) -> bool:
        """Run ``work(*args)`` in the background; False (dropped) when the runtime is stopping."""
        if self._tg is None:
            return False
        self._tg.start_soon(work, *args)
        return True

    def add_listener(self, listener: Callable[[RequestRecord], None]) -> None:
        """Call ``listener`` with the record of every request when it ends (metrics, logs)."""
        self.history.add_listener(listener)

    def running(self) -> list[RequestRecord]:
        """The records of the requests queued or running now."""
        now = self.clock()
        live = [e for e in [*self.joinable, *self.preparations.running()] if not e.done]
        for exchange in live:
            exchange.record.running_for(now - exchange.started)
        return [exchange.record for exchange in live]

    def records(self) -> list[RequestRecord]:
        """The most recent finished requests (the last 64), oldest first."""
        return self.history.records()

    def snapshot(self) -> RuntimeSnapshot:
        """The operator's view: slots, queue, store, agents, recent requests."""
        dispatcher = self.dispatcher.snapshot()
        tree = tuple(self.tree.view())
        return RuntimeSnapshot(
            slots=self.tree.annotate(dispatcher.slots, tree),
            queue=self.tree.annotate(dispatcher.queue, tree),
            background=dispatcher.background,
            checkpoints=dispatcher.checkpoints,
            placements=dispatcher.placements,
            store=self.store.snapshot() if self.store is not None else None,
            compactions=self.compactor.store.snapshot(),
            engines=self.client.engines(),
            agents=self.history.agents(),
            tree=tree,
            running=tuple(r.view() for r in self.running()),
            recent=tuple(r.view() for r in self.history.records()[-16:]),
            costs=self.costs.view(),
        )
