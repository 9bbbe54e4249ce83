"""A pool of llama-servers under one scheduler: their slots as one slot space.

:class:`EnginePool` stands where one :class:`~agentkv.runtime.client.LlamaSlotClient` stands: both
are an :class:`~agentkv.runtime.seam.Engine`. The pool holds one client per engine and numbers the
slots of all its engines one after the other (engine 0's slots first), so global slot ``k`` is one
(engine, local slot) pair, and it sends each call to the client of the engine that owns the slot.
The runtime does not change: :func:`agentkv.slots.place` already prices every slot of the table,
so it chooses an (engine, slot) pair with the one cost model. Calls that name no slot
(templating, tokenizing, ``/props``) go to the first engine that is up, and to the next one when
that one fails.

Each engine writes its slot files into its own directory (its ``--slot-save-path``); the prefix
store's files live in the pool's store directory. A save on engine A moves the file from A's
directory into the store; a restore on engine B links (or, across file systems, copies) the
store's file into B's directory, restores it there and removes the link. That is how a context
computed on one engine is served from another: the prefix store checks the file's tokens before
the restore and the count llama-server restored after it, as for any restore, and placement
restores only when that is priced lower than a prefill. It needs the same model, build and
context settings on every engine (the store key); agentkv launches its engines alike, and
engines given with ``--upstream`` must be started alike.

An engine that dies or stops answering (its ``/health`` fails ``health_failures`` probes in a
row, or the supervisor of an engine agentkv launched says it is restarting) is *down*: its slots
are taken out of placement, so its agents are placed on the other engines. Requests running on it
fail as they would with one engine; nothing else does. A call that fails on an engine makes the
pool probe it at once. When it answers again it rejoins, its slots empty (whatever they held is
forgotten).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import secrets
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import anyio
import anyio.to_thread
import attrs

from agentkv.exceptions import EngineError, EngineTimeoutError, EngineUnavailableError
from agentkv.prompts import PromptStats
from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.seam import SlotsChanged
from agentkv.snapshot import EngineRow

if TYPE_CHECKING:
    from agentkv.runtime.hints import EngineHints
    from agentkv.runtime.status import EngineStatus

__all__ = ["EnginePool", "PoolMember"]

log = logging.getLogger("agentkv.pool")

T = TypeVar("T")


@attrs.define(eq=False)
class PoolMember:
    """One engine of the pool: its client, its slots in the pool's numbering, its directory."""

    index: int
    client: LlamaSlotClient
    slots: range
    #: The engine's ``--slot-save-path`` as seen from here (None: the pool's store directory).
    slot_dir: Path | None = None
    up: bool = True
    #: Health probes failed in a row.
    failures: int = 0
    #: Why it is down, in words ("" while up).
    detail: str = ""
    #: Times it came back after being down.
    rejoined: int = 0
    #: The supervisor's generation last seen (a restart between two probes empties its slots).
    generation: int = 0
    #: The engine has no supervisor here: the pool's probes tell its client whether it answers
    #: (:meth:`~agentkv.runtime.client.LlamaSlotClient.set_reachable`), so that calls to it
    #: fail at once while it is down.
    owns_status: bool = False

    @property
    def base_url(self) -> str:
        return self.client.base_url


def _link_or_copy(source: Path, target: Path) -> None:
    """Put ``source`` at ``target`` (replacing it): a hard link when both are on one file
    system, else a copy."""
    with contextlib.suppress(FileNotFoundError):
        target.unlink()
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copyfile(source, target)
    with contextlib.suppress(OSError):
        os.chmod(target, 0o600)


def _move(source: Path, target: Path) -> None:
    """Move a file into place: a rename on one file system, else a copy and an unlink."""
    try:
        os.replace(source, target)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        shutil.copyfile(source, target)
        source.unlink()
    with contextlib.suppress(OSError):
        os.chmod(target, 0o600)


#: A store file linked into an engine's directory for one restore.
_STAGED_PREFIX = "akv-staged-"


def _file_error(member: PoolMember, what: str, exc: OSError) -> EngineUnavailableError:
    """A file that could not be moved between directories: for the store, a link failure (the
    entry stays; this request prefills)."""
    return EngineUnavailableError(f"could not {what} for engine {member.index}: {exc}")


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


class EnginePool:
    """Several llama-servers of one model as one :class:`~agentkv.runtime.seam.Engine`; see the
    module docstring.

    ``members`` are the engines' clients (closed by :meth:`aclose`), ``slots`` how many slots
    each has, ``slot_dirs`` each one's ``--slot-save-path`` (None entries, or none given: the
    engine writes into ``store_dir`` itself), ``store_dir`` the prefix store's directory.
    ``on_change`` hears when an engine's slots go out of placement or come back; the runtime
    sets it (:meth:`watch`).
    """

    #: llama-servers all: their slots are saved and restored as files.
    slot_files: ClassVar[bool] = True
    engine_name: ClassVar[str] = "llama-server"

    def __init__(
        self,
        members: Sequence[LlamaSlotClient],
        *,
        slots: Sequence[int],
        slot_dirs: Sequence[Path | None] | None = None,
        store_dir: Path | None = None,
        health_interval: float = 1.0,
        health_timeout: float = 3.0,
        health_failures: int = 2,
    ) -> None:
        if not members:
            raise ValueError("a pool needs at least one engine")
        if len(slots) != len(members):
            raise ValueError("give the slot count of every engine")
        dirs = list(slot_dirs) if slot_dirs is not None else [None] * len(members)
        if len(dirs) != len(members):
            raise ValueError("give the slot directory of every engine (or of none)")
        self.members: list[PoolMember] = []
        first = 0
        for index, (client, count, directory) in enumerate(zip(members, slots, dirs, strict=True)):
            if count < 1:
                raise ValueError(f"engine {index} has no slots")
            # Up, as far as the pool knows; an engine with no supervisor is the pool's to judge.
            owns = client.set_reachable(True)
            assert client.status is not None
            self.members.append(
                PoolMember(
                    index,
                    client,
                    range(first, first + count),
                    None if directory is None else Path(directory),
                    generation=client.status.generation,
                    owns_status=owns,
                )
            )
            first += count
        self.n_slots = first
        self.store_dir = None if store_dir is None else Path(store_dir)
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.health_failures = max(1, health_failures)
        self.on_change: SlotsChanged | None = None
        self._suspect = anyio.Event()

    @property
    def status(self) -> EngineStatus | None:
        """None: each engine has its own supervisor, or none (see :meth:`engine_state`)."""
        return None

    async def __aenter__(self) -> EnginePool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- routing --------------------------------------------------------------------------------

    def member_of(self, slot: int) -> tuple[PoolMember, int]:
        """The engine that owns global ``slot``, and the slot's number on that engine."""
        for member in self.members:
            if slot in member.slots:
                return member, slot - member.slots.start
        raise ValueError(f"no slot {slot}: slots are 0..{self.n_slots - 1}")

    def up(self) -> list[PoolMember]:
        """The engines in placement now, in order."""
        return [m for m in self.members if m.up]

    def _any(self) -> list[PoolMember]:
        """Where a call that names no slot goes: the engines that are up, else all of them
        (the call then fails the way it would with one engine)."""
        return self.up() or list(self.members)

    def _failed(self, member: PoolMember, exc: EngineError) -> None:
        """A call failed on ``member``: probe it now rather than at the next interval."""
        if isinstance(exc, EngineUnavailableError | EngineTimeoutError):
            log.info("engine %d (%s) failed a call: %s", member.index, member.base_url, exc)
            self._suspect.set()

    async def _first_up(self, call: Callable[[LlamaSlotClient], Awaitable[T]]) -> T:
        """``call`` on the first engine that is up; on the next when it cannot be reached."""
        error: EngineError | None = None
        for member in self._any():
            try:
                return await call(member.client)
            except (EngineUnavailableError, EngineTimeoutError) as exc:
                self._failed(member, exc)
                error = exc
        assert error is not None
        raise error

    async def _on(self, slot: int, call: Callable[[LlamaSlotClient, int], Awaitable[T]]) -> T:
        member, local = self.member_of(slot)
        async with self._watched(member):
            return await call(member.client, local)

    @contextlib.asynccontextmanager
    async def _watched(self, member: PoolMember) -> AsyncIterator[None]:
        """Note a failure of ``member`` while the block runs (a stream being read included)."""
        try:
            yield
        except EngineError as exc:
            self._failed(member, exc)
            raise

    # -- chat and raw completions --------------------------------------------------------------

    async def chat(
        self, body: Mapping[str, Any], *, slot: int | None, hints: EngineHints | None = None
    ) -> dict[str, Any]:
        if slot is None:
            return await self._first_up(lambda c: c.chat(body, slot=None, hints=hints))
        return await self._on(slot, lambda c, s: c.chat(body, slot=s, hints=hints))

    @contextlib.asynccontextmanager
    async def stream(
        self, body: Mapping[str, Any], *, slot: int | None, hints: EngineHints | None = None
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        member, local = (self._any()[0], None) if slot is None else self.member_of(slot)
        async with (
            self._watched(member),
            member.client.stream(body, slot=local, hints=hints) as chunks,
        ):
            yield chunks

    @contextlib.asynccontextmanager
    async def prefill(
        self, tokens: list[int] | tuple[int, ...], *, slot: int
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        member, local = self.member_of(slot)
        async with self._watched(member), member.client.prefill(tokens, slot=local) as chunks:
            yield chunks

    @contextlib.asynccontextmanager
    async def complete(
        self, payload: Mapping[str, Any], *, slot: int
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        member, local = self.member_of(slot)
        async with self._watched(member), member.client.complete(payload, slot=local) as chunks:
            yield chunks

    # -- calls that name no slot ---------------------------------------------------------------

    async def tokenize(
        self, content: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        return await self._first_up(
            lambda c: c.tokenize(content, add_special=add_special, parse_special=parse_special)
        )

    async def detokenize(self, tokens: list[int] | tuple[int, ...]) -> str:
        return await self._first_up(lambda c: c.detokenize(tokens))

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        return await self._first_up(lambda c: c.apply_template(body))

    async def prompt_tokens(self, body: Mapping[str, Any]) -> list[int]:
        return await self._first_up(lambda c: c.prompt_tokens(body))

    async def props(self) -> dict[str, Any]:
        return await self._first_up(lambda c: c.props())

    async def accepts_images(self) -> bool:
        return await self._first_up(lambda c: c.accepts_images())

    async def metrics(self) -> str:
        """The first engine's ``/metrics`` (see :meth:`member_metrics` for all of them)."""
        return await self._first_up(lambda c: c.metrics())

    async def member_metrics(self) -> list[str | None]:
        """Every engine's ``/metrics`` text, in order (None for one that did not answer)."""
        texts: list[str | None] = []
        for member in self.members:
            try:
                texts.append(await member.client.metrics())
            except EngineError:
                texts.append(None)
        return texts

    # -- slots ---------------------------------------------------------------------------------

    async def slots(self) -> list[dict[str, Any]]:
        """Every engine's ``/slots``, renumbered into the pool's slots; an engine that is down
        contributes nothing."""
        rows: list[dict[str, Any]] = []
        for member in self.up():
            try:
                table = await member.client.slots()
            except (EngineUnavailableError, EngineTimeoutError) as exc:
                self._failed(member, exc)
                continue
            for row in table:
                local = row.get("id")
                if isinstance(local, int) and 0 <= local < len(member.slots):
                    rows.append({**row, "id": member.slots.start + local, "engine": member.index})
        return rows

    def _dirs(self, member: PoolMember) -> tuple[Path, Path] | None:
        """(the engine's directory, the store's) when they differ, else None."""
        if member.slot_dir is None or self.store_dir is None:
            return None
        if member.slot_dir.resolve() == self.store_dir.resolve():
            return None
        return member.slot_dir, self.store_dir

    async def save_slot(self, slot: int, filename: str) -> dict[str, Any]:
        """Save ``slot`` on its engine, then move the file into the store's directory."""
        member, _ = self.member_of(slot)
        reply = await self._on(slot, lambda c, s: c.save_slot(s, filename))
        dirs = self._dirs(member)
        if dirs is not None:
            engine_dir, store_dir = dirs
            try:
                await anyio.to_thread.run_sync(_move, engine_dir / filename, store_dir / filename)
            except OSError as exc:
                await anyio.to_thread.run_sync(_unlink, engine_dir / filename)
                raise _file_error(member, "move a saved slot into the store", exc) from exc
        return reply

    async def restore_slot(self, slot: int, filename: str) -> dict[str, Any]:
        """Restore ``slot`` on its engine from the store's ``filename``, linked (or copied) into
        that engine's directory under a name of its own for this restore (two slots may restore
        one entry at once) and removed from there afterwards."""
        member, _ = self.member_of(slot)
        dirs = self._dirs(member)
        if dirs is None:
            return await self._on(slot, lambda c, s: c.restore_slot(s, filename))
        engine_dir, store_dir = dirs
        staged = f"{_STAGED_PREFIX}{secrets.token_hex(8)}.bin"
        try:
            await anyio.to_thread.run_sync(_link_or_copy, store_dir / filename, engine_dir / staged)
        except OSError as exc:
            raise _file_error(member, "copy a slot file to the engine", exc) from exc
        try:
            return await self._on(slot, lambda c, s: c.restore_slot(s, staged))
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_unlink, engine_dir / staged)

    async def erase_slot(self, slot: int) -> dict[str, Any]:
        return await self._on(slot, lambda c, s: c.erase_slot(s))

    # -- readiness and health ------------------------------------------------------------------

    async def health(self) -> bool:
        """True while at least one engine serves."""
        for member in self._any():
            if await member.client.health():
                return True
        return False

    async def engine_state(self) -> tuple[str, str]:
        """``ready`` while at least one engine is up (the detail says how many)."""
        up = self.up()
        if not up:
            details = "; ".join(f"engine {m.index}: {m.detail or 'down'}" for m in self.members)
            return "engine_unavailable", details
        state, detail = await up[0].client.engine_state()
        if state != "ready":
            return state, detail
        return "ready", f"{len(up)} of {len(self.members)} engines ready"

    async def wait_ready(
        self,
        timeout: float,  # noqa: ASYNC109 - part of the public contract
        *,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        """Wait until every engine has loaded its model (they load side by side, so each gets
        ``timeout`` seconds)."""
        for member in self.members:
            await member.client.wait_ready(timeout, on_progress=on_progress)
        await anyio.to_thread.run_sync(self._clean_dirs)

    def _clean_dirs(self) -> None:
        """Slot files left in an engine's own directory by an earlier run that stopped between
        a save and its move (or during a restore): the store does not know them."""
        for dirs in filter(None, map(self._dirs, self.members)):
            for path in dirs[0].glob("akv-*.bin"):
                _unlink(path)

    async def check(self, member: PoolMember) -> None:
        """Probe ``member`` once and move it in or out of placement."""
        # The supervisor's status, where one speaks for the engine.
        status = None if member.owns_status else member.client.status
        if status is not None and status.state != "ready":
            ok, detail = False, status.detail or status.state
        else:
            ok = False
            with anyio.move_on_after(self.health_timeout):
                ok = await member.client.health()
            detail = "" if ok else f"its /health does not answer ({member.base_url})"
        if status is not None and ok and status.generation != member.generation:
            # Restarted between two probes: up, but nothing it held is there any more.
            member.generation = status.generation
            if member.up:
                log.warning("engine %d restarted: its slots are empty", member.index)
                self._changed(member, True)
        if ok:
            member.failures = 0
            if not member.up:
                member.up, member.detail = True, ""
                member.rejoined += 1
                if member.owns_status:
                    member.client.set_reachable(True)
                log.warning(
                    "engine %d (%s) answers again: it rejoins the pool, its slots empty",
                    member.index,
                    member.base_url,
                )
                self._changed(member, True)
            return
        member.failures += 1
        if member.up and (member.failures >= self.health_failures or status is not None):
            member.up, member.detail = False, detail
            if member.owns_status:
                # Calls to it now fail at once instead of waiting on refused connections.
                member.client.set_reachable(False, detail)
            log.warning(
                "engine %d (%s) is down (%s): its slots are out of placement",
                member.index,
                member.base_url,
                detail,
            )
            self._changed(member, False)

    def _changed(self, member: PoolMember, up: bool) -> None:
        if self.on_change is not None:
            self.on_change(member.slots, up)

    async def watch(self, on_change: SlotsChanged | None = None) -> None:
        """Probe every engine each ``health_interval`` seconds (at once after a failed call),
        forever; ``on_change`` hears an engine leaving placement or rejoining it."""
        if on_change is not None:
            self.on_change = on_change
        while True:
            async with anyio.create_task_group() as tg:
                for member in self.members:
                    tg.start_soon(self.check, member)
            with anyio.move_on_after(self.health_interval):
                await self._suspect.wait()
            if self._suspect.is_set():
                self._suspect = anyio.Event()

    @property
    def restarts(self) -> int:
        """The restarts of every engine's supervisor, summed (an upstream has none)."""
        return sum(m.client.status.restarts for m in self.members if m.client.status is not None)

    def prompt_answers(self) -> PromptStats:
        """Where the prompt answers of every engine came from, summed."""
        answers = (m.client.prompt_answers() for m in self.members)
        return functools.reduce(PromptStats.add, answers, PromptStats())

    def engines(self) -> tuple[EngineRow, ...]:
        """One row per engine, for the operator."""
        return tuple(
            EngineRow(
                engine=m.index,
                url=m.base_url,
                slots=(m.slots.start, m.slots.stop - 1),
                up=m.up,
                detail=m.detail,
                rejoined=m.rejoined,
            )
            for m in self.members
        )

    async def aclose(self) -> None:
        for member in self.members:
            await member.client.aclose()
