"""The ``decode`` scenario: its requests, and one quick run on the real engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentkv_bench import cli
from agentkv_bench.decode import KINDS, DecodeSpec, bodies


def test_each_kind_of_reply_sits_on_the_same_read_file() -> None:
    """At both depths the three requests share everything up to the user's ask, and are greedy."""
    for depth in ("1k", "12k"):
        requests = bodies(depth, max_tokens=16)
        assert set(requests) == set(KINDS)
        heads = {json.dumps(body["messages"][:-1]) for body in requests.values()}
        assert len(heads) == 1
        assert all(body["temperature"] == 0.0 for body in requests.values())


@pytest.mark.engine
def test_quick_decode_scenario_runs_both_configurations(tmp_path: Path) -> None:
    """llama-server alone and agentkv (as ``agentkv-server`` builds it, through the SDK) both
    reply to every kind at 1K depth, one agent and two at once; the report has every ratio."""
    from tests._engine_fixture import locate_engine

    locate_engine()
    out = tmp_path / "bench"
    assert cli.main(["--scenario", "decode", "--quick", "--out", str(out)]) == 0
    report = json.loads((out / "decode.json").read_text())
    spec = DecodeSpec.quick()
    keys = {f"1k {kind}" for kind in spec.kinds} | {"1k copy x2"}
    assert set(report["ratios"]) == keys
    for config in ("llama-server", "agentkv"):
        for kind in spec.kinds:
            row = report[config][f"1k {kind}"]
            assert row["output_tokens"] > 0, (config, kind, row)
            assert row["decode_tps"] > 0
        pair = report[config]["1k copy x2"]
        assert len(pair["replies"]) == 2 and pair["aggregate_tps"] > 0
