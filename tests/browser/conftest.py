"""The live page in a real headless Chromium: Debian's ``chromium`` and ``chromium-driver``,
driven through Selenium, against an agentkv server on a loopback port.

Without a browser the tests skip, except under ``CI`` where they fail: CI installs it
(``.ci/run``), so a broken install cannot pass silently. ``AGENTKV_CHROMIUM`` and
``AGENTKV_CHROMEDRIVER`` name other binaries.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import anyio.from_thread
import httpx
import pytest
import uvicorn

from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.engine import free_port
from agentkv.runtime.lifecycle import Runtime
from agentkv_server.app import create_app
from tests.fakes import FakeLlama, split_config


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"the browser tests need Chromium and its driver: {reason}")
    pytest.skip(f"no browser: {reason}")


def browser_binaries() -> tuple[str, str]:
    """(chromium, chromedriver), or a skip (a failure under CI)."""
    chromium = os.environ.get("AGENTKV_CHROMIUM") or shutil.which("chromium")
    driver = os.environ.get("AGENTKV_CHROMEDRIVER") or shutil.which("chromedriver")
    if chromium is None or driver is None:
        _missing("install Debian's chromium and chromium-driver")
    assert chromium is not None and driver is not None
    return chromium, driver


def start_browser(width: int = 1280, height: int = 900) -> Any:
    """A headless Chromium under Selenium (the caller quits it)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _missing("the selenium package is not installed (pip install -e '.[test]')")
    chromium, driver = browser_binaries()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(argument)
    return webdriver.Chrome(options=options, service=Service(driver))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the module."""
    driver = start_browser()
    try:
        yield driver
    finally:
        driver.quit()


class PageServer(NamedTuple):
    url: str
    runtime: Runtime


@contextmanager
def serve_http(
    runtime: Runtime, on_shutdown: Callable[[], Awaitable[None]] | None = None, **server: Any
) -> Iterator[str]:
    """The app around ``runtime`` under uvicorn on a free loopback port, in a background loop;
    yields its base URL."""
    from agentkv_server.config import ServerConfig

    app = create_app(runtime, ServerConfig(**server), on_shutdown=on_shutdown)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    with anyio.from_thread.start_blocking_portal() as portal:
        done = portal.start_task_soon(uv.serve)
        deadline = time.monotonic() + 30
        while not uv.started:
            assert not done.done(), "agentkv server exited during startup"
            assert time.monotonic() < deadline, "agentkv server did not start"
            time.sleep(0.05)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            uv.should_exit = True
            done.result(timeout=30)


@contextmanager
def fake_page_server(fake: FakeLlama, **config: Any) -> Iterator[PageServer]:
    """agentkv over the fake engine (in-process transport), served on loopback for a browser."""
    server_config, runtime_config = split_config(config)
    engine_http = httpx.AsyncClient(transport=fake.transport(), base_url="http://engine")
    client = LlamaSlotClient("http://engine", http=engine_http, connect_retries=0)
    runtime = Runtime(client, runtime_config)
    with serve_http(runtime, engine_http.aclose, api_key=server_config.api_key) as url:
        yield PageServer(url, runtime)


def screenshot(driver: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(path))
