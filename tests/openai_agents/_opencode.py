"""The real OpenCode CLI (``opencode run``) against ``agentkv-server``, set up as
docs/openai-agents.md says: a custom provider through the AI SDK's OpenAI-compatible package.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from tests._cli_run import run_bounded
from tests.openai_agents._codex import AgentRun

ENV_OPENCODE_BIN = "AGENTKV_OPENCODE_BIN"
#: The OpenCode version the suite pins (``.ci/run`` installs it).
OPENCODE_VERSION = "1.18.33"
_INSTALLED = (
    Path(__file__).resolve().parents[2] / ".ci" / "opencode" / "node_modules" / ".bin" / "opencode"
)
_SCRUB = re.compile(r"^(OPENAI_|OPENCODE_|ANTHROPIC_|XDG_)")


class OpenCodeNotFoundError(RuntimeError):
    """The OpenCode CLI is not installed where the tests look."""


def find_opencode() -> Path:
    explicit = os.environ.get(ENV_OPENCODE_BIN)
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise OpenCodeNotFoundError(f"${ENV_OPENCODE_BIN}={explicit} is not an executable file")
        return path
    if _INSTALLED.is_file():
        return _INSTALLED
    found = shutil.which("opencode")
    if found is None:
        raise OpenCodeNotFoundError(
            f"no OpenCode CLI in .ci/opencode, on PATH or in ${ENV_OPENCODE_BIN}; install it with "
            f"`npm install --prefix .ci/opencode opencode-ai@{OPENCODE_VERSION}`"
        )
    return Path(found)


def opencode_config(base_url: str, *, agent: str, context: int = 32768) -> dict[str, object]:
    """``opencode.json`` for a project: agentkv as a provider, its model the default."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "agentkv": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "agentkv",
                "options": {
                    "baseURL": f"{base_url}/v1",
                    "apiKey": "agentkv",
                    "headers": {"X-Agent-Id": agent},
                },
                "models": {
                    "agentkv-local": {
                        "name": "agentkv-local",
                        "limit": {"context": context, "output": 4096},
                    }
                },
            }
        },
        "model": "agentkv/agentkv-local",
    }


def run_opencode(
    base_url: str,
    prompt: str,
    *,
    project: Path,
    home: Path,
    timeout: float,
    agent: str = "opencode",
    opencode: Path | None = None,
) -> AgentRun:
    """``opencode run PROMPT`` in ``project`` (its ``opencode.json`` written), ``home`` as HOME."""
    binary = opencode or find_opencode()
    project.mkdir(parents=True, exist_ok=True)
    home.mkdir(parents=True, exist_ok=True)
    (project / "opencode.json").write_text(json.dumps(opencode_config(base_url, agent=agent)))
    environ = {k: v for k, v in os.environ.items() if not _SCRUB.match(k)}
    # OpenCode takes its project directory from $PWD, not from the working directory it runs in.
    environ |= {"HOME": str(home), "PWD": str(project)}
    ran = run_bounded([str(binary), "run", prompt], cwd=project, env=environ, timeout=timeout)
    return AgentRun(**ran)
