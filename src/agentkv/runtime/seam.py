"""The engine seam: what the runtime asks of the engine it runs on, and nothing more.

:class:`Engine` is a :class:`typing.Protocol`: the runtime (its lifecycle, relay, admission,
compactor, slot contents and prefix store) and the server (``/health``, ``/v1/models``,
``/metrics``) name it and never ask which engine they hold. Three classes implement it:

- :class:`~agentkv.runtime.client.LlamaSlotClient`: one llama-server, whose slots agentkv pins,
  saves and restores;
- :class:`~agentkv.runtime.pool.EnginePool`: several llama-servers as one slot space, built of
  member clients;
- :class:`~agentkv.runtime.adapters.OpenAIEngineClient` and its subclasses: an engine that places
  requests itself (vLLM, SGLang, Dynamo), with no slot files.

Only :mod:`agentkv.runtime.assemble` knows which one it built. Slots are numbered by the engine
(a pool numbers its engines' slots one after the other); an engine that places requests itself
ignores them. Every failure is an :class:`~agentkv.exceptions.EngineError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from agentkv.prompts import PromptStats
    from agentkv.runtime.hints import EngineHints
    from agentkv.runtime.status import EngineStatus
    from agentkv.snapshot import EngineRow

__all__ = ["Chunks", "Engine", "SlotsChanged"]

#: Called with the global slots of an engine and whether they may be placed on now (True: the
#: engine rejoined, its slots empty; False: it is down).
SlotsChanged = Callable[[range, bool], None]

#: A streamed reply: ``async with`` it for its parsed chunks; leaving the block (also by
#: cancellation) closes the response, which stops the engine generating.
Chunks = AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]


class Engine(Protocol):
    """The engine the runtime runs on (see the module docstring)."""

    # -- what it is -----------------------------------------------------------------------------

    @property
    def slot_files(self) -> bool:
        """The engine saves and restores its slots' KV cache as files (the prefix store)."""
        ...

    @property
    def status(self) -> EngineStatus | None:
        """The supervisor's view of the engine (None: no one supervisor speaks for it)."""
        ...

    @property
    def restarts(self) -> int:
        """The engine's restarts by its supervisor so far (a pool: every engine's, summed)."""
        ...

    # -- completions ----------------------------------------------------------------------------

    async def chat(
        self, body: Mapping[str, Any], *, slot: int | None, hints: EngineHints | None = None
    ) -> dict[str, Any]:
        """A non-streamed chat completion on ``slot`` (None: any); the reply with ``timings``."""
        ...

    def stream(
        self, body: Mapping[str, Any], *, slot: int | None, hints: EngineHints | None = None
    ) -> Chunks:
        """A streamed chat completion on ``slot``."""
        ...

    def prefill(self, tokens: list[int] | tuple[int, ...], *, slot: int) -> Chunks:
        """Compute ``tokens`` into ``slot``'s cache, generating nothing worth keeping."""
        ...

    def complete(self, payload: Mapping[str, Any], *, slot: int) -> Chunks:
        """A streamed raw completion of token ids on ``slot``."""
        ...

    # -- prompts --------------------------------------------------------------------------------

    async def prompt_tokens(self, body: Mapping[str, Any]) -> list[int]:
        """The prompt tokens of a chat ``body``, as the engine computes them (or estimates)."""
        ...

    async def tokenize(
        self, content: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        """Token ids of ``content``."""
        ...

    async def detokenize(self, tokens: list[int] | tuple[int, ...]) -> str:
        """The text of ``tokens``."""
        ...

    async def accepts_images(self) -> bool:
        """Whether the engine's model can see images."""
        ...

    def prompt_answers(self) -> PromptStats:
        """Where the prompt answers came from (kept, in pieces, asked of the engine)."""
        ...

    # -- slot files (where :attr:`slot_files`) -------------------------------------------------

    async def save_slot(self, slot: int, filename: str) -> dict[str, Any]:
        """Write ``slot``'s KV cache to ``filename`` in the store's directory."""
        ...

    async def restore_slot(self, slot: int, filename: str) -> dict[str, Any]:
        """Load ``slot``'s KV cache from ``filename``, saved by :meth:`save_slot`."""
        ...

    async def erase_slot(self, slot: int) -> dict[str, Any]:
        """Drop ``slot``'s KV cache."""
        ...

    # -- readiness and health -------------------------------------------------------------------

    async def health(self) -> bool:
        """True when the engine serves (one probe)."""
        ...

    async def engine_state(self) -> tuple[str, str]:
        """What ``/health`` reports: ``("ready" | "engine_restarting" | "engine_unavailable",
        detail)``."""
        ...

    async def wait_ready(
        self,
        timeout: float,  # noqa: ASYNC109 - part of the public contract
        *,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        """Wait until the engine has loaded its model."""
        ...

    def engines(self) -> tuple[EngineRow, ...] | None:
        """One row per engine for the operator, when the engine stands for several."""
        ...

    async def watch(self, on_change: SlotsChanged | None = None) -> None:
        """Follow the engines' health, forever, when it stands for several (``on_change`` hears
        their slots leave placement or rejoin it); returns at once otherwise."""
        ...

    async def aclose(self) -> None:
        """Close what it opened."""
        ...
