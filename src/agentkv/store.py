"""The prefix store's index: saved slot states, what tokens each holds, and which to keep.

Entries are a shared ``prefix`` (a prompt head many requests start with), one agent's parked
``context``, or a ``suspended`` request's progress (pinned until it resumes); a request finds the
entry sharing its longest token prefix. The index keeps the files under a byte budget, evicting
first the least valuable: tokens held times the chance of another use (from hits and idle time).
Pure: ``agentkv.runtime.store`` does the file and engine work; times are wall-clock seconds passed
in, because entries outlive a restart.
"""

from __future__ import annotations

import enum
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from agentkv.tokens import Tokens, common_prefix, digest

__all__ = ["EntryKind", "StoreEntry", "StoreIndex", "StoreStats"]


class EntryKind(enum.Enum):
    PREFIX = "prefix"
    CONTEXT = "context"
    SUSPENDED = "suspended"


#: How long an unused entry keeps half of its value, by kind (seconds).
_HALF_LIFE = {
    EntryKind.PREFIX: 24 * 3600.0,
    EntryKind.CONTEXT: 2 * 3600.0,
    EntryKind.SUSPENDED: 3600.0,
}


@attrs.frozen
class StoreEntry:
    """One saved slot state. ``id`` names its file (``<id>.bin``) in the store directory."""

    id: str
    kind: EntryKind
    tokens: Tokens = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    nbytes: int
    created: float
    last_used: float
    agent: str | None = None
    hits: int = 0
    #: The prompt sections (label, digest) of the request whose state this is.
    sections: tuple[tuple[str, str], ...] = attrs.field(default=(), repr=False)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def value(self, now: float) -> float:
        """Prefill saved (tokens) times the chance of another use."""
        idle = max(0.0, now - self.last_used)
        reuse = (1 + self.hits) / (2 + self.hits) * 0.5 ** (idle / _HALF_LIFE[self.kind])
        return float(self.n_tokens * reuse)

    def to_record(self) -> dict[str, Any]:
        """What the on-disk index keeps (the tokens themselves live in the file's header)."""
        return {
            "id": self.id,
            "kind": self.kind.value,
            "agent": self.agent,
            "n_tokens": self.n_tokens,
            "digest": digest(self.tokens),
            "nbytes": self.nbytes,
            "created": self.created,
            "last_used": self.last_used,
            "hits": self.hits,
            "sections": [list(section) for section in self.sections],
        }


@attrs.frozen
class StoreStats:
    entries: int
    bytes: int
    budget: int
    saves: int
    restores: int
    hits_tokens: int
    seconds_saved: float
    evicted: int
    expired: int
    refused: int


#: The counters of :class:`StoreStats` kept as whole numbers.
_COUNTERS = ("saves", "restores", "hits_tokens", "evicted", "expired", "refused")


def entry_id(kind: EntryKind, tokens: Tokens) -> str:
    """A stable id: the same state saved twice replaces itself."""
    return f"akv-{kind.value}-{digest(tokens)}"


@attrs.define
class StoreIndex:
    """The entries of one store, for one engine configuration (``compat``), within ``budget``.

    ``context_ttl``: a context entry unused this long belongs to an agent that is gone.
    """

    budget: int
    compat: str = ""
    context_ttl: float = 6 * 3600.0
    _entries: dict[str, StoreEntry] = attrs.field(init=False, factory=dict)
    _pins: Counter[str] = attrs.field(init=False, factory=Counter)
    _counts: defaultdict[str, float] = attrs.field(init=False, factory=lambda: defaultdict(int))

    # -- reading ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self._entries

    def get(self, entry_id: str) -> StoreEntry | None:
        return self._entries.get(entry_id)

    def entries(self) -> list[StoreEntry]:
        return list(self._entries.values())

    @property
    def total_bytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())

    def best(self, tokens: Tokens, *, exclude: Iterable[str] = ()) -> tuple[StoreEntry, int] | None:
        """The entry sharing the longest token prefix with ``tokens``, and that length.

        Ties go to the smaller file (cheaper to restore). None when nothing shares a token.
        """
        skip = set(exclude)
        entries = [e for e in self._entries.values() if e.id not in skip]
        found = [(e, shared) for e in entries if (shared := common_prefix(tokens, e.tokens))]
        return max(found, key=lambda c: (c[1], -c[0].nbytes), default=None)

    def covers(self, tokens: Tokens, *, slack: int = 0) -> StoreEntry | None:
        """An entry holding all of ``tokens`` but at most ``slack``, if any."""
        found = self.best(tokens)
        if found is not None and found[1] >= len(tokens) - slack:
            return found[0]
        return None

    def stats(self) -> StoreStats:
        counts = {name: int(self._counts[name]) for name in _COUNTERS}
        seconds = round(self._counts["seconds_saved"], 3)
        return StoreStats(len(self), self.total_bytes, self.budget, seconds_saved=seconds, **counts)

    # -- pins ---------------------------------------------------------------------------------

    def pin(self, entry_id: str) -> None:
        """Keep an entry from eviction and expiry (it is being restored, or it is suspended)."""
        self._pins[entry_id] += 1

    def unpin(self, entry_id: str) -> None:
        self._pins[entry_id] -= 1
        if self._pins[entry_id] <= 0:
            del self._pins[entry_id]

    def pinned(self, entry_id: str) -> bool:
        return entry_id in self._pins

    # -- changes (each returns the entries whose files the caller must delete) -------------------

    def add(self, entry: StoreEntry, now: float) -> list[StoreEntry]:
        """Record a saved state; returns the entries it removes (superseded or evicted).

        An entry that alone is over the budget is refused: it is returned itself and not added.
        Non-pinned entries whose tokens are a prefix of the new one are superseded (the new file
        serves every request they served), and so is the same agent's older context. A shared
        head (a ``prefix`` entry) is superseded only by a longer shared head: an agent's context
        or a suspended request's progress that starts with it expires, is cleared with its agent
        or is dropped when its request ends, and must not take the head with it.
        """
        if entry.nbytes > self.budget:
            self._counts["refused"] += 1
            return [entry]
        removed: list[StoreEntry] = []
        hits = entry.hits
        for old in list(self._entries.values()):
            if old.id == entry.id or self.pinned(old.id):
                continue
            same_context = (
                entry.kind is EntryKind.CONTEXT
                and old.kind is EntryKind.CONTEXT
                and old.agent == entry.agent
            )
            prefix_of_new = old.n_tokens <= entry.n_tokens and (
                common_prefix(old.tokens, entry.tokens) == old.n_tokens
            )
            shared_head = old.kind is EntryKind.PREFIX and entry.kind is not EntryKind.PREFIX
            if same_context or (
                prefix_of_new and old.kind is not EntryKind.SUSPENDED and not shared_head
            ):
                hits += old.hits if prefix_of_new else 0
                removed.append(self._entries.pop(old.id))
        previous = self._entries.pop(entry.id, None)
        if previous is not None:
            hits += previous.hits
        self._entries[entry.id] = attrs.evolve(entry, hits=hits)
        self._counts["saves"] += 1
        removed += self._evict_to_budget(now, keep=entry.id)
        return removed

    def touch(self, entry_id: str, now: float, *, tokens_saved: int, seconds_saved: float) -> None:
        """Record a restore: a hit that saved ``tokens_saved`` tokens of prefill."""
        entry = self._entries.get(entry_id)
        if entry is None:
            return
        self._entries[entry_id] = attrs.evolve(entry, hits=entry.hits + 1, last_used=now)
        self._counts["restores"] += 1
        self._counts["hits_tokens"] += max(0, tokens_saved)
        self._counts["seconds_saved"] += max(0.0, seconds_saved)

    def remove(self, entry_id: str) -> StoreEntry | None:
        """Forget an entry (it failed to load, or the caller deletes it)."""
        self._pins.pop(entry_id, None)
        return self._entries.pop(entry_id, None)

    def clear(self, *, agent: str | None = None) -> list[StoreEntry]:
        """Forget every entry, or every entry of one agent; pinned entries stay."""
        return self._remove_where(lambda entry: agent is None or entry.agent == agent)

    def expire(self, now: float) -> list[StoreEntry]:
        """Drop the context entries of agents that are gone (unused for ``context_ttl``)."""
        doomed = self._remove_where(
            lambda entry: (
                entry.kind is EntryKind.CONTEXT and now - entry.last_used > self.context_ttl
            )
        )
        self._counts["expired"] += len(doomed)
        return doomed

    def _remove_where(self, doomed: Callable[[StoreEntry], bool]) -> list[StoreEntry]:
        """Remove the entries, pinned ones excepted, that ``doomed`` picks."""
        removed = [e for e in self._entries.values() if not self.pinned(e.id) and doomed(e)]
        for entry in removed:
            del self._entries[entry.id]
        return removed

    def _evict_to_budget(self, now: float, keep: str) -> list[StoreEntry]:
        removed: list[StoreEntry] = []
        total = self.total_bytes
        if total <= self.budget:
            return removed
        candidates = sorted(
            (e for e in self._entries.values() if e.id != keep and not self.pinned(e.id)),
            key=lambda e: (e.value(now), e.last_used),
        )
        for entry in candidates:
            if total <= self.budget:
                break
            del self._entries[entry.id]
            total -= entry.nbytes
            removed.append(entry)
        self._counts["evicted"] += len(removed)
        if total > self.budget:
            # Only pinned entries are left to evict: the new one cannot stay.
            newest = self._entries.pop(keep)
            removed.append(newest)
            self._counts["refused"] += 1
        return removed

    # -- persistence ----------------------------------------------------------------------------

    def restore_records(
        self, records: Iterable[Mapping[str, Any]], tokens_of: Mapping[str, Tokens]
    ) -> list[str]:
        """Rebuild the index from saved records and the tokens read from each file's header.

        Returns the ids of records that cannot be trusted (no file, tokens that do not match
        the recorded digest, malformed record): the caller deletes their files.
        """
        refused: list[str] = []
        for record in records:
            try:
                entry_id_ = str(record["id"])
                tokens = tokens_of.get(entry_id_)
                # A suspended request does not survive a restart: its client is gone.
                suspended = EntryKind(record["kind"]) is EntryKind.SUSPENDED
                if tokens is None or suspended or digest(tokens) != record["digest"]:
                    refused.append(entry_id_)
                    continue
                entry = StoreEntry(
                    id=entry_id_,
                    kind=EntryKind(record["kind"]),
                    tokens=tokens,
                    nbytes=int(record["nbytes"]),
                    created=float(record["created"]),
                    last_used=float(record["last_used"]),
                    agent=record.get("agent"),
                    hits=int(record.get("hits", 0)),
                    sections=tuple(
                        (str(label), str(value)) for label, value in record.get("sections", ())
                    ),
                )
            except (KeyError, TypeError, ValueError):
                refused.append(str(record.get("id", "?")) if isinstance(record, Mapping) else "?")
                continue
            self._entries[entry.id] = entry
        return refused
