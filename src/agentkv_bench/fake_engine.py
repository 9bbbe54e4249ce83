"""A fake llama-server, for fast tests, fault injection and the ``overhead`` scenario.

It speaks the subset of llama-server's HTTP API that agentkv uses, in-process: through
``httpx.MockTransport`` (:meth:`FakeLlama.transport`) or as an ASGI app to serve over real HTTP
(:meth:`FakeLlama.asgi`). It keeps a KV cache per slot as llama-server does, counts the prompt
tokens it computed, and records every chat request so tests can check which slot a request was
pinned to. A test's fake, never the only evidence: the engine tests run the real llama-server.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx

from agentkv.tokens import common_prefix

__all__ = ["FakeLlama", "Reply", "read_state", "render", "tokenize", "write_state"]

#: A reply: text, cut into ``chunk_chars`` pieces, or the streamed pieces themselves.
Reply = str | tuple[str, ...]


@attrs.define
class FakeLlama:
    """Answers chat requests with ``reply`` split into ``chunk_chars`` pieces, ``delay`` apart
    (a tuple of pieces is streamed as it is, one chunk each)."""

    reply: Reply = "Hello from the fake engine."
    #: When not empty, each chat request takes the next reply from here instead of ``reply``.
    script: list[Reply | Callable[[dict[str, Any]], Reply]] = attrs.field(factory=list)
    chunk_chars: int = 4
    delay: float = 0.0
    #: Seconds before the first chunk (a stand-in for prefill).
    prefill_delay: float = 0.0
    #: When set, chat requests get this HTTP status and an llama-server-shaped error body.
    fail_status: int | None = None
    #: When True, the stream stops after the first chunk without a finish reason or [DONE].
    truncate: bool = False
    healthy: bool = True
    requests: list[dict[str, Any]] = attrs.field(factory=list)
    #: The path of every request the fake received, health checks included.
    paths: list[str] = attrs.field(factory=list)
    #: Slot save/restore/erase calls, as (slot, action, filename).
    slot_actions: list[tuple[int, str, str]] = attrs.field(factory=list)
    active: dict[int, int] = attrs.field(factory=dict)
    started: int = 0
    finished: int = 0
    #: Most requests seen running at the same time on one slot (must never exceed 1).
    max_per_slot: int = 0
    #: Where slot saves are written (llama-server's --slot-save-path); None: saving fails.
    save_dir: Path | None = None
    #: What /props says of images: None answers 404 (an older server), False refuses any
    #: image as llama-server does for a model without vision (HTTP 500).
    vision: bool | None = None
    #: What each slot's KV cache holds, in tokens, as a real server would track it.
    cache: dict[int, list[int]] = attrs.field(factory=dict)
    #: Prompt tokens computed (not reused), summed over every request: /metrics' counter.
    computed: int = 0
    #: False: a restore reports every token but the next request computes them all again, as
    #: llama-server does on sliding-window and hybrid models.
    restore_reuses: bool = True
    #: Speculative decoding, as a streamed reply's timings report it: (drafted, accepted).
    drafts: tuple[int, int] | None = None
    #: The slots its ``/slots`` table lists.
    slots: int = 4
    #: False: nothing is kept per request (:attr:`requests`, :attr:`paths`, :attr:`slot_actions`
    #: stay empty), for a long run or one whose memory is measured in the same process.
    record: bool = True

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The fake as an ASGI app, to serve it over real HTTP (for a whole agentkv-server)."""
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        query = scope.get("query_string", b"").decode()
        request = httpx.Request(
            scope["method"],
            f"http://engine{scope['path']}" + (f"?{query}" if query else ""),
            headers=[(k.decode(), v.decode()) for k, v in scope["headers"]],
            content=body,
        )
        response = await self.handle(request)
        framing = {"content-length", "transfer-encoding"}
        headers = [
            (k.encode(), v.encode()) for k, v in response.headers.items() if k not in framing
        ]
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": headers}
        )
        try:
            whole = response.content  # a plain reply, already read
        except httpx.ResponseNotRead:
            async for chunk in response.aiter_raw():  # a stream
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            whole = b""
        await send({"type": "http.response.body", "body": whole})

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if self.record:
            self.paths.append(path)
        if path == "/health":
            if self.healthy:
                return httpx.Response(200, json={"status": "ok"})
            return httpx.Response(503, json={"error": {"message": "Loading model", "code": 503}})
        if path == "/props" and self.vision is not None:
            return httpx.Response(200, json={"modalities": {"vision": self.vision}})
        if path in ("/v1/chat/completions", "/apply-template") and self._refuses_images(request):
            # As llama-server without a multimodal projector answers (measured, b11434).
            return _error(
                500,
                "image input is not supported - hint: if this is unexpected, "
                "you may need to provide the mmproj",
            )
        if path == "/v1/chat/completions":
            return self._chat(json.loads(request.content))
        if path == "/apply-template":
            return httpx.Response(200, json={"prompt": render(json.loads(request.content))})
        if path == "/tokenize":
            text = json.loads(request.content)["content"]
            return httpx.Response(200, json={"tokens": tokenize(text)})
        if path == "/completion":
            return self._completion(json.loads(request.content))
        if path.startswith("/slots/") and request.method == "POST":
            slot = int(path.rsplit("/", 1)[1])
            action = request.url.params.get("action", "")
            filename = json.loads(request.content or b"{}").get("filename", "")
            if self.record:
                self.slot_actions.append((slot, action, filename))
            return self._slot_action(slot, action, filename)
        if path == "/slots":
            busy = [{"id": i, "is_processing": bool(self.active.get(i))} for i in range(self.slots)]
            return httpx.Response(200, json=busy)
        return httpx.Response(404, json={"error": {"message": "not found", "code": 404}})

    def _refuses_images(self, request: httpx.Request) -> bool:
        if self.vision is not False:
            return False
        messages = json.loads(request.content).get("messages") or []
        return any(
            isinstance(part, dict) and part.get("type") == "image_url"
            for m in messages
            if isinstance(m.get("content"), list)
            for part in m["content"]
        )

    def _run_prompt(self, slot: int, tokens: list[int]) -> tuple[int, int]:
        """Reuse the slot's cache for the common prefix, as llama-server does: (cache, computed)."""
        cache_n = common_prefix(self.cache.get(slot, []), tokens)
        cache_n = min(cache_n, max(0, len(tokens) - 1))  # at least one token is evaluated
        self.cache[slot] = list(tokens)
        self.computed += len(tokens) - cache_n
        return cache_n, len(tokens) - cache_n

    def _chat(self, body: dict[str, Any]) -> httpx.Response:
        if self.record:
            self.requests.append(body)
        if self.fail_status is not None:
            return _error(self.fail_status, "injected failure")
        slot = int(body.get("id_slot", -1))
        cache_n, prompt_n = self._run_prompt(slot, tokenize(render(body)))
        reply = self.script.pop(0) if self.script else self.reply
        if callable(reply):  # a reply that depends on the request (a continuation's prefill)
            reply = reply(body)
        last = body["messages"][-1] if body["messages"] else {}
        if last.get("role") == "assistant" and isinstance(last.get("content"), str):
            # A continued reply: llama-server sends the given beginning back first.
            begun = last["content"]
            reply = begun + reply if isinstance(reply, str) else (begun, *reply)
        pieces = self._pieces(reply)
        if not body.get("stream"):
            return httpx.Response(200, json=self._final("".join(pieces), prompt_n, cache_n))
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=self._stream(
                slot, prompt_n, pieces, cache_n, progress=bool(body.get("return_progress"))
            ),
        )

    def _pieces(self, reply: Reply) -> list[str]:
        if isinstance(reply, tuple):
            return list(reply)
        return [reply[i : i + self.chunk_chars] for i in range(0, len(reply), self.chunk_chars)]

    def _completion(self, body: dict[str, Any]) -> httpx.Response:
        """A streamed raw-token prefill, as agentkv uses ``/completion`` for checkpoints."""
        if self.record:
            self.requests.append(body)
        slot = int(body.get("id_slot", -1))
        tokens = [int(t) for t in body["prompt"]]
        cache_n, prompt_n = self._run_prompt(slot, tokens)

        async def stream() -> AsyncIterator[bytes]:
            if self.prefill_delay:
                await anyio.sleep(self.prefill_delay)
            progress = {"total": len(tokens), "cache": cache_n, "processed": cache_n + prompt_n}
            yield _sse({"content": "", "stop": False, "prompt_progress": progress})
            timings = {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": 1.0 * prompt_n}
            yield _sse({"content": "x", "stop": True, "stop_type": "limit", "timings": timings})

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream())

    def _slot_action(self, slot: int, action: str, filename: str) -> httpx.Response:
        if action == "erase":
            self.cache.pop(slot, None)
            return httpx.Response(200, json={"id_slot": slot, "n_erased": 0})
        if self.save_dir is None:
            return _error(501, "This server does not support slots action")
        path = self.save_dir / filename
        if action == "save":
            tokens = self.cache.get(slot, [])
            write_state(path, tokens)
            counts = {"n_saved": len(tokens), "n_written": path.stat().st_size}
        elif action == "restore":
            restored = read_state(path)
            if restored is None:
                return _error(400, "Unable to restore slot")
            self.cache[slot] = restored if self.restore_reuses else []
            counts = {"n_restored": len(restored), "n_read": path.stat().st_size}
        else:
            return _error(400, "bad action")
        return httpx.Response(200, json={"id_slot": slot, "filename": filename, **counts})

    def _final(self, text: str, prompt_n: int, cache_n: int = 0) -> dict[str, Any]:
        return {
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": text},
                }
            ],
            "usage": {"prompt_tokens": prompt_n, "completion_tokens": len(text) // 4},
            "timings": {"cache_n": cache_n, "prompt_n": prompt_n, "predicted_n": len(text) // 4},
        }

    async def _stream(
        self,
        slot: int,
        prompt_n: int,
        pieces: Sequence[str],
        cache_n: int = 0,
        *,
        progress: bool = False,
    ) -> AsyncIterator[bytes]:
        # A stream the client drops is never finished; httpx may not close the generator, so the
        # bookkeeping happens before the last chunk rather than in a ``finally``.
        self.started += 1
        self.active[slot] = self.active.get(slot, 0) + 1
        self.max_per_slot = max(self.max_per_slot, self.active[slot])
        if self.prefill_delay:
            # The prefill in steps; with ``return_progress``, llama-server's progress chunks: a
            # bare role delta, and the slot's prompt so far (cached tokens included; last whole).
            steps = 4
            for step in range(steps + 1):
                if progress:
                    role = {"role": "assistant", "content": None}
                    yield _sse(
                        {
                            "choices": [{"index": 0, "delta": role, "finish_reason": None}],
                            "prompt_progress": {
                                "total": cache_n + prompt_n,
                                "cache": cache_n,
                                "processed": cache_n + prompt_n * step // steps,
                            },
                        }
                    )
                if step < steps:
                    await anyio.sleep(self.prefill_delay / steps)
        for n, piece in enumerate(pieces):
            yield _sse(
                {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            )
            if self.truncate and n == 0:
                return
            if self.delay:
                await anyio.sleep(self.delay)
        timings = {"cache_n": cache_n, "prompt_n": prompt_n, "predicted_n": len(pieces)}
        if self.drafts is not None:
            timings.update(draft_n=self.drafts[0], draft_n_accepted=self.drafts[1])
        final = {
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_n, "completion_tokens": len(pieces)},
            "timings": timings,
        }
        self.finished += 1
        self.active[slot] -= 1
        yield _sse(final)
        yield b"data: [DONE]\n\n"


def _error(status: int, message: str) -> httpx.Response:
    """An error as llama-server answers it."""
    return httpx.Response(status, json={"error": {"code": status, "message": message}})


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def render(body: dict[str, Any]) -> str:
    """The fake chat template: the system message(s), the tools (as a real template puts them
    in the system prompt), then each message as ``<role>content``."""
    messages = body["messages"]
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    tools = f"<tools>{json.dumps(body['tools'])}" if body.get("tools") else ""
    parts = [f"<{m['role']}>{m.get('content')}" for m in messages]
    return "".join(parts[:head]) + tools + "".join(parts[head:])


def tokenize(text: str) -> list[int]:
    """The fake tokenizer: one token per 4 characters, a hash of them, so equal text gives equal
    tokens and a shared beginning gives a shared token prefix."""
    return [zlib.crc32(text[i : i + 4].encode()) % 150_000 for i in range(0, len(text), 4)]


def write_state(path: Path, tokens: Sequence[int]) -> None:
    """A slot-state file with llama.cpp's header (magic, version, versioned token list)."""
    words = [0xFFFFFFFF, 1, len(tokens), *tokens, 0]
    header = struct.pack("<III", 0x67677371, 4, len(words))
    path.write_bytes(header + struct.pack(f"<{len(words)}I", *words) + b"\0" * 64)


def read_state(path: Path) -> list[int] | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    magic, _, n = struct.unpack("<III", data[:12])
    if magic != 0x67677371:
        return None
    words = struct.unpack(f"<{n}I", data[12 : 12 + 4 * n])
    return list(words[3 : 3 + words[2]])
