"""Stream, then call again on the same client, N times, against a real llama-server.

    python -m tests.engine.link_repro [N] [pooled,close,fixed] [tokenize|save]

Starts llama-server with the default model (2 slots, a free port), then for each mode N times a
streamed ``/completion`` read to its end followed by a ``/tokenize`` (or a slot save) on the same
client, and prints how many of those calls failed:

- ``pooled``: a plain ``httpx.AsyncClient`` (pooled, keep-alive), as agentkv used before;
- ``close``: the same, with ``Connection: close`` on the stream only;
- ``fixed``: ``LlamaSlotClient`` as it is (a stream on a connection of its own, the other calls
  on one kept-alive connection, one resend after a drop).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx

from agentkv.runtime.engine import EngineConfig, LlamaServerProcess, find_llama_server
from agentkv.runtime.model import default_model_path

PROMPT = "Write one sentence about the sea."


async def raw(base: str, headers: dict[str, str], close: bool, after: str, n: int) -> int:
    failed = 0
    payload = {"prompt": PROMPT, "n_predict": 4, "stream": True, "temperature": 0}
    async with httpx.AsyncClient(timeout=120) as http:
        for _ in range(n):
            stream_headers = {**headers, "connection": "close"} if close else headers
            async with http.stream(
                "POST", base + "/completion", json=payload, headers=stream_headers
            ) as response:
                async for _chunk in response.aiter_raw():
                    pass
            try:
                if after == "tokenize":
                    answer = await http.post(
                        base + "/tokenize", json={"content": "hello"}, headers=headers
                    )
                else:
                    answer = await http.post(
                        base + "/slots/0?action=save", json={"filename": "x.bin"}, headers=headers
                    )
                answer.raise_for_status()
            except httpx.HTTPError as exc:
                failed += 1
                print(f"   failed: {exc!r:.120}")
    return failed


async def fixed(process: LlamaServerProcess, after: str, n: int) -> tuple[int, int, int]:
    failed = 0
    async with process.client(read_timeout=120) as client:
        for _ in range(n):
            payload = {"prompt": PROMPT, "n_predict": 4, "temperature": 0}
            async with client.complete(payload, slot=0) as chunks:
                async for _chunk in chunks:
                    pass
            try:
                if after == "tokenize":
                    await client.tokenize("hello")
                else:
                    await client.save_slot(0, "x.bin")
            except Exception as exc:
                failed += 1
                print(f"   failed: {exc!r:.160}")
        return failed, client.link.resent, client.link.requests


async def main(n: int, modes: list[str], after: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="agentkv-link-"))
    config = EngineConfig(
        model=default_model_path(), slots=2, ctx_per_slot=2048, port=0, slot_save_dir=root / "s"
    )
    binary = find_llama_server()
    async with LlamaServerProcess(
        config, binary=binary, log_dir=root / "logs", startup_timeout=300
    ) as process:
        for mode in modes:
            started = time.monotonic()
            if mode == "fixed":
                failed, resent, requests = await fixed(process, after, n)
                extra = f"; {resent} of {requests} requests sent again"
            else:
                failed = await raw(process.base_url, process.headers, mode == "close", after, n)
                extra = ""
            took = time.monotonic() - started
            print(f"{mode}: {failed}/{n} {after} calls after a stream failed{extra} ({took:.0f} s)")


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    chosen = sys.argv[2].split(",") if len(sys.argv) > 2 else ["pooled", "close", "fixed"]
    anyio.run(main, count, chosen, sys.argv[3] if len(sys.argv) > 3 else "tokenize")
