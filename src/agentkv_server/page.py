"""``/agentkv/``: the live page, shipped as package data (``static/``): HTML, JS and CSS, no build
step and nothing fetched from elsewhere, so it works offline.

The files hold no data, so they are served without the API key: a browser cannot send
``x-api-key`` when it loads a page. Everything the page shows comes from ``GET /agentkv/slots``,
which the page polls once a second with the key as a header; when a key is needed, the page asks
for it once and keeps it in the tab's ``sessionStorage`` (gone when the tab closes).
"""

from __future__ import annotations

from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

__all__ = ["page_mount"]


def page_mount() -> Mount:
    """The page and its files under ``/agentkv/`` (place it after the ``/agentkv/…`` routes)."""
    files = StaticFiles(packages=[("agentkv_server", "static")], html=True)
    return Mount("/agentkv", app=files, name="page")
