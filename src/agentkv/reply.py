"""One reply, as agentkv's own typed events: what every route's stream is encoded from.

:class:`~agentkv.sse.SSEAssembler` makes them, the runtime keeps them (a late client replays them),
and each API's encoder reads them once, in order. A reply is ``Started``, then blocks
(``BlockOpened``, its ``Delta`` s, ``BlockClosed``; indices count up from 0, one block open at a
time), then ``Ended``. A tool call's block carries its id and name when it opens, and its input, a
JSON object, as one ``input`` delta. Pure frozen values.
"""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = [
    "BlockClosed",
    "BlockKind",
    "BlockOpened",
    "Delta",
    "DeltaKind",
    "Ended",
    "ReplyEvent",
    "Started",
    "Usage",
]

BlockKind = Literal["text", "thinking", "tool_use"]
#: ``text`` and ``thinking`` add to their block's text; ``signature`` closes a thinking block's
#: content with its (opaque) signature; ``input`` is a tool call's input JSON.
DeltaKind = Literal["text", "thinking", "signature", "input"]


@attrs.frozen
class Usage:
    """Token counts: the prompt's uncached tokens, the prompt's tokens read from the cache, and
    the tokens generated."""

    input_tokens: int = 0
    cache_read_tokens: int = 0
    output_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        """The whole prompt, cached or not."""
        return self.input_tokens + self.cache_read_tokens


@attrs.frozen
class Started:
    """The reply begins (sent as early as possible: it keeps clients from timing out)."""

    message_id: str
    model: str
    #: The prompt's size as far as it is known before the engine answers.
    input_tokens: int


@attrs.frozen
class BlockOpened:
    """A content block begins: text, thinking, or a tool call (with its id and name)."""

    index: int
    kind: BlockKind
    tool_id: str = ""
    tool_name: str = ""


@attrs.frozen
class Delta:
    """Content added to the open block ``index``."""

    index: int
    kind: DeltaKind
    value: str


@attrs.frozen
class BlockClosed:
    """The block ``index`` is complete."""

    index: int


@attrs.frozen
class Ended:
    """The reply is complete: why it stopped (``end_turn``, ``max_tokens``, ``stop_sequence``,
    ``tool_use``), the stop sequence that ended it if one did, and the whole reply's usage."""

    stop_reason: str
    stop_sequence: str | None
    usage: Usage


ReplyEvent = Started | BlockOpened | Delta | BlockClosed | Ended
