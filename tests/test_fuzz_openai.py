"""Fuzz the OpenAI routes with hostile bodies: never a 500, always the OpenAI error shape, and
nothing left behind in the dispatcher.

Bodies start as valid Responses or Chat Completions requests (input items, function calls and their
outputs, namespaced and custom tools, tool choices, images, sampling options) and then get the
hostile mutations and byte-level damage of :mod:`tests.test_fuzz`. Derandomized and bounded;
``AGENTKV_FUZZ_OPENAI_EXAMPLES`` sets the number of bodies (default 1000; docs/openai-agents.md
gives the figures of a longer run).
"""

from __future__ import annotations

import json
import os
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
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Runtime
from agentkv_server import create_app
from tests.fakes import FakeLlama
from tests.test_fuzz import (
    Blob,
    encode,
    get,
    header_bytes,
    hostile,
    names,
    paths,
    reason,
    short_text,
    surrogate_text,
)

EXAMPLES = int(os.environ.get("AGENTKV_FUZZ_OPENAI_EXAMPLES", "1000"))
RESPONSES, CHAT = "/v1/responses", "/v1/chat/completions"
# Mostly JSON, so that most bodies reach the translators; the body reader's own refusals are
# covered in depth by tests/test_fuzz.py.
content_types = st.sampled_from(
    ["application/json"] * 16 + ["application/json; charset=utf-8", "text/plain", None]
)

schema = st.fixed_dictionaries(
    {
        "type": st.just("object"),
        "properties": st.dictionaries(
            names, st.fixed_dictionaries({"type": st.sampled_from(["string", "integer"])})
        ),
    }
)
arguments = st.dictionaries(names, st.one_of(st.integers(), short_text), max_size=3).map(json.dumps)
image_url = st.sampled_from(
    ["data:image/png;base64,iVBORw0KGgo=", "https://example.com/a.png", "data:bad", "ftp://x"]
)

# -- Responses bodies ------------------------------------------------------------------------------

input_text = st.fixed_dictionaries({"type": st.just("input_text"), "text": short_text})
output_text = st.fixed_dictionaries({"type": st.just("output_text"), "text": short_text})
input_image = st.fixed_dictionaries({"type": st.just("input_image"), "image_url": image_url})
items = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("message"),
            "role": st.sampled_from(["user", "developer", "system"]),
            "content": st.one_of(
                short_text, st.lists(st.one_of(input_text, input_image), max_size=3)
            ),
        }
    ),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.lists(output_text, max_size=2)}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": names,
            "name": names,
            "arguments": arguments,
        },
        optional={"namespace": names},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call_output"),
            "call_id": names,
            "output": st.one_of(short_text, st.lists(input_text, max_size=2)),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("custom_tool_call"), "call_id": names, "name": names, "input": short_text}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("reasoning"),
            "summary": st.lists(
                st.fixed_dictionaries({"type": st.just("summary_text"), "text": short_text}),
                max_size=2,
            ),
        }
    ),
)
function_tool = st.fixed_dictionaries(
    {"type": st.just("function"), "name": names, "parameters": schema},
    optional={"description": short_text, "strict": st.booleans()},
)
responses_tools = st.one_of(
    function_tool,
    st.fixed_dictionaries({"type": st.just("custom"), "name": names}),
    st.fixed_dictionaries(
        {"type": st.just("namespace"), "name": names, "tools": st.lists(function_tool, max_size=2)}
    ),
    st.fixed_dictionaries({"type": st.just("web_search"), "external_web_access": st.booleans()}),
)


@st.composite
def responses_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": draw(st.sampled_from(["gpt-5", "m", ""])),
        "input": draw(st.one_of(short_text, st.lists(items, min_size=1, max_size=5))),
    }
    tools = draw(st.lists(responses_tools, max_size=3))
    if tools:
        body["tools"] = tools
        named = [t["name"] for t in tools if t["type"] == "function"]
        body["tool_choice"] = draw(
            st.sampled_from(
                ["auto", "none", "required"]
                + [{"type": "function", "name": name} for name in named]
            )
        )
    optional = {
        "stream": st.booleans(),
        "instructions": short_text,
        "max_output_tokens": st.integers(1, 64),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1),
        "parallel_tool_calls": st.booleans(),
        "store": st.booleans(),
        "reasoning": st.fixed_dictionaries({"summary": st.just("auto")}),
        "include": st.just(["reasoning.encrypted_content"]),
        "prompt_cache_key": short_text,
        "text": st.just({"format": {"type": "text"}}),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            body[key] = draw(strategy)
    return body


# -- Chat Completions bodies -----------------------------------------------------------------------

text_part = st.fixed_dictionaries({"type": st.just("text"), "text": short_text})
image_part = st.fixed_dictionaries(
    {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": image_url})}
)
tool_call = st.fixed_dictionaries(
    {
        "id": names,
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": names, "arguments": arguments}),
    }
)
chat_messages = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "developer"]),
            "content": st.one_of(
                short_text, st.lists(st.one_of(text_part, image_part), max_size=3)
            ),
        }
    ),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.one_of(st.none(), short_text)},
        optional={"tool_calls": st.lists(tool_call, max_size=2)},
    ),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": names, "content": short_text}),
)
chat_tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": names, "parameters": schema}, optional={"description": short_text}
        ),
    }
)


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": draw(st.sampled_from(["gpt-4o", "m", ""])),
        "messages": draw(st.lists(chat_messages, min_size=1, max_size=5)),
    }
    tools = draw(st.lists(chat_tool, max_size=3, unique_by=lambda t: t["function"]["name"]))
    if tools:
        body["tools"] = tools
        body["tool_choice"] = draw(
            st.sampled_from(
                [
                    "auto",
                    "none",
                    "required",
                    {"type": "function", "function": {"name": tools[0]["function"]["name"]}},
                ]
            )
        )
    optional = {
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "max_tokens": st.integers(1, 64),
        "max_completion_tokens": st.integers(1, 64),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1),
        "stop": st.one_of(short_text, st.lists(short_text, max_size=2)),
        "n": st.integers(1, 2),
        "user": short_text,
        "seed": st.integers(),
        "parallel_tool_calls": st.booleans(),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            body[key] = draw(strategy)
    return body


# -- hostile versions ------------------------------------------------------------------------------


@st.composite
def mutated(draw: st.DrawFn, route: str) -> dict[str, Any]:
    body = draw(responses_bodies() if route == RESPONSES else chat_bodies())
    for _ in range(draw(st.integers(0, 3))):
        where = paths(body)
        kind = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
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


@st.composite
def raw_bodies(draw: st.DrawFn, route: str) -> Blob:
    raw = encode(draw(mutated(route)))
    damage = draw(st.sampled_from(["none"] * 8 + ["truncate", "bad-utf8", "deep", "array"]))
    if damage == "truncate":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif damage == "bad-utf8":
        cut = draw(st.integers(0, len(raw)))
        raw = raw[:cut] + b"\xff" + raw[cut:]
    elif damage == "deep":
        raw = raw[:-1] + b', "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    elif damage == "array":
        raw = b"[" + raw + b"]"
    return Blob(raw)


@attrs.frozen
class Case:
    route: str
    body: Blob
    headers: dict[str, Blob]


@st.composite
def requests(draw: st.DrawFn) -> Case:
    route = draw(st.sampled_from([RESPONSES, CHAT]))
    headers: dict[str, Blob] = {}
    content_type = draw(content_types)
    if content_type is not None:
        headers["content-type"] = Blob(content_type.encode())
    if draw(st.integers(0, 3)) == 0:
        header = draw(
            st.sampled_from(["x-agent-id", "x-codex-turn-metadata", "thread-id", "session-id"])
        )
        value = draw(
            st.one_of(
                header_bytes,
                st.just(b'{"thread_id": "t", "agent_name": "/root"}'),
                st.just(b'{"thread_id": 5}'),
                st.just(b"a" * 300_000),
            )
        )
        headers[header] = Blob(value)
    if draw(st.integers(0, 4)) == 0:
        headers["x-agent-priority"] = Blob(draw(st.sampled_from([b"0", b"3", b"9", b"x"])))
    return Case(route, draw(raw_bodies(route)), headers)


# -- the checks ------------------------------------------------------------------------------------


def check_openai_error(payload: Any) -> str:
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, payload
    assert isinstance(error["message"], str) and error["message"], payload
    assert isinstance(error["type"], str) and error["type"], payload
    assert error["param"] is None or isinstance(error["param"], str), payload
    return str(error["message"])


def check_response(route: str, response: httpx.Response, reasons: Counter[str]) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code != 200:
        reasons[reason(check_openai_error(response.json()))] += 1
        return
    if not response.headers["content-type"].startswith("text/event-stream"):
        payload = response.json()
        assert payload["object"] in ("response", "chat.completion"), payload
        return
    frames = response.text.strip().split("\n\n")
    if route == RESPONSES:
        for frame in frames:
            fields = dict(line.split(": ", 1) for line in frame.splitlines())
            event = json.loads(fields["data"])
            assert event["type"] == fields["event"]
        assert json.loads(frames[-1].split("data: ", 1)[1])["type"] in (
            "response.completed",
            "response.incomplete",
            "response.failed",
        )
    else:
        assert frames[-1] == "data: [DONE]"
        for frame in frames[:-1]:
            if frame.startswith(":"):
                continue
            chunk = json.loads(frame.removeprefix("data: "))
            if "error" in chunk:
                check_openai_error(chunk)


def test_fuzz_both_openai_routes() -> None:
    """Hostile bodies on /v1/responses and /v1/chat/completions: no 500, OpenAI-shaped errors,
    an idle dispatcher after."""
    fake = FakeLlama(reply='{"name": "x", "arguments": {}}')
    engine = httpx.AsyncClient(transport=fake.transport(), base_url="http://engine")
    client = LlamaSlotClient("http://engine", http=engine, connect_retries=0)
    runtime = Runtime(client, RuntimeConfig(ctx_per_slot=8192))
    app = create_app(runtime)
    statuses: Counter[int] = Counter()
    reasons: Counter[str] = Counter()
    started = time.monotonic()

    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(runtime),
    ):

        async def send(case: Case) -> None:
            transport = httpx.ASGITransport(app=app)
            headers = [(name.encode(), value.data) for name, value in case.headers.items()]
            async with httpx.AsyncClient(transport=transport, base_url="http://agentkv") as http:
                request = http.build_request(
                    "POST", case.route, content=case.body.data, headers=headers
                )
                with anyio.fail_after(30):
                    response = await http.send(request)
                statuses[response.status_code] += 1
                check_response(case.route, response, reasons)

        @settings(
            max_examples=EXAMPLES,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(case=requests())
        def one(case: Case) -> None:
            portal.call(send, case)

        one()
        portal.call(client.aclose)

    elapsed = time.monotonic() - started
    snapshot = runtime.snapshot()
    leaked = sum(slot.busy + len(slot.leases) for slot in snapshot.slots)
    assert snapshot.queue == () and snapshot.background == (), snapshot
    assert leaked == 0
    assert all(count == 0 for count in fake.active.values()), fake.active
    total = sum(statuses.values())
    print(
        f"\nfuzz (OpenAI routes): {total} requests in {elapsed:.1f} s, "
        f"statuses {dict(sorted(statuses.items()))}, 500s {statuses[500]}, leaked leases {leaked}"
    )
    for text, count in reasons.most_common(40):
        print(f"{count:6d}  {text}")
    assert total >= EXAMPLES
    assert statuses[200] > 0 and statuses[400] > 0, statuses
