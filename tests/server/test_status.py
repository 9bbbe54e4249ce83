"""``agentkv-server status``: the snapshot as text, from a runtime's real snapshot."""

from __future__ import annotations

import re
from typing import Any

import anyio
import attrs
import httpx
import pytest

from agentkv.snapshot import Divergence, unstructure
from agentkv_server import status
from agentkv_server.cli import build_parser
from agentkv_server.cli import main as cli_main
from tests._snapshot import empty_snapshot, request_view
from tests.fakes import FakeLlama, wait_for

pytestmark = pytest.mark.anyio

BODY: dict[str, Any] = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 32,
    "messages": [{"role": "user", "content": "Read the file and explain it. " * 20}],
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def serving(table: dict[str, Any], *, key: str | None = None) -> httpx.MockTransport:
    """A transport that answers /agentkv/slots with ``table`` (401 without ``key``)."""

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/agentkv/slots"
        if key is not None and request.headers.get("x-api-key") != key:
            return httpx.Response(401, json={"type": "error", "error": {"type": "auth"}})
        return httpx.Response(200, json=table)

    return httpx.MockTransport(handle)


async def test_status_shows_prefill_progress_queue_and_recent_requests(serve: Any) -> None:
    fake = FakeLlama(reply="fine", prefill_delay=1.2)
    http = await serve(fake, n_slots=1)
    runtime = http.runtime  # type: ignore[attr-defined]

    async def call(agent: str) -> None:
        r = await http.post("/v1/messages", json=BODY, headers={"x-agent-id": agent})
        assert r.status_code == 200

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, "first")
        await wait_for(lambda: any(r.prefilled for r in runtime.running()))
        tg.start_soon(call, "second")
        await wait_for(lambda: runtime.snapshot().queue)
        served = unstructure(runtime.snapshot())
        text = status.render(status.fetch("http://agentkv", transport=serving(served)), url="x")
    lines = text.splitlines()
    (slot,) = [line for line in lines if re.match(r"\s+0\s+first\s", line)]
    assert "prefilling" in slot
    assert re.search(r"\d+/\d+ prompt tokens \(\d+%\)", slot), slot
    (queued,) = [line for line in lines if re.match(r"\s+\d+\s+second\s", line)]
    assert queued.rstrip().endswith("a slot")
    text = status.render(runtime.snapshot())
    recent = text.split("recent requests (newest first)")[1].splitlines()[2:]
    assert [line.split()[0] for line in recent] == ["second", "first"]
    assert all(" ok" in line for line in recent)


def test_status_says_why_a_prompt_missed_the_cache() -> None:
    divergence = Divergence(
        reused=812,
        computed=8188,
        seconds=19.9,
        position=812,
        section="tool 3 (Bash)",
        candidate=None,
    )
    snapshot = empty_snapshot(
        placements=attrs.evolve(empty_snapshot().placements, acquired=1, cold=1),
        recent=(
            request_view(
                "coder",
                source="slot",
                cached_tokens=812,
                prompt_tokens=9000,
                ttft_s=20.5,
                total_s=25.0,
                divergence=divergence,
            ),
        ),
    )
    text = status.render(snapshot)
    assert "token 812 in tool 3 (Bash): reused 812, computed 8188, ~19.9 s" in text
    assert "store: off" in text and "0% warm" in text


def test_status_needs_the_key_and_says_so() -> None:
    snapshot = empty_snapshot()
    table = unstructure(snapshot)
    with pytest.raises(status.StatusError, match="needs its API key"):
        status.fetch("http://agentkv", transport=serving(table, key="k"))
    with pytest.raises(status.StatusError, match="refused that API key"):
        status.fetch("http://agentkv", "wrong", transport=serving(table, key="k"))
    assert status.fetch("http://agentkv", "k", transport=serving(table, key="k")) == snapshot


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda t: t.pop("costs"), "costs"),
        (lambda t: t["placements"].update(warm=3), "warm"),
        (lambda t: t.update(slots={"0": {}}), "slots"),
        (lambda t: t["placements"].update(acquired="many"), "acquired"),
    ],
)
def test_status_refuses_a_snapshot_of_another_shape(change: Any, named: str) -> None:
    """A field missing, added, or of another type (another agentkv version) is an error that
    says so, never a table drawn from half the data."""
    table = unstructure(empty_snapshot())
    change(table)
    with pytest.raises(status.StatusError, match="another shape") as raised:
        status.fetch("http://agentkv", transport=serving(table))
    assert named in str(raised.value)


def test_status_refuses_json_that_is_no_snapshot() -> None:
    with pytest.raises(status.StatusError, match="another shape"):
        status.fetch("http://agentkv", transport=serving([]))  # type: ignore[arg-type]


def test_status_of_a_server_that_is_not_there(capsys: pytest.CaptureFixture[str]) -> None:
    from agentkv.runtime.engine import free_port

    url = f"http://127.0.0.1:{free_port()}"
    assert cli_main(["status", "--url", url]) == 1
    assert f"cannot reach agentkv at {url}" in capsys.readouterr().err


def test_the_server_command_keeps_its_flags() -> None:
    """``status`` is dispatched before the server's parser: the server's flags are unchanged."""
    args = build_parser().parse_args(["--slots", "4", "--log-format", "json"])
    assert (args.slots, args.log_format, args.upstream) == (4, "json", None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["status"])  # not a server flag: only main() dispatches it
