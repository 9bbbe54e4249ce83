"""Hostile and malformed requests: a 400 (or 413) naming the field, no 500, no engine work.

Each case here once got through to a 500, a stuck lease or a broken slot table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv.limits import IMAGE_NOTE, NO_IMAGES, RequestLimits
from tests.fakes import FakeLlama
from tests.server.conftest import Serve

pytestmark = pytest.mark.anyio

BODY: dict[str, Any] = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "Say hello."}],
}
ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
JSON = {"content-type": "application/json"}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def assert_idle(http: httpx.AsyncClient) -> None:
    """No lease held, no ticket queued: nothing is left behind by a refused request."""
    snapshot = http.runtime.snapshot()  # type: ignore[attr-defined]
    assert all(not slot.busy and not slot.leases for slot in snapshot.slots)
    assert snapshot.queue == () and snapshot.background == ()


def assert_400(response: httpx.Response, message: str, status: int = 400) -> None:
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["type"] == "error"
    expected = "invalid_request_error" if status == 400 else "request_too_large"
    assert payload["error"]["type"] == expected
    assert payload["error"]["message"].startswith(message), payload["error"]["message"]


async def post_raw(http: httpx.AsyncClient, route: str, raw: bytes) -> httpx.Response:
    return await http.post(route, content=raw, headers=JSON)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("stream", [False, True])
async def test_lone_surrogate_in_model(serve: Serve, route: str, stream: bool) -> None:
    """``"model": "\\ud800"`` is a 400 at parse time, streaming or not; no lease is taken."""
    fake = FakeLlama()
    http = await serve(fake, ctx_per_slot=4096)
    raw = json.dumps({**BODY, "stream": stream})
    raw = raw.replace('"claude-sonnet-4-5"', '"\\ud800"')
    response = await post_raw(http, route, raw.encode())
    assert_400(response, "model: string contains an unpaired surrogate")
    assert fake.paths == []
    assert_idle(http)
    # The server is unharmed: the next request is served.
    assert (await http.post("/v1/messages", json={**BODY, "stream": stream})).status_code == 200
    assert_idle(http)


async def test_poisoned_session_id_breaks_no_one(serve: Serve, tmp_path: Path) -> None:
    """A session_id decoding to lone surrogates: its request, the agent that evicts it, and the
    slot table all still work, and the parked-context file name is a plain digest."""
    fake = FakeLlama(reply="fine", save_dir=tmp_path)
    http = await serve(fake, n_slots=1, store_dir=tmp_path, park_min=1)
    poisoned = {**BODY, "metadata": {"user_id": '{"session_id":"\\udc00evil\\u001b[2J"}'}}
    r = await http.post("/v1/messages", json=poisoned)
    assert r.status_code == 200, r.text
    # Another agent takes the only slot: the poisoned agent's context is parked.
    other = {**BODY, "messages": [{"role": "user", "content": "something else"}]}
    r = await http.post("/v1/messages", json=other, headers={"x-agent-id": "other"})
    assert r.status_code == 200, r.text
    assert [(action, name.startswith("akv-")) for _, action, name in fake.slot_actions] == [
        ("save", True)
    ]
    saved = [p.name.startswith("akv-context-") for p in tmp_path.glob("*.bin")]
    assert saved == [True]
    r = await http.get("/agentkv/slots")
    assert r.status_code == 200, r.text
    table = r.json()
    assert set(table["agents"]) == {"evil[2J", "other"}
    assert [e["agent"] for e in table["store"]["entries"]] == ["evil[2J"]
    # The same id sent as a real lone surrogate inside the body's JSON is a 400 at parse time.
    raw = json.dumps({**BODY, "metadata": {"user_id": "x"}}).replace('"x"', '"\\udc00"')
    assert_400(await post_raw(http, "/v1/messages", raw.encode()), "metadata.user_id: string")
    assert_idle(http)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("fragment", "path", "shown"),
    [
        ('"temperature": NaN', "temperature", "nan"),
        ('"temperature": Infinity', "temperature", "inf"),
        ('"top_p": -Infinity', "top_p", "-inf"),
        ('"temperature": 1e400', "temperature", "inf"),
        (
            '"tools": [{"name": "t", "input_schema": {"type": "object", "maximum": 1e999}}]',
            "tools[0].input_schema.maximum",
            "inf",
        ),
    ],
)
async def test_non_finite_numbers(
    serve: Serve, route: str, fragment: str, path: str, shown: str
) -> None:
    fake = FakeLlama()
    http = await serve(fake, ctx_per_slot=4096)
    raw = json.dumps(BODY)[:-1] + ", " + fragment + "}"
    response = await post_raw(http, route, raw.encode())
    assert_400(response, f"{path}: number {shown} is not finite")
    assert fake.paths == []
    assert_idle(http)


@pytest.mark.parametrize("route", ROUTES)
async def test_deep_nesting(serve: Serve, route: str) -> None:
    """100,000 nested arrays, and 100: a 400 each, the second naming where."""
    fake = FakeLlama()
    http = await serve(fake, ctx_per_slot=4096)
    prefix = json.dumps(BODY)[:-1]
    deep = f'{prefix}, "x": {"[" * 100_000}{"]" * 100_000}}}'
    assert_400(await post_raw(http, route, deep.encode()), "request body is nested deeper")
    medium = f'{prefix}, "x": {"[" * 100}{"]" * 100}}}'
    assert_400(await post_raw(http, route, medium.encode()), "x[0][0]")
    assert fake.paths == []
    assert_idle(http)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("content_type", "message"),
    [
        ("text/plain", "header content-type: must be application/json, got 'text/plain'"),
        ("text/plain;charset=UTF-8", "header content-type: must be application/json"),
        ("application/x-www-form-urlencoded", "header content-type: must be application/json"),
        ("multipart/form-data; boundary=x", "header content-type: must be application/json"),
        (None, "header content-type: is missing"),
        ("application/json; charset=latin-1", "header content-type: JSON must be UTF-8"),
    ],
)
async def test_only_json_content_type_is_served(
    serve: Serve, route: str, content_type: str | None, message: str
) -> None:
    """A browser's "simple" cross-site request (text/plain, form, no type) never runs."""
    fake = FakeLlama()
    http = await serve(fake, ctx_per_slot=4096)
    request = http.build_request("POST", route, content=json.dumps(BODY).encode())
    if content_type is not None:
        request.headers["content-type"] = content_type
    assert request.headers.get("content-type") == content_type
    assert_400(await http.send(request), message)
    assert fake.paths == []
    assert_idle(http)


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
async def test_json_content_type_with_parameters_is_fine(serve: Serve, content_type: str) -> None:
    http = await serve(FakeLlama())
    r = await http.post(
        "/v1/messages", content=json.dumps(BODY).encode(), headers={"content-type": content_type}
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ROUTES)
async def test_ten_thousand_tools_cost_the_engine_nothing(serve: Serve, route: str) -> None:
    """10,000 tools are refused before any engine request (no templating, no token count)."""
    fake = FakeLlama()
    http = await serve(fake, ctx_per_slot=4096)
    tools = [
        {"name": f"tool_{i}", "input_schema": {"type": "object", "properties": {}}}
        for i in range(10_000)
    ]
    r = await http.post(route, json={**BODY, "tools": tools})
    assert_400(r, "tools: has 10000 tools; the limit is 512")
    assert fake.paths == []
    assert_idle(http)


def with_tool_image(image: dict[str, Any]) -> dict[str, Any]:
    """A turn answering a Read call whose tool_result holds text and ``image``."""
    return {
        **BODY,
        "messages": [
            {"role": "user", "content": "look at the screenshot"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "Read", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [{"type": "text", "text": "shot.png"}, image],
                    }
                ],
            },
        ],
    }


#: Image data of every kind: a valid 1x1 PNG, data that is not base64, none at all.
PNG_1X1 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9"
    "awAAAABJRU5ErkJggg=="
)
IMAGE_DATA = [PNG_1X1, "AAAA", "not base64 at all!", ""]


def image_of(data: str) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


@pytest.mark.parametrize("data", IMAGE_DATA)
@pytest.mark.parametrize("how", ["limits", "props"])
@pytest.mark.parametrize("route", ROUTES)
async def test_images_on_a_text_only_engine(serve: Serve, route: str, how: str, data: str) -> None:
    """On an engine without vision (set in the limits, or learned from its /props), whatever the
    image holds: an image in a user's own turn is a 400 naming it; an image inside a tool_result
    becomes a short note in its place and the request goes on (200)."""
    if how == "limits":
        fake = FakeLlama()
        http = await serve(fake, ctx_per_slot=4096, limits=RequestLimits(images=False))
    else:
        fake = FakeLlama(vision=False)  # refuses images with a 500, as llama-server does
        http = await serve(fake, ctx_per_slot=4096)
    direct = {**BODY, "messages": [{"role": "user", "content": [image_of(data)]}]}
    assert_400(await http.post(route, json=direct), f"messages[0].content[0]: {NO_IMAGES}")
    assert not {"/apply-template", "/v1/chat/completions"} & set(fake.paths)
    response = await http.post(route, json=with_tool_image(image_of(data)))
    assert response.status_code == 200, response.text
    templated = [r for r in fake.requests if "messages" in r] or []
    if route == "/v1/messages":
        tool = next(m for m in fake.requests[-1]["messages"] if m["role"] == "tool")
        assert tool["content"] == f"shot.png\n\n{IMAGE_NOTE}"
        assert "image_url" not in json.dumps(templated)
    assert_idle(http)


async def test_images_on_an_engine_that_sees(serve: Serve) -> None:
    """An engine with vision gets the images; data that is not base64 is a 400 naming it
    before the engine sees anything."""
    fake = FakeLlama(vision=True)
    http = await serve(fake)
    good = {**BODY, "messages": [{"role": "user", "content": [image_of(PNG_1X1)]}]}
    assert (await http.post("/v1/messages", json=good)).status_code == 200
    assert "image_url" in json.dumps(fake.requests[-1])
    for data in ("not base64 at all!", ""):
        bad = with_tool_image(image_of(data))
        path = "messages[2].content[0].content[1].source.data"
        response = await http.post("/v1/messages", json=bad)
        assert response.status_code == 400 and path in response.json()["error"]["message"]


async def test_an_engine_refusing_images_is_a_400_not_a_500(serve: Serve) -> None:
    """An engine that refuses an image although /props did not say so (an older server):
    the client gets a 400 that says images are not accepted, never a 500."""
    fake = FakeLlama(vision=False)
    http = await serve(fake)
    http.runtime.client._vision = True  # type: ignore[attr-defined]
    direct = {**BODY, "messages": [{"role": "user", "content": [image_of(PNG_1X1)]}]}
    response = await http.post("/v1/messages", json=direct)
    assert response.status_code == 400, response.text
    assert "does not accept images" in response.json()["error"]["message"]
    assert_idle(http)


async def test_oversized_agent_id_is_bounded(serve: Serve) -> None:
    """A 1 MB X-Agent-Id becomes a 54-character digest form in the slot table."""
    fake = FakeLlama()
    http = await serve(fake)
    huge = "agent-" + "x" * (1024 * 1024)
    r = await http.post("/v1/messages", json=BODY, headers={"x-agent-id": huge})
    assert r.status_code == 200, r.text
    view = await http.get("/agentkv/slots")
    assert len(view.content) < 10_000
    (agent,) = view.json()["agents"]
    assert len(agent) == 54 and agent.startswith("agent-" + "x" * 34 + "…#")
    # The same id maps to the same agent: its second request is a prefix hit on its slot.
    await http.post("/v1/messages", json=BODY, headers={"x-agent-id": huge})
    assert view.json()["agents"][agent]["requests"] == 1
    assert (await http.get("/agentkv/slots")).json()["agents"][agent]["requests"] == 2


@pytest.mark.parametrize("route", ROUTES)
async def test_oversized_body_is_still_a_413(serve: Serve, route: str) -> None:
    fake = FakeLlama()
    http = await serve(fake, max_body_bytes=1000)
    big = {**BODY, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_400(await http.post(route, json=big), "request body", status=413)
    assert fake.paths == []
