"""The compaction scenario's session and report (its real runs are a benchmark)."""

from __future__ import annotations

from typing import Any

from agentkv.forecast import CLAUDE_CODE_BUFFER, compaction_point
from agentkv_bench.compaction import CompactionSpec, _ratios, compaction_table, notes, turns


def test_the_session_crosses_the_point_twice_with_think_time_before_each_compaction() -> None:
    spec = CompactionSpec(think=60.0)
    session = turns(spec)
    assert [word for word, _, _ in session] == ["alpha", "beta", "gamma", "delta", "epsilon"]
    assert [think for _, _, think in session] == [0.0, 0.0, 60.0, 0.0, 60.0]
    assert all(prompt.endswith(f"Reply with the single word: {w}") for w, prompt, _ in session)
    # about 16 tokens a line (four characters a token): the first turn's notes take Claude Code's
    # ~11.9K-token first request past its point at the printed lines (32768, 4096 out)
    point = compaction_point(32768, 4096)
    assert point == 32768 - 4096 - CLAUDE_CODE_BUFFER
    assert 11_900 + len(notes(420, 7)) / 4 > point
    assert notes(420, 7) == notes(420, 7) != notes(420, 8)  # the same every run


def _config(name: str, seconds: list[float], prepared: dict[str, Any] | None) -> dict[str, Any]:
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    rows = [
        {
            "word": w,
            "seconds": s,
            "compacted": w in ("gamma", "epsilon"),
            "prefill_computed": 100,
            "rc": 0,
        }
        for w, s in zip(words, seconds, strict=True)
    ]
    report: dict[str, Any] = {
        "name": name,
        "label": name,
        "turns": rows,
        "busy_s": sum(seconds),
        "wall_s": sum(seconds) + 120,
        "compactions": 2,
        "failed": 0,
    }
    if prepared is not None:
        report["prepared"] = prepared
    return report


def test_each_turn_and_the_session_are_compared_with_llama_server_alone() -> None:
    base = _config("llama-server", [260, 2, 100, 60, 100], None)
    mine = _config(
        "agentkv",
        [130, 1, 10, 30, 20],
        {
            "prepared": 3,
            "served": 2,
            "joined": 1,
            "heads": 2,
            "missed": {"differs": 0, "expired": 1},
            "wasted_tokens": 5,
            "waiting": 0,
        },
    )
    off = _config("agentkv-noprep", [130, 1, 50, 30, 40], None)
    for config in (base, off, mine):
        config["vs_llama-server"] = _ratios(config, base)
        config["vs_agentkv-noprep"] = _ratios(config, off)
    assert mine["vs_agentkv-noprep"]["gamma"] == 0.2
    mine["vs_llama_server"] = mine["vs_llama-server"]
    assert mine["vs_llama_server"]["gamma"] == 0.1
    assert mine["vs_llama_server"]["epsilon"] == 0.2
    assert mine["vs_llama_server"]["busy_s"] == round(191 / 522, 3)
    table = compaction_table(
        {
            "configs": [base, off, mine],
            "spec": {"think": 60.0},
            "slots": 2,
            "ctx_per_slot": 32768,
        }
    )
    assert "turn gamma: seconds" in table and "(compaction)" in table
    assert "turn gamma / preparation off" in table and "0.2×" in table
    assert "3 / 2 / 1 (2 heads)" in table and "expired 1" in table
    assert "60 s of think time" in table


def test_claude_code_gets_the_printed_lines() -> None:
    """The model id Claude Code does not know, so that the window it is told applies (with a
    model id it knows it takes that model's window and never compacts here)."""
    from pathlib import Path

    from agentkv_bench.compaction import _env

    env = _env("http://127.0.0.1:1", Path("/nonexistent-home"), 32768)
    assert env["ANTHROPIC_MODEL"] == "agentkv-local"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "4096"
    assert env["HOME"] == "/nonexistent-home"
