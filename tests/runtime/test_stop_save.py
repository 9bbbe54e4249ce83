"""A clean stop saves what idle slots hold that the store does not: agents' latest contexts come
back from the store after a restart, instead of being computed again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentkv.store import EntryKind
from tests.fakes import FakeLlama
from tests.runtime.test_lifecycle import ask, running

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def conversation(words: str) -> dict[str, Any]:
    """An agent's own long context (nothing another agent shares), then a question."""
    return {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": f"{words} " * 400 + "Reply with one word."}],
    }


def _contexts(runtime: Any) -> list[Any]:
    return [e for e in runtime.store.index.entries() if e.kind is EntryKind.CONTEXT]


async def test_an_agents_context_outlives_a_clean_stop(tmp_path: Path) -> None:
    fake = FakeLlama(reply="ok", save_dir=tmp_path)
    async with running(fake, n_slots=2, store_dir=tmp_path, ctx_per_slot=32768) as runtime:
        await ask(runtime, conversation("alpha"), "a")
        assert _contexts(runtime) == []  # nothing evicted it: nothing was parked
    fresh = FakeLlama(reply="ok", save_dir=tmp_path)  # the engine restarted: empty slots
    async with running(fresh, n_slots=2, store_dir=tmp_path, ctx_per_slot=32768) as runtime:
        (entry,) = _contexts(runtime)
        assert entry.agent == "a" and entry.n_tokens > 400
        await ask(runtime, conversation("alpha"), "a")
        record = runtime.records()[-1]
        assert record.source == "store"
        assert record.computed_tokens is not None and record.computed_tokens < 10
        assert fresh.computed < 10


async def test_a_stop_saves_nothing_the_store_already_has_or_when_told_not_to(
    tmp_path: Path,
) -> None:
    fake = FakeLlama(reply="ok", save_dir=tmp_path)
    async with running(fake, n_slots=2, store_dir=tmp_path, ctx_per_slot=32768) as runtime:
        await ask(runtime, conversation("alpha"), "a")
    async with running(fake, n_slots=2, store_dir=tmp_path, ctx_per_slot=32768) as runtime:
        # The same engine, the same slots: the context is already an entry; nothing new.
        before = len(runtime.store.index)
    assert len(runtime.store.index) == before
    off = tmp_path / "off"
    off.mkdir()
    other = FakeLlama(reply="ok", save_dir=off)
    async with running(other, n_slots=2, store_dir=off, ctx_per_slot=32768, stop_save=0) as runtime:
        await ask(runtime, conversation("bravo"), "b")
    assert not any(action == "save" for _, action, _ in other.slot_actions)


async def test_a_stop_tries_nothing_when_the_engine_is_gone(tmp_path: Path) -> None:
    fake = FakeLlama(reply="ok", save_dir=tmp_path)
    async with running(fake, n_slots=2, store_dir=tmp_path, ctx_per_slot=32768) as runtime:
        await ask(runtime, conversation("alpha"), "a")
        fake.healthy = False  # a Ctrl-C in a terminal stops llama-server too
    assert not any(action == "save" for _, action, _ in fake.slot_actions)


def follow_up(words: str, *turns: str) -> dict[str, Any]:
    """``conversation(words)`` with the agent's later turns: each a reply and a short question."""
    body = conversation(words)
    for turn in turns:
        body["messages"] += [
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": turn},
        ]
    return body


async def test_a_stop_saves_a_turn_however_short_its_extension(tmp_path: Path) -> None:
    """A follow-up a few tokens past the stored context is saved at stop, so that the turn after
    the restart computes only its own new tokens, not the follow-up's again."""
    config: dict[str, Any] = {"n_slots": 2, "store_dir": tmp_path, "ctx_per_slot": 32768}
    async with running(FakeLlama(reply="ok", save_dir=tmp_path), **config) as runtime:
        await ask(runtime, conversation("alpha"), "a")
    async with running(FakeLlama(reply="ok", save_dir=tmp_path), **config) as runtime:
        await ask(runtime, follow_up("alpha", "Once more."), "a")
        (first,) = _contexts(runtime)
    fresh = FakeLlama(reply="ok", save_dir=tmp_path)
    async with running(fresh, **config) as runtime:
        (entry,) = _contexts(runtime)  # the same agent's older context was superseded
        assert entry.n_tokens > first.n_tokens
        await ask(runtime, follow_up("alpha", "Once more.", "And again."), "a")
        record = runtime.records()[-1]
        assert record.source == "store"
        # Only what follows the saved follow-up is computed (without the stop's save, the
        # follow-up's own tokens would be computed again too).
        assert record.planned_reuse == entry.n_tokens - 1 or record.planned_reuse == entry.n_tokens
        assert record.computed_tokens == record.prompt_tokens - record.planned_reuse
        assert record.computed_tokens < entry.n_tokens - first.n_tokens + 8
