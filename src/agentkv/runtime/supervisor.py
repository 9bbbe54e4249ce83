"""Keeping a launched llama-server alive: restart it when it dies, give up when it keeps dying.

:class:`EngineSupervisor` watches a :class:`~agentkv.runtime.engine.LlamaServerProcess` it was
given (already started): the process exiting, or ``/health`` failing ``health_failures`` times in
a row, counts as a death. It then restarts the server with exponential backoff (``backoff``,
doubling per recent failure, at most ``backoff_max`` seconds), and meanwhile sets the shared
:class:`~agentkv.runtime.status.EngineStatus` to ``restarting``, so that requests fail at once
with 529 ``overloaded_error`` and a ``retry-after``. A start that fails counts as another
failure. More than ``max_failures`` failures within ``window`` seconds and it gives up: the status
becomes ``unavailable``, :attr:`EngineSupervisor.failure` holds the reason, ``on_give_up`` is
called and :meth:`EngineSupervisor.run` returns, for the server to exit non-zero.

Every restart starts a new generation (``status.generation``): all slots are empty again.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import anyio
import attrs
import httpx
from anyio.abc import TaskStatus

from agentkv.exceptions import AgentKVError, EngineUnavailableError
from agentkv.runtime.engine import LlamaServerProcess, crash_hint, exit_words
from agentkv.runtime.health import probe
from agentkv.runtime.status import EngineStatus

__all__ = ["EngineGaveUpError", "EngineSupervisor"]

log = logging.getLogger("agentkv.engine")


class EngineGaveUpError(EngineUnavailableError):
    """llama-server kept failing: agentkv stopped restarting it."""


@attrs.define
class EngineSupervisor:
    """Restarts a launched llama-server that dies; see the module docstring.

    ``async with anyio.create_task_group() as tg: await tg.start(supervisor.run)`` after the
    process has started. :meth:`stand_down` before stopping the process on purpose.
    """

    process: LlamaServerProcess
    status: EngineStatus = attrs.field(factory=EngineStatus)
    max_failures: int = 5
    window: float = 300.0
    backoff: float = 0.5
    backoff_max: float = 30.0
    health_interval: float = 5.0
    health_timeout: float = 10.0
    health_failures: int = 3
    on_give_up: Callable[[EngineGaveUpError], None] | None = None
    clock: Callable[[], float] = time.monotonic
    #: Why the supervisor gave up (None while it has not).
    failure: EngineGaveUpError | None = attrs.field(default=None, init=False)
    _failures: list[float] = attrs.field(factory=list, init=False)
    _standing_down: bool = attrs.field(default=False, init=False)

    def stand_down(self) -> None:
        """Restart nothing from now on: agentkv is stopping the engine itself."""
        self._standing_down = True

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Watch and restart until cancelled, stood down, or given up.

        ``await tg.start(supervisor.run)`` returns once it watches."""
        task_status.started()
        while not self._standing_down:
            reason = await self._watch()
            if self._standing_down or not await self._recover(reason):
                return

    async def _watch(self) -> str:
        """Wait until the engine dies; why, in words."""
        reasons: list[str] = []
        async with anyio.create_task_group() as tg:

            async def exited() -> None:
                code = await self.process.wait()
                hint = crash_hint(code)
                reasons.append(f"llama-server exited with {exit_words(code)}")
                if hint:
                    log.error("%s", hint)
                tg.cancel_scope.cancel()

            async def unhealthy() -> None:
                failed = 0
                async with httpx.AsyncClient() as http:
                    while True:
                        await anyio.sleep(self.health_interval)
                        state, detail = await probe(
                            http, self.process.base_url, timeout=self.health_timeout
                        )
                        failed = 0 if state == "ready" else failed + 1
                        if failed >= self.health_failures:
                            reasons.append(
                                f"llama-server failed {failed} health checks in a row ({detail})"
                            )
                            tg.cancel_scope.cancel()
                            return

            tg.start_soon(exited)
            if self.health_interval > 0:
                tg.start_soon(unhealthy)
        return reasons[0]

    async def _recover(self, reason: str) -> bool:
        """Restart until the engine serves (True) or it is time to give up (False)."""
        while True:
            now = self.clock()
            self._failures = [t for t in self._failures if now - t < self.window] + [now]
            failures = len(self._failures)
            if failures > self.max_failures:
                self._give_up(reason, failures)
                return False
            delay = min(self.backoff_max, self.backoff * 2 ** (failures - 1))
            expected = delay + (self.process.startup_seconds or 10.0)
            log.warning(
                "%s; restarting it in %.1f s (failure %d of %d allowed in %.0f s)",
                reason,
                delay,
                failures,
                self.max_failures,
                self.window,
            )
            self.status.set_state("restarting", reason, retry_after=math.ceil(expected))
            await anyio.sleep(delay)
            if self._standing_down:
                return False
            try:
                await self.process.restart()
            except AgentKVError as exc:
                # EngineStartError (it died or hung while loading) or a vanished model file.
                reason = exc.message.splitlines()[0]
                continue
            except OSError as exc:  # the binary vanished or cannot be run any more
                reason = f"llama-server could not be started: {exc}"
                continue
            generation = self.status.new_generation()
            log.warning(
                "llama-server restarted in %.1f s (engine generation %d; all slots are empty)",
                self.process.startup_seconds or 0.0,
                generation,
            )
            return True

    def _give_up(self, reason: str, failures: int) -> None:
        message = (
            f"llama-server failed {failures} times within {self.window:g} s; giving up "
            f"(last: {reason}). Its log: {self.process.log_path}"
        )
        hint = crash_hint(self.process.returncode)
        error = EngineGaveUpError(f"{message}\n{hint}" if hint else message)
        self.failure = error
        self.status.set_state("unavailable", reason)
        log.error("%s", error.message)
        if self.on_give_up is not None:
            self.on_give_up(error)
