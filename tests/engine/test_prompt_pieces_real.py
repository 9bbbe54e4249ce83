"""Prompts tokenized in pieces on a real llama-server: the same tokens as the engine's whole answer.

Claude Code's captured requests, one session's turns, another project, a coordinator and its
sub-agents, go through one client in order: each one that begins like a prompt before is tokenized
from that prompt's tokens and the rest only (``agentkv.prompts``). Every answer is compared with the
engine's own tokenizing of the whole prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentkv.translate import MessagesTranslator
from tests._engine_fixture import Engine

pytestmark = [pytest.mark.engine, pytest.mark.anyio]

FIXTURES = Path(__file__).parent.parent / "fixtures" / "claude_code"
#: In the order a user's agents would send them.
SEQUENCE = (
    "a_one_word.json",
    "b_file_task_1.json",
    "b_file_task_2.json",
    "b_file_task_3.json",
    "d_other_project.json",
    "subagents/fg_1_coordinator.json",
    "subagents/fg_2_subagent_back.json",
    "subagents/fg_3_subagent_front.json",
    "subagents/fg_4_continuation.json",
    "projects/subagent_git_other.json",
)


def engine_bodies() -> list[dict[str, Any]]:
    translator = MessagesTranslator()
    out = []
    for name in SEQUENCE:
        captured = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
        out.append(translator.translate(captured.get("body", captured)).body)
    return out


async def test_prompts_tokenized_in_pieces_match_the_engines_whole_answer(engine: Engine) -> None:
    async with engine.process.client(read_timeout=120) as client:
        for body in engine_bodies():
            got = await client.prompt_tokens(body)
            prompt = await client.apply_template(body)
            assert got == await client.tokenize(prompt, add_special=True)
        # Most of them began like one before, and were tokenized in pieces; the checks of the
        # first ones found them right, so pieces are still used.
        assert client.prompt_stats.tokens_pieces >= 6
        assert client._split_checks is not None
        assert "<|im_start|>" in client._markers
