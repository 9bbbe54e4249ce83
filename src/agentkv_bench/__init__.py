"""``agentkv-bench``: agentkv against llama-server alone, side by side in one run.

What is sent (``workload``, ``claude_workload``, ``codex_workload``), the configurations
(``engines``), the client side (``drivers``), llama-server's counters (``metrics``), the scenarios
(``scenarios`` and one module per larger scenario), reports (``report``), the fake llama-server
the tests use too (``fake_engine``) and the command line (``cli``).
"""

from __future__ import annotations

__all__: list[str] = []
