"""``/agentkv/``: the live page, shipped as package data (``static/``: HTML, JS and CSS, no build
step, nothing fetched from elsewhere).

Its files hold no data, so they are served without the API key (a browser cannot send
``x-api-key`` when it loads a page). The page polls ``GET /agentkv/slots`` once a second with the
key, which it asks for once and keeps in the tab's ``sessionStorage``.
"""

from __future__ import annotations

from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

__all__ = ["page_mount"]


def page_mount() -> Mount:
    """The page and its files under ``/agentkv/`` (place it after the ``/agentkv/…`` routes)."""
    files = StaticFiles(packages=[("agentkv_server", "static")], html=True)
    return Mount("/agentkv", app=files, name="page")
