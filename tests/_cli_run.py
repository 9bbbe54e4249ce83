"""Running a real agent CLI once, bounded in time: what the harnesses of every client share."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def run_bounded(
    command: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout: float
) -> dict[str, Any]:
    """Run ``command`` with no stdin; kill its whole process group after ``timeout`` seconds.

    Returns ``stdout``, ``stderr`` (decoded), ``returncode``, ``elapsed`` and ``timed_out``.
    """
    start = time.monotonic()
    process = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
    return {
        "stdout": out.decode(errors="replace"),
        "stderr": err.decode(errors="replace"),
        "returncode": process.returncode,
        "elapsed": time.monotonic() - start,
        "timed_out": timed_out,
    }
