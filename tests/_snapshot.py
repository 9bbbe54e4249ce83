"""Snapshots built by hand, for the readers of one (``status``, the soak's leak counter): an idle
runtime's, with the parts a test cares about replaced."""

from __future__ import annotations

from typing import Any

import attrs

from agentkv.snapshot import CostsView, Placements, RequestView, RuntimeSnapshot, SlotRow


def empty_snapshot(**changes: Any) -> RuntimeSnapshot:
    """The snapshot of a runtime that has served nothing, with ``changes``."""
    snapshot = RuntimeSnapshot(
        slots=(),
        queue=(),
        background=(),
        checkpoints=(),
        placements=Placements(
            acquired=0,
            from_slot=0,
            from_store=0,
            cold=0,
            reclaimed=0,
            hit_rate=0.0,
            planned_reused_tokens=0,
            planned_computed_tokens=0,
        ),
        store=None,
        compactions=(),
        engines=None,
        agents={},
        tree=(),
        running=(),
        recent=(),
        costs=CostsView(
            prefill_tokens_per_s_at_0=0.0,
            prefill_tokens_per_s_at_10k=0.0,
            decode_tokens_per_s=0.0,
            restore_bytes_per_s=0,
            bytes_per_token=0,
        ),
    )
    return attrs.evolve(snapshot, **changes)


def slot_row(slot: int, **changes: Any) -> SlotRow:
    """Slot ``slot``, empty and idle, with ``changes``."""
    row = SlotRow(
        slot=slot,
        agent=None,
        tokens=0,
        stored=None,
        busy=False,
        state="idle",
        priority=None,
        idle_s=None,
        leases=(),
        parent=None,
        description=None,
    )
    return attrs.evolve(row, **changes)


def request_view(agent: str, **changes: Any) -> RequestView:
    """A finished request of ``agent`` (priority 1, nothing cached), with ``changes``."""
    view = RequestView(
        agent=agent,
        priority=1,
        ticket=1,
        parent=None,
        description=None,
        waited_on=None,
        dispatch_seq=1,
        slot=0,
        source="none",
        prompt_tokens=0,
        planned_reuse=0,
        computed_tokens=0,
        cached_tokens=0,
        output_tokens=0,
        draft_tokens=0,
        draft_accepted=0,
        decode_s=0.0,
        checkpoint_tokens=None,
        parked=False,
        queued_s=0.0,
        ttft_s=None,
        total_s=None,
        retried=False,
        suspended=0,
        stopped=None,
        attached=1,
        prefilled=None,
        generating_s=None,
        divergence=None,
        generated=0,
        status="ok",
        error_type=None,
    )
    return attrs.evolve(view, **changes)
