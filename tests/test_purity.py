"""The pure core imports no I/O library, so it can be embedded anywhere.

The list of pure modules is written once, in the import contract in ``pyproject.toml``; this test
reads it from there, checks that it names every module of the core, and imports them all in a fresh
interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
IO_LIBRARIES = ("httpx", "starlette", "anyio", "uvicorn", "tenacity")


def _pure_modules() -> tuple[str, ...]:
    """The forbidden contract's source modules: the one written list of the pure core."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    (pure,) = (c for c in contracts if c["type"] == "forbidden" and "pure core" in c["name"])
    return tuple(pure["source_modules"])


def test_the_contract_names_every_module_of_the_core() -> None:
    """Every module of ``agentkv`` outside ``agentkv.runtime`` is in the pure list, and no other."""
    found = {
        f"agentkv.{path.stem}" for path in (SRC / "agentkv").glob("*.py") if path.stem != "__init__"
    }
    found |= {
        f"agentkv.{path.name}"
        for path in (SRC / "agentkv").iterdir()
        if path.is_dir() and path.name != "runtime" and (path / "__init__.py").exists()
    }
    assert set(_pure_modules()) == found


def test_pure_core_imports_no_io_libraries() -> None:
    """Importing every pure module (and the public names) loads no httpx/anyio/starlette."""
    probe = f"""
import importlib, sys
for name in {_pure_modules()!r}:
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
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"I/O libraries imported: {result.stdout.strip()}"
