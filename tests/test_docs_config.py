"""docs/configuration.md lists every option and every config field as the code defines them.

The tables between the ``<!-- name:begin ... -->`` and ``<!-- name:end -->`` markers are generated;
to refresh them after changing an option, run ``python -m tests.test_docs_config``.
"""

from __future__ import annotations

import re
from pathlib import Path

from agentkv.runtime.config import RuntimeConfig
from agentkv_server.cli import build_parser, fields_markdown, options_markdown
from agentkv_server.config import ServerConfig

DOC = Path(__file__).parent.parent / "docs" / "configuration.md"


def generated() -> dict[str, str]:
    return {
        "options": options_markdown(),
        "runtime-config": fields_markdown(RuntimeConfig),
        "server-config": fields_markdown(ServerConfig),
    }


def render(text: str) -> str:
    """``text`` with every generated block replaced by what the code generates now."""
    for name, table in generated().items():
        pattern = re.compile(
            rf"(<!-- {re.escape(name)}:begin[^>]*-->\n)(.*?)(<!-- {re.escape(name)}:end -->)",
            re.S,
        )
        assert pattern.search(text), f"docs/configuration.md lacks the {name} markers"
        block = table.rstrip("\n") + "\n"
        text = pattern.sub(lambda m, block=block: m.group(1) + block + m.group(3), text)
    return text


def test_generated_tables_match_the_code() -> None:
    text = DOC.read_text()
    assert render(text) == text, "run: python -m tests.test_docs_config"


def test_every_flag_of_the_command_is_documented() -> None:
    text = DOC.read_text()
    flags = {
        max(action.option_strings, key=len)
        for action in build_parser()._actions
        if action.option_strings and action.dest != "help"
    }
    missing = sorted(flag for flag in flags if f"`{flag}" not in text)
    assert not missing, missing
    # And every documented flag exists (no stale option survives in prose).
    documented = set(re.findall(r"`(--[a-z][a-z0-9-]+)", text))
    others = _section(text, "## The llama-server flags") + _section(text, "## Claude Code")
    not_ours = set(re.findall(r"`(--[a-z][a-z0-9-]+)", others))
    stale = sorted(documented - flags - not_ours)
    assert not stale, stale


def _section(text: str, heading: str) -> str:
    """A section about another program's flags (llama-server's, Claude Code's)."""
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


if __name__ == "__main__":
    DOC.write_text(render(DOC.read_text()))
