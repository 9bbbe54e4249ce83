"""Prefix fingerprints: which part of a conversation a llama-server slot already holds.

A fingerprint is a chain of block hashes in prompt order: the leading system message(s) as one
block, then the tools (with ``tool_choice`` and ``response_format``) as one, then one block per
further message; ``blocks[i]`` is ``sha256(blocks[i-1] + canonical_json(block_i))``, so two
fingerprints agree on their first ``k`` entries exactly when their first ``k`` blocks are equal.
A chain keeps the whole history without changing on every turn: one hash of the whole history
gave hit rates under 20%, one of system plus the latest rounds about 70%. Only those body keys
enter it; volatile text (Claude Code's billing header) is normalised by the translator first.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from agentkv._types import Fingerprint

__all__ = ["PrefixFingerprinter", "canonical_json"]

# The body keys that shape the tools part of the prompt (and the grammar the engine applies).
_TOOL_KEYS = ("tools", "tool_choice", "response_format")


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace: equal values give equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@attrs.frozen
class PrefixFingerprinter:
    """Turns an engine request body into a :class:`Fingerprint` of its stable prefix.

    ``max_turns`` is how many conversation messages after the system block enter the chain
    (``None`` = all of them; ``0`` = system and tools only).
    """

    max_turns: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(0))
    )

    def fingerprint(self, body: Mapping[str, Any]) -> Fingerprint:
        """The chained fingerprint of ``body``, an OpenAI chat body (``EngineRequest.body``)."""
        messages = body.get("messages", [])
        if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
            raise ValueError("body.messages must be a list of messages")
        head = next((i for i, m in enumerate(messages) if _role(m) != "system"), len(messages))
        turns = messages[head:]
        if self.max_turns is not None:
            turns = turns[: self.max_turns]
        tools = {key: body[key] for key in _TOOL_KEYS if body.get(key) is not None}
        parts = [canonical_json(list(messages[:head])), canonical_json(tools)]
        parts.extend(canonical_json(message) for message in turns)
        blocks = tuple(itertools.accumulate(parts, _link, initial=""))[1:]
        return Fingerprint(blocks=blocks, sizes=tuple(len(part) for part in parts))


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, Mapping) else None


def _link(previous: str, part: str) -> str:
    return hashlib.sha256((previous + part).encode()).hexdigest()
