"""A checkpoint's request runs at the urgency of whoever waits for it (the dispatcher alone)."""

from __future__ import annotations

from agentkv._types import Lease
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.dispatcher import Dispatcher
from agentkv.store import StoreIndex

#: A sub-agent's head (system prompt, tools, environment note) and three prompts that share it.
HEAD = tuple(range(1, 3001))
BACKGROUND = (*HEAD, 9001, 9002)
FOREGROUND = (*HEAD, 9101, 9102)
OTHER = tuple(range(50_001, 53_001))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def priority_of(dispatcher: Dispatcher, lease: Lease) -> int | None:
    """The urgency the request holding ``lease`` runs at now, as the operator's view says."""
    return dispatcher.snapshot().slots[lease.slot].priority


def _dispatcher(**config: object) -> Dispatcher:
    settings = {"n_slots": 2, "preempt_from": 1, **config}
    index = StoreIndex(budget=1 << 40)
    return Dispatcher(
        RuntimeConfig(**settings),  # type: ignore[arg-type]
        store_index=lambda: index,
        clock=Clock(),
    )


def _start(
    dispatcher: Dispatcher, agent: str, priority: int, tokens: tuple[int, ...], *, head: int | None
):
    """Submit, take the lease and declare it running; returns (lease, suspensions seen)."""
    ticket = dispatcher.submit(agent, priority, tokens, head=head)
    waiter = dispatcher._waiters[ticket.id]
    assert waiter.lease is not None, f"{agent} got no slot"
    lease = waiter.lease
    del dispatcher._waiters[ticket.id]
    suspended: list[str] = []
    dispatcher.declare_running(lease, priority, lambda: suspended.append(agent))
    return lease, suspended


def test_a_waited_on_subagent_lends_its_urgency_to_the_head_it_waits_for() -> None:
    """A P0 sub-agent arrives while its P1 sibling computes their shared head and a P2 request
    of another session prefills: the sibling's checkpoint goes on at P0 (never suspended for
    it), the P2 prefill is suspended, and new P2 work waits until the head is saved."""
    dispatcher = _dispatcher()
    sibling, sibling_suspended = _start(dispatcher, "s/bg", 1, BACKGROUND, head=len(HEAD))
    checkpoint = dispatcher.checkpoint_of(sibling)
    assert checkpoint is not None
    other, other_suspended = _start(dispatcher, "other", 2, OTHER, head=None)

    foreground = dispatcher.submit("s/fg", 0, FOREGROUND, head=len(HEAD))
    assert dispatcher._waiters[foreground.id].blocked_on is checkpoint
    assert other_suspended == ["other"]  # the engine is the head's
    assert sibling_suspended == []
    assert priority_of(dispatcher, sibling) == 0
    # The suspended request gives its slot back and queues again: it waits while the head is
    # computed for a P0 waiter.
    dispatcher.release(other, holds=OTHER[:512])
    again = dispatcher.submit("other", 2, OTHER, head=None)
    assert dispatcher._waiters[again.id].lease is None

    # The head is saved: the sibling goes back to its own priority, the P0 sub-agent takes the
    # free slot, and the P2 request still waits while a P0 request runs.
    dispatcher.checkpoint_progress(checkpoint, len(HEAD))
    dispatcher.end_checkpoint(checkpoint)
    assert priority_of(dispatcher, sibling) == 1
    lease = dispatcher._waiters[foreground.id].lease
    assert lease is not None and lease.slot == other.slot
    assert dispatcher._waiters[again.id].lease is None


def test_without_a_free_slot_the_released_waiter_suspends_less_urgent_work() -> None:
    """When the head is saved and both slots are still busy, the P0 waiter suspends the least
    urgent request still computing its prompt, as it would have on arrival."""
    dispatcher = _dispatcher(preempt_from=1)
    sibling, sibling_suspended = _start(dispatcher, "s/bg", 2, BACKGROUND, head=len(HEAD))
    checkpoint = dispatcher.checkpoint_of(sibling)
    assert checkpoint is not None
    _, other_suspended = _start(dispatcher, "other", 2, OTHER, head=None)
    # A P1 waiter lends P1 (not urgent enough to quiet the engine).
    waiting = dispatcher.submit("s/fg", 1, FOREGROUND, head=len(HEAD))
    assert priority_of(dispatcher, sibling) == 1
    assert other_suspended == []
    # It becomes waited on (P0): the lent urgency follows, and the engine goes quiet for it.
    dispatcher.reprioritise("s/fg", 0)
    assert priority_of(dispatcher, sibling) == 0
    assert other_suspended == ["other"]
    assert waiting.id in dispatcher._waiters
    dispatcher.end_checkpoint(checkpoint)
    # Both slots are still held (the suspended request has not given its back yet): the
    # sibling, back at P2 and still prefilling its own tokens, is the one suspended now.
    assert sibling_suspended == ["s/bg"]


def test_a_checkpoint_nobody_urgent_waits_for_keeps_its_own_priority() -> None:
    dispatcher = _dispatcher()
    sibling, _ = _start(dispatcher, "s/bg", 1, BACKGROUND, head=len(HEAD))
    _, other_suspended = _start(dispatcher, "other", 2, OTHER, head=None)
    dispatcher.submit("s/bg2", 2, (*HEAD, 9201), head=len(HEAD))
    assert priority_of(dispatcher, sibling) == 1
    assert other_suspended == []


def test_the_slot_a_suspension_frees_goes_to_the_request_it_was_freed_for() -> None:
    """With aging, an older P1 ticket outranks a fresh P0 one; but the slot the P0 ticket had a
    P2 request suspended for is the P0 ticket's."""
    dispatcher = _dispatcher()
    clock = dispatcher.clock
    assert isinstance(clock, Clock)
    busy, _ = _start(dispatcher, "busy", 1, BACKGROUND, head=None)
    victim, victim_suspended = _start(dispatcher, "victim", 2, OTHER, head=None)
    old = dispatcher.submit("old", 1, tuple(range(70_001, 71_001)))  # queued: no slot free
    clock.now = 60.0  # it has aged: 1 - 0.1 x 60 = -5, below any fresh P0 ticket's score
    urgent = dispatcher.submit("urgent", 0, tuple(range(80_001, 81_001)))
    assert victim_suspended == ["victim"]
    dispatcher.release(victim, holds=OTHER[:512])
    assert dispatcher._waiters[urgent.id].lease is not None
    assert dispatcher._waiters[old.id].lease is None
    del busy


def test_a_request_suspended_for_urgent_work_counts_its_quiet_aging_from_the_suspension() -> None:
    """A P2 request that had waited long is suspended for a P0 waiter's head; queued again with
    its old arrival, it does not start next to the head at once (its queue order keeps its whole
    wait), but the quiet rule still lets it go once it has waited its priority's worth again."""
    dispatcher = _dispatcher()
    clock = dispatcher.clock
    assert isinstance(clock, Clock)
    sibling, _ = _start(dispatcher, "s/bg", 1, BACKGROUND, head=len(HEAD))
    other, other_suspended = _start(dispatcher, "other", 2, OTHER, head=None)
    arrival = 0.0
    clock.now = 146.0
    dispatcher.submit("s/fg", 0, FOREGROUND, head=len(HEAD))
    assert other_suspended == ["other"]
    clock.now = 160.0  # its batch ended, its progress is saved: it queues again
    dispatcher.release(other, holds=OTHER[:512])
    again = dispatcher.submit("other", 2, OTHER, arrival=arrival)
    assert dispatcher._waiters[again.id].lease is None  # 2 - 0.1 x (160 - 146) > 0: quiet
    clock.now = 167.0  # 2 - 0.1 x 21 < 0: the bound holds
    dispatcher._dispatch()  # as any event does
    assert dispatcher._waiters[again.id].lease is not None
    del sibling


def test_an_urgent_arrival_quiets_every_less_urgent_prefill_at_once() -> None:
    """Two P2 prompts prefill on both slots when a P0 request arrives: both are suspended at
    once (each stops at the end of the engine's batch in progress), not the second only when P0
    starts; the first slot given back is P0's, and the other stays free while P0 prepares."""
    dispatcher = _dispatcher()
    first, first_suspended = _start(dispatcher, "bg-1", 2, BACKGROUND, head=None)
    second, second_suspended = _start(dispatcher, "bg-2", 2, OTHER, head=None)
    urgent = dispatcher.submit("coordinator", 0, tuple(range(80_001, 81_001)))
    assert first_suspended == ["bg-1"] and second_suspended == ["bg-2"]
    # The one that was not the chosen victim gives its slot back first: P0 takes it.
    dispatcher.release(first, holds=BACKGROUND[:512])
    lease = dispatcher._waiters[urgent.id].lease
    assert lease is not None and lease.slot == first.slot
    again = dispatcher.submit("bg-1", 2, BACKGROUND, head=None)
    # The other comes back while P0 still restores its context (not declared running yet): a
    # P2 prompt does not start next to it.
    dispatcher.release(second, holds=OTHER[:512])
    assert dispatcher._waiters[again.id].lease is None
    del dispatcher._waiters[urgent.id]
    dispatcher.declare_running(lease, 0, lambda: None)
    assert dispatcher._waiters[again.id].lease is None
    # P0 done: the queued P2 request goes.
    dispatcher.release(lease, holds=None)
    assert dispatcher._waiters[again.id].lease is not None


def test_a_lease_the_watchdog_reclaims_lets_its_checkpoints_waiters_go() -> None:
    """A request computing a shared head hangs past the lease TTL: the watchdog reclaims its
    lease, and the request waiting for that head is dispatched instead of waiting for a save
    that will never come."""
    dispatcher = _dispatcher(n_slots=1, lease_ttl=60.0)
    sibling, _ = _start(dispatcher, "s/bg", 1, BACKGROUND, head=len(HEAD))
    checkpoint = dispatcher.checkpoint_of(sibling)
    assert checkpoint is not None
    waiting = dispatcher.submit("s/fg", 1, FOREGROUND, head=len(HEAD))
    assert dispatcher._waiters[waiting.id].blocked_on is checkpoint
    dispatcher.clock.now = 61.0  # type: ignore[attr-defined]
    assert dispatcher.sweep() == [sibling]
    assert checkpoint.done
    assert dispatcher.checkpoint_of(sibling) is None
    lease = dispatcher._waiters[waiting.id].lease
    assert lease is not None and lease.slot == sibling.slot
    # It computes the head itself now, as the checkpoint of its own lease.
    assert [c.agent for c in dispatcher.snapshot().checkpoints] == ["s/fg"]
