"""The config.toml lines ``agentkv-server`` prints for Codex."""

from __future__ import annotations

import tomllib

from agentkv_server.cli import codex_config
from agentkv_server.logs import startup_block, startup_fields
from tests.openai_agents._codex import codex_config as read_printed


def test_the_lines_are_a_codex_provider() -> None:
    """Valid TOML: a provider on the Responses API at /v1, the key variable, the slot's window."""
    text = codex_config("http://127.0.0.1:8788", None, ctx_per_slot=32768)
    toml, _, shell = text.partition("# and in the shell that starts Codex:")
    config = tomllib.loads(toml)
    assert config["model"] == "agentkv-local"
    assert config["model_provider"] == "agentkv"
    assert config["model_context_window"] == 32768
    assert config["model_providers"]["agentkv"] == {
        "name": "agentkv",
        "base_url": "http://127.0.0.1:8788/v1",
        "wire_api": "responses",
        "env_key": "AGENTKV_API_KEY",
    }
    assert shell.strip().startswith("export AGENTKV_API_KEY=agentkv")


def test_a_configured_key_is_never_printed() -> None:
    text = codex_config("http://h:1", "s3cret-key", ctx_per_slot=None)
    assert "s3cret-key" not in text
    assert "model_context_window" not in tomllib.loads(text.partition("\n\n")[0])
    assert "# export AGENTKV_API_KEY=<the key>" in text


def test_the_startup_block_carries_them_after_claude_code() -> None:
    """The printed block reads back as the same TOML and shell variable (as the tests use it)."""
    fields = startup_fields(
        engine="http://e",
        launched=True,
        model=None,
        slots=2,
        ctx_per_slot=32768,
        store=None,
        store_budget=None,
        url="http://127.0.0.1:8788",
        api_key=False,
        claude_code="export ANTHROPIC_BASE_URL=http://127.0.0.1:8788",
        codex=codex_config("http://127.0.0.1:8788", None, ctx_per_slot=32768),
    )
    block = startup_block(fields)
    assert block.index("Point Claude Code at it:") < block.index("Point Codex at it")
    toml, env = read_printed(block)
    assert tomllib.loads(toml)["model_providers"]["agentkv"]["wire_api"] == "responses"
    assert env == {"AGENTKV_API_KEY": "agentkv"}
