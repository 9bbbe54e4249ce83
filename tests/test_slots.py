"""SlotManager and placement: slots chosen by cost, in tokens; leases and the watchdog."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv._types import Placement, Source
from agentkv.costs import CostModel
from agentkv.slots import SlotManager, place
from agentkv.store import EntryKind, StoreEntry, StoreIndex, entry_id

COSTS = CostModel()
SYSTEM = tuple(range(1000, 2300))  # a 1,300-token system prompt


def tok(*parts: tuple[int, ...] | range) -> tuple[int, ...]:
    out: list[int] = []
    for part in parts:
        out.extend(part)
    return tuple(out)


def run(
    manager: SlotManager, tokens: tuple[int, ...], now: float, agent: str = "a", **kw: object
) -> Placement:
    """Place, acquire and release with the request's tokens as the slot's new content."""
    placement = manager.place(tokens, COSTS, **kw)  # type: ignore[arg-type]
    assert placement is not None
    lease = manager.acquire(placement, now, agent=agent, tokens=tokens)
    assert manager.release(lease, now + 1, holds=tokens)
    return placement


def test_first_request_takes_an_empty_slot_and_computes_everything() -> None:
    manager = SlotManager(2)
    placement = run(manager, tok(SYSTEM, (1, 2, 3)), 0)
    assert placement.source is Source.NONE and placement.reuse == 0
    assert placement.seconds > 0


def test_same_agent_second_question_goes_to_the_slot_sharing_its_prompt() -> None:
    """A slot sharing 1,300 tokens beats an empty one (the measured 6.4 s vs 1 s case)."""
    manager = SlotManager(2)
    first = run(manager, tok(SYSTEM, range(5000, 5100)), 0)
    second = manager.place(tok(SYSTEM, range(7000, 7060)), COSTS)
    assert second is not None
    assert second.slot == first.slot
    assert second.source is Source.SLOT and second.reuse == len(SYSTEM)


def fill(manager: SlotManager, slot: int, tokens: tuple[int, ...], now: float = 0) -> None:
    """Put ``tokens`` into ``slot`` (whatever placement would have chosen)."""
    lease = manager.acquire(Placement(slot, 0, Source.NONE), now, agent=f"s{slot}", tokens=tokens)
    manager.release(lease, now, holds=tokens)


def test_the_longest_shared_prefix_wins() -> None:
    manager = SlotManager(3)
    fill(manager, 0, tok(SYSTEM, range(5000, 5200), range(9000, 9300)))
    fill(manager, 1, tok(SYSTEM, range(5000, 5500)))
    request = tok(SYSTEM, range(5000, 5500), (1, 2))
    placement = manager.place(request, COSTS)
    assert placement is not None and placement.slot == 1
    assert placement.reuse == len(SYSTEM) + 500


def test_an_empty_slot_is_preferred_to_overwriting_another_agents_context() -> None:
    """A request sharing nothing leaves a busy agent's 6,000-token context alone."""
    manager = SlotManager(2)
    held = run(manager, tuple(range(6000)), 0, agent="x")
    placement = manager.place(tuple(range(50_000, 50_300)), COSTS)
    assert placement is not None and placement.slot != held.slot
    assert placement.source is Source.NONE


def test_overwriting_unsaved_content_parks_it_when_a_store_exists() -> None:
    """With every slot holding an unsaved context, the overwritten one is parked first."""
    manager = SlotManager(1)
    run(manager, tuple(range(6000)), 0, agent="x")
    store = StoreIndex(budget=10**10)
    placement = manager.place(tuple(range(50_000, 50_300)), COSTS, store=store)
    assert placement is not None and placement.park
    without = manager.place(tuple(range(50_000, 50_300)), COSTS)
    assert without is not None and not without.park  # nowhere to park it
    # A small remainder is not worth a save.
    assert not manager.place((*tuple(range(5900)), 7), COSTS, store=store).park  # type: ignore[union-attr]


def test_a_stored_state_that_holds_more_is_restored() -> None:
    """A fresh agent whose project prefix is in the store gets it restored, not recomputed."""
    manager = SlotManager(2)
    head = tok(SYSTEM, range(3000, 11000))
    store = StoreIndex(budget=10**10)
    entry = StoreEntry(
        id=entry_id(EntryKind.PREFIX, head),
        kind=EntryKind.PREFIX,
        tokens=head,
        nbytes=len(head) * 12_300,
        created=0,
        last_used=0,
    )
    store.add(entry, 0)
    placement = manager.place(tok(head, (1, 2, 3)), COSTS, store=store)
    assert placement is not None
    assert placement.source is Source.STORE and placement.entry_id == entry.id
    assert placement.reuse == len(head)
    assert placement.seconds < 2  # a restore and 3 tokens, not 9,300 tokens of prefill


def test_a_restore_is_not_chosen_for_a_gain_smaller_than_its_cost() -> None:
    """When the slot already shares nearly everything, a big restore is not worth it."""
    manager = SlotManager(1)
    request = tok(SYSTEM, range(3000, 9000))
    run(manager, request[:-2], 0)
    store = StoreIndex(budget=10**12)
    store.add(
        StoreEntry(
            id="akv-prefix-x",
            kind=EntryKind.PREFIX,
            tokens=request[:-1],
            nbytes=10**11,  # very slow to read
            created=0,
            last_used=0,
        ),
        0,
    )
    placement = manager.place(request, COSTS, store=store)
    assert placement is not None and placement.source is Source.SLOT


def test_ties_go_to_the_least_recently_used_slot() -> None:
    manager = SlotManager(2)
    a = run(manager, (1,) * 10, 0)
    b = run(manager, (2,) * 10, 5)
    placement = manager.place((3,) * 10, COSTS)
    assert placement is not None and placement.slot == a.slot != b.slot


def test_busy_slots_are_never_handed_out() -> None:
    manager = SlotManager(1)
    placement = manager.place((1, 2), COSTS)
    assert placement is not None
    manager.acquire(placement, 0, agent="a", tokens=(1, 2))
    assert manager.place((1, 2), COSTS) is None
    assert manager.free == 0
    with pytest.raises(ValueError, match="busy"):
        manager.acquire(placement, 1, agent="b", tokens=(1, 2))


def test_release_records_what_the_slot_holds() -> None:
    manager = SlotManager(1)
    placement = manager.place((1, 2, 3), COSTS)
    assert placement is not None
    lease = manager.acquire(placement, 0, agent="a", tokens=(1, 2, 3))
    assert manager.table()[0].refcount == 1  # the deprecated number for ``held``
    assert manager.release(lease, 1, holds=(1, 2, 3, 4))
    assert manager.table()[0].tokens == (1, 2, 3, 4) and manager.table()[0].refcount == 0
    assert manager.table()[0].agent == "a" and not manager.table()[0].held
    assert not manager.release(lease, 2, holds=())  # a second release changes nothing
    assert manager.table()[0].tokens == (1, 2, 3, 4)


def test_release_of_unknown_content_empties_the_slot() -> None:
    """After a failure nobody knows what the slot holds: it must not promise a cache."""
    manager = SlotManager(1)
    run(manager, (1, 2, 3), 0)
    placement = manager.place((1, 2, 3, 4), COSTS)
    assert placement is not None and placement.reuse == 3
    lease = manager.acquire(placement, 1, agent="a", tokens=(1, 2, 3, 4))
    manager.release(lease, 2, holds=None)
    assert manager.table()[0].tokens == ()


def test_stored_content_stays_marked_until_it_changes() -> None:
    manager = SlotManager(1)
    run(manager, (1, 2, 3), 0)
    manager.mark_stored(0, "akv-x")
    assert manager.table()[0].stored == "akv-x"
    placement = manager.place((1, 2, 3), COSTS)
    assert placement is not None
    lease = manager.acquire(placement, 1, agent="a", tokens=(1, 2, 3))
    manager.release(lease, 2, holds=(1, 2, 3))  # unchanged: still saved
    assert manager.table()[0].stored == "akv-x"
    manager.forget_entry("akv-x")
    assert manager.table()[0].stored is None


def test_sweep_reclaims_expired_leases_and_forgets_their_content() -> None:
    manager = SlotManager(2, lease_ttl=10)
    run(manager, (9, 9), 0)
    placement = manager.place((1,), COSTS)
    assert placement is not None
    lease = manager.acquire(placement, 0, agent="stuck", tokens=(1,))
    assert manager.sweep(5) == []
    assert manager.sweep(11) == [lease]
    assert manager.free == 2
    assert manager.table()[lease.slot].tokens == ()
    assert manager.stats().reclaimed == 1
    assert not manager.release(lease, 12, holds=(1,))


def test_a_lease_that_reports_progress_is_never_reclaimed_mid_way() -> None:
    """A prefill that outlasts lease_ttl but keeps reporting progress keeps its slot; once it
    falls silent for lease_ttl, the watchdog takes the slot back."""
    manager = SlotManager(1, lease_ttl=10)
    placement = manager.place((1, 2), COSTS)
    assert placement is not None
    lease = manager.acquire(placement, 0, agent="slow", tokens=(1, 2))
    for now in range(8, 100, 8):  # progress every 8 s, for 96 s: ten times the TTL
        assert manager.touch(lease.id, now)
        assert manager.sweep(now + 1) == []
    assert manager.sweep(96 + 10) == []  # silent for exactly the TTL: not yet
    assert manager.sweep(96 + 11) == [lease]
    assert not manager.touch(lease.id, 120)  # no longer live
    assert manager.stats().reclaimed == 1


def test_touch_never_moves_a_lease_s_clock_back() -> None:
    manager = SlotManager(1, lease_ttl=10)
    placement = manager.place((1,), COSTS)
    assert placement is not None
    lease = manager.acquire(placement, 0, agent="a", tokens=(1,))
    manager.touch(lease.id, 30)
    manager.touch(lease.id, 5)  # a late report of older progress
    assert manager.sweep(39) == []
    assert manager.sweep(41) == [lease]


def test_invalidate_forgets_content() -> None:
    manager = SlotManager(1)
    run(manager, (1, 2), 0)
    manager.invalidate(0)
    assert manager.table()[0].tokens == ()
    with pytest.raises(ValueError):
        manager.invalidate(3)


def test_stats_count_sources_and_tokens() -> None:
    manager = SlotManager(1)
    run(manager, (1, 2, 3, 4), 0)
    run(manager, (1, 2, 3, 4, 5, 6), 1)
    stats = manager.stats()
    assert (stats.acquired, stats.cold, stats.from_slot) == (2, 1, 1)
    assert stats.reused_tokens == 4 and stats.computed_tokens == 4 + 2
    assert stats.hit_rate == 0.5


def test_place_on_no_idle_slot_is_none() -> None:
    assert place((1,), [], COSTS) is None


ops = st.lists(
    st.tuples(
        st.sampled_from(["acquire", "release", "release-unknown", "sweep", "touch"]),
        st.lists(st.integers(0, 3), max_size=8),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_sequences_keep_the_table_consistent(sequence: list[tuple[str, list[int]]]) -> None:
    """Whatever happens, a slot is leased at most once and its held flag matches the live leases."""
    manager = SlotManager(3, lease_ttl=5)
    leases = []
    now = 0.0
    for op, tokens in sequence:
        now += 1
        if op == "acquire":
            placement = manager.place(tuple(tokens), COSTS)
            if placement is None:
                assert manager.free == 0
                continue
            leases.append(manager.acquire(placement, now, agent="a", tokens=tuple(tokens)))
        elif op in ("release", "release-unknown") and leases:
            lease = leases.pop(0)
            manager.release(lease, now, holds=None if op == "release-unknown" else tuple(tokens))
        elif op == "sweep":
            manager.sweep(now)
        elif op == "touch" and leases:
            manager.touch(leases[0].id, now)
        rows = manager.table()
        assert manager.free == sum(1 for row in rows if not row.held)
        live = [lease for lease in leases if manager.lease(lease.id) is not None]
        assert sorted(lease.slot for lease in live) == sorted(row.slot for row in rows if row.held)


def test_a_waiting_coordinators_context_is_overwritten_last_and_always_parked() -> None:
    """Its slot is the one kept; when it must go, even a small context is saved first."""
    manager = SlotManager(2)
    run(manager, tuple(range(3000)), 0, agent="coordinator")
    run(manager, tuple(range(10_000, 13_000)), 1, agent="other")
    store = StoreIndex(budget=10**10)
    fresh = tuple(range(50_000, 50_300))
    # Least recently used would be the coordinator's slot; waiting, it is kept.
    plain = manager.place(fresh, COSTS, store=store)
    kept = manager.place(fresh, COSTS, store=store, keep={"coordinator"})
    assert plain is not None and plain.slot == 0
    assert kept is not None and kept.slot == 1
    small = SlotManager(1)
    run(small, tuple(range(100)), 0, agent="coordinator")
    assert not small.place(fresh, COSTS, store=store, park_min=256).park  # type: ignore[union-attr]
    parked = small.place(fresh, COSTS, store=store, park_min=256, keep={"coordinator"})
    assert parked is not None and parked.park


def test_a_restore_may_start_from_an_entry_that_goes_on_past_the_divergence() -> None:
    """A new agent restores the stored context that shares the most tokens with it, even when
    that context goes on past the point where the two part ways (its own turns), rather than
    a shorter entry that holds nothing else."""
    manager = SlotManager(1)
    head = tok(SYSTEM, range(3000, 5000))
    other_agent = tok(head, range(60_000, 60_040), range(70_000, 72_000))
    store = StoreIndex(budget=10**10)
    for kind, tokens in ((EntryKind.PREFIX, head), (EntryKind.CONTEXT, other_agent)):
        store.add(
            StoreEntry(
                id=entry_id(kind, tokens),
                kind=kind,
                tokens=tokens,
                nbytes=len(tokens) * 12_300,
                created=0,
                last_used=0,
                agent="other" if kind is EntryKind.CONTEXT else None,
            ),
            0,
        )
    new_agent = tok(head, range(60_000, 60_040), range(80_000, 80_010))
    placement = manager.place(new_agent, COSTS, store=store)
    assert placement is not None and placement.source is Source.STORE
    assert placement.entry_id == entry_id(EntryKind.CONTEXT, other_agent)
    assert placement.reuse == len(head) + 40
