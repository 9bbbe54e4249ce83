"""The one place a request body is read and parsed: :func:`read_json` refuses, with a 400 (413 for
size) in the Anthropic error shape, what would otherwise fail later and deeper.

That is: a content type other than ``application/json`` (a browser's "simple" cross-site request
cannot send it); a body too large, empty, not UTF-8 or not JSON; ``NaN``, ``Infinity`` and numbers
too large for a double (httpx refuses to send them to the engine); nesting deeper than the limit;
strings or keys with an unpaired surrogate (every later UTF-8 encode would fail); a top level that
is not an object. The check is one iterative walk, a small fraction of ``json.loads``'s cost.
"""

from __future__ import annotations

import json
import math
from typing import Any, Final

import attrs
from starlette.requests import Request

from agentkv.exceptions import InvalidRequestError, RequestTooLargeError
from agentkv.schema import json_type

__all__ = ["BodyLimits", "check_json", "parse_json", "read_json"]

_MEDIA_TYPE: Final = "application/json"
# Integers beyond this magnitude become infinite as doubles (what most JSON readers use).
_MAX_NUMBER: Final = 2**1024
_INFINITY: Final = math.inf
# Keys shown in a path as ``.key``; anything else is quoted as ``["..."]``.
_KEY_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_MAX_KEY_SHOWN: Final = 64


@attrs.frozen
class BodyLimits:
    """How large and how deeply nested a request body may be."""

    #: Largest body in bytes; larger ones get 413 request_too_large.
    max_bytes: int = attrs.field(default=32 * 1024 * 1024, validator=attrs.validators.ge(1))
    #: Deepest nesting of arrays and objects (the top-level object is level 1).
    max_depth: int = attrs.field(default=64, validator=attrs.validators.ge(1))


async def read_json(request: Request, limits: BodyLimits) -> dict[str, Any]:
    """Read, parse and check a JSON object body; raise InvalidRequestError (400) or 413."""
    _check_content_type(request.headers.get("content-type"))
    limit = limits.max_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLargeError(f"request body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLargeError(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return parse_json(b"".join(chunks), limits.max_depth)


def parse_json(raw: bytes, max_depth: int) -> dict[str, Any]:
    """Parse a body that must be one JSON object, and :func:`check_json` it."""
    if not raw.strip():
        raise InvalidRequestError("request body is empty; expected a JSON object")
    try:
        # Decoded here, not by json.loads, which would also accept UTF-16 and UTF-32.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise InvalidRequestError(
            f"request body is nested deeper than the limit of {max_depth} levels"
        ) from None
    except ValueError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError(f"request body must be a JSON object, not {json_type(body)}")
    check_json(body, max_depth)
    return body


def _check_content_type(value: str | None) -> None:
    if value is None:
        raise InvalidRequestError(
            f"is missing; requests must be sent as {_MEDIA_TYPE}", "header content-type"
        )
    media_type, _, params = value.partition(";")
    if media_type.strip().lower() != _MEDIA_TYPE:
        raise InvalidRequestError(
            f"must be {_MEDIA_TYPE}, got {_shorten(media_type.strip())!r}", "header content-type"
        )
    for param in params.split(";"):
        name, _, charset = param.partition("=")
        if name.strip().lower() == "charset":
            charset = charset.strip().strip('"').lower()
            if charset not in ("utf-8", "utf8"):
                raise InvalidRequestError(
                    f"JSON must be UTF-8, got charset {_shorten(charset)!r}", "header content-type"
                )


# A parent link for paths, built only for containers: (parent link, key in parent) or None.
_Link = tuple[Any, str | int] | None


def check_json(value: dict[str, Any] | list[Any], max_depth: int) -> None:
    """Refuse what cannot travel on as JSON: non-finite numbers, unpaired surrogates, deep nesting.

    ``value`` is what ``json.loads`` returned. The walk is iterative; the error names the path
    (``messages[0].content[1].text: string contains an unpaired surrogate``).
    """
    stack: list[tuple[dict[str, Any] | list[Any], _Link, int]] = [(value, None, 1)]
    while stack:
        node, link, depth = stack.pop()
        if depth > max_depth:
            raise InvalidRequestError(
                f"nesting is deeper than the limit of {max_depth} levels", _path(link)
            )
        items = node.items() if type(node) is dict else enumerate(node)
        for key, item in items:
            if type(key) is str and not key.isascii() and _unpaired(key):
                raise InvalidRequestError(
                    "object key contains an unpaired surrogate", _path((link, key))
                )
            kind = type(item)
            if kind is str:
                if not item.isascii() and _unpaired(item):
                    raise InvalidRequestError(
                        "string contains an unpaired surrogate", _path((link, key))
                    )
            elif kind is float:
                if item != item or item == _INFINITY or item == -_INFINITY:
                    raise InvalidRequestError(
                        f"number {item!r} is not finite; JSON numbers must be finite",
                        _path((link, key)),
                    )
            elif kind is int:
                if not -_MAX_NUMBER < item < _MAX_NUMBER:
                    raise InvalidRequestError(
                        "number is too large (it does not fit a double)", _path((link, key))
                    )
            elif kind is dict or kind is list:
                stack.append((item, (link, key), depth + 1))


def _unpaired(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate (json.loads keeps ``\\ud800`` escapes as such)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _path(link: _Link) -> str | None:
    keys: list[str | int] = []
    while link is not None:
        link, key = link
        keys.append(key)
    out: list[str] = []
    for key in reversed(keys):
        if isinstance(key, int):
            out.append(f"[{key}]")
        elif 0 < len(key) <= _MAX_KEY_SHOWN and set(key) <= _KEY_CHARS and not key[0].isdigit():
            out.append(f".{key}" if out else key)
        else:
            # Surrogates are escaped (ensure_ascii), so the message itself can always be encoded.
            shown = json.dumps(key[:_MAX_KEY_SHOWN], ensure_ascii=_unpaired(key))
            out.append(f"[{shown}{'…' if len(key) > _MAX_KEY_SHOWN else ''}]")
    return "".join(out) or None


def _shorten(text: str) -> str:
    return text if len(text) <= _MAX_KEY_SHOWN else text[:_MAX_KEY_SHOWN] + "…"
