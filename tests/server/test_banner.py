"""The startup banner's device row and warnings (the GPU used, a GPU left unused, a store off)."""

from __future__ import annotations

from typing import Any

from agentkv_server import logs


def fields(**extra: Any) -> dict[str, Any]:
    return logs.startup_fields(
        engine="http://127.0.0.1:1234",
        launched=True,
        model="/models/m.gguf",
        slots=2,
        ctx_per_slot=4096,
        store=None,
        store_budget=None,
        url="http://127.0.0.1:8788",
        api_key=False,
        claude_code="export ANTHROPIC_BASE_URL=http://127.0.0.1:8788",
        **extra,
    )


def test_the_banner_names_the_device_and_shows_each_warning() -> None:
    block = logs.startup_block(
        fields(
            device="CUDA0 NVIDIA H200 (139.2 GiB free): all layers offloaded",
            warnings=["prefix store off: restoring a saved slot gives no reuse"],
        )
    )
    rows = block.splitlines()
    assert "  device   CUDA0 NVIDIA H200 (139.2 GiB free): all layers offloaded" in rows
    assert rows.index("  device   CUDA0 NVIDIA H200 (139.2 GiB free): all layers offloaded") == 4
    assert "  warning: prefix store off: restoring a saved slot gives no reuse" in rows
    assert block.index("warning:") < block.index("Point Claude Code at it")


def test_without_a_device_or_warnings_the_banner_is_as_before() -> None:
    """With --upstream agentkv does not know the device: no row, and nothing else changes."""
    block = logs.startup_block(fields())
    assert "device" not in block and "warning" not in block
    assert block.splitlines()[3] == "  model    /models/m.gguf"
