"""The prefix store on disk: llama-server's slot files, indexed by the tokens they hold.

:class:`agentkv.store.StoreIndex` decides; this module saves slots into the store directory
(llama-server's ``--slot-save-path``) and indexes each file by the tokens its header holds: what
is really there, not what agentkv assumed. Every restore checks header and restored count (a file
that fails is deleted and the slot erased, so a wrong state never reaches a client; the caller
then prefills). ``index.json`` next to the files is bound to one engine configuration (model file
hash, llama-server build, context per slot, KV cache type): entries made under another are
refused and deleted, and files no index knows are deleted at startup. Files and directory are
readable by their owner only: a KV state is as sensitive as the transcript it encodes.

:func:`probe_restore` checks once per engine configuration that a restore gives reuse at all: on
sliding-window and hybrid models llama-server may recompute every restored token, and then a
store only costs time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import attrs

from agentkv.exceptions import (
    AgentKVError,
    EngineError,
    EngineTimeoutError,
    EngineUnavailableError,
)
from agentkv.runtime.model import write_atomic
from agentkv.runtime.seam import Engine
from agentkv.snapshot import StoreEntryRow, StoreSnapshot
from agentkv.store import EntryKind, StoreEntry, StoreIndex, entry_id
from agentkv.tokens import Tokens, digest

__all__ = [
    "PROBE_FILE",
    "PrefixStore",
    "RestoreProbe",
    "probe_length",
    "probe_restore",
    "read_state_tokens",
]

log = logging.getLogger("agentkv.store")

INDEX_FILE = "index.json"
_INDEX_VERSION = 1
_MAGIC = 0x67677371  # 'ggsq', llama.cpp's sequence-state file magic
_TOKEN_NULL = 0xFFFFFFFF  # LLAMA_TOKEN_NULL as u32: marks llama-server's versioned token state
_FILE_PREFIX = "akv-"


def read_state_tokens(path: Path) -> Tokens | None:
    """The tokens recorded in the header of a llama.cpp slot-state file; None if unreadable.

    Layout (llama.cpp ``state_seq_save_file``): u32 magic, u32 version, u32 n, then n u32 words of
    token data. llama-server writes that data either as a plain token list or, since it learnt to
    save media, as ``[TOKEN_NULL, state version, u32 count, tokens…, u32 media count, …]``.
    """
    try:
        with path.open("rb") as f:
            head = f.read(12)
            if len(head) < 12:
                return None
            magic, _version, n_words = struct.unpack("<III", head)
            if magic != _MAGIC or n_words > 1 << 24:
                return None
            raw = f.read(4 * n_words)
    except OSError:
        return None
    if len(raw) != 4 * n_words:
        return None
    words = struct.unpack(f"<{n_words}I", raw)
    if words and words[0] == _TOKEN_NULL:
        if n_words < 3 or 3 + words[2] > n_words:
            return None
        return tuple(words[3 : 3 + words[2]])
    return tuple(words)


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)


@attrs.define
class PrefixStore:
    """Saved slot states of one engine, under ``directory``, within ``index.budget`` bytes."""

    directory: Path = attrs.field(converter=Path)
    client: Engine
    index: StoreIndex
    #: Wall clock for entry ages (they outlive the process).
    wall: Callable[[], float] = time.time
    #: Seconds spent in llama-server's slot saves and restores, summed (for the metrics).
    save_seconds: float = attrs.field(init=False, default=0.0)
    restore_seconds: float = attrs.field(init=False, default=0.0)
    _lock: anyio.Lock = attrs.field(init=False, factory=anyio.Lock)

    # -- startup ------------------------------------------------------------------------------

    async def open(self) -> list[str]:
        """Load the index of an earlier run; delete what cannot be trusted. Returns the ids
        refused (other engine configuration, missing or mismatching file)."""
        return await anyio.to_thread.run_sync(self._open_sync)

    def _open_sync(self) -> list[str]:
        _private_dir(self.directory)
        records: list[dict[str, Any]] = []
        refused: list[str] = []
        try:
            saved = json.loads((self.directory / INDEX_FILE).read_text())
        except (OSError, ValueError):
            saved = None
        if isinstance(saved, dict) and saved.get("version") == _INDEX_VERSION:
            entries = [r for r in saved.get("entries", []) if isinstance(r, dict)]
            if saved.get("compat") == self.index.compat:
                records = entries
            else:
                refused = [str(r.get("id")) for r in entries]
                log.info(
                    "prefix store: %d entries were made by another engine configuration; "
                    "deleting them",
                    len(refused),
                )
        tokens = {}
        for record in records:
            rid = str(record.get("id", ""))
            if rid.startswith(_FILE_PREFIX) and "/" not in rid:
                found = read_state_tokens(self.directory / f"{rid}.bin")
                if found is not None:
                    tokens[rid] = found
        refused += self.index.restore_records(records, tokens)
        known = {entry.id for entry in self.index.entries()}
        for path in self.directory.glob(f"{_FILE_PREFIX}*.bin"):
            if path.stem not in known:
                _unlink(path)
        self._write_index_sync()
        return refused

    # -- save and restore -----------------------------------------------------------------------

    async def save(
        self,
        slot: int,
        kind: EntryKind,
        *,
        agent: str | None,
        sections: tuple[tuple[str, str], ...] = (),
    ) -> StoreEntry | None:
        """Save what ``slot`` holds as a store entry; None when there was nothing worth keeping.

        Raises :class:`EngineError` when llama-server cannot save (no ``--slot-save-path``).
        """
        temp = f"{_FILE_PREFIX}tmp-{secrets.token_hex(8)}"
        path = self.directory / f"{temp}.bin"
        started = time.monotonic()
        try:
            reply = await self.client.save_slot(slot, f"{temp}.bin")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_unlink, path)
            raise
        seconds = time.monotonic() - started
        self.save_seconds += seconds
        tokens = await anyio.to_thread.run_sync(read_state_tokens, path)
        if not tokens:
            await anyio.to_thread.run_sync(_unlink, path)
            return None
        nbytes = int(reply.get("n_written") or 0) or _size(path)
        now = self.wall()
        entry = StoreEntry(
            id=entry_id(kind, tokens),
            kind=kind,
            tokens=tokens,
            nbytes=nbytes,
            created=now,
            last_used=now,
            agent=agent,
            sections=sections,
        )
        async with self._lock:
            final = self.directory / f"{entry.id}.bin"
            await anyio.to_thread.run_sync(_publish, path, final)
            await self._delete(self.index.add(entry, now))
        log.debug(
            "saved slot %d: %d tokens, %d bytes in %.3f s as %s",
            slot,
            len(tokens),
            nbytes,
            seconds,
            entry.id,
        )
        return entry if entry.id in self.index else None

    async def restore(self, entry: StoreEntry, slot: int) -> dict[str, Any] | None:
        """Load ``entry`` into ``slot``; the engine's reply, or None when the entry was bad.

        A bad entry (file gone, header tokens not the indexed ones, or llama-server restoring a
        different number of tokens) is deleted and the slot erased; the caller prefills instead.
        """
        self.index.pin(entry.id)
        try:
            path = self.directory / f"{entry.id}.bin"
            header = await anyio.to_thread.run_sync(read_state_tokens, path)
            if header is None or digest(header) != digest(entry.tokens):
                log.warning("prefix store: %s does not hold what the index says; deleted", entry.id)
                await self.drop(entry.id)
                return None
            started = time.monotonic()
            try:
                reply = await self.client.restore_slot(slot, f"{entry.id}.bin")
            except (EngineUnavailableError, EngineTimeoutError) as exc:
                # The link failed, not the entry: it stays, and the caller prefills this time.
                log.warning("prefix store: restoring %s failed (%s); prefilling", entry.id, exc)
                return None
            except EngineError as exc:
                log.warning("prefix store: restoring %s failed (%s); deleted", entry.id, exc)
            else:
                self.restore_seconds += time.monotonic() - started
                if int(reply.get("n_restored", -1)) == entry.n_tokens:
                    return reply
                log.warning(
                    "prefix store: %s restored %s tokens, expected %d; deleted",
                    entry.id,
                    reply.get("n_restored"),
                    entry.n_tokens,
                )
            with contextlib.suppress(AgentKVError):
                await self.client.erase_slot(slot)
            await self.drop(entry.id)
            return None
        finally:
            self.index.unpin(entry.id)

    def record_hit(self, entry_id_: str, *, tokens_saved: int, seconds_saved: float) -> None:
        self.index.touch(
            entry_id_, self.wall(), tokens_saved=tokens_saved, seconds_saved=seconds_saved
        )

    async def drop(self, entry_id_: str) -> None:
        """Delete one entry and its file."""
        async with self._lock:
            entry = self.index.remove(entry_id_)
            await self._delete([entry] if entry is not None else [])

    async def clear(self, *, agent: str | None = None) -> list[str]:
        """Delete every entry, or every entry of one agent, with its file (entries being restored
        stay); the ids deleted."""
        async with self._lock:
            removed = self.index.clear(agent=agent)
            await self._delete(removed)
        return [entry.id for entry in removed]

    async def expire(self) -> int:
        """Delete the contexts of agents that are gone."""
        async with self._lock:
            removed = self.index.expire(self.wall())
            if removed:
                await self._delete(removed)
        return len(removed)

    async def _delete(self, entries: list[StoreEntry]) -> None:
        """Delete the files of entries the index no longer has, and write the index."""
        for entry in entries:
            await anyio.to_thread.run_sync(_unlink, self.directory / f"{entry.id}.bin")
        await anyio.to_thread.run_sync(self._write_index_sync)

    def _write_index_sync(self) -> None:
        data = {
            "version": _INDEX_VERSION,
            "compat": self.index.compat,
            "entries": [entry.to_record() for entry in self.index.entries()],
        }
        write_atomic(self.directory / INDEX_FILE, json.dumps(data).encode())

    def snapshot(self) -> StoreSnapshot:
        """The store's size, counters and entries (most valuable first), for the operator."""
        stats = self.index.stats()
        now = self.wall()
        return StoreSnapshot(
            directory_entries=stats.entries,
            bytes=stats.bytes,
            budget=stats.budget,
            saves=stats.saves,
            restores=stats.restores,
            tokens_restored=stats.hits_tokens,
            seconds_saved=stats.seconds_saved,
            save_seconds=round(self.save_seconds, 6),
            restore_seconds=round(self.restore_seconds, 6),
            evicted=stats.evicted,
            expired=stats.expired,
            refused=stats.refused,
            entries=tuple(
                StoreEntryRow(
                    id=entry.id,
                    kind=entry.kind,
                    agent=entry.agent,
                    tokens=entry.n_tokens,
                    bytes=entry.nbytes,
                    hits=entry.hits,
                    idle_s=round(now - entry.last_used, 1),
                    value=round(entry.value(now), 1),
                )
                for entry in sorted(self.index.entries(), key=lambda e: -e.value(now))
            ),
        )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _publish(temp: Path, final: Path) -> None:
    with contextlib.suppress(OSError):
        os.chmod(temp, 0o600)
    os.replace(temp, final)


# -- does a restore give reuse on this engine? ------------------------------------------------

PROBE_FILE = "restore-probe.json"
#: Below this share of the saved tokens taken from the cache after a restore, the store is off.
_REUSE_SHARE = 0.9
_PROBE_SECONDS = 300.0
_PROBE_TEXT = "".join(
    f"Step {n}: read the file, run the tests, and write down what changed and why.\n"
    for n in range(40)
)


@attrs.frozen
class RestoreProbe:
    """One save and restore of a slot: ``tokens`` computed and saved, ``restored`` as
    llama-server reports it, and ``reused``: the next request's ``cache_n`` (it extends the
    same tokens)."""

    tokens: int
    restored: int
    reused: int

    @property
    def reuses(self) -> bool:
        """Whether a restore gives reuse: every token came back, and the next request took at
        least 90 % of them from the cache instead of computing them again."""
        return (
            self.tokens > 0
            and self.restored == self.tokens
            and self.reused >= _REUSE_SHARE * self.tokens
        )

    def describe(self) -> str:
        return (
            f"{self.tokens} tokens saved, {self.restored} restored, "
            f"{self.reused} reused by the next request"
        )


def probe_length(sliding_window: int | None, *, batch: int = 512) -> int:
    """Tokens for the probe: a few for a plain model; more than the attention window and one
    batch for a sliding-window model, whose restored window otherwise starts at 0 and hides
    the problem; ``None`` (the model is unknown) assumes a window of 1024."""
    window = 1024 if sliding_window is None else sliding_window
    return 64 if window <= 0 else window + batch + 64


async def _once_more(call: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """A slot action, sent again once if the connection dropped: llama-server sometimes closes
    a kept-alive connection after a streamed reply, and these actions can be repeated."""
    try:
        return await call()
    except EngineUnavailableError:
        await anyio.sleep(0.2)
        return await call()


async def _run_probe(client: Engine, directory: Path, n: int, slot: int) -> RestoreProbe:
    block = await client.tokenize(_PROBE_TEXT)
    if not block:
        raise EngineError("llama-server tokenized the probe text to nothing")
    tokens = (block * (n // len(block) + 1))[:n]
    filename = f"{_FILE_PREFIX}probe-{secrets.token_hex(8)}.bin"
    try:
        async with client.prefill(tokens, slot=slot) as chunks:
            async for _ in chunks:
                pass
        await _once_more(lambda: client.save_slot(slot, filename))
        await _once_more(lambda: client.erase_slot(slot))
        reply = await _once_more(lambda: client.restore_slot(slot, filename))
        restored = int(reply.get("n_restored", -1))
        # What a request that extends the restored tokens takes from the cache.
        payload = {"prompt": [*tokens, *tokens[:8]], "n_predict": 1, "temperature": 0.0}
        reused = -1
        async with client.complete(payload, slot=slot) as chunks:
            async for chunk in chunks:
                timings = chunk.get("timings")
                if isinstance(timings, dict) and "cache_n" in timings:
                    reused = int(timings["cache_n"])
        # llama-server's saved state may include the token the prefill sampled.
        return RestoreProbe(len(tokens), min(restored, len(tokens)), reused)
    finally:
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(AgentKVError):
                await _once_more(lambda: client.erase_slot(slot))
            await anyio.to_thread.run_sync(_unlink, directory / filename)


async def probe_restore(
    client: Engine,
    directory: Path,
    *,
    compat: str,
    n_tokens: int,
    slot: int = 0,
) -> RestoreProbe | None:
    """Whether restoring a saved slot gives reuse on this engine: compute ``n_tokens`` into
    ``slot``, save it into ``directory`` (llama-server's ``--slot-save-path``), erase, restore,
    and send a request that extends the same tokens.

    The result is kept in ``directory/restore-probe.json`` for the engine configuration
    ``compat``, so the probe runs once per configuration. None when the engine cannot tell (no
    slot saving, an error, or 300 s passed: a large model on a slow CPU); the store then stays
    on, and every restore is still checked on its own.
    """
    record_path = directory / PROBE_FILE
    known = await anyio.to_thread.run_sync(_read_probe, record_path, compat, n_tokens)
    if known is not None:
        return known
    probe: RestoreProbe | None = None
    with anyio.move_on_after(_PROBE_SECONDS):
        try:
            probe = await _run_probe(client, directory, n_tokens, slot)
        except EngineError as exc:
            log.warning("prefix store: could not check that a restore gives reuse (%s)", exc)
            return None
    if probe is None:
        log.warning(
            "prefix store: checking that a restore gives reuse took over %.0f s", _PROBE_SECONDS
        )
        return None
    record = {"compat": compat, "n_tokens": n_tokens, **attrs.asdict(probe)}
    await anyio.to_thread.run_sync(_write_probe, record_path, record)
    return probe


def _read_probe(path: Path, compat: str, n_tokens: int) -> RestoreProbe | None:
    try:
        data = json.loads(path.read_text())
        if data.get("compat") != compat or data.get("n_tokens") != n_tokens:
            return None
        return RestoreProbe(int(data["tokens"]), int(data["restored"]), int(data["reused"]))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _write_probe(path: Path, record: dict[str, Any]) -> None:
    _private_dir(path.parent)
    write_atomic(path, json.dumps(record).encode())
