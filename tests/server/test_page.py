"""The live page's files: served under /agentkv/ without the key, self-contained (no CDN)."""

from __future__ import annotations

import re
from importlib.resources import files
from typing import Any

import pytest

from tests.fakes import FakeLlama

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


STATIC = files("agentkv_server") / "static"


async def test_page_and_its_files_are_served_without_the_key(serve: Any) -> None:
    """The files hold no data (a browser cannot send x-api-key on a page load); the data does."""
    http = await serve(FakeLlama(), api_key="s3cret")
    page = await http.get("/agentkv/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert 'src="live.js"' in page.text and 'href="live.css"' in page.text
    for name, kind in (("live.js", "javascript"), ("live.css", "text/css")):
        r = await http.get(f"/agentkv/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"]
    assert (await http.get("/agentkv/slots")).status_code == 401
    r = await http.get("/agentkv/slots", headers={"x-api-key": "s3cret"})
    assert r.status_code == 200 and "slots" in r.json()


async def test_page_without_trailing_slash_redirects(serve: Any) -> None:
    http = await serve(FakeLlama())
    r = await http.get("/agentkv")
    assert r.status_code in (307, 308) and r.headers["location"].endswith("/agentkv/")


async def test_unknown_page_file_is_an_anthropic_404(serve: Any) -> None:
    http = await serve(FakeLlama())
    r = await http.get("/agentkv/nothing-here.js")
    assert r.status_code == 404
    assert r.json()["type"] == "error"


def test_every_slot_state_has_a_style() -> None:
    """Each state a slot row can have (the ones /metrics counts, ``out`` in a pool of engines
    included) is drawn in a colour of its own."""
    from agentkv_server.metrics import _STATES

    css = (STATIC / "live.css").read_text()
    colours = {}
    for state in _STATES:
        rule = re.search(rf"\.state\.{state} {{ background: ([^;]+);", css)
        assert rule, state
        colours[state] = rule.group(1)
    assert len(set(colours.values())) == len(colours), colours


def test_page_loads_nothing_from_elsewhere() -> None:
    """Works offline: no URL with a scheme or a protocol-relative URL in any of the files (the
    SVG namespace, an identifier rather than a fetch, is the one exception)."""
    names = sorted(entry.name for entry in STATIC.iterdir())
    assert names == ["index.html", "live.css", "live.js"]
    for name in names:
        text = (STATIC / name).read_text()
        text = text.replace("http://www.w3.org/2000/svg", "")
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.IGNORECASE), name
        assert "@import" not in text and "import(" not in text


def test_page_writes_client_text_only_as_text() -> None:
    """Agent ids are client input: the script never hands strings to the HTML parser."""
    script = (STATIC / "live.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script
