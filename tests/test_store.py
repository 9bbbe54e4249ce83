"""The prefix store's index: matching, superseding, budget, value-based eviction, expiry."""

from __future__ import annotations

from agentkv.store import EntryKind, StoreEntry, StoreIndex, entry_id

MB = 1_000_000


def entry(
    tokens: tuple[int, ...],
    kind: EntryKind = EntryKind.PREFIX,
    *,
    nbytes: int | None = None,
    agent: str | None = None,
    at: float = 0.0,
    hits: int = 0,
) -> StoreEntry:
    return StoreEntry(
        id=entry_id(kind, tokens),
        kind=kind,
        tokens=tokens,
        nbytes=len(tokens) * 10 if nbytes is None else nbytes,
        created=at,
        last_used=at,
        agent=agent,
        hits=hits,
    )


def test_best_is_the_longest_shared_prefix() -> None:
    """A request finds the entry sharing the most tokens with it, and how many."""
    index = StoreIndex(budget=10 * MB)
    short = entry(tuple(range(100)))
    other = entry((9, 9, 9))
    index.add(short, 0)
    index.add(other, 0)
    request = (*range(100), 500, 501)
    found = index.best(request)
    assert found is not None and found[0].id == short.id and found[1] == 100
    assert index.best((7, 7)) is None
    assert index.covers(tuple(range(50))) is not None
    assert index.covers((*range(100), 1, 2, 3), slack=2) is None


def test_a_longer_prefix_supersedes_the_entries_it_contains() -> None:
    """Saving a longer state with the same start replaces the shorter one; hits carry over."""
    index = StoreIndex(budget=10 * MB)
    index.add(entry(tuple(range(50)), hits=3), 0)
    removed = index.add(entry(tuple(range(80))), 1)
    assert [e.n_tokens for e in removed] == [50]
    assert [e.n_tokens for e in index.entries()] == [80]
    assert index.entries()[0].hits == 3


def test_one_context_per_agent() -> None:
    """An agent's newer parked context replaces its older one, whatever its tokens."""
    index = StoreIndex(budget=10 * MB)
    index.add(entry((1, 2, 3), EntryKind.CONTEXT, agent="a"), 0)
    index.add(entry((4, 5, 6), EntryKind.CONTEXT, agent="b"), 0)
    removed = index.add(entry((7, 8), EntryKind.CONTEXT, agent="a"), 1)
    assert [e.tokens for e in removed] == [(1, 2, 3)]
    assert sorted(e.agent or "" for e in index.entries()) == ["a", "b"]


def test_budget_is_never_exceeded_and_least_valuable_go_first() -> None:
    """Over budget, the entry that saves least times its chance of reuse is evicted first."""
    index = StoreIndex(budget=100 * MB)
    hot = entry((1,) * 1 + tuple(range(1000, 5000)), nbytes=40 * MB, hits=5)
    cold = entry((2, *tuple(range(1000, 5000))), nbytes=40 * MB)
    small = entry((3, *tuple(range(10))), nbytes=10 * MB)
    for e in (hot, cold, small):
        assert index.add(e, 0) == []
    removed = index.add(entry((4, *tuple(range(2000))), nbytes=30 * MB), 10)
    assert index.total_bytes <= index.budget
    # The small one saves least; the cold one (no hits) is next.
    assert [e.id for e in removed] == [small.id, cold.id]
    assert hot.id in index


def test_an_entry_over_the_whole_budget_is_refused() -> None:
    index = StoreIndex(budget=MB)
    big = entry((1, 2), nbytes=2 * MB)
    assert index.add(big, 0) == [big]
    assert len(index) == 0
    assert index.stats().refused == 1


def test_pinned_entries_are_neither_evicted_nor_superseded() -> None:
    """A state being restored (or a suspended request) stays until it is unpinned."""
    index = StoreIndex(budget=50 * MB)
    keep = entry(tuple(range(10)), nbytes=40 * MB)
    index.add(keep, 0)
    index.pin(keep.id)
    newcomer = entry(tuple(range(20)), nbytes=20 * MB)
    removed = index.add(newcomer, 1)
    assert [e.id for e in removed] == [newcomer.id]
    assert keep.id in index
    index.unpin(keep.id)
    assert index.add(newcomer, 2) == [keep]


def test_contexts_of_gone_agents_expire() -> None:
    index = StoreIndex(budget=10 * MB, context_ttl=100)
    index.add(entry((1,), EntryKind.CONTEXT, agent="gone", at=0), 0)
    index.add(entry((2,), EntryKind.CONTEXT, agent="here", at=90), 90)
    index.add(entry((3,), EntryKind.PREFIX, at=0), 0)
    expired = index.expire(150)
    assert [e.agent for e in expired] == ["gone"]
    assert len(index) == 2
    assert index.stats().expired == 1


def test_touch_counts_hits_and_time_saved() -> None:
    index = StoreIndex(budget=10 * MB)
    e = entry(tuple(range(100)))
    index.add(e, 0)
    index.touch(e.id, 5, tokens_saved=100, seconds_saved=1.5)
    stats = index.stats()
    assert (stats.restores, stats.hits_tokens, stats.seconds_saved) == (1, 100, 1.5)
    assert index.get(e.id) is not None and index.get(e.id).hits == 1  # type: ignore[union-attr]


def test_clear_per_agent_or_whole() -> None:
    index = StoreIndex(budget=10 * MB)
    index.add(entry((1,), EntryKind.CONTEXT, agent="a"), 0)
    index.add(entry((2,), EntryKind.CONTEXT, agent="b"), 0)
    index.add(entry((3,)), 0)
    assert [e.agent for e in index.clear(agent="a")] == ["a"]
    assert len(index.clear()) == 2
    assert len(index) == 0


def test_records_round_trip_and_mismatched_tokens_are_refused() -> None:
    """The on-disk index is rebuilt from records plus the tokens in each file's header."""
    index = StoreIndex(budget=10 * MB)
    a = entry(tuple(range(30)))
    b = entry(tuple(range(40, 60)), EntryKind.CONTEXT, agent="x")
    s = entry((5, 6), EntryKind.SUSPENDED)
    for e in (a, b, s):
        index.add(e, 0)
    records = [e.to_record() for e in index.entries()]
    again = StoreIndex(budget=10 * MB)
    refused = again.restore_records(
        [*records, {"id": "junk"}],
        {a.id: a.tokens, b.id: (1, 2, 3), s.id: s.tokens},
    )
    assert sorted(refused) == sorted([b.id, s.id, "junk"])
    assert [e.id for e in again.entries()] == [a.id]


def test_a_shared_head_outlives_the_contexts_that_start_with_it() -> None:
    """An agent's context (or a suspended request's progress) that extends a shared head does
    not supersede it: the context expires, or is dropped, and the head stays for everyone."""
    index = StoreIndex(budget=10 * MB, context_ttl=100)
    head = entry(tuple(range(50)))
    index.add(head, 0)
    context = entry(tuple(range(80)), EntryKind.CONTEXT, agent="a")
    progress = entry(tuple(range(70)), EntryKind.SUSPENDED, agent="b")
    assert index.add(context, 1) == []
    assert index.add(progress, 1) == []
    assert {e.id for e in index.entries()} == {head.id, context.id, progress.id}
    assert [e.id for e in index.expire(500)] == [context.id]
    found = index.best((*range(50), 999))
    assert found is not None and found[0].id == head.id
    # A longer shared head still replaces it.
    assert index.add(entry(tuple(range(60))), 2) == [head]
