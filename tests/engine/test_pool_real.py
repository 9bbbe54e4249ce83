"""Two real llama-servers of one thread each under one runtime, launched as ``agentkv-server
--engines 2`` launches them: a context moved from one to the other, a head computed once across
the pool, and an engine killed with SIGKILL while four agents work."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from agentkv.runtime.assemble import EngineHandle, EngineSettings, open_engine
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Runtime
from agentkv.runtime.pool import EnginePool
from agentkv.runtime.pool_launch import open_engines
from agentkv.runtime.store import PrefixStore
from agentkv.store import EntryKind, StoreIndex
from agentkv.translate import MessagesTranslator
from agentkv_bench.metrics import parse_counters
from agentkv_bench.workload import minimum_prefill
from agentkv_server import cli
from tests._engine_fixture import locate_engine
from tests.fakes import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.anyio]

CTX = 4096
#: About 37 tokens; each test's prompt begins with its own words, so that no cache from one
#: serves another.
HEAD = (
    "You are a careful coding agent in a large repository. Read before you write, keep each "
    "change small, run the tests after every edit, and explain what you changed and why. "
)


@pytest.fixture(scope="module")
async def engines(
    anyio_backend: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[EngineHandle]:
    """Two llama-servers exactly as ``agentkv-server --engines 2 --threads 2`` launches them
    (one thread each, each with its own slot directory and supervisor)."""
    _, model = locate_engine()
    root = tmp_path_factory.mktemp("pool")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AGENTKV_CACHE_DIR", str(root))
        args = cli.build_parser().parse_args(
            [
                "--model", str(model), "--engines", "2", "--threads", "2", "--slots", "2",
                "--ctx-per-slot", str(CTX), "--store-dir", str(root / "store"),
                "--gpu-layers", "0",
            ]
        )  # fmt: skip
        settings: EngineSettings = cli._from_args(EngineSettings, args)
        async with open_engine(settings) as engine:
            yield engine


async def pool_of(engine: EngineHandle) -> EnginePool:
    client = await open_engines(
        engine.members, slots=2, store_dir=engine.store_dir, timeout=300, read_timeout=300
    )
    assert isinstance(client, EnginePool)
    return client


def first_request(head: str, words: str) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 4,
        "temperature": 0,
        "system": head,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": words}]},
            {"role": "system", "content": "<system-reminder>Today is Tuesday.</system-reminder>"},
        ],
    }


def computed(texts: list[str | None]) -> list[float]:
    return [parse_counters(text)["prompt_computed"] if text else 0.0 for text in texts]


async def test_the_engines_are_launched_as_a_pool(engines: EngineHandle) -> None:
    """``--engines 2 --threads 2``: two servers, one thread each, each its own slot directory."""
    assert len(engines.members) == 2
    processes = [m.supervisor.process for m in engines.members if m.supervisor is not None]
    assert len(processes) == 2
    commands = [process.running_config.args() for process in processes]
    for i, command in enumerate(commands):
        assert command[command.index("-t") + 1] == "1"
        assert command[command.index("--slot-save-path") + 1].endswith(f"engine-{i}")


async def test_a_context_computed_on_one_engine_is_restored_on_the_other(
    engines: EngineHandle,
) -> None:
    """Computed on engine 0, saved, moved and restored on engine 1: engine 1 computes < 5 % of
    the prompt, and the restore takes less time than engine 0's prefill did."""
    pool = await pool_of(engines)
    async with pool:
        body = first_request("Context A. " + HEAD * 8, "Reply with: moved")
        translated = MessagesTranslator().translate(body).body
        chat = {**translated, "max_tokens": 1, "temperature": 0}
        first = await pool.chat(chat, slot=0)
        timings_a = first["timings"]
        prompt = timings_a["prompt_n"] + timings_a["cache_n"]
        assert prompt > 250
        assert engines.store_dir is not None
        store = PrefixStore(engines.store_dir, pool, StoreIndex(budget=1 << 30))
        await store.open()
        entry = await store.save(0, EntryKind.CONTEXT, agent="mover")
        assert entry is not None and entry.n_tokens >= prompt - 1
        started = time.monotonic()
        restored = await store.restore(entry, 2)  # engine 1, its slot 0
        restore_s = time.monotonic() - started
        assert restored is not None and restored["n_restored"] == entry.n_tokens
        before = computed(await pool.member_metrics())
        second = await pool.chat(chat, slot=2)
        after = computed(await pool.member_metrics())
        timings_b = second["timings"]
        assert timings_b["prompt_n"] < 0.05 * prompt, timings_b
        assert after[1] - before[1] < 0.05 * prompt
        prefill_s = timings_a["prompt_ms"] / 1000
        print(
            f"\nmoved {entry.n_tokens} tokens ({entry.nbytes} bytes): engine 0 prefill "
            f"{prefill_s:.2f} s, link and restore on engine 1 {restore_s:.3f} s, engine 1 "
            f"computed {timings_b['prompt_n']} of {prompt}"
        )
        assert restore_s < prefill_s


async def test_four_agents_share_one_head_across_the_pool_and_survive_a_killed_engine(
    engines: EngineHandle,
) -> None:
    """Four agents with a ~1.5K-token head on two engines: both serve, the head is computed
    once across the pool (both engines' counters against the minimum); after one engine is
    SIGKILLed every agent's next turn succeeds, and the engine rejoins once restarted."""
    pool = await pool_of(engines)
    head = "Context B. " + HEAD * 40
    config = RuntimeConfig(n_slots=pool.n_slots, ctx_per_slot=CTX, store_dir=engines.store_dir)
    async with pool, Runtime(pool, config, store_compat=engines.compat) as runtime:
        bodies = [first_request(head, f"Agent {i}: reply with the word ok.") for i in range(4)]
        prepared = [
            await runtime.prepare(body, agent=f"agent{i}", priority=1)
            for i, body in enumerate(bodies)
        ]
        before = computed(await pool.member_metrics())
        replies: dict[int, dict[str, Any]] = {}

        async def turn(i: int, body: dict[str, Any]) -> None:
            ready = await runtime.prepare(body, agent=f"agent{i}", priority=1)
            replies[i] = await runtime.submit(ready).message()

        async with anyio.create_task_group() as tg:
            for i, body in enumerate(bodies):
                tg.start_soon(turn, i, body)
        after = computed(await pool.member_metrics())
        records = runtime.records()
        assert [r.status for r in records] == ["ok"] * 4
        engines_used = {pool.member_of(r.slot)[0].index for r in records if r.slot is not None}
        assert engines_used == {0, 1}, [r.slot for r in records]
        minimum = minimum_prefill([p.tokens for p in prepared])
        total = sum(after) - sum(before)
        per_engine = [a - b for a, b in zip(after, before, strict=True)]
        print(f"\nprompt tokens computed per engine {per_engine}, total {total}, minimum {minimum}")
        # Each request computes at least its last token again, and the head's save costs one.
        assert total <= minimum + 4 * 8, (total, minimum)

        # Kill engine 1; wait until the pool takes it out of placement.
        member = pool.members[1]
        process = engines.members[1].supervisor.process  # type: ignore[union-attr]
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        await wait_for(lambda: not member.up, timeout=30)
        next_bodies = []
        for i, body in enumerate(bodies):
            text = "".join(b.get("text", "") for b in replies[i]["content"]) or "ok"
            messages = [
                *body["messages"],
                {"role": "assistant", "content": text},
                {"role": "user", "content": "Now reply with the word done."},
            ]
            next_bodies.append({**body, "messages": messages})
        async with anyio.create_task_group() as tg:
            for i, body in enumerate(next_bodies):
                tg.start_soon(turn, i, body)
        later = runtime.records()[4:]
        assert [r.status for r in later] == ["ok"] * 4
        # The supervisor restarts it (perhaps while those turns ran, and then it served some of
        # them): it rejoins, once.
        await wait_for(lambda: member.up, timeout=120)
        assert member.rejoined == 1
