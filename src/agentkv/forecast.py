"""Claude Code's next compaction request, predicted from the request and reply before it.

When Claude Code's context (the last reply's ``usage``: input, cache read, cache creation and
output tokens) reaches ``window − min(max_tokens, 20000) − 13000``, its next turn begins with a
compaction request (docs/claude-code.md, "What the compaction request contains"): the previous
request's body with ``messages`` = the previous messages, the reply as streamed, and one user
message that is the instruction text, every other field as it was. Only a ``cache_control`` mark
moves, which the engine never sees. Never after the first reply of a session, and a compaction
between tool calls (the reply ended in ``tool_use``) carries the tool's result, so it cannot be
known before the tool has run: only a reply that ended its turn leads to a prediction.

:class:`CompactionForecast` recognises Claude Code's requests and its compaction requests, learns
a new client version's instruction from the first start-of-turn compaction it sees, and predicts
the compaction body. Pure: values in, values out (the shipped instruction is package data, read
once).
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from agentkv.translate import BILLING_HEADER_PREFIX

__all__ = [
    "CLAUDE_CODE_BUFFER",
    "ESTIMATE_SLACK",
    "MAX_RESERVED_OUTPUT",
    "CompactionForecast",
    "compaction_point",
    "context_tokens",
    "is_claude_code",
    "shipped_instruction",
]

#: Tokens Claude Code keeps free below its reply's reserve (the "autocompact buffer").
CLAUDE_CODE_BUFFER = 13000
#: Claude Code reserves ``min(max_tokens, this)`` of the window for the reply.
MAX_RESERVED_OUTPUT = 20000
#: Claude Code adds its own estimate of what came after the reported usage (measured: 2 tokens
#: after a one-word reply): a reply within this many tokens below the point is predicted too.
ESTIMATE_SLACK = 16

#: Claude Code's system prompt says who it is in one of these (the ``-p`` mode names the SDK).
_CLAUDE_CODE_MARKERS = ("You are Claude Code", "Claude Agent SDK")
_BILLING_VERSION = BILLING_HEADER_PREFIX + " cc_version="


@functools.cache
def shipped_instruction() -> str:
    """The compaction instruction Claude Code 2.1.328 sends (6,912 characters), as shipped."""
    text = (
        importlib.resources.files("agentkv")
        .joinpath("data", "claude_code_compaction.txt")
        .read_text(encoding="utf-8")
    )
    return text.removesuffix("\n")


def _system_texts(system: Any) -> list[str]:
    if isinstance(system, str):
        return [system]
    if isinstance(system, Sequence):
        return [
            b["text"] for b in system if isinstance(b, Mapping) and isinstance(b.get("text"), str)
        ]
    return []


def is_claude_code(body: Mapping[str, Any]) -> bool:
    """The request comes from Claude Code: its system prompt opens with Claude Code's billing line
    (``x-anthropic-billing-header: cc_version=…``) or says it is Claude Code."""
    texts = _system_texts(body.get("system"))
    if texts and texts[0].startswith(_BILLING_VERSION):
        return True
    return any(marker in text for text in texts for marker in _CLAUDE_CODE_MARKERS)


def _last_text(content: Any) -> str | None:
    """A message's last text: the string, or its last text block."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        for block in reversed(content):
            if isinstance(block, Mapping) and block.get("type") == "text":
                text = block.get("text")
                return text if isinstance(text, str) else None
    return None


def _whole_text(content: Any) -> str | None:
    """A message's content when it is text alone: a string, or one text block."""
    if isinstance(content, str):
        return content
    if (
        isinstance(content, Sequence)
        and len(content) == 1
        and isinstance(content[0], Mapping)
        and content[0].get("type") == "text"
        and isinstance(content[0].get("text"), str)
    ):
        return str(content[0]["text"])
    return None


def _messages(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    return [m for m in messages if isinstance(m, Mapping)]


def context_tokens(usage: Mapping[str, Any]) -> int:
    """Claude Code's context after a reply: input, cache read, cache creation and output."""
    fields = (
        "input_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
        "output_tokens",
    )
    return sum(int(usage.get(name) or 0) for name in fields)


def compaction_point(window: int, max_tokens: int) -> int:
    """The context at which Claude Code compacts before its next turn."""
    return window - min(max_tokens, MAX_RESERVED_OUTPUT) - CLAUDE_CODE_BUFFER


@attrs.frozen
class CompactionForecast:
    """What Claude Code's next request is, when it is a compaction that can be known now.

    ``instruction`` is the text of the compaction request's last message: the shipped one until a
    start-of-turn compaction request with another is seen (:meth:`learn` returns the forecast that
    knows it).
    """

    instruction: str = attrs.field(factory=shipped_instruction)

    @property
    def first_line(self) -> str:
        """What every compaction request's instruction begins with."""
        return self.instruction.split("\n", 1)[0]

    def is_compaction(self, body: Mapping[str, Any]) -> bool:
        """The request is a Claude Code compaction: its last user message's text begins with the
        instruction's first line (at the start of a turn, or after a tool's result)."""
        messages = _messages(body)
        if not messages or messages[-1].get("role") != "user":
            return False
        text = _last_text(messages[-1].get("content"))
        return text is not None and text.startswith(self.first_line)

    def learn(self, body: Mapping[str, Any]) -> CompactionForecast:
        """The forecast after seeing ``body``: a start-of-turn compaction request (its last
        message a user message that is the instruction alone) with an instruction that is not the
        known one teaches it. A retry's instruction (the known one and a paragraph more) or one
        with added instructions extends the known one and teaches nothing."""
        if not self.is_compaction(body):
            return self
        text = _whole_text(_messages(body)[-1].get("content"))
        if text is None or text.startswith(self.instruction):
            return self
        return attrs.evolve(self, instruction=text)

    def predict(
        self, body: Mapping[str, Any], reply: Mapping[str, Any], window: int
    ) -> dict[str, Any] | None:
        """The compaction request Claude Code sends next, or None when none can be known now.

        ``body`` is the request that was answered, ``reply`` the whole reply as one Messages API
        Message (its ``content``, ``stop_reason`` and ``usage``), ``window`` Claude Code's context
        window (``CLAUDE_CODE_MAX_CONTEXT_TOKENS``, which agentkv has it set to its slot size).
        """
        messages = _messages(body)
        if (
            not is_claude_code(body)
            or self.is_compaction(body)
            or len(messages) != len(body.get("messages") or ())
            or not any(m.get("role") == "assistant" for m in messages)
            or reply.get("stop_reason") != "end_turn"
        ):
            return None
        max_tokens = body.get("max_tokens")
        usage = reply.get("usage")
        if not isinstance(max_tokens, int) or not isinstance(usage, Mapping):
            return None
        if context_tokens(usage) + ESTIMATE_SLACK < compaction_point(window, max_tokens):
            return None
        content = reply.get("content")
        if not isinstance(content, list) or not content:
            return None
        said = {"role": "assistant", "content": [dict(block) for block in content]}
        ask = {"role": "user", "content": self.instruction}
        return {**body, "messages": [*body["messages"], said, ask]}
