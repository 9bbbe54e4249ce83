"""The live page in headless Chromium: it loads, follows a request through prefill, decoding and
idle on its own, shows the request afterwards, and asks for the API key when one is needed."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.browser.conftest import fake_page_server
from tests.fakes import FakeLlama

pytestmark = pytest.mark.browser

BODY: dict[str, Any] = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "Read the file and explain it. " * 30}],
}


def wait_until(driver: Any, condition: Callable[[Any], Any], timeout: float = 15) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)


def slots(driver: Any) -> list[dict[str, Any]]:
    """The slot rows as the page shows them now, read in one go (the page redraws each second,
    so element handles go stale)."""
    rows: list[dict[str, Any]] = driver.execute_script(
        """return [...document.querySelectorAll('#slots tbody tr[data-slot]')].map(r => ({
            slot: Number(r.dataset.slot), state: r.dataset.state, text: r.innerText}))"""
    )
    return rows


def slot_row(driver: Any, slot: int) -> dict[str, Any]:
    return next(row for row in slots(driver) if row["slot"] == slot)


def text(driver: Any, selector: str) -> str:
    found = driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.innerText : null", selector
    )
    assert found is not None, f"nothing matches {selector}"
    return str(found)


@pytest.fixture
def request_in_background() -> Iterator[Callable[..., list[httpx.Response]]]:
    threads: list[threading.Thread] = []

    def start(url: str, body: dict[str, Any], headers: dict[str, str]) -> list[httpx.Response]:
        out: list[httpx.Response] = []

        def run() -> None:
            out.append(httpx.post(f"{url}/v1/messages", json=body, headers=headers, timeout=60))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
        return out

    yield start
    for thread in threads:
        thread.join(timeout=60)


def test_page_follows_a_request_through_its_slot(
    browser: Any, request_in_background: Callable[..., list[httpx.Response]]
) -> None:
    """Idle → prefilling with progress → decoding with tokens/s → idle; then the request is in
    the recent table with its source and cached/prompt tokens."""
    fake = FakeLlama(reply="x" * 60, chunk_chars=2, delay=0.05, prefill_delay=2.0)
    with fake_page_server(fake, n_slots=2) as server:
        browser.get(f"{server.url}/agentkv/")
        wait_until(browser, lambda d: text(d, "#conn") == "live")
        assert [row["state"] for row in slots(browser)] == ["idle", "idle"]
        assert "no request has finished yet" in text(browser, "#recent")

        reply = request_in_background(server.url, BODY, {"x-agent-id": "reviewer"})
        row = wait_until(
            browser,
            lambda d: next(
                (
                    r
                    for r in slots(d)
                    if r["state"] == "prefilling" and "prompt tokens" in r["text"]
                ),
                False,
            ),
        )
        assert "reviewer" in row["text"]
        assert re.search(r"\d+ / \d+ prompt tokens \(\d+%\)", row["text"]), row["text"]
        slot = row["slot"]
        decoding = wait_until(
            browser,
            lambda d: (
                (r := slot_row(d, slot))["state"] == "decoding" and "tokens/s" in r["text"] and r
            ),
        )
        assert re.search(r"[\d.]+ tokens/s, \d+ generated", decoding["text"]), decoding["text"]
        wait_until(browser, lambda d: slot_row(d, slot)["state"] == "idle")
        wait_until(browser, lambda d: "reviewer" in text(d, "#recent tbody"))
        assert reply and reply[0].status_code == 200
        recent = text(browser, "#recent tbody")
        record = server.runtime.records()[-1]
        assert f"{record.cached_tokens} / {record.prompt_tokens}" in recent
        assert "none" in recent  # the cache was cold: computed from scratch
        assert text(browser, "#hitrate") != "–"


def test_page_asks_for_the_api_key_once(browser: Any) -> None:
    """The page itself loads without the key; its data needs it. A wrong key is refused, the
    right one is kept for the tab and used from then on."""
    with fake_page_server(FakeLlama(), n_slots=1, api_key="s3cret") as server:
        assert httpx.get(f"{server.url}/agentkv/slots").status_code == 401
        browser.get(f"{server.url}/agentkv/")
        wait_until(browser, lambda d: d.find_element("id", "keyform").is_displayed())
        assert text(browser, "#conn") == "needs the API key"
        browser.find_element("id", "key").send_keys("wrong")
        browser.find_element("css selector", "#keyform button").click()
        wait_until(browser, lambda d: "refused" in text(d, "#keyerror"))
        field = browser.find_element("id", "key")
        field.clear()
        field.send_keys("s3cret")
        browser.find_element("css selector", "#keyform button").click()
        wait_until(browser, lambda d: text(d, "#conn") == "live")
        assert slot_row(browser, 0)["state"] == "idle"
        browser.refresh()  # the key is kept for the tab: no second question
        wait_until(browser, lambda d: text(d, "#conn") == "live")
        assert not browser.find_element("id", "keyform").is_displayed()
        browser.execute_script("sessionStorage.clear()")


def test_page_shows_the_agent_tree(browser: Any) -> None:
    """A coordinator and the two sub-agents it started: the coordinator first, its sub-agents
    indented under it with their calls' descriptions, and named so in the recent requests."""
    import json
    from pathlib import Path

    captures = Path(__file__).parent.parent / "fixtures" / "claude_code" / "subagents"
    keep = ("x-agent-id", "x-claude-code-session-id", "x-claude-code-agent-id")
    with fake_page_server(FakeLlama(reply="done"), n_slots=2) as server:
        for name in (
            "fg_1_coordinator.json",
            "fg_2_subagent_back.json",
            "fg_3_subagent_front.json",
            "fg_4_continuation.json",
        ):
            data = json.loads((captures / name).read_text())
            headers = {k: v for k, v in data["headers"].items() if k in keep}
            body = {**data["body"], "max_tokens": 8, "stream": False}
            response = httpx.post(
                f"{server.url}/v1/messages", json=body, headers=headers, timeout=60
            )
            assert response.status_code == 200, response.text
        browser.get(f"{server.url}/agentkv/")
        wait_until(browser, lambda d: text(d, "#conn") == "live")
        rows = wait_until(
            browser,
            lambda d: (
                (
                    found := d.execute_script(
                        """return [...document.querySelectorAll('#agents tbody tr[data-agent]')]
                        .map(r => ({depth: Number(r.dataset.depth), text: r.innerText}))"""
                    )
                )
                and len(found) == 3
                and found
            ),
        )
        assert rows[0]["depth"] == 0 and rows[0]["text"].startswith("coordinator")
        assert [row["depth"] for row in rows[1:]] == [1, 1]
        described = " ".join(row["text"] for row in rows[1:])
        assert "Write the front end" in described and "Write the back end" in described
        assert "waited on" in described
        assert "(Write the back end)" in text(browser, "#recent tbody")
