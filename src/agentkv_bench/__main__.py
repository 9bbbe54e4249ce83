"""``python -m agentkv_bench``."""

from __future__ import annotations

from agentkv_bench.cli import main

raise SystemExit(main())
