"""``agentkv-bench``: agentkv against llama-server alone, side by side in one run.

Modules: :mod:`~agentkv_bench.workload` and :mod:`~agentkv_bench.claude_workload` (what is
sent), :mod:`~agentkv_bench.engines` (the configurations), :mod:`~agentkv_bench.drivers` (the
client side), :mod:`~agentkv_bench.metrics` (llama-server's counters and the minimum prefill),
:mod:`~agentkv_bench.scenarios` (what runs), :mod:`~agentkv_bench.report` (table, JSON, chart),
:mod:`~agentkv_bench.overhead` (the gateway against :mod:`~agentkv_bench.fake_engine`, the
fake llama-server the tests use too), :mod:`~agentkv_bench.claude`
(the real Claude Code CLI as the client), :mod:`~agentkv_bench.soak` (many clients, dropped
requests and an engine kill against ``agentkv-server``) and :mod:`~agentkv_bench.cli`.
"""

from __future__ import annotations

__all__: list[str] = []
