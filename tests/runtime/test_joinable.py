"""Joinable: running exchanges, and finished replies kept for a retry within bounds."""

from __future__ import annotations

import gc
import weakref

import attrs

from agentkv.runtime.joinable import Joinable


@attrs.define(eq=False)
class Exchange:
    done: bool = False


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_running_exchange_is_found_until_it_ends_badly() -> None:
    joinable: Joinable[Exchange] = Joinable(5.0, Clock())
    exchange = Exchange()
    joinable.add("k", exchange)
    assert joinable.get("k") is exchange and list(joinable) == [exchange]
    joinable.ended("k", exchange, keep=False)
    assert joinable.get("k") is None and len(joinable) == 0


def test_a_finished_reply_is_kept_for_retry_grace_then_dropped() -> None:
    clock = Clock()
    joinable: Joinable[Exchange] = Joinable(5.0, clock)
    exchange = Exchange()
    joinable.add("k", exchange)
    exchange.done = True
    joinable.ended("k", exchange, keep=True)
    clock.now = 4.9
    assert joinable.get("k") is exchange
    clock.now = 5.0
    assert joinable.get("k") is None and len(joinable) == 0


def test_a_new_run_of_the_same_request_replaces_the_kept_reply() -> None:
    joinable: Joinable[Exchange] = Joinable(5.0, Clock())
    first, second = Exchange(done=True), Exchange()
    joinable.add("k", first)
    joinable.ended("k", first, keep=True)
    joinable.add("k", second)
    assert joinable.get("k") is second and list(joinable) == [second]
    # The first run's late end does not drop the second.
    joinable.ended("k", first, keep=False)
    assert joinable.get("k") is second


def test_at_most_max_kept_finished_replies_the_oldest_freed_at_once() -> None:
    joinable: Joinable[Exchange] = Joinable(60.0, Clock(), max_kept=3)
    refs = []
    for i in range(5):
        exchange = Exchange(done=True)
        joinable.add(f"k{i}", exchange)
        joinable.ended(f"k{i}", exchange, keep=True)
        refs.append(weakref.ref(exchange))
        del exchange
    assert len(joinable) == 3
    gc.collect()
    assert refs[0]() is None and refs[1]() is None
    assert list(joinable) == [refs[2](), refs[3](), refs[4]()]
