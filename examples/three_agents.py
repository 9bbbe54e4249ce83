"""Three agents share one llama-server through the agentkv library, without agentkv-server.

A coordinator (priority 0), a frontend agent (P1) and a test-writing agent (P2) each take two short
turns on the same system prompt. Two engine slots serve three agents, so somebody always waits.

The scheduling parts are pure (sans-IO): they take values and the current time and return values.

* ``MessagesTranslator`` turns an Anthropic Messages body into a llama-server chat body;
* ``PrefixFingerprinter`` hashes the prefix that body puts in a slot's KV cache;
* ``FairScheduler`` orders the waiting tickets by priority with aging;
* ``SlotManager`` leases the idle slot whose cache holds the most of the prefix;
* ``SSEAssembler`` turns engine chunks into Anthropic events.

This file supplies the I/O around them: a dispatch loop that pops tickets and acquires leases,
one task per request that streams from ``LlamaSlotClient`` pinned to ``lease.slot``, and a
``finally`` that releases the lease whatever happens.

Run::

    python examples/three_agents.py                      # launches llama-server, default model
    python examples/three_agents.py --upstream URL       # a running llama-server (-np >= 2)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
import attrs

from agentkv import (
    AgentKVError,
    EngineRequest,
    FairScheduler,
    Fingerprint,
    Lease,
    LlamaSlotClient,
    MatchKind,
    MessagesTranslator,
    PrefixFingerprinter,
    SlotManager,
    SlotStats,
    SlotView,
    SSEAssembler,
    Ticket,
)
from agentkv.sse import accumulate

N_SLOTS = 2
CTX_PER_SLOT = 4096
MAX_TOKENS = 16

# About 300 tokens, shared by all three agents: the prefix worth keeping in a slot's KV cache.
SYSTEM_PROMPT = """\
You are one agent in a small team of coding agents working on the same repository, a web shop
written in Python (Starlette back end) and TypeScript (React front end). A coordinator splits the
work, a frontend agent changes the user interface, and a test agent writes and runs the tests.

Rules for every agent:
1. Read the relevant code before you change it. Never guess a function's signature.
2. Keep every change small and focused on the task you were given; do not refactor on the side.
3. Follow the existing style: type hints everywhere, short docstrings, comments that say why.
4. Public functions keep their names and arguments; add parameters only with defaults.
5. Every bug fix comes with a test that fails before the fix and passes after it.
6. Never commit secrets, tokens, passwords or generated files such as build outputs.
7. Prefer the standard library; add a dependency only when the coordinator agrees.
8. When a command fails, read the whole error message before trying something else.
9. Report what you changed, how you checked it, and what is still open, in at most five lines.
10. If a task is unclear, ask the coordinator one precise question instead of guessing.

The repository layout: backend/ holds the Starlette application, its models and its database
migrations; frontend/ holds the React components, hooks and styles; tests/ holds pytest tests for
the back end and vitest tests for the front end; docs/ holds the user and operator documentation.
Answer briefly.
"""


@attrs.frozen
class Agent:
    """One agent: who it is, how urgent its requests are, and what it asks in each turn."""

    name: str
    priority: int  # 0 = most urgent … 3 = background
    turns: tuple[str, ...]


AGENTS = (
    Agent(
        "coordinator",
        0,
        (
            "Split the task 'add a discount code field to checkout' into steps. One line.",
            "Which agent should take the first step? One word.",
        ),
    ),
    Agent(
        "frontend",
        1,
        (
            "Name the React component that should hold the discount code input.",
            "Which hook stores its value? One word.",
        ),
    ),
    Agent(
        "tests",
        2,
        (
            "Name one pytest test for the discount code endpoint.",
            "What status code should an unknown code return? One number.",
        ),
    ),
)


@attrs.frozen
class RequestResult:
    """What one request did: when it arrived, when it got which slot, and what the engine reused."""

    agent: str
    priority: int
    turn: int
    ticket: int
    arrival: float
    dispatch_seq: int  # 1, 2, …: the order in which requests got a slot
    slot: int
    match: MatchKind
    shared_blocks: int  # leading prefix blocks the slot shared with the request
    cache_n: int  # prompt tokens llama-server took from the slot's KV cache
    prompt_n: int  # prompt tokens it had to compute
    reply: str
    #: The reply as the agent's next request carries it (an Anthropic assistant message).
    assistant: dict[str, Any] = attrs.field(eq=False, repr=False, factory=dict)
    error: str | None = None

    @property
    def cached_share(self) -> float:
        """Share of the prompt served from cache."""
        total = self.cache_n + self.prompt_n
        return self.cache_n / total if total else 0.0


@attrs.frozen
class Report:
    """Every request's result, and the slot table after the run."""

    results: tuple[RequestResult, ...]
    stats: SlotStats
    slots: tuple[SlotView, ...]
    free: int
    n_slots: int
    wall_s: float


@attrs.frozen
class _Job:
    """What a ticket carries: the client's request and where the result goes."""

    agent: Agent
    turn: int
    body: dict[str, Any]  # the Anthropic Messages body
    request: EngineRequest  # the same, translated for llama-server


@attrs.define
class Orchestrator:
    """Owns the pure scheduling state of one engine and does the waiting around it.

    Single event loop, no lock: the pure objects are only touched between awaits.
    """

    client: LlamaSlotClient
    n_slots: int
    echo: Callable[[str], None] = print
    clock: Callable[[], float] = time.monotonic
    translator: MessagesTranslator = attrs.field(factory=MessagesTranslator)
    fingerprinter: PrefixFingerprinter = attrs.field(factory=PrefixFingerprinter)
    scheduler: FairScheduler = attrs.field(factory=FairScheduler)
    slots: SlotManager = attrs.field(init=False)
    results: list[RequestResult] = attrs.field(init=False, factory=list)
    _ids: itertools.count[int] = attrs.field(init=False, factory=lambda: itertools.count(1))
    _seq: itertools.count[int] = attrs.field(init=False, factory=lambda: itertools.count(1))
    _running: int = attrs.field(init=False, default=0)
    _wake: anyio.Event = attrs.field(init=False, factory=anyio.Event)

    def __attrs_post_init__(self) -> None:
        self.slots = SlotManager(self.n_slots)

    def submit(self, agent: Agent, turn: int, body: dict[str, Any], now: float) -> Ticket:
        """Translate and fingerprint a request, and queue its ticket (arrival = ``now``)."""
        request = self.translator.translate(body)
        ticket = Ticket(
            id=next(self._ids),
            agent=agent.name,
            priority=agent.priority,
            arrival=now,
            fingerprint=self.fingerprinter.fingerprint(request.body),
            payload=_Job(agent, turn, body, request),
        )
        self.scheduler.submit(ticket, now)
        return ticket

    async def drain(self) -> None:
        """Dispatch until the queue is empty and every running request has finished."""
        async with anyio.create_task_group() as tg:
            while len(self.scheduler) or self._running:
                now = self.clock()
                while self.slots.free and len(self.scheduler):
                    ticket = self.scheduler.pop(now, hits=self._hits)
                    assert ticket is not None  # the queue is not empty
                    lease = self.slots.acquire(ticket.fingerprint, now, agent=ticket.agent)
                    assert lease is not None  # a slot is free
                    self._running += 1
                    tg.start_soon(self._run, ticket, lease, next(self._seq))
                # Woken when a request ends and its slot is free again.
                await self._wake.wait()
                self._wake = anyio.Event()

    def _hits(self, ticket: Ticket) -> bool:
        # Near-ties in score go to a ticket whose prefix is cached in an idle slot.
        match = self.slots.peek(ticket.fingerprint)
        return match is not None and match.kind is not MatchKind.MISS

    async def _run(self, ticket: Ticket, lease: Lease, seq: int) -> None:
        job: _Job = ticket.payload
        assembler = SSEAssembler(message_id=f"msg_{ticket.id:04d}", model=job.request.model)
        events = assembler.start()
        timings: dict[str, Any] = {}
        holds: Fingerprint | None = None
        assistant = _assistant_turn({})
        error: str | None = None
        try:
            async with self.client.stream(job.request.body, slot=lease.slot) as chunks:
                async for chunk in chunks:
                    timings = chunk.get("timings") or timings
                    events += assembler.feed(chunk, self.clock())
                    if assembler.stop is not None:
                        break  # a degenerate loop: closing the stream stops llama-server
            events += assembler.finish(self.clock())
            assistant = _assistant_turn(accumulate(events))
            holds = self._holds_after(job, assistant)
        except AgentKVError as exc:
            error = exc.message
        finally:
            # Synchronous, so nothing (not even cancellation) can skip it. The slot now holds the
            # prompt plus the reply; after a failure nobody knows what it holds.
            if self.slots.release(lease, self.clock(), fingerprint=holds) and holds is None:
                self.slots.invalidate(lease.slot)
            self._running -= 1
            self._wake.set()
        result = RequestResult(
            agent=job.agent.name,
            priority=job.agent.priority,
            turn=job.turn,
            ticket=ticket.id,
            arrival=ticket.arrival,
            dispatch_seq=seq,
            slot=lease.slot,
            match=lease.match.kind,
            shared_blocks=lease.match.shared_blocks,
            cache_n=int(timings.get("cache_n", 0)),
            prompt_n=int(timings.get("prompt_n", 0)),
            reply=_text(assistant),
            assistant=assistant,
            error=error,
        )
        self.results.append(result)
        self.echo(_line(result))

    def _holds_after(self, job: _Job, assistant: dict[str, Any]) -> Fingerprint:
        """The fingerprint of the conversation including the reply: what the slot caches now.

        The agent's next turn extends exactly this, so it finds this slot as a prefix hit.
        """
        body = {**job.body, "messages": [*job.body["messages"], assistant]}
        return self.fingerprinter.fingerprint(self.translator.translate(body).body)


def _assistant_turn(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message an agent appends to its history for an Anthropic reply."""
    content = message.get("content") or [{"type": "text", "text": "(no reply)"}]
    return {"role": "assistant", "content": content}


def _text(message: dict[str, Any]) -> str:
    blocks = message.get("content", [])
    return "".join(b.get("text", "") for b in blocks if b.get("type") == "text")


def _line(r: RequestResult) -> str:
    outcome = f"error: {r.error}" if r.error else repr(r.reply[:40])
    return (
        f"#{r.dispatch_seq} {r.agent:<11} P{r.priority} turn {r.turn}  slot {r.slot} "
        f"{r.match.value:<6} ({r.shared_blocks} blocks)  cache_n {r.cache_n:>4} / "
        f"prompt_n {r.prompt_n:>4} ({r.cached_share:4.0%} cached)  {outcome}"
    )


def _body(history: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": "local",
        "system": SYSTEM_PROMPT,
        "messages": list(history),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }


@asynccontextmanager
async def _engine(
    upstream: str | None, progress: Callable[[str], None] | None
) -> AsyncIterator[str]:
    """The engine's URL: ``upstream``, or a llama-server launched here and stopped on exit."""
    if upstream:
        yield upstream
        return
    # Imported here: only the launching path needs them.
    from agentkv.runtime.engine import EngineConfig, LlamaServerProcess
    from agentkv.runtime.model import default_model_path

    # The first call joins the model's parts and hashes them: file work, kept off the loop.
    model = await anyio.to_thread.run_sync(default_model_path)
    config = EngineConfig(model=model, slots=N_SLOTS, ctx_per_slot=CTX_PER_SLOT, port=0)
    async with LlamaServerProcess(config, on_progress=progress) as process:
        yield process.base_url


async def main(
    upstream: str | None = None,
    *,
    echo: Callable[[str], None] = print,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Run the three agents for two turns each and return what happened.

    ``echo`` gets one line per finished request and the final slot statistics; ``progress``
    hears how launching llama-server goes.
    """
    async with _engine(upstream, progress) as url, LlamaSlotClient(url) as client:
        await client.wait_ready(600.0)
        # Lease only slots the engine has: -np of a running llama-server is whatever it was given.
        n_slots = N_SLOTS if upstream is None else len(await client.slots())
        orchestrator = Orchestrator(client, n_slots, echo=echo)
        histories: dict[str, list[dict[str, Any]]] = {agent.name: [] for agent in AGENTS}
        started = time.monotonic()
        for turn in (1, 2):
            # All three agents ask at the same moment. They are queued lowest priority first, so
            # FIFO alone would serve the coordinator last: only its priority puts it first.
            now = orchestrator.clock()
            for agent in reversed(AGENTS):
                history = histories[agent.name]
                history.append({"role": "user", "content": agent.turns[turn - 1]})
                orchestrator.submit(agent, turn, _body(history), now)
            await orchestrator.drain()
            for result in orchestrator.results[-len(AGENTS) :]:
                histories[result.agent].append(result.assistant)
        slots = orchestrator.slots
        report = Report(
            results=tuple(orchestrator.results),
            stats=slots.stats(),
            slots=tuple(slots.table()),
            free=slots.free,
            n_slots=n_slots,
            wall_s=time.monotonic() - started,
        )
    stats = report.stats
    echo(
        f"slots: {report.free}/{report.n_slots} free, refcounts "
        f"{[row.refcount for row in report.slots]}; acquired {stats.acquired}: "
        f"exact {stats.exact}, prefix {stats.prefix}, miss {stats.miss} "
        f"(hit rate {stats.hit_rate:.0%}); {report.wall_s:.1f} s"
    )
    return report


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--upstream", metavar="URL", help="a running llama-server (default: launch one)"
    )
    args = parser.parse_args(argv)

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        report = anyio.run(functools.partial(main, args.upstream, progress=progress))
    except AgentKVError as exc:  # no engine, no model, engine failed to start
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    return 0 if all(r.error is None for r in report.results) else 1


if __name__ == "__main__":
    raise SystemExit(cli())
