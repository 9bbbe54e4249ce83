"""A fake llama-server for fast tests and fault injection (never the only evidence).

It speaks the subset of llama-server's HTTP API that agentkv uses, through ``httpx.MockTransport``,
and records every chat request so tests can check which slot a request was pinned to.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import attrs
import httpx


@attrs.define
class FakeLlama:
    """Answers chat requests with ``reply`` split into ``chunk_chars`` pieces, ``delay`` apart."""

    reply: str = "Hello from the fake engine."
    #: When not empty, each chat request takes the next reply from here instead of ``reply``.
    script: list[str] = attrs.field(factory=list)
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

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.paths.append(path)
        if path == "/health":
            if self.healthy:
                return httpx.Response(200, json={"status": "ok"})
            return httpx.Response(503, json={"error": {"message": "Loading model", "code": 503}})
        if path == "/v1/chat/completions":
            return self._chat(json.loads(request.content))
        if path == "/apply-template":
            body = json.loads(request.content)
            prompt = "".join(f"<{m['role']}>{m.get('content')}" for m in body["messages"])
            return httpx.Response(200, json={"prompt": prompt})
        if path == "/tokenize":
            body = json.loads(request.content)
            return httpx.Response(200, json={"tokens": list(range(len(body["content"]) // 4))})
        if path.startswith("/slots/") and request.method == "POST":
            slot = int(path.rsplit("/", 1)[1])
            action = request.url.params.get("action", "")
            filename = json.loads(request.content or b"{}").get("filename", "")
            self.slot_actions.append((slot, action, filename))
            return httpx.Response(200, json={"id_slot": slot, "filename": filename})
        if path == "/slots":
            return httpx.Response(
                200, json=[{"id": i, "is_processing": bool(self.active.get(i))} for i in range(4)]
            )
        return httpx.Response(404, json={"error": {"message": "not found", "code": 404}})

    def _chat(self, body: dict[str, Any]) -> httpx.Response:
        self.requests.append(body)
        if self.fail_status is not None:
            return httpx.Response(
                self.fail_status,
                json={"error": {"code": self.fail_status, "message": "injected failure"}},
            )
        slot = int(body.get("id_slot", -1))
        prompt_n = sum(len(json.dumps(m)) for m in body["messages"]) // 4
        reply = self.script.pop(0) if self.script else self.reply
        if not body.get("stream"):
            return httpx.Response(200, json=self._final(reply, prompt_n))
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=self._stream(slot, prompt_n, reply),
        )

    def _final(self, text: str, prompt_n: int) -> dict[str, Any]:
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
            "timings": {"cache_n": 0, "prompt_n": prompt_n, "predicted_n": len(text) // 4},
        }

    async def _stream(self, slot: int, prompt_n: int, reply: str) -> AsyncIterator[bytes]:
        # A stream the client drops is never finished; httpx may not close the generator, so the
        # bookkeeping happens before the last chunk rather than in a ``finally``.
        self.started += 1
        self.active[slot] = self.active.get(slot, 0) + 1
        self.max_per_slot = max(self.max_per_slot, self.active[slot])
        if self.prefill_delay:
            await anyio.sleep(self.prefill_delay)
        pieces = [reply[i : i + self.chunk_chars] for i in range(0, len(reply), self.chunk_chars)]
        for n, piece in enumerate(pieces):
            yield _sse(
                {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            )
            if self.truncate and n == 0:
                return
            if self.delay:
                await anyio.sleep(self.delay)
        final = {
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_n, "completion_tokens": len(pieces)},
            "timings": {"cache_n": 0, "prompt_n": prompt_n, "predicted_n": len(pieces)},
        }
        self.finished += 1
        self.active[slot] -= 1
        yield _sse(final)
        yield b"data: [DONE]\n\n"


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"
