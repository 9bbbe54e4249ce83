"""The pure core imports no I/O library, so it can be embedded anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

PURE_MODULES = (
    "agentkv.translate",
    "agentkv.sse",
    "agentkv.fingerprint",
    "agentkv.slots",
    "agentkv.scheduler",
    "agentkv.repair",
    "agentkv.compaction",
    "agentkv.tokens",
    "agentkv.costs",
    "agentkv.store",
    "agentkv.limits",
    "agentkv.guard",
    "agentkv.agents",
)
IO_LIBRARIES = ("httpx", "starlette", "anyio", "uvicorn", "tenacity")

# Runs in a fresh interpreter: this test process may already have imported the I/O libraries.
PROBE = f"""
import importlib, sys
for name in {PURE_MODULES!r}:
    importlib.import_module(name)
from agentkv import (
    FairScheduler,
    MessagesTranslator,
    PrefixFingerprinter,
    SSEAssembler,
    SlotManager,
)
loaded = sorted(
    name for name in sys.modules if name.split(".")[0] in {IO_LIBRARIES!r}
)
print(",".join(loaded))
"""


def test_pure_core_imports_no_io_libraries() -> None:
    """Importing the five pure modules (and their public names) loads no httpx/anyio/starlette."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"I/O libraries imported: {result.stdout.strip()}"
