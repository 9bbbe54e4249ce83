"""Running compaction jobs: ask the model for a summary through the scheduler, then warm the slot.

The planning and rewriting are pure (``agentkv.compaction``); this module does the waiting and the
engine calls, a background job in the dispatcher's background lane at priority 3. With a
``summarizer`` (a second, small engine: ``--compaction-model``) the summary is written there, one
at a time, and only the prefill of the compacted conversation takes a slot of the agents' engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import anyio.abc
import attrs

from agentkv import AgentKVError, PrefixFingerprinter, Ticket
from agentkv.compaction import (
    Compaction,
    CompactionPlan,
    CompactionStore,
    plan_compaction,
    rebase,
    summary_request,
)
from agentkv.runtime.dispatcher import Dispatcher
from agentkv.runtime.hints import LEAST_URGENT, EngineHints
from agentkv.runtime.seam import Engine

__all__ = ["Compactor"]

log = logging.getLogger("agentkv.server")


@attrs.define
class Compactor:
    """Plans, runs and records compactions for the agents of one engine."""

    dispatcher: Dispatcher
    client: Engine
    fingerprinter: PrefixFingerprinter
    #: The engine that writes the summaries, when it is not the agents' own.
    summarizer: Engine | None = None
    keep_recent: int = 6
    summary_tokens: int = 320
    store: CompactionStore = attrs.field(factory=CompactionStore)
    clock: Callable[[], float] = time.monotonic
    _tasks: anyio.abc.TaskGroup | None = None
    #: Per agent, the compaction in flight.
    _inflight: dict[str, _Job] = attrs.field(factory=dict)
    #: The summarizer writes one summary at a time (it has one slot).
    _summarizing: anyio.Lock = attrs.field(factory=anyio.Lock)

    def attach(self, tasks: anyio.abc.TaskGroup | None) -> None:
        """Where background jobs run (the server's lifespan task group); None stops scheduling."""
        self._tasks = tasks

    def schedule(
        self, agent: str, raw: Mapping[str, Any], tokens: int, share: float | None = None
    ) -> bool:
        """Start a background compaction of ``agent``'s request ``raw`` (as the client sent it,
        an engine body; ``tokens`` long with the agent's compactions applied) unless one is in
        flight; True if started. A ``share`` folds only the oldest messages that hold that share
        of the prompt (:func:`agentkv.compaction.plan_compaction`)."""
        if self._tasks is None or agent in self._inflight:
            return False
        job = self._begin(agent, raw, share)
        if job is None:
            return False
        self._tasks.start_soon(self._background, agent, tokens, job)
        return True

    async def _background(self, agent: str, tokens: int, job: _Job) -> None:
        try:
            await self._run(agent, tokens, job, priority=LEAST_URGENT, background=True)
        except AgentKVError as exc:
            log.warning("background compaction for agent %s failed: %s", agent, exc.message)

    def _begin(self, agent: str, raw: Mapping[str, Any], share: float | None) -> _Job | None:
        """The job for ``raw``, planned on the request as the agent's compactions rewrite it, and
        in flight from now on; None when there is nothing to compact or one is in flight."""
        body, _, applied = self.store.rewrite(agent, raw, self.fingerprinter)
        plan = plan_compaction(
            body,
            agent=agent,
            keep_recent=self.keep_recent,
            fingerprinter=self.fingerprinter,
            share=share,
        )
        if plan is None:
            return None
        job = _Job(plan, body, rebase(plan, raw, applied, self.fingerprinter), tuple(applied))
        if not self.store.begin(agent):
            return None
        self._inflight[agent] = job  # in flight from now on, before its task first runs
        return job

    async def compact(
        self,
        agent: str,
        raw: Mapping[str, Any],
        tokens: int,
        *,
        priority: int,
        background: bool,
    ) -> Compaction | None:
        """Summarise the oldest turns of ``raw`` (the client's request, an engine body) and
        remember it for ``agent``; the leased slot is then prefilled with the compacted
        conversation, so the agent's next request is a prefix hit there. One already in flight
        for the agent is made as urgent as ``priority`` and its result returned instead."""
        job = self._inflight.get(agent)
        if job is not None:
            if job.ticket is not None:
                self.dispatcher.promote(job.ticket, priority)
            await job.done.wait()
            return self.store.latest(agent)
        job = self._begin(agent, raw, None)
        if job is None:
            return None
        return await self._run(agent, tokens, job, priority=priority, background=background)

    async def _run(
        self, agent: str, tokens: int, job: _Job, *, priority: int, background: bool
    ) -> Compaction | None:
        plan, body = job.plan, job.body
        result: Compaction | None = None
        ask = summary_request(body, plan, max_tokens=self.summary_tokens)
        try:
            summary: str | None = None
            if self.summarizer is not None:
                # Written on the small engine: no slot of the agents' engine is taken for it.
                async with self._summarizing:
                    summary = _reply_text(await self.summarizer.chat(ask, slot=None))
                if not summary:
                    log.warning("compaction for agent %s produced no summary", agent)
                    return None
            job.ticket = self.dispatcher.submit(
                f"{agent} (compaction)", priority, background=background
            )
            lease = await self.dispatcher.wait(job.ticket)
            job.ticket = None
            holds: tuple[int, ...] | None = None
            # An engine that places requests itself runs the summary where the agent's context is.
            hints = EngineHints(agent=agent, priority=priority)
            try:
                if summary is None:
                    summary = _reply_text(await self.client.chat(ask, slot=lease.slot, hints=hints))
                if not summary:
                    log.warning("compaction for agent %s produced no summary", agent)
                    return None
                compacted = Compaction(plan, summary, created_at=self.clock()).apply(body)
                # Stored as a plan on the client's own request: it replaces the ones it folds.
                result = Compaction(
                    job.stored, summary, created_at=self.clock(), tokens_before=tokens
                )
                warm = await self.client.chat(
                    {**compacted, "max_tokens": 1}, slot=lease.slot, hints=hints
                )
                timings = warm.get("timings") or {}
                after = int(timings.get("prompt_n", 0)) + int(timings.get("cache_n", 0))
                result = attrs.evolve(result, tokens_after=after)
                # The slot now holds the compacted conversation: the agent's next request hits it.
                holds = tuple(await self.client.prompt_tokens(compacted))
            finally:
                self.dispatcher.release(lease, holds=holds)
            log.info(
                "compacted agent %s: %d messages -> summary, %d -> %d prompt tokens",
                agent,
                plan.cut,
                result.tokens_before,
                result.tokens_after,
            )
            return result
        finally:
            self.store.end(agent, result, replaces=job.applied)
            self._inflight.pop(agent, None)
            job.done.set()


@attrs.define
class _Job:
    """A compaction in flight: its plan on the request as rewritten (``body``), the same plan on
    the client's own request (``stored``), the compactions it folds, its ticket while it waits for
    a slot, and its end."""

    plan: CompactionPlan
    body: Mapping[str, Any]
    stored: CompactionPlan
    applied: tuple[Compaction, ...]
    ticket: Ticket | None = None
    done: anyio.Event = attrs.field(factory=anyio.Event)


def _reply_text(reply: Mapping[str, Any]) -> str:
    try:
        content = reply["choices"][0]["message"].get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        return ""
    return content.strip() if isinstance(content, str) else ""
