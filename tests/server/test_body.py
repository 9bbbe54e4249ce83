"""The body reader: what JSON is refused before anything else sees it, and where it says."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from agentkv import InvalidRequestError
from agentkv_server.body import check_json, parse_json

FIXTURE = Path(__file__).parent.parent / "fixtures" / "claude_code_request.json"


def refused(raw: bytes, max_depth: int = 64) -> str:
    with pytest.raises(InvalidRequestError) as info:
        parse_json(raw, max_depth)
    return info.value.message


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"model": "\\ud800"}', "model: string contains an unpaired surrogate"),
        (b'{"a": ["ok", "\\udfff tail"]}', "a[1]: string contains an unpaired surrogate"),
        # A proper pair is one character; only a lone half is refused.
        (
            b'{"m": [{"content": [{}, {"text": "\\ud83d\\ude00 \\ud83d"}]}]}',
            "m[0].content[1].text: string contains an unpaired surrogate",
        ),
        (b'{"k": {"\\udc00": 1}}', 'k["\\udc00"]: object key contains an unpaired surrogate'),
        (b'{"t": NaN}', "t: number nan is not finite; JSON numbers must be finite"),
        (b'{"t": [Infinity]}', "t[0]: number inf is not finite; JSON numbers must be finite"),
        (b'{"t": {"u": -Infinity}}', "t.u: number -inf is not finite; JSON numbers must be finite"),
        (b'{"t": 1e400}', "t: number inf is not finite; JSON numbers must be finite"),
        (b'{"t": -1e400}', "t: number -inf is not finite; JSON numbers must be finite"),
        (
            b'{"n": ' + b"9" * 400 + b"}",
            "n: number is too large (it does not fit a double)",
        ),
        (b'{"odd key!": NaN}', '["odd key!"]: number nan'),
        (b"", "request body is empty; expected a JSON object"),
        (b"  \n ", "request body is empty; expected a JSON object"),
        (b"[1, 2]", "request body must be a JSON object, not array"),
        (b'"text"', "request body must be a JSON object, not string"),
        (b"\xff\xfe{\x00}\x00", "request body is not valid UTF-8 (byte 0)"),
        (b'{"a": "\xed\xa0\x80"}', "request body is not valid UTF-8 (byte 7)"),
    ],
)
def test_hostile_json_is_refused_naming_the_path(raw: bytes, message: str) -> None:
    assert refused(raw).startswith(message)


def test_invalid_json_says_so() -> None:
    assert refused(b"{not json").startswith("request body is not valid JSON: ")
    assert refused(b'\xef\xbb\xbf{"a": 1}').startswith("request body is not valid JSON: ")


def test_nesting_deeper_than_the_limit_names_where() -> None:
    """Past the limit the walk names the path; far past it the parser's RecursionError is a 400."""
    assert parse_json(b'{"a": [[[1]]]}', max_depth=4) == {"a": [[[1]]]}
    # Empty containers count too.
    assert refused(b'{"a": [[[[]]]]}', max_depth=4) == (
        "a[0][0][0]: nesting is deeper than the limit of 4 levels"
    )
    deep = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert refused(deep) == "request body is nested deeper than the limit of 64 levels"
    # Between the limit and the parser's own recursion limit.
    medium = b'{"x": ' + b"[" * 200 + b"]" * 200 + b"}"
    assert refused(medium).startswith("x" + "[0]" * 63 + ": nesting is deeper than the limit")


def test_long_keys_in_paths_are_shortened() -> None:
    key = "k" * 500
    message = refused(json.dumps({key: float("nan")}).encode())
    assert len(message) < 200
    assert message.startswith('["' + "k" * 64 + '"…]: number nan')
    assert refused('{"é ✓": NaN}'.encode()).startswith('["é ✓"]: number nan')


def test_claude_code_request_passes_unchanged() -> None:
    raw = FIXTURE.read_bytes()
    assert parse_json(raw, 64) == json.loads(raw)
    # Unicode text (pairs included) and big but finite numbers are fine.
    body: dict[str, Any] = {"t": "héllo \U0001f600 ✓", "n": [1e308, -(2**1000), 0.5, True, None]}
    assert parse_json(json.dumps(body).encode(), 64) == body


def test_the_walk_is_cheap_next_to_parsing() -> None:
    """check_json on a 5 MB body of many small values costs less than 2x json.loads."""
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": f"line {i} é"}, {"n": i}]}
            for i in range(50_000)
        ]
    }
    raw = json.dumps(body)
    parsed = json.loads(raw)

    def best_of_3(work: Any) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        return min(times)

    parse_s = best_of_3(lambda: json.loads(raw))
    walk_s = best_of_3(lambda: check_json(parsed, 64))
    assert walk_s < 2 * parse_s + 0.05, (walk_s, parse_s)
