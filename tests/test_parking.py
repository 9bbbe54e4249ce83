"""ParkingLot: which evicted contexts to save, and when restoring one pays."""

from __future__ import annotations

from typing import Any

from agentkv.fingerprint import PrefixFingerprinter
from agentkv.parking import ParkingLot

FP = PrefixFingerprinter()


def conversation(agent: str, turns: int) -> Any:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "shared rules " * 20}]
    for n in range(turns):
        messages.append({"role": "user", "content": f"{agent} question {n} " + "x" * 600})
        messages.append({"role": "assistant", "content": f"{agent} answer {n}"})
    return FP.fingerprint({"messages": messages})


def test_a_returning_agent_gets_its_parked_context_back() -> None:
    """An agent's parked prefix is offered when its next request extends it."""
    lot = ParkingLot(min_gain=100)
    assert lot.should_park("a", conversation("a", 2))
    lot.park("a", conversation("a", 2), now=1.0)
    parked = lot.best("a", conversation("a", 3), shared=0)
    assert parked is not None and parked.filename == lot.filename("a")
    # Not for another agent, and not for a history that diverged.
    assert lot.best("b", conversation("a", 3), shared=0) is None
    assert lot.best("a", conversation("z", 3), shared=0) is None


def test_restore_only_when_it_beats_what_the_slot_shares() -> None:
    """A parked prefix must beat the slot's own shared prefix by ``min_gain``."""
    lot = ParkingLot(min_gain=500)
    fp = conversation("a", 2)
    lot.park("a", fp, now=1.0)
    assert lot.best("a", conversation("a", 3), shared=fp.total_size - 400) is None
    assert lot.best("a", conversation("a", 3), shared=fp.total_size - 600) is not None


def test_one_file_per_agent_and_a_capacity() -> None:
    """A new park replaces the agent's old one; past capacity the oldest agent is dropped."""
    lot = ParkingLot(capacity=2)
    lot.park("a", conversation("a", 1), now=1.0)
    lot.park("a", conversation("a", 2), now=2.0)
    assert [row["agent"] for row in lot.table()] == ["a"]
    assert not lot.should_park("a", conversation("a", 2))  # already parked as it is
    lot.park("b", conversation("b", 1), now=3.0)
    lot.park("c", conversation("c", 1), now=4.0)
    assert [row["agent"] for row in lot.table()] == ["b", "c"]
    assert lot.filename("a") != lot.filename("b")
    assert not lot.should_park(None, conversation("a", 1))
