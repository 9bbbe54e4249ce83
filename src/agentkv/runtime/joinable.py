"""The exchanges a client's retry may join, by request key.

Claude Code retries a request it gave up on; a retry of a request still running, or finished well
within ``retry_grace`` seconds, gets that request's reply instead of a second computation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

import attrs
from cachetools import TTLCache

__all__ = ["MAX_KEPT_REPLIES", "Joinable"]

#: Most finished replies kept for a client's retry at once (within ``retry_grace``).
MAX_KEPT_REPLIES = 64


class _Exchange(Protocol):
    @property
    def done(self) -> bool: ...


E = TypeVar("E", bound=_Exchange)


@attrs.define(eq=False)
class Joinable(Generic[E]):
    """Running exchanges and the finished replies kept for a retry: a TTL cache on the runtime's
    ``clock``, of at most ``max_kept`` (each holds its prompt's tokens and events), oldest out."""

    retry_grace: float
    clock: Callable[[], float]
    max_kept: int = MAX_KEPT_REPLIES
    _running: dict[str, E] = attrs.field(init=False, factory=dict)
    _finished: TTLCache[str, E] = attrs.field(init=False)

    @_finished.default
    def _cache(self) -> TTLCache[str, E]:
        return TTLCache(maxsize=self.max_kept, ttl=self.retry_grace, timer=self.clock)

    def get(self, key: str) -> E | None:
        return self._running.get(key) or self._finished.get(key)

    def add(self, key: str, exchange: E) -> None:
        """``exchange`` starts: a retry of its request joins it from now on."""
        self._running[key] = exchange
        self._finished.pop(key, None)

    def __iter__(self) -> Iterator[E]:
        self._finished.expire()
        return iter([*self._running.values(), *self._finished.values()])

    def __len__(self) -> int:
        self._finished.expire()
        return len(self._running) + len(self._finished)

    def ended(self, key: str, exchange: E, *, keep: bool) -> None:
        """``exchange`` ended: kept for ``retry_grace`` when ``keep`` (it ended well and the
        runtime runs on), else forgotten now."""
        if self._running.get(key) is exchange:
            del self._running[key]
        if keep:
            self._finished[key] = exchange
