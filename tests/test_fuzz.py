"""Fuzz both message routes with hostile bodies: never a 500, always the Anthropic error shape,
and nothing left behind in the dispatcher.

Bodies start structurally valid (messages, blocks, tools, tool_choice, metadata, ...) and then get
zero or more hostile mutations: values replaced by wrong types, huge or non-finite numbers, strings
with lone surrogates, deep nesting, unknown block types, images, bogus tool_choice; keys removed or
added; and at the byte level, truncation, invalid UTF-8, a BOM, 100,000 nested arrays, a top level
that is not an object, or a content type that is not JSON.

The run is derandomized (the same bodies every time) and bounded. ``AGENTKV_FUZZ_EXAMPLES`` sets
the number of bodies (default 500); docs/reliability.md has the command for a long run.
"""

from __future__ import annotations

import copy
import json
import os
import re
import time
from collections import Counter
from typing import Any

import anyio
import anyio.from_thread
import attrs
import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv import LlamaSlotClient
from agentkv.limits import IMAGE_NOTE
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Runtime
from agentkv_server import create_app
from tests.fakes import FakeLlama

EXAMPLES = int(os.environ.get("AGENTKV_FUZZ_EXAMPLES", "500"))
ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
SURROGATES = ("\ud800", "\udbff", "\udc00", "\udfff")
JSONValue = Any

# -- structurally valid bodies ------------------------------------------------------------------

short_text = st.text(max_size=20)
names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-0123456789", min_size=1, max_size=12)
#: Image data of every kind: a valid 1x1 PNG, short valid base64, data that is not base64
#: (bad padding, foreign characters, a data URL pasted in), none, and a large blob.
image_data = st.sampled_from(
    [
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9"
        "awAAAABJRU5ErkJggg==",
        "iVBORw0KGgo=",
        "AAA",
        "not base64 at all!",
        "data:image/png;base64,iVBORw0KGgo=",
        "",
        "QUFB" * 2_000,
    ]
)
image = st.fixed_dictionaries(
    {
        "type": st.just("image"),
        "source": st.one_of(
            st.fixed_dictionaries(
                {
                    "type": st.just("base64"),
                    "media_type": st.sampled_from(["image/png", "image/jpeg", "text/plain"]),
                    "data": image_data,
                }
            ),
            st.fixed_dictionaries(
                {"type": st.just("url"), "url": st.just("https://example.com/a.png")}
            ),
        ),
    }
)
text_block = st.fixed_dictionaries({"type": st.just("text"), "text": short_text})
tool_use = st.fixed_dictionaries(
    {
        "type": st.just("tool_use"),
        "id": names,
        "name": names,
        "input": st.dictionaries(names, st.one_of(st.integers(), short_text), max_size=3),
    }
)
tool_result = st.fixed_dictionaries(
    {
        "type": st.just("tool_result"),
        "tool_use_id": names,
        "content": st.one_of(short_text, st.lists(st.one_of(text_block, image), max_size=3)),
    },
    optional={"is_error": st.booleans()},
)
thinking = st.fixed_dictionaries(
    {"type": st.just("thinking"), "thinking": short_text, "signature": short_text}
)
redacted = st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": short_text})
block = st.one_of(text_block, image, tool_use, tool_result, thinking, redacted)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": st.one_of(short_text, st.lists(block, max_size=4)),
    }
)
schema = st.fixed_dictionaries(
    {
        "type": st.just("object"),
        "properties": st.dictionaries(
            names, st.fixed_dictionaries({"type": st.sampled_from(["string", "integer"])})
        ),
    }
)
tool = st.fixed_dictionaries(
    {"name": names, "input_schema": schema}, optional={"description": short_text}
)
user_id = st.one_of(
    short_text,
    st.builds(lambda s: json.dumps({"device_id": "d", "session_id": s}), short_text),
    st.builds(lambda s: f"user_abc_account__session_{s}", names),
)


@st.composite
def valid_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": draw(st.sampled_from(["claude-sonnet-4-5", "m", ""])),
        "max_tokens": draw(st.integers(1, 64)),
        "messages": draw(st.lists(message, min_size=1, max_size=4)),
    }
    tools = draw(st.lists(tool, max_size=3, unique_by=lambda t: t["name"]))
    if tools:
        body["tools"] = tools
        body["tool_choice"] = draw(
            st.sampled_from(
                [
                    {"type": "auto"},
                    {"type": "any"},
                    {"type": "none"},
                    {"type": "tool", "name": tools[0]["name"]},
                ]
            )
        )
    optional = {
        "stream": st.booleans(),
        # An image where only text fits is a mistake a client can make too.
        "system": st.one_of(short_text, st.lists(st.one_of(text_block, image), max_size=2)),
        "temperature": st.floats(0, 1),
        "top_p": st.floats(0, 1),
        "top_k": st.integers(0, 100),
        "stop_sequences": st.lists(short_text, max_size=2),
        "metadata": st.fixed_dictionaries({"user_id": user_id}),
        "thinking": st.sampled_from(
            [{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}]
        ),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            body[key] = draw(strategy)
    if draw(st.integers(0, 3)) == 0:
        # A tool's answer holding an image, as Claude Code's Read tool sends for an image file.
        body["messages"] += [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [*draw(st.lists(text_block, max_size=2)), draw(image)],
                    }
                ],
            },
        ]
    return body


# -- hostile mutations --------------------------------------------------------------------------


def nested(depth: int) -> JSONValue:
    value: JSONValue = []
    for _ in range(depth):
        value = [value]
    return value


surrogate_text = st.builds(
    lambda a, s, b: a + s + b, short_text, st.sampled_from(SURROGATES), short_text
)
hostile = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([0, -1, 2**31, 2**63, 10**400, -(10**400)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308]),
    st.text(max_size=30),
    surrogate_text,
    st.just("x" * 5000),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(short_text, st.integers(), max_size=3),
    st.integers(60, 300).map(nested),
    st.sampled_from(
        [
            {"type": "bogus"},
            {"type": "image"},
            {"type": "tool_result"},
            {"type": "text"},
            {"type": "text", "text": 5},
            {"type": "tool", "name": "no_such_tool"},
            {"type": "any"},
            {"type": None},
            {},
            [],
            "",
        ]
    ).map(copy.deepcopy),  # mutations edit values in place: never share one between draws
    image,
    block,
)


# Top-level values over the default limits (RequestLimits), or breaking a rule checked there.
over_limits = st.sampled_from(
    [
        ("tools", [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(600)]),
        ("tools", [{"name": "same"}, {"name": "same"}]),
        ("tools", [{"name": "big", "input_schema": {"enum": ["v" * 70_000]}}]),
        ("tools", [{"name": "n" * 300}]),
        ("stop_sequences", ["s"] * 100),
        ("stop_sequences", ["s" * 2000]),
        ("max_tokens", 2**31),
        ("top_k", 2**40),
        ("system", [{"type": "text", "text": "x"}] * 1001),
    ]
).map(copy.deepcopy)


def paths(value: JSONValue, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into ``value`` (the root excluded)."""
    out: list[tuple[Any, ...]] = []
    if isinstance(value, dict):
        items: list[tuple[Any, Any]] = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        return out
    for key, item in items:
        out.append((*prefix, key))
        out.extend(paths(item, (*prefix, key)))
    return out


def get(value: JSONValue, path: tuple[Any, ...]) -> JSONValue:
    for key in path:
        value = value[key]
    return value


@st.composite
def mutated(draw: st.DrawFn) -> dict[str, Any]:
    body = draw(valid_bodies())
    for _ in range(draw(st.integers(0, 3))):
        where = paths(body)
        kind = draw(st.sampled_from(["replace", "replace", "delete", "add", "limit"]))
        if kind == "limit":
            key, value = draw(over_limits)
            body[key] = value
            continue
        if kind == "add" or not where:
            target = get(body, draw(st.sampled_from(where))[:-1]) if where else body
            if isinstance(target, dict):
                key = draw(st.one_of(short_text, surrogate_text, st.sampled_from(list(body))))
                target[key] = draw(hostile)
            elif isinstance(target, list):
                target.append(draw(hostile))
            continue
        path = draw(st.sampled_from(where))
        parent = get(body, path[:-1])
        if kind == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(hostile)
    return body


def encode(body: JSONValue) -> bytes:
    # allow_nan writes NaN/Infinity tokens; ensure_ascii writes lone surrogates as \\udXXX escapes.
    return json.dumps(body, allow_nan=True).encode()


class Blob:
    """Bytes with a short repr: hostile bodies and headers can be hundreds of kB long, and
    hypothesis prints what it drew when a test fails. (Not attrs: hypothesis would print the
    fields of an attrs class itself.)"""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:
        data = self.data
        return repr(data) if len(data) <= 600 else f"{data[:600]!r}... ({len(data)} bytes)"


@st.composite
def raw_bodies(draw: st.DrawFn) -> Blob:
    raw = encode(draw(mutated()))
    damage = draw(
        st.sampled_from(
            ["none"] * 6 + ["truncate", "bad-utf8", "bom", "deep", "not-object", "empty", "array"]
        )
    )
    if damage == "truncate":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif damage == "bad-utf8":
        cut = draw(st.integers(0, len(raw)))
        raw = raw[:cut] + draw(st.sampled_from([b"\xff", b"\xed\xa0\x80", b"\xc3"])) + raw[cut:]
    elif damage == "bom":
        raw = b"\xef\xbb\xbf" + raw
    elif damage == "deep":
        raw = raw[:-1] + b', "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    elif damage == "not-object":
        raw = draw(st.sampled_from([b"1", b'"text"', b"null", b"true", b"NaN"]))
    elif damage == "empty":
        raw = b""
    elif damage == "array":
        raw = b"[" + raw + b"]"
    return Blob(raw)


content_types = st.sampled_from(
    ["application/json"] * 8
    + ["application/json; charset=utf-8", "text/plain", "text/plain;charset=UTF-8", None]
    + ["application/x-www-form-urlencoded", "application/json; charset=latin-1"]
)
header_bytes = st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b)


@attrs.frozen
class Case:
    """One request to send."""

    route: str
    body: Blob
    headers: dict[str, Blob]


@st.composite
def requests(draw: st.DrawFn) -> Case:
    route = draw(st.sampled_from(ROUTES))
    body = draw(raw_bodies())
    headers: dict[str, Blob] = {}
    content_type = draw(content_types)
    if content_type is not None:
        headers["content-type"] = Blob(content_type.encode())
    if draw(st.booleans()):
        headers["x-agent-id"] = draw(
            st.one_of(header_bytes.map(Blob), st.just(Blob(b"a" * 300_000)))
        )
    if draw(st.integers(0, 4)) == 0:
        value = draw(st.sampled_from([b"0", b"3", b"9", b"-1", b"x", b""]))
        headers["x-agent-priority"] = Blob(value)
    return Case(route, body, headers)


# -- the checks ---------------------------------------------------------------------------------


def check_error_shape(payload: JSONValue) -> None:
    assert isinstance(payload, dict) and payload.get("type") == "error", payload
    error = payload.get("error")
    assert isinstance(error, dict), payload
    assert isinstance(error.get("type"), str) and error["type"], payload
    assert isinstance(error.get("message"), str) and error["message"], payload


_PATH = re.compile(r"^(\w+|\[[^\]]*\])(\.\w+|\[[^\]]*\])*: ")


def reason(message: str) -> str:
    """An error message without its field path and values: what kind of refusal it was."""
    head = _PATH.sub("", message, count=1)
    return re.split(r"[\d'\"]", head, maxsplit=1)[0].strip()[:48]


def check_response(response: httpx.Response, reasons: Counter[str]) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code != 200:
        payload = response.json()
        check_error_shape(payload)
        reasons[reason(payload["error"]["message"])] += 1
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        for frame in response.text.strip().split("\n\n"):
            fields = dict(line.split(": ", 1) for line in frame.splitlines())
            event = json.loads(fields["data"])
            assert event["type"] == fields["event"]
            if event["type"] == "error":
                check_error_shape(event)
    else:
        payload = response.json()
        assert payload.get("type") in ("message", None) or "input_tokens" in payload, payload


def test_fuzz_both_message_routes() -> None:
    """Hostile bodies on both routes: no 500, Anthropic-shaped errors, an idle dispatcher after."""
    # A reply that is a valid call of any tool whose schema accepts an object, so forced tool
    # choices succeed too. The first engine sees images; the second is text-only as the default
    # model is: its /props says so, and it refuses an image with a 500, as llama-server does.
    reply = '{"name": "x", "arguments": {}}'
    fakes = [FakeLlama(reply=reply, vision=True), FakeLlama(reply=reply, vision=False)]
    clients = [
        LlamaSlotClient(
            "http://engine",
            http=httpx.AsyncClient(transport=fake.transport(), base_url="http://engine"),
            connect_retries=0,
        )
        for fake in fakes
    ]
    runtimes = [Runtime(client, RuntimeConfig(ctx_per_slot=8192)) for client in clients]
    apps = [create_app(runtime) for runtime in runtimes]
    statuses: Counter[int] = Counter()
    reasons: Counter[str] = Counter()
    started = time.monotonic()

    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(runtimes[0]),
        portal.wrap_async_context_manager(runtimes[1]),
    ):

        async def send(app_index: int, case: Case) -> None:
            transport = httpx.ASGITransport(app=apps[app_index])
            headers = [(name.encode(), value.data) for name, value in case.headers.items()]
            async with httpx.AsyncClient(transport=transport, base_url="http://agentkv") as http:
                request = http.build_request(
                    "POST", case.route, content=case.body.data, headers=headers
                )
                with anyio.fail_after(30):
                    response = await http.send(request)
                statuses[response.status_code] += 1
                check_response(response, reasons)

        @settings(
            max_examples=EXAMPLES,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(case=requests(), app_index=st.integers(0, 1))
        def one(case: Case, app_index: int) -> None:
            portal.call(send, app_index, case)

        one()
        for client in clients:
            portal.call(client.aclose)

    elapsed = time.monotonic() - started
    leaked = 0
    for runtime in runtimes:
        snapshot = runtime.snapshot()
        leaked += sum(slot.busy + len(slot.leases) for slot in snapshot.slots)
        assert snapshot.queue == () and snapshot.background == (), snapshot
    assert leaked == 0
    for fake in fakes:
        assert all(count == 0 for count in fake.active.values()), fake.active
    # Images inside tool results reached the text-only engine as notes, and were answered.
    noted = sum(1 for r in fakes[1].requests if IMAGE_NOTE in json.dumps(r))
    assert noted > 0
    total = sum(statuses.values())
    print(
        f"\nfuzz: {total} requests in {elapsed:.1f} s, statuses {dict(sorted(statuses.items()))}, "
        f"500s {statuses[500]}, leaked leases {leaked}, tool images sent as notes {noted}"
    )
    for text, count in reasons.most_common(40):
        print(f"{count:6d}  {text}")
    # The mix reaches both the success path and the refusals.
    assert statuses[200] > 0 and statuses[400] > 0, statuses
