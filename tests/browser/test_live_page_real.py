"""The live page on the real engine: a long request's prefill progress (a captured Claude Code
request with its last Read result grown), as llama-server reports it, shown while it runs.

``AGENTKV_SCREENSHOT=docs/live-page.png`` saves the page mid-prefill (how the screenshot in the
docs is made).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio.from_thread
import httpx
import pytest
import uvicorn

from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.engine import EngineConfig, LlamaServerProcess, free_port
from agentkv.runtime.lifecycle import Runtime
from agentkv_server import status
from agentkv_server.app import create_app
from tests._engine_fixture import locate_engine
from tests.browser.conftest import screenshot, start_browser
from tests.browser.test_live_page import slots, text, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.browser]

FIXTURE = Path(__file__).parent.parent / "fixtures" / "claude_code_request.json"
CTX_PER_SLOT = 16384


def claude_code_request(extra_lines: int) -> dict[str, Any]:
    """Claude Code's request (system prompt, 14 tools, a session), its last Read result grown by
    ``extra_lines`` lines of a source file, as a long session has."""
    body: dict[str, Any] = json.loads(FIXTURE.read_text())
    listing = "\n".join(
        f"{n:6d}\tdef step_{n}(state):  # advance the parser by one token, keeping line {n}"
        for n in range(100, 100 + extra_lines)
    )
    last = body["messages"][-1]["content"][0]
    last["content"][0]["text"] += "\n" + listing
    body["max_tokens"] = 8
    body["stream"] = True
    return body


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Runtime]]:
    """agentkv over llama-server with the default model: 2 slots of 16k tokens, store on."""
    binary, model = locate_engine()
    root = tmp_path_factory.mktemp("page-real")
    config = EngineConfig(
        model=model, slots=2, ctx_per_slot=CTX_PER_SLOT, port=0, slot_save_dir=root / "slots"
    )
    with anyio.from_thread.start_blocking_portal() as portal:
        process = LlamaServerProcess(config, binary=binary, log_dir=root / "logs")
        with portal.wrap_async_context_manager(process):
            client = process.client(read_timeout=600)
            runtime = Runtime(
                client,
                RuntimeConfig(n_slots=2, ctx_per_slot=CTX_PER_SLOT, store_dir=root / "slots"),
            )
            port = free_port()
            server = uvicorn.Server(
                uvicorn.Config(create_app(runtime), host="127.0.0.1", port=port, log_level="error")
            )
            done = portal.start_task_soon(server.serve)
            deadline = time.monotonic() + 60
            while not server.started:
                assert not done.done() and time.monotonic() < deadline, "agentkv did not start"
                time.sleep(0.05)
            try:
                yield f"http://127.0.0.1:{port}", runtime
            finally:
                server.should_exit = True
                done.result(timeout=60)
                portal.call(client.aclose)


def post(url: str, body: dict[str, Any], agent: str, priority: int = 1) -> httpx.Response:
    headers = {"x-agent-id": agent, "x-agent-priority": str(priority)}
    return httpx.post(f"{url}/v1/messages", json=body, headers=headers, timeout=900)


def test_page_shows_a_real_prefill_progressing(real_server: tuple[str, Runtime]) -> None:
    url, runtime = real_server
    # One small finished request first, so that the page has a history and measured speeds.
    warm = {
        "model": "agentkv-local",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Say hello."}],
    }
    assert post(url, warm, "reviewer", 2).status_code == 200
    browser = start_browser(1280, 1000)
    threads: list[threading.Thread] = []
    replies: list[httpx.Response] = []
    try:
        browser.get(f"{url}/agentkv/")
        wait_until(browser, lambda d: text(d, "#conn") == "live")
        # about 5,900 tokens: a prefill of about a minute here, watched at the page's 1 s pace
        big = claude_code_request(extra_lines=100)
        thread = threading.Thread(target=lambda: replies.append(post(url, big, "coder")))
        thread.start()
        threads.append(thread)

        def progress(d: Any) -> tuple[int, str] | bool:
            """A prefilling slot's row, between 15% and 70% of its prompt."""
            for row in slots(d):
                found = re.search(r"\((\d+)%\)", row["text"])
                if row["state"] == "prefilling" and found and 15 <= int(found.group(1)) <= 70:
                    return int(found.group(1)), row["text"]
            return False

        _, row = wait_until(browser, progress, timeout=300)
        assert "coder" in row and ("prompt tokens" in row or "shared head" in row), row
        shot = os.environ.get("AGENTKV_SCREENSHOT")
        if shot:
            screenshot(browser, Path(shot))
            print(status.render(status.fetch(url), url=url))  # the terminal view, same moment

        def moved(d: Any) -> str | bool:
            for now in slots(d):
                if now["state"] == "prefilling" and "coder" in now["text"] and now["text"] != row:
                    return str(now["text"])
            return False

        later = wait_until(browser, moved, timeout=300)  # the engine's progress, moving
        assert re.search(r"\(\d+%\)", later), later
        thread.join(timeout=900)
        assert replies and replies[0].status_code == 200
        record = runtime.records()[-1]
        assert record.agent == "coder" and record.prompt_tokens > 5000
        wait_until(browser, lambda d: "coder" in text(d, "#recent tbody"), timeout=30)
        assert f"{record.prompt_tokens:,}" in text(browser, "#recent tbody")
    finally:
        browser.quit()
        for thread in threads:
            thread.join(timeout=900)
