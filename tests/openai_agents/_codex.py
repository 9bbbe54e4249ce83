"""The real Codex CLI (``codex exec``) against a real ``agentkv-server``, set up as a user would.

``codex_config`` reads the ``config.toml`` lines the server prints for Codex; ``run_codex`` writes
them into a fresh ``CODEX_HOME`` and runs ``codex exec`` in a project directory, under a hard
timeout, with only the variables those lines name.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import attrs

from tests._cli_run import run_bounded

#: Where to find the CLI: this variable, else ``.ci/codex`` (what ``.ci/run`` installs), else PATH.
ENV_CODEX_BIN = "AGENTKV_CODEX_BIN"
#: The Codex version the suite pins (``.ci/run`` installs it).
CODEX_VERSION = "0.171.0"
_INSTALLED = (
    Path(__file__).resolve().parents[2] / ".ci" / "codex" / "node_modules" / ".bin" / "codex"
)

_BLOCK_START = "Point Codex at it"
_SHELL_START = "# and in the shell that starts Codex:"
# Variables of the developer's own shell that would change what Codex does.
_SCRUB = re.compile(r"^(OPENAI_|CODEX_|AGENTKV_API_KEY$)")
#: Lines Codex 0.171.0 writes to stderr that say nothing about the answer: no bubblewrap on this
#: machine, no built-in metadata for a local model's name, and (tests only) a CODEX_HOME under the
#: temporary directory, where it does not put its helper binaries.
KNOWN_WARNINGS = (
    "could not find bubblewrap",
    "Model metadata for",
    "could not create PATH aliases",
)


class CodexNotFoundError(RuntimeError):
    """The Codex CLI is not installed where the tests look."""


def find_codex() -> Path:
    explicit = os.environ.get(ENV_CODEX_BIN)
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise CodexNotFoundError(f"${ENV_CODEX_BIN}={explicit} is not an executable file")
        return path
    if _INSTALLED.is_file():
        return _INSTALLED
    found = shutil.which("codex")
    if found is None:
        raise CodexNotFoundError(
            f"no Codex CLI in .ci/codex, on PATH or in ${ENV_CODEX_BIN}; install it with "
            f"`npm install --prefix .ci/codex @openai/codex@{CODEX_VERSION}`"
        )
    return Path(found)


def codex_config(output: str) -> tuple[str, dict[str, str]]:
    """The ``config.toml`` text and the shell variables ``agentkv-server`` printed for Codex."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(_BLOCK_START)), None)
    if start is None:
        raise ValueError(f"no {_BLOCK_START!r} block in the server's output")
    toml: list[str] = []
    env: dict[str, str] = {}
    rest = iter(lines[start + 1 :])
    for line in rest:
        if line.strip() == _SHELL_START:
            break
        toml.append(line)
    for line in rest:
        found = re.match(r"^export (\w+)=(\S+)", line)
        if found:
            env[found.group(1)] = found.group(2)
        break
    return "\n".join(toml).strip() + "\n", env


@attrs.frozen
class AgentRun:
    stdout: str
    stderr: str
    returncode: int
    elapsed: float
    timed_out: bool

    def answer(self) -> str:
        """The final message, as one word: case, surrounding space and punctuation dropped."""
        return self.stdout.strip().strip(".!\"'`").lower()

    def warnings(self) -> list[str]:
        """stderr lines that start with ``warning``/``error``, or are logged at ``ERROR`` (Codex
        logs a call it cannot route so), and are not known to be harmless."""
        return [
            line
            for line in self.stderr.splitlines()
            if (line.lower().startswith(("warning", "error")) or " ERROR " in line)
            and not any(known in line for known in KNOWN_WARNINGS)
        ]

    def describe(self) -> str:
        return (
            f"rc={self.returncode} timed_out={self.timed_out} {self.elapsed:.0f}s\n"
            f"stdout: {self.stdout[-2000:]}\nstderr: {self.stderr[-4000:]}"
        )


def run_codex(
    config: str,
    env: dict[str, str],
    prompt: str,
    *,
    project: Path,
    home: Path,
    timeout: float,
    codex: Path | None = None,
    args: Sequence[str] = (),
) -> AgentRun:
    """``codex exec --skip-git-repo-check PROMPT`` in ``project``, ``home`` as CODEX_HOME."""
    binary = codex or find_codex()
    home.mkdir(parents=True, exist_ok=True)
    project.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(config)
    environ = {k: v for k, v in os.environ.items() if not _SCRUB.match(k)}
    environ |= env | {"CODEX_HOME": str(home)}
    command = [str(binary), "exec", "--skip-git-repo-check", *args, prompt]
    ran = run_bounded(command, cwd=project, env=environ, timeout=timeout)
    return AgentRun(**ran)
