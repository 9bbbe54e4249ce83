"""The band scenario's conversation, configurations and report (its real runs are a benchmark)."""

from __future__ import annotations

from typing import Any

import attrs

from agentkv.runtime.config import RuntimeConfig
from agentkv_bench.band import BandSpec, _config, _message, band_table


def test_the_configurations_are_the_defaults_and_the_band_from_half_the_slot() -> None:
    high, band = _config("high-water", 4096), _config("band", 4096)
    assert high == attrs.evolve(RuntimeConfig(), prepare_compaction=False)
    assert band == attrs.evolve(high, compact_from=2048)
    assert high.compact_from is None


def test_the_conversation_is_the_same_every_run_and_grows_past_the_low_mark() -> None:
    assert _message(3, 12) == _message(3, 12) != _message(4, 12)
    spec = BandSpec()
    # about four characters a token: the default conversation passes half of 4,096 tokens early
    # and would pass the whole slot without compaction
    chars = sum(len(_message(t, spec.lines)) for t in range(spec.turns))
    assert chars / 4 > 4096
    assert sum(len(_message(t, spec.lines)) for t in range(spec.turns // 2)) / 4 > 2048 / 2


def _report(name: str, prompts: list[int], compactions: int) -> dict[str, Any]:
    turns = [
        {"turn": i, "seconds": 1.5, "prompt_tokens": p, "computed_tokens": 40, "idle_wait_s": 0.1}
        for i, p in enumerate(prompts)
    ]
    return {
        "name": name,
        "label": name,
        "compact_at": 3072,
        "compact_from": 2048 if name == "band" else None,
        "turns": turns,
        "busy_s": 3.0,
        "wall_s": 4.0,
        "idle_wait_s": 0.2,
        "compactions": compactions,
        "band": [min(prompts[1:]), max(prompts[1:])],
        "prompt_total": sum(prompts),
        "engine_prompt_computed": 900,
        "engine_generated": 300,
    }


def test_the_table_puts_the_band_and_the_engine_work_side_by_side() -> None:
    table = band_table(
        {
            "configs": [_report("high-water", [2000, 3100], 1), _report("band", [2000, 2100], 3)],
            "spec": {"turns": 2, "lines": 12},
            "slots": 2,
            "ctx_per_slot": 4096,
        }
    )
    assert "| compact at / from" in table and "3072 / 2048" in table and "3072 / –" in table
    assert "2100–2100" in table and "3100–3100" in table
    assert "turn 1: prompt / computed / time" in table and "2100 / 40 / 1.5 s" in table
    assert "prompt tokens llama-server computed" in table
    assert table.endswith(
        "One conversation of 2 turns (12 lines of notes each) on 2 slots of 4096 tokens."
    )
