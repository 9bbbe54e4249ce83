"""The exchanges a client's retry may join, by request key.

Claude Code retries a request it gave up on. A retry of a request that is still running, or that
finished within ``retry_grace`` seconds, gets that request's reply instead of a second
computation. So the runtime keeps each exchange here while it runs and, once it ended well, for
``retry_grace`` more seconds; at most ``max_kept`` finished ones at once (each holds its prompt's
tokens and its events), the oldest dropped first.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import anyio
import attrs

__all__ = ["MAX_KEPT_REPLIES", "Joinable"]

#: Most finished replies kept for a client's retry at once (within ``retry_grace``).
MAX_KEPT_REPLIES = 64


class _Exchange(Protocol):
    @property
    def done(self) -> bool: ...


E = TypeVar("E", bound=_Exchange)


@attrs.define(eq=False)
class Joinable(Generic[E]):
    """Running exchanges and the finished replies kept for a retry.

    ``later(work, *args)`` runs ``work`` in the runtime's background (False when stopping).
    """

    retry_grace: float
    later: Callable[..., bool]
    max_kept: int = MAX_KEPT_REPLIES
    _by_key: dict[str, E] = attrs.field(init=False, factory=dict)
    #: The keys of the finished replies still kept, oldest first.
    _kept: OrderedDict[str, None] = attrs.field(init=False, factory=OrderedDict)

    def get(self, key: str) -> E | None:
        return self._by_key.get(key)

    def add(self, key: str, exchange: E) -> None:
        """``exchange`` starts: a retry of its request joins it from now on."""
        self._by_key[key] = exchange

    def __iter__(self) -> Iterator[E]:
        return iter(list(self._by_key.values()))

    def __len__(self) -> int:
        return len(self._by_key)

    def ended(self, key: str, exchange: E, *, keep: bool) -> None:
        """``exchange`` ended: kept for ``retry_grace`` when ``keep`` (it ended well and the
        runtime runs on), else forgotten now."""
        if not keep or not self.later(self._forget_later, key, weakref.ref(exchange)):
            self._by_key.pop(key, None)
            return
        self._kept[key] = None
        self._kept.move_to_end(key)
        while len(self._kept) > self.max_kept:
            oldest, _ = self._kept.popitem(last=False)
            kept = self._by_key.get(oldest)
            if kept is not None and kept.done:
                del self._by_key[oldest]

    async def _forget_later(self, key: str, reply: weakref.ref[Any]) -> None:
        # The timer holds the reply weakly: one dropped for the bound is freed at once.
        await anyio.sleep(self.retry_grace)
        exchange = reply()
        if exchange is not None and self._by_key.get(key) is exchange:
            del self._by_key[key]
            self._kept.pop(key, None)
