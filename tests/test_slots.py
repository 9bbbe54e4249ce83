"""SlotManager: cache-affine slot leases, release, watchdog and hit counters."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv._types import Fingerprint, Lease, MatchKind
from agentkv.fingerprint import PrefixFingerprinter
from agentkv.slots import SlotManager, SlotStats

FP = PrefixFingerprinter()


def conversation(agent: str, turns: int, *, system: str = "shared system prompt") -> Fingerprint:
    """The fingerprint of ``agent``'s conversation after ``turns`` user turns."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{agent} asks {turn}"})
        messages.append({"role": "assistant", "content": f"answer {turn} for {agent}"})
    return FP.fingerprint({"messages": messages, "tools": [{"name": "read"}]})


def held(manager: SlotManager, fp: Fingerprint, now: float = 0.0) -> None:
    """Lease a slot for ``fp`` and release it at once, so the slot caches ``fp``."""
    lease = manager.acquire(fp, now)
    assert lease is not None
    assert manager.release(lease, now)


def test_first_request_takes_an_empty_slot_and_misses() -> None:
    """With nothing cached, acquire gives slot 0 with a MISS and the slot becomes busy."""
    manager = SlotManager(2)
    lease = manager.acquire(conversation("a", 1), 1.0, agent="a")
    assert lease is not None
    assert (lease.slot, lease.match.kind, lease.agent, lease.acquired_at) == (
        0,
        MatchKind.MISS,
        "a",
        1.0,
    )
    assert manager.free == 1
    row = manager.table()[0]
    assert (row.refcount, row.agent, row.lease_ids, row.last_used) == (1, "a", (lease.id,), 1.0)


def test_exact_hit_returns_to_the_same_slot() -> None:
    """After release, the same fingerprint is an EXACT hit on the slot that holds it."""
    manager = SlotManager(3)
    a, b = conversation("a", 1), conversation("b", 1)
    held(manager, a, now=1.0)
    held(manager, b, now=2.0)
    lease = manager.acquire(b, 3.0)
    assert lease is not None
    assert (lease.slot, lease.match.kind) == (1, MatchKind.EXACT)
    assert lease.match.shared_size == b.total_size


def test_longest_prefix_hit_wins() -> None:
    """Among prefix hits the slot sharing the most is chosen, even over an empty slot."""
    manager = SlotManager(3)
    # Both leased at once, so slot 0 keeps one turn and slot 1 gets two.
    short = manager.acquire(conversation("a", 1), 1.0)
    long = manager.acquire(conversation("a", 2), 2.0)
    assert short is not None and long is not None
    assert manager.release(short, 2.0) and manager.release(long, 2.0)
    lease = manager.acquire(conversation("a", 3), 3.0)
    assert lease is not None
    assert (lease.slot, lease.match.kind) == (1, MatchKind.PREFIX)
    assert lease.match.shared_size == conversation("a", 2).total_size


def test_empty_slot_preferred_over_evicting_another_agents_cache() -> None:
    """A request without a hit takes an empty slot, keeping other caches alive."""
    manager = SlotManager(2)
    held(manager, conversation("a", 2), now=1.0)
    lease = manager.acquire(conversation("b", 2), 2.0)
    assert lease is not None
    assert (lease.slot, lease.match.kind) == (1, MatchKind.MISS)


def test_without_empty_slots_the_most_shared_slot_is_evicted() -> None:
    """With no hit and no empty slot, the idle slot sharing most (system + tools) is chosen."""
    manager = SlotManager(2)
    held(manager, conversation("a", 2, system="other system"), now=1.0)
    held(manager, conversation("b", 2), now=2.0)
    lease = manager.acquire(conversation("c", 2), 3.0)
    assert lease is not None
    assert (lease.slot, lease.match.kind) == (1, MatchKind.MISS)
    assert lease.match.shared_blocks == 2


def test_ties_go_to_the_least_recently_used_slot() -> None:
    """When idle slots share equally, the one used longest ago is evicted."""
    manager = SlotManager(3)
    held(manager, conversation("a", 1), now=5.0)
    held(manager, conversation("b", 1), now=1.0)
    held(manager, conversation("c", 1), now=3.0)
    lease = manager.acquire(conversation("d", 1), 9.0)
    assert lease is not None
    assert manager.table()[lease.slot].last_used == 9.0
    assert lease.slot == 1


def test_slots_a_waiting_request_would_hit_are_evicted_last() -> None:
    """A miss evicts another idle slot before the one the next queued agent would reuse."""
    manager = SlotManager(2)
    held(manager, conversation("a", 1), now=1.0)  # least recently used, but "a" is waiting
    held(manager, conversation("b", 1), now=2.0)
    waiting = [conversation("a", 2)]
    assert manager.peek(conversation("c", 1)) is not None
    lease = manager.acquire(conversation("c", 1), 3.0, protect=waiting)
    assert lease is not None
    assert lease.slot == 1  # the slot that held "b", although "a"'s is older
    # With only protected slots left, one of them is still handed out rather than none.
    lease2 = manager.acquire(conversation("d", 1), 4.0, protect=waiting)
    assert lease2 is not None and lease2.slot == 0


def test_busy_slots_are_never_handed_out() -> None:
    """An exact hit on a busy slot is skipped; when every slot is busy acquire returns None."""
    manager = SlotManager(2)
    fp = conversation("a", 1)
    first = manager.acquire(fp, 1.0)
    second = manager.acquire(fp, 1.0)
    assert first is not None and second is not None
    assert first.slot != second.slot
    assert second.match.kind is not MatchKind.EXACT
    assert manager.acquire(fp, 1.0) is None
    assert manager.peek(fp) is None
    assert manager.free == 0


def test_peek_predicts_acquire_without_taking_a_slot() -> None:
    """peek returns the match acquire would give and changes nothing."""
    manager = SlotManager(2)
    fp = conversation("a", 1)
    held(manager, fp)
    before = manager.table()
    match = manager.peek(fp)
    assert match is not None and match.kind is MatchKind.EXACT
    assert manager.table() == before
    lease = manager.acquire(fp, 1.0)
    assert lease is not None and lease.match == match


def test_none_fingerprint_takes_a_slot_and_leaves_it_unknown() -> None:
    """A request without a fingerprint is a MISS and the slot's cache is unknown afterwards."""
    manager = SlotManager(1)
    lease = manager.acquire(None, 1.0)
    assert lease is not None and lease.match.kind is MatchKind.MISS
    assert manager.release(lease, 2.0)
    assert manager.table()[0].fingerprint is None


def test_release_records_the_new_fingerprint() -> None:
    """release stores the fingerprint passed (request + reply) as the slot's cached prefix."""
    manager = SlotManager(1)
    request, after = conversation("a", 1), conversation("a", 2)
    lease = manager.acquire(request, 1.0)
    assert lease is not None
    assert manager.release(lease, 4.0, fingerprint=after)
    row = manager.table()[0]
    assert (row.fingerprint, row.refcount, row.last_used, row.lease_ids) == (after, 0, 4.0, ())


def test_release_without_fingerprint_keeps_the_leases() -> None:
    """release(fingerprint=None) records the lease's own fingerprint."""
    manager = SlotManager(1)
    request = conversation("a", 1)
    lease = manager.acquire(request, 1.0)
    assert lease is not None
    assert manager.release(lease, 2.0)
    assert manager.table()[0].fingerprint == request


def test_double_release_is_a_no_op() -> None:
    """Releasing twice returns False the second time and leaves the slot alone."""
    manager = SlotManager(1)
    lease = manager.acquire(conversation("a", 1), 1.0)
    assert lease is not None
    assert manager.release(lease, 2.0)
    other = manager.acquire(conversation("b", 1), 3.0)
    assert other is not None
    assert not manager.release(lease, 4.0)
    assert manager.table()[0].refcount == 1
    assert manager.table()[0].lease_ids == (other.id,)


def test_release_of_an_unknown_lease_is_refused() -> None:
    """A lease object the manager did not hand out (same id, other slot) is not released."""
    manager = SlotManager(2)
    lease = manager.acquire(conversation("a", 1), 1.0)
    assert lease is not None
    forged = Lease(id=lease.id, slot=1, match=lease.match, agent="", acquired_at=1.0)
    assert not manager.release(forged, 2.0)
    assert manager.table()[0].refcount == 1


def test_sweep_reclaims_expired_leases_and_forgets_their_cache() -> None:
    """The watchdog returns leases older than lease_ttl; their slots become empty and idle."""
    manager = SlotManager(2, lease_ttl=10.0)
    old = manager.acquire(conversation("a", 1), 0.0)
    young = manager.acquire(conversation("b", 1), 5.0)
    assert old is not None and young is not None
    assert manager.sweep(10.0) == []  # exactly at the ttl is not yet past it
    assert manager.sweep(12.0) == [old]
    rows = manager.table()
    assert (rows[old.slot].refcount, rows[old.slot].fingerprint) == (0, None)
    assert rows[young.slot].refcount == 1
    assert manager.stats().reclaimed == 1
    assert not manager.release(old, 13.0)  # the request finishing late changes nothing
    assert manager.table()[old.slot].fingerprint is None
    assert manager.release(young, 13.0)


def test_invalidate_forgets_the_cached_prefix() -> None:
    """After invalidate the slot no longer gives a hit."""
    manager = SlotManager(1)
    fp = conversation("a", 1)
    held(manager, fp)
    manager.invalidate(0)
    assert manager.table()[0].fingerprint is None
    match = manager.peek(fp)
    assert match is not None and match.kind is MatchKind.MISS
    with pytest.raises(ValueError, match="no slot 1"):
        manager.invalidate(1)


def test_stats_count_hits_and_saved_prefix() -> None:
    """Counters follow each acquisition's match kind and shared size."""
    manager = SlotManager(2)
    a1, a2 = conversation("a", 1), conversation("a", 2)
    held(manager, a1)  # miss
    held(manager, a1)  # exact
    held(manager, a2)  # prefix
    stats = manager.stats()
    assert stats == SlotStats(
        exact=1,
        prefix=1,
        miss=1,
        acquired=3,
        reclaimed=0,
        saved_size=2 * a1.total_size,
    )
    assert stats.hit_rate == pytest.approx(2 / 3)
    assert SlotStats().hit_rate == 0.0


@pytest.mark.parametrize("kwargs", [{"n_slots": 0}, {"n_slots": 1, "lease_ttl": 0.0}])
def test_invalid_configuration_is_rejected(kwargs: dict[str, Any]) -> None:
    """A manager needs at least one slot and a positive lease ttl."""
    with pytest.raises(ValueError, match="must be > 0"):
        SlotManager(**kwargs)


# --- invariants under random operation sequences -------------------------------------------------

fingerprints = st.sampled_from(
    [None] + [conversation(agent, turns) for agent in "ab" for turns in range(3)]
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), fingerprints),
        st.tuples(st.just("release"), st.integers(0, 20), fingerprints),
        st.tuples(st.just("sweep")),
        st.tuples(st.just("invalidate"), st.integers(0, 2)),
        st.tuples(st.just("advance"), st.floats(0.0, 8.0)),
    ),
    max_size=60,
)


@settings(max_examples=200)
@given(operations)
def test_random_sequences_keep_the_table_consistent(ops: list[tuple[Any, ...]]) -> None:
    """Refcounts stay 0 or 1, no slot is leased twice, and free matches the live leases."""
    manager = SlotManager(3, lease_ttl=10.0)
    now = 0.0
    issued: list[Lease] = []
    live: dict[int, Lease] = {}
    for op in ops:
        if op[0] == "acquire":
            lease = manager.acquire(op[1], now)
            if lease is None:
                assert len(live) == 3
            else:
                assert lease.slot not in {other.slot for other in live.values()}
                issued.append(lease)
                live[lease.id] = lease
        elif op[0] == "release" and issued:
            lease = issued[op[1] % len(issued)]
            assert manager.release(lease, now, fingerprint=op[2]) == (lease.id in live)
            live.pop(lease.id, None)
        elif op[0] == "sweep":
            reclaimed = manager.sweep(now)
            assert all(now - lease.acquired_at > 10.0 for lease in reclaimed)
            assert all(lease.id in live for lease in reclaimed)
            for lease in reclaimed:
                del live[lease.id]
            assert all(now - lease.acquired_at <= 10.0 for lease in live.values())
        elif op[0] == "invalidate":
            manager.invalidate(op[1])
        elif op[0] == "advance":
            now += op[1]
        rows = manager.table()
        assert all(row.refcount in (0, 1) for row in rows)
        assert all(row.refcount == len(row.lease_ids) for row in rows)
        assert sorted(i for row in rows for i in row.lease_ids) == sorted(live)
        assert manager.free == 3 - len(live)
        assert {lease.slot for lease in live.values()} == {r.slot for r in rows if r.refcount}
    stats = manager.stats()
    assert stats.exact + stats.prefix + stats.miss == stats.acquired == len(issued)
