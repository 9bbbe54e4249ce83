"""What agentkv knows about the engine it runs: ready, restarting, or given up on.

The supervisor (:mod:`agentkv.runtime.supervisor`) writes an :class:`EngineStatus`; the client
reads it before each request (a request during a restart fails at once with
:class:`~agentkv.exceptions.EngineRestartingError` instead of waiting on refused connections), and
the server's ``/health`` reports it. ``generation`` counts the engine's starts: every slot of a
new generation is empty, so whoever remembers slot contents forgets them when it changes
(:meth:`EngineStatus.wait_generation`).
"""

from __future__ import annotations

import math
from typing import Literal

import anyio
import attrs

from agentkv.exceptions import EngineRestartingError, EngineUnavailableError

__all__ = ["EngineState", "EngineStatus"]

#: ``ready``: serving. ``restarting``: it died and is being started again. ``unavailable``:
#: agentkv gave up restarting it.
EngineState = Literal["ready", "restarting", "unavailable"]


@attrs.define
class EngineStatus:
    """The state of a supervised engine, shared by the supervisor, the client and ``/health``."""

    state: EngineState = "ready"
    #: 1 once the engine first served; +1 after each successful restart.
    generation: int = 1
    #: Why the engine is not ready, in words ("" when it is).
    detail: str = ""
    #: Seconds until a restart is expected to be done; what clients are told to wait.
    retry_after: float = 1.0
    #: Restarts so far.
    restarts: int = 0
    _changed: anyio.Event | None = attrs.field(default=None, init=False, repr=False)

    def set_state(
        self, state: EngineState, detail: str = "", *, retry_after: float | None = None
    ) -> None:
        """Move to ``state``; waiters wake up."""
        self.state = state
        self.detail = detail
        if retry_after is not None:
            self.retry_after = max(1.0, retry_after)
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def new_generation(self) -> int:
        """A restarted engine serves: ready again, every slot empty. Returns the generation."""
        self.generation += 1
        self.restarts += 1
        self.set_state("ready")
        return self.generation

    async def changed(self) -> None:
        """Wait for the next change of state or generation."""
        if self._changed is None:
            self._changed = anyio.Event()
        await self._changed.wait()

    async def wait_generation(self, after: int) -> int:
        """Wait until the generation is past ``after`` (the engine was restarted and serves
        again); returns the new generation."""
        while self.generation <= after:
            await self.changed()
        return self.generation

    def error(self) -> EngineUnavailableError | None:
        """The error a request gets now, or None while the engine is ready."""
        if self.state == "ready":
            return None
        retry_after = float(math.ceil(self.retry_after))
        if self.state == "restarting":
            return EngineRestartingError(
                f"llama-server is restarting ({self.detail}); retry in {retry_after:g} s",
                retry_after=retry_after,
            )
        return EngineUnavailableError(f"llama-server is unavailable: {self.detail}")
