"""Slots out of placement: a pool's engine that is down offers none of its slots."""

from __future__ import annotations

from agentkv._types import Source
from agentkv.costs import CostModel
from agentkv.slots import SlotManager


def test_slots_taken_out_are_never_placed_and_come_back_empty() -> None:
    """Taken out: not idle, not free, never chosen, even holding the whole prompt; brought
    back: placeable again, holding nothing."""
    manager = SlotManager(4)
    tokens = tuple(range(2000))
    manager.set_content(2, tokens)
    assert manager.place(tokens, CostModel()).slot == 2  # type: ignore[union-attr]
    manager.take_out([2, 3])
    assert [view.slot for view in manager.idle()] == [0, 1]
    assert manager.free == 2 and manager.is_out(2) and not manager.is_out(0)
    placement = manager.place(tokens, CostModel())
    assert placement is not None and placement.slot in (0, 1)
    assert placement.source is Source.NONE
    manager.take_out([0, 1])
    assert manager.place(tokens, CostModel()) is None and manager.free == 0
    manager.bring_back([2])
    assert manager.table()[2].tokens == () and manager.free == 1


def test_a_lease_on_a_slot_taken_out_still_releases() -> None:
    """A request running when its engine went down gives its slot back as usual; the slot
    stays out of placement."""
    manager = SlotManager(2)
    placement = manager.place((1, 2, 3), CostModel())
    assert placement is not None
    lease = manager.acquire(placement, 0.0, agent="a", tokens=(1, 2, 3))
    manager.take_out([lease.slot])
    assert manager.release(lease, 1.0, holds=None)
    assert manager.is_out(lease.slot) and manager.free == 1
