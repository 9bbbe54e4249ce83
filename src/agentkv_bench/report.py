"""Summaries of one configuration's run, and the report: a table, a JSON file and a PNG chart."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import attrs

from agentkv_bench.drivers import RequestResult
from agentkv_bench.engines import LABELS
from agentkv_bench.metrics import Counters, PrefillYardstick

__all__ = [
    "Row",
    "fmt",
    "percentile",
    "render_table",
    "summarize",
    "target_lines",
    "write_report",
]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _ttfts(results: Sequence[RequestResult]) -> dict[str, dict[str, Any]]:
    by_priority: dict[str, dict[str, Any]] = {}
    for priority in sorted({r.priority for r in results}):
        values = [r.ttft for r in results if r.priority == priority and r.ttft is not None]
        by_priority[f"P{priority}"] = {
            "requests": sum(1 for r in results if r.priority == priority),
            "ttft_p50_s": rounded(percentile(values, 0.5)),
            "ttft_p95_s": rounded(percentile(values, 0.95)),
        }
    return by_priority


def _agents(results: Sequence[RequestResult]) -> dict[str, dict[str, Any]]:
    """Each agent's first answer (TTFT of its first request) and when its last reply ended."""
    agents: dict[str, dict[str, Any]] = {}
    for result in sorted(results, key=lambda r: (r.agent, r.submitted)):
        row = agents.setdefault(
            result.agent,
            {"first_ttft_s": result.ttft, "first_answer": result.text, "requests": 0},
        )
        row["requests"] += 1
        row["done_s"] = max(row.get("done_s", 0.0), result.done)
    return agents


def summarize(
    name: str,
    wall: float,
    results: Sequence[RequestResult],
    counters: Counters,
    yardstick: PrefillYardstick | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The report for one configuration (plain JSON values). ``counters`` are llama-server's,
    as a difference over the run; ``yardstick`` gives the minimum for these prompts."""
    computed = int(counters.get("prompt_computed", 0))
    cached = int(counters.get("prompt_cached", 0))
    total = computed + cached
    ttfts = [r.ttft for r in results if r.ttft is not None]
    minimum = yardstick.minimum if yardstick is not None else None
    output = sum(r.output_tokens for r in results)
    return {
        "name": name,
        "label": LABELS.get(name, name),
        **(extra or {}),
        "wall_s": round(wall, 2),
        "requests": len(results),
        "errors": sum(1 for r in results if r.error is not None),
        "prompt_tokens_total": total,
        "prefill_computed": computed,
        "prefill_minimum": minimum,
        "prefill_naive": yardstick.naive if yardstick is not None else None,
        "prefill_ratio": round(computed / minimum, 3) if minimum else None,
        "computed_twice": computed - minimum if minimum is not None else None,
        "cache_hit_ratio": round(1 - computed / total, 4) if total else None,
        "prefill_seconds": round(counters.get("prompt_seconds", 0.0), 2),
        "ttft": _ttfts(results),
        "ttft_p50_s": rounded(percentile(ttfts, 0.5)),
        "ttft_p95_s": rounded(percentile(ttfts, 0.95)),
        "longest_wait_s": rounded(max(ttfts, default=None)),
        "agents": _agents(results),
        "output_tokens": output,
        "engine_output_tokens": int(counters.get("predicted", 0)),
        "output_tokens_per_s": round(output / wall, 2) if wall else None,
        "per_request": [attrs.asdict(r) for r in results],
    }


def fmt(value: Any, unit: str = "") -> str:
    """A figure for the table: 3 significant digits, whole numbers from 100 on."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}{unit}" if abs(value) < 100 else f"{value:.0f}{unit}"
    return f"{value}{unit}"


#: A table row: its name and a function of one configuration's summary giving the cell.
Row = tuple[str, Callable[[dict[str, Any]], str]]


def render_table(configs: Sequence[dict[str, Any]], rows: Sequence[Row]) -> str:
    """A Markdown table, one column per configuration."""
    cells = [(name, [cell(c) for c in configs]) for name, cell in rows]
    header = ["", *(c["label"] for c in configs)]
    widths = [max(len(name) for name, _ in cells)] + [
        max(len(header[i + 1]), *(len(r[1][i]) for r in cells)) for i in range(len(configs))
    ]

    def line(parts: Sequence[str]) -> str:
        return "| " + " | ".join(p.ljust(w) for p, w in zip(parts, widths, strict=True)) + " |"

    lines = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [line([name, *row]) for name, row in cells]
    return "\n".join(lines)


def target_lines(targets: dict[str, Any], heading: str = "Targets:") -> list[str]:
    """The report's targets as text lines: each with its figure, its target and the verdict."""
    lines = [heading]
    for key, row in targets.items():
        verdict = {True: "met", False: "MISSED", None: "not measured"}[row.get("met")]
        lines.append(f"- {key}: {row['value']} (target {row['target']}): {verdict}")
    return lines


Panel = tuple[str, Callable[[dict[str, Any]], float]]


def chart(
    configs: Sequence[dict[str, Any]], panels: Sequence[Panel], title: str, path: Path
) -> None:
    """Bar charts side by side, one bar per configuration in each panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [c["label"].replace(" + ", "\n+ ").replace(" (", "\n(") for c in configs]
    palette = ["#999999", "#5b8fd1", "#2ca25f", "#d95f02", "#7570b3", "#e7298a"]
    colors = [palette[i % len(palette)] for i in range(len(configs))]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), squeeze=False)
    for ax, (panel_title, value) in zip(axes[0], panels, strict=True):
        values = [value(c) for c in configs]
        bars = ax.bar(range(len(values)), values, color=colors)
        ax.set_title(panel_title)
        ax.set_xticks(range(len(values)), labels, fontsize=7)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.margins(y=0.15)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def write_report(
    report: dict[str, Any],
    text: str,
    out: Path,
    *,
    stem: str,
    panels: Sequence[Panel] = (),
    title: str = "",
) -> None:
    """``{stem}.json``, ``{stem}.txt`` and, with panels, ``{stem}.png`` under ``out``."""
    await anyio.Path(out).mkdir(parents=True, exist_ok=True)
    await anyio.Path(out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    await anyio.Path(out / f"{stem}.txt").write_text(text + "\n")
    if panels:
        await anyio.to_thread.run_sync(chart, report["configs"], panels, title, out / f"{stem}.png")
