"""What each slot holds and what the prefix store keeps: one owner for both.

Every change to a slot's recorded content goes through :class:`SlotContents`: a park, a restore,
a checkpoint, a suspended request's progress, deleted entries, an engine restart. It alone switches
the store off when llama-server cannot serve it, and every step reads the store as it is *now*.
Leases are not content: the :class:`~agentkv.runtime.dispatcher.Dispatcher` keeps the slot table
and hands this module its content writer (:class:`~agentkv.slots.ContentWriter`) once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import anyio
import attrs

from agentkv._types import Lease, Source
from agentkv.costs import CostModel
from agentkv.exceptions import (
    AgentKVError,
    EngineError,
    EngineRestartingError,
    EngineTimeoutError,
    EngineUnavailableError,
)
from agentkv.runtime.chunks import prompt_done
from agentkv.runtime.dispatcher import Checkpoint, Dispatcher
from agentkv.runtime.seam import Engine
from agentkv.runtime.status import EngineStatus
from agentkv.runtime.store import PrefixStore
from agentkv.slots import ContentWriter
from agentkv.store import EntryKind, StoreEntry, StoreIndex
from agentkv.tokens import Tokens, common_prefix

__all__ = ["SlotContents"]

log = logging.getLogger("agentkv.runtime")

_T = TypeVar("_T")


@attrs.define(eq=False)
class SlotContents:
    """The slots' recorded contents and the prefix store of one engine.

    ``store`` is None when there is no store, or once it was switched off; ``later`` runs work
    in the background (dropping files nobody waits for) and says False when it cannot.
    """

    dispatcher: Dispatcher
    client: Engine
    costs: CostModel
    store: PrefixStore | None = None
    clock: Callable[[], float] = time.monotonic
    later: Callable[..., bool] = attrs.field(default=lambda *_: False)
    #: The slot table's content writer: this is its one owner.
    slots: ContentWriter = attrs.field(init=False)
    _off: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self.slots = self.dispatcher.hand_contents()

    @classmethod
    def create(
        cls,
        dispatcher: Dispatcher,
        client: Engine,
        costs: CostModel,
        compat: str,
        clock: Callable[[], float] = time.monotonic,
        later: Callable[..., bool] = lambda *_: False,
    ) -> SlotContents:
        """The cache of one engine, with the store its config asks for (``store_dir``), bound
        to the engine configuration ``compat``; an engine without slot files has none."""
        config, store = dispatcher.config, None
        if config.store_dir is not None and client.slot_files:
            index = StoreIndex(
                budget=config.store_budget, compat=compat, context_ttl=config.store_context_ttl
            )
            store = PrefixStore(config.store_dir, client, index)
        return cls(dispatcher, client, costs, store, clock=clock, later=later)

    def index(self) -> StoreIndex | None:
        """The prefix store's index while there is a store (placement prices restores and plans
        checkpoints from it)."""
        return self.store.index if self.store is not None else None

    @property
    def enabled(self) -> bool:
        """A store is on now (parking, restores, checkpoints and suspensions are possible)."""
        return self.store is not None

    # -- the store's life -------------------------------------------------------------------------

    async def open(self) -> None:
        """Load the store's index of an earlier run (entries that cannot be trusted go)."""
        if self.store is not None:
            refused = await self.store.open()
            if refused:
                log.info("prefix store: %d entries refused and deleted", len(refused))

    async def guard(self, work: Awaitable[_T]) -> _T | None:
        """Run a store operation; None when it failed, never fatal to the request unless the
        engine is restarting (its slots are gone). A store the engine cannot serve (an error
        status) is switched off; a link that failed (twice: the client retried) leaves it on.
        Either way nothing is lost: a failed restore prefills, a failed save keeps the state in
        its slot."""
        try:
            return await work
        except EngineRestartingError:
            raise
        except (EngineUnavailableError, EngineTimeoutError) as exc:
            log.warning("a prefix store operation failed; going on without it: %s", exc.message)
            return None
        except EngineError as exc:
            if not self._off:
                log.warning("prefix store is off: llama-server cannot save slots (%s)", exc.message)
            self.switch_off()
            return None

    def switch_off(self) -> None:
        """No store from now on: placement stops pricing restores, nobody saves or parks."""
        self._off = True
        self.store = None

    async def clear(self, *, agent: str | None = None) -> int:
        """Delete the store's entries (every one, or one agent's) and their files; slots whose
        content they covered count as unsaved again. Returns how many were deleted."""
        if self.store is None:
            return 0
        removed = await self.store.clear(agent=agent)
        for entry_id in removed:
            self.slots.forget_entry(entry_id)
        log.info(
            "prefix store: %d entries deleted%s", len(removed), f" of {agent}" if agent else ""
        )
        return len(removed)

    async def run_upkeep(self, interval: float) -> None:
        """Every ``interval`` seconds, forever: delete the saved contexts of agents that are
        gone (best effort). Run it in the runtime's task group."""
        while True:
            await anyio.sleep(interval)
            if self.store is not None:
                with contextlib.suppress(AgentKVError, OSError):
                    await self.store.expire()

    async def follow_engine_restarts(self, status: EngineStatus) -> None:
        """A restarted engine's slots are all empty: forget what they held, every time."""
        generation = status.generation
        while True:
            generation = await status.wait_generation(generation)
            for slot in range(self.dispatcher.config.n_slots):
                self.slots.invalidate(slot)
            log.info("engine restarted (generation %d): slot contents forgotten", generation)

    def engine_changed(self, slots: range, up: bool) -> None:
        """An engine of a pool left placement (``up`` False) or rejoined it, its slots empty
        either way (:class:`agentkv.runtime.pool.EnginePool`); the queue goes on elsewhere."""
        if up:
            self.slots.bring_back(slots)
            self.dispatcher.wake()
        else:
            self.slots.take_out(slots)

    # -- preparing a leased slot ------------------------------------------------------------------

    async def park(self, lease: Lease) -> bool:
        """Save the slot's present content before the lease overwrites it, when placement said
        it is worth it; True when it was saved."""
        store = self.store
        if not lease.placement.park or store is None or not lease.evicted:
            return False
        previous = self.slots.table()[lease.slot].sections
        return await self._save_context(store, lease.slot, lease.evicted_agent, previous)

    async def _save_context(
        self,
        store: PrefixStore,
        slot: int,
        agent: str | None,
        sections: tuple[tuple[str, str], ...],
    ) -> bool:
        """Save what ``slot`` holds as ``agent``'s context; True when it was saved."""
        entry = await self.guard(
            store.save(slot, EntryKind.CONTEXT, agent=agent, sections=sections)
        )
        if entry is None:
            return False
        self.slots.mark_stored(slot, entry.id)
        return True

    async def restore(self, lease: Lease, tokens: Tokens) -> bool | None:
        """Load the saved state placement chose for a prompt of ``tokens``, verified: None when
        placement chose no restore, True when the slot now holds the entry, False when it did
        not work (the slot then counts as empty and the prompt is prefilled)."""
        placement = lease.placement
        if placement.source is not Source.STORE:
            return None
        store = self.store  # read now: a park just before may have switched the store off
        entry = store.index.get(placement.entry_id) if store and placement.entry_id else None
        if store is not None and entry is not None:
            started = self.clock()
            restored = await self.guard(store.restore(entry, lease.slot))
            if restored is not None:
                seconds = self.clock() - started
                self.costs.restore.observe(entry.nbytes, seconds)
                reuse = common_prefix(tokens, entry.tokens)
                store.record_hit(
                    entry.id,
                    tokens_saved=reuse,
                    seconds_saved=max(0.0, self.costs.prefill.estimate(0, reuse) - seconds),
                )
                self._holds(lease.slot, entry)
                return True
        self.slots.invalidate(lease.slot)
        return False

    async def checkpoint(
        self,
        lease: Lease,
        checkpoint: Checkpoint,
        sections: tuple[tuple[str, str], ...],
        computed: Callable[[Mapping[str, Any]], object] | None = None,
    ) -> StoreEntry | None:
        """Compute the shareable head alone and save it for other agents to restore; the entry
        saved, or None. ``computed`` is told the engine's ``timings`` of the head's computation,
        as the request counts those tokens as its own.

        Requests waiting for the head are let go when it is saved; when the save failed they wait
        for this request to give the slot back, and reuse the head there
        (``Dispatcher.release``)."""
        dispatcher = self.dispatcher
        if self.store is None:
            dispatcher.end_checkpoint(checkpoint)
            return None
        entry = None
        try:
            async with self.client.prefill(checkpoint.tokens, slot=lease.slot) as chunks:
                async for chunk in chunks:
                    dispatcher.note_progress(lease)
                    done = prompt_done(chunk)
                    if done is not None:
                        dispatcher.checkpoint_progress(checkpoint, done)
                    timings = chunk.get("timings")
                    self.costs.observe_timings(timings)
                    if isinstance(timings, Mapping) and "prompt_n" in timings and computed:
                        computed(timings)
            for _ in range(2):  # a save that failed is tried once more: others wait for it
                store = self.store  # a failed save may have switched it off
                if entry is None and store is not None:
                    entry = await self.guard(
                        store.save(lease.slot, EntryKind.PREFIX, agent=None, sections=sections)
                    )
            if entry is not None:
                self._holds(lease.slot, entry)
        except BaseException:
            dispatcher.end_checkpoint(checkpoint)
            raise
        if entry is not None:
            dispatcher.end_checkpoint(checkpoint)
        return entry

    def _holds(self, slot: int, entry: StoreEntry) -> None:
        """``slot`` now holds what ``entry`` saved."""
        self.slots.set_content(slot, entry.tokens, stored=entry.id, sections=entry.sections)

    async def save_at_stop(self, limit: float) -> int:
        """:meth:`save_for_restart`, bounded by ``limit`` seconds and shielded from the stop's
        cancellation; a failure is logged, never raised (the engine may be gone)."""
        saved = 0
        with anyio.move_on_after(limit, shield=True):
            try:
                saved = await self.save_for_restart()
            except Exception as exc:
                log.warning("could not save the slots for the next start: %r", exc)
        if saved:
            log.info("saved %d slot(s) to the prefix store for the next start", saved)
        return saved

    async def save_for_restart(self) -> int:
        """At a clean stop: save, as its agent's context, what each idle slot holds past the
        longest entry it begins with (however few tokens: a turn's follow-up is often a few
        dozen), so that the next turn after a restart restores it. The number saved; nothing is
        tried when the engine no longer answers (a Ctrl-C in a terminal reaches it too)."""
        store = self.store
        if store is None or not await self.client.health():
            return 0
        saved = 0
        for row in self.slots.table():
            store = self.store  # a failed save may have switched it off
            if store is None:
                break
            if row.held or row.stored is not None or not row.tokens:
                continue
            best = store.index.best(row.tokens)
            if best is not None and best[1] >= len(row.tokens):
                continue
            if await self._save_context(store, row.slot, row.agent, row.sections):
                saved += 1
        return saved

    # -- a suspended request's progress -----------------------------------------------------------

    async def save_progress(self, slot: int, agent: str) -> tuple[Tokens | None, StoreEntry | None]:
        """After a suspension: keep what the slot computed, pinned in the store until
        :meth:`forget_progress`. Returns what the slot holds now (None: unknown) and the entry
        that holds it (None when nothing was saved)."""
        store = self.store
        if store is None:
            return None, None
        try:
            entry = await store.save(slot, EntryKind.SUSPENDED, agent=agent)
        except EngineError as exc:
            log.warning("could not save a suspended request's progress: %s", exc.message)
            return None, None
        if entry is None:
            return (), None
        store.index.pin(entry.id)
        self.slots.mark_stored(slot, entry.id)
        return entry.tokens, entry

    def forget_progress(self, entry_ids: list[str]) -> None:
        """The request ended: its saved progress is of no more use (unpinned, then dropped)."""
        store = self.store
        if store is None:
            return
        for entry_id in entry_ids:
            store.index.unpin(entry_id)
            self.later(store.drop, entry_id)
