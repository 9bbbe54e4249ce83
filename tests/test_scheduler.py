"""FairScheduler: priority with aging, cache-affine near-ties, cap and starvation bound."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv._types import Ticket
from agentkv.exceptions import QueueFullError
from agentkv.scheduler import FairScheduler


def ticket(id: int, priority: int, arrival: float, agent: str = "") -> Ticket:
    return Ticket(id=id, agent=agent or f"agent-{id}", priority=priority, arrival=arrival)


def filled(scheduler: FairScheduler, *tickets: Ticket) -> FairScheduler:
    for t in tickets:
        scheduler.submit(t, t.arrival)
    return scheduler


def drain(scheduler: FairScheduler, now: float) -> list[int]:
    """Pop everything at ``now`` and return the ids in dispatch order."""
    ids = []
    while (t := scheduler.pop(now)) is not None:
        ids.append(t.id)
    return ids


def test_lowest_priority_number_runs_first() -> None:
    """With equal waits, priority 0 is dispatched before 1, 2 and 3."""
    s = filled(FairScheduler(), ticket(1, 3, 0.0), ticket(2, 1, 0.0), ticket(3, 0, 0.0))
    assert drain(s, 0.0) == [3, 2, 1]


def test_score_is_priority_minus_aging_times_wait() -> None:
    """score() follows priority - aging * (now - arrival)."""
    s = FairScheduler(aging=0.5)
    assert s.score(ticket(1, 2, 10.0), 14.0) == pytest.approx(0.0)
    assert s.score(ticket(1, 3, 10.0), 10.0) == 3.0


def test_waiting_lets_a_background_ticket_overtake() -> None:
    """A priority-3 ticket that has waited long enough runs before a fresh priority-0 one."""
    s = filled(FairScheduler(aging=0.1), ticket(1, 3, 0.0), ticket(2, 0, 40.0))
    first = s.pop(40.0)
    assert first is not None and first.id == 1


def test_equal_scores_are_fifo() -> None:
    """Ties in score go to the earlier arrival, then the lower id."""
    s = FairScheduler(aging=1.0)
    # All three score -7 at now=10: priority 1 waited 8 s, priority 2 waited 9 s.
    filled(s, ticket(5, 1, 2.0), ticket(4, 2, 1.0), ticket(3, 1, 2.0))
    assert [score for _, score in s.queued(10.0)] == [-7.0, -7.0, -7.0]
    assert drain(s, 10.0) == [4, 3, 5]


def test_hits_wins_a_near_tie() -> None:
    """Within tie_window of the best score, a ticket whose prefix is cached goes first."""
    s = filled(FairScheduler(aging=0.1, tie_window=0.25), ticket(1, 1, 0.0), ticket(2, 1, 2.0))
    # Scores at 2.0: ticket 1 = 0.8, ticket 2 = 1.0 (within 0.25).
    chosen = s.pop(2.0, hits=lambda t: t.id == 2)
    assert chosen is not None and chosen.id == 2


def test_hits_does_not_bend_a_clear_order() -> None:
    """Outside the tie window the cache hit does not matter."""
    s = filled(FairScheduler(aging=0.1, tie_window=0.25), ticket(1, 0, 0.0), ticket(2, 1, 0.0))
    chosen = s.pop(0.0, hits=lambda t: t.id == 2)
    assert chosen is not None and chosen.id == 1


def test_among_hits_the_lowest_score_wins() -> None:
    """Several hitting tickets in the window: the best-scored of them is chosen."""
    s = FairScheduler(aging=0.1, tie_window=0.5)
    filled(s, ticket(1, 1, 0.0), ticket(2, 1, 1.0), ticket(3, 1, 3.0), ticket(4, 2, 0.0))
    asked: list[int] = []

    def hits(t: Ticket) -> bool:
        asked.append(t.id)
        return t.id in (2, 3)

    chosen = s.pop(3.0, hits=hits)
    assert chosen is not None and chosen.id == 2
    assert 4 not in asked  # outside the window: the predicate is not even consulted


def test_no_hit_falls_back_to_the_best_score() -> None:
    """When no ticket in the window hits, the best score wins as usual."""
    s = filled(FairScheduler(), ticket(1, 1, 0.0), ticket(2, 1, 1.0))
    chosen = s.pop(1.0, hits=lambda t: False)
    assert chosen is not None and chosen.id == 1


def test_cancel_removes_a_queued_ticket() -> None:
    """cancel returns the ticket once, then None; it is never dispatched."""
    t = ticket(1, 1, 0.0)
    s = filled(FairScheduler(), t, ticket(2, 2, 0.0))
    assert s.cancel(1) == t
    assert s.cancel(1) is None
    assert len(s) == 1
    popped = s.pop(0.0)
    assert popped is not None and popped.id == 2


def test_full_queue_raises_overloaded() -> None:
    """Submitting beyond max_queue raises QueueFullError (HTTP 529) with a clear message."""
    s = FairScheduler(max_queue=2)
    filled(s, ticket(1, 1, 0.0), ticket(2, 1, 0.0))
    with pytest.raises(QueueFullError) as info:
        s.submit(ticket(3, 1, 0.0), 0.0)
    assert info.value.message == "queue is full: 2 requests waiting; retry later"
    assert info.value.status == 529
    assert info.value.to_anthropic()["error"]["type"] == "overloaded_error"
    assert len(s) == 2


def test_default_cap_is_256() -> None:
    """The default queue holds 256 tickets and refuses the 257th."""
    s = FairScheduler()
    for i in range(256):
        s.submit(ticket(i, 2, 0.0), 0.0)
    with pytest.raises(QueueFullError, match="queue is full: 256 requests waiting; retry later"):
        s.submit(ticket(256, 2, 0.0), 0.0)


@pytest.mark.parametrize("priority", [-1, 4])
def test_priority_outside_range_is_rejected(priority: int) -> None:
    """Priorities other than 0..3 raise ValueError."""
    with pytest.raises(ValueError, match=r"priority must be 0\.\.3"):
        FairScheduler().submit(ticket(1, priority, 0.0), 0.0)


def test_duplicate_ticket_id_is_rejected() -> None:
    """A ticket id can be queued only once."""
    s = filled(FairScheduler(), ticket(1, 1, 0.0))
    with pytest.raises(ValueError, match="already queued"):
        s.submit(ticket(1, 2, 0.0), 0.0)


@pytest.mark.parametrize(
    "kwargs", [{"aging": 0.0}, {"max_queue": 0}, {"tie_window": -0.1}], ids=str
)
def test_invalid_configuration_is_rejected(kwargs: dict[str, Any]) -> None:
    """Aging must be positive (or nothing bounds waiting), the cap positive, the window >= 0."""
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        FairScheduler(**kwargs)


def test_queued_lists_dispatch_order_with_scores() -> None:
    """queued(now) is what pop would return one by one (without hits), with current scores."""
    s = filled(FairScheduler(aging=0.1), ticket(1, 2, 0.0), ticket(2, 0, 5.0), ticket(3, 2, 1.0))
    listing = s.queued(10.0)
    assert [(t.id, round(score, 9)) for t, score in listing] == [(2, -0.5), (1, 1.0), (3, 1.1)]
    assert [t.id for t, _ in listing] == drain(s, 10.0)


# --- the starvation bound ---------------------------------------------------------------------

events = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, 3), st.integers(0, 30)),
        st.tuples(st.just("pop"), st.integers(0, 30), st.booleans()),
    ),
    max_size=80,
)


@settings(max_examples=300)
@given(
    ops=events,
    aging=st.sampled_from([0.05, 0.1, 0.5, 1.0]),
    tie_window=st.sampled_from([0.0, 0.25, 1.0]),
    use_hits=st.booleans(),
    hit_seed=st.integers(0, 2**16),
)
def test_starvation_bound(
    ops: list[tuple[Any, ...]], aging: float, tie_window: float, use_hits: bool, hit_seed: int
) -> None:
    """Whenever U is dispatched while T waits, a_U - a_T <= (p_T - p_U + w) / aging."""
    s = FairScheduler(aging=aging, max_queue=16, tie_window=tie_window)
    now, next_id = 0.0, 0
    window = tie_window if use_hits else 0.0
    for op in ops:
        if op[0] == "submit":
            now += op[2] / 10
            if len(s) < s.max_queue:
                s.submit(ticket(next_id, op[1], now), now)
                next_id += 1
            continue
        now += op[1] / 10
        waiting = [t for t, _ in s.queued(now)]

        def hits(t: Ticket) -> bool:
            return hash((hit_seed, t.id)) % 3 == 0

        chosen = s.pop(now, hits=hits if use_hits else None)
        assert (chosen is None) == (not waiting)
        for other in waiting:
            if chosen is not None and other.id != chosen.id:
                bound = (other.priority - chosen.priority + window) / aging
                assert chosen.arrival - other.arrival <= bound + 1e-9
                # The stated corollary: T is served before anything arriving (p_T + w)/aging later.
                assert chosen.arrival - other.arrival <= (other.priority + window) / aging + 1e-9


@given(st.lists(st.integers(0, 3), min_size=1, max_size=30))
def test_every_ticket_is_dispatched_once(priorities: list[int]) -> None:
    """Popping until empty returns every submitted ticket exactly once."""
    s = FairScheduler()
    for i, p in enumerate(priorities):
        s.submit(ticket(i, p, float(i)), float(i))
    out = []
    while (t := s.pop(100.0, hits=lambda t: t.id % 2 == 0)) is not None:
        out.append(t.id)
    assert sorted(out) == list(range(len(priorities)))
    assert len(s) == 0
