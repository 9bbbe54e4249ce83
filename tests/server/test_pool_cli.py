"""``agentkv-server --engines N`` and ``--upstream`` given twice: how a pool is laid out."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import attrs
import httpx
import pytest

from agentkv import AgentKVError
from agentkv.runtime.assemble import EngineSettings, open_engine
from agentkv.runtime.build import DEVICE_MARGIN, Device, Offload
from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.engine import EngineConfig
from agentkv.runtime.pool_launch import check_alike, pool_layout
from agentkv_server import cli

pytestmark = pytest.mark.anyio

GIB = 1 << 30


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_engines_on_the_cpu_split_the_threads_and_the_kv_budget() -> None:
    """Two engines on 2 cores: one thread each, half the KV budget each."""
    layout = pool_layout(2, Offload(0), model_bytes=GIB, kv_budget=8 * GIB, threads=None, cpus=2)
    assert (layout.threads, layout.kv_budget, layout.devices) == (1, 4 * GIB, ())
    assert pool_layout(3, Offload(0), model_bytes=GIB, kv_budget=9 * GIB, threads=8).threads == 2
    one = pool_layout(1, Offload(0), model_bytes=GIB, kv_budget=8 * GIB, threads=None)
    assert (one.threads, one.kv_budget) == (None, 8 * GIB)


def test_engines_on_gpus_get_one_device_each() -> None:
    """With as many GPUs as engines each engine runs on its own, its KV budget that device's
    room; each gets its own slot directory inside the store's."""
    devices = (Device("CUDA0", "A", 80 * GIB, 70 * GIB), Device("CUDA1", "B", 80 * GIB, 60 * GIB))
    offload = Offload(999, 120 * GIB, devices)
    layout = pool_layout(2, offload, model_bytes=4 * GIB, kv_budget=120 * GIB, threads=None)
    assert [d.name for d in layout.devices] == ["CUDA0", "CUDA1"]
    assert layout.kv_budget == 60 * GIB - 4 * GIB - DEVICE_MARGIN
    config = EngineConfig(model=Path("m.gguf"), slot_save_dir=Path("store"), gpu_layers=999)
    configs = layout.configs(config)
    assert [c.slot_save_dir for c in configs] == [Path("store/engine-0"), Path("store/engine-1")]
    assert [c.extra_args for c in configs] == [("--device", "CUDA0"), ("--device", "CUDA1")]
    assert layout.configs(config)[0].slots == config.slots
    assert [c.port for c in layout.configs(attrs.evolve(config, port=9000))] == [9000, 9001]
    assert [c.port for c in layout.configs(attrs.evolve(config, port=0))] == [0, 0]
    # More engines than GPUs: they share the devices llama-server spreads the model over.
    crowded = pool_layout(3, offload, model_bytes=4 * GIB, kv_budget=120 * GIB, threads=None)
    assert crowded.devices == () and crowded.kv_budget == 40 * GIB


def settings(*flags: str) -> EngineSettings:
    """The engine settings ``agentkv-server FLAGS`` runs with."""
    settings: EngineSettings = cli._from_args(EngineSettings, cli.build_parser().parse_args(flags))
    return settings


async def test_upstream_given_twice_is_a_pool_of_two() -> None:
    """Every --upstream is a member, with its slot directory where one is given."""
    given = settings(
        "--upstream", "http://a:8080/", "--upstream", "http://b:8080",
        "--upstream-slot-dir", "/a", "--upstream-slot-dir", "/b", "--store-dir", "/s",
    )  # fmt: skip
    assert given.upstream == ("http://a:8080/", "http://b:8080")
    async with open_engine(given) as engine:
        assert [m.base_url for m in engine.engines] == ["http://a:8080", "http://b:8080"]
        assert [m.slot_dir for m in engine.engines] == [Path("/a"), Path("/b")]
        assert engine.compat == "upstream:http://a:8080,http://b:8080"
        assert engine.supervisors == []
    async with open_engine(settings("--upstream", "http://a", "--upstream", "http://b")) as engine:
        assert [m.slot_dir for m in engine.engines] == [None, None]
    # One upstream, as before the pool: one member, the handle's own fields.
    async with open_engine(EngineSettings(upstream="http://a/")) as engine:
        assert [m.base_url for m in engine.engines] == ["http://a"] == [engine.base_url]
    with pytest.raises(ValueError, match="once per --upstream"):
        settings("--upstream", "http://a", "--upstream", "http://b", "--upstream-slot-dir", "/a")


def test_engines_and_upstream_do_not_mix(capsys: pytest.CaptureFixture[str]) -> None:
    """--engines launches; --upstream does not: both at once is refused, in the command's
    words; --upstream-slot-dir must match the upstreams."""
    with pytest.raises(SystemExit, match="not with --upstream"):
        cli.main(["--engines", "2", "--upstream", "http://a"])
    with pytest.raises(SystemExit, match="at least 1"):
        cli.main(["--engines", "0"])
    with pytest.raises(SystemExit, match="once per --upstream"):
        cli.main(
            ["--upstream", "http://a", "--upstream-slot-dir", "/a", "--upstream-slot-dir", "/b"]
        )
    with pytest.raises(ValueError, match="not with --upstream"):
        EngineSettings(upstream=("http://a",), engines=2)
    # A pool is of llama-servers: an engine that places requests itself is given once.
    with pytest.raises(ValueError, match="a pool is of llama-servers"):
        EngineSettings(upstream=("http://a", "http://b"), engine_kind="vllm")
    assert EngineSettings(upstream="http://a", engine_kind="vllm").upstream == ("http://a",)


def test_agentkv_server_over_two_upstreams_serves_from_both_and_drops_one_that_fails() -> None:
    """The whole command with ``--upstream`` twice (two fake engines over real HTTP): requests
    of several agents run on both; an engine whose /health fails is taken out, and every next
    request runs on the other."""
    from tests.fakes import FakeLlama
    from tests.server.test_logs import agentkv_server, fake_engine_over_http

    a, b = FakeLlama(reply="from a"), FakeLlama(reply="from b")
    with (
        fake_engine_over_http(a) as url_a,
        fake_engine_over_http(b) as url_b,
        agentkv_server(url_a, "--upstream", url_b, "--slots", "4") as (url, _),
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        engines = http.get("/agentkv/slots").json()["engines"]
        assert [e["url"] for e in engines] == [url_a, url_b]
        # Upstreams have no supervisor here: the pool's restarts are there, and none.
        assert http.get("/health").json()["engine_restarts"] == 0
        assert len(http.get("/agentkv/slots").json()["slots"]) == 8

        def ask(agent: str) -> str:
            body = {
                "model": "m",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": f"{agent}: say hello."}],
            }
            r = http.post("/v1/messages", json=body, headers={"x-agent-id": agent})
            assert r.status_code == 200, r.text
            return str(r.json()["content"][0]["text"])

        # Slots 0-3 are engine a's: eight agents at once fill them, then engine b's.
        a.prefill_delay = b.prefill_delay = 0.5
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(ask, [f"agent{i}" for i in range(8)]))
        assert set(replies) == {"from a", "from b"}
        b.healthy = False
        deadline = time.monotonic() + 15
        while http.get("/agentkv/slots").json()["engines"][1]["up"]:
            assert time.monotonic() < deadline, "engine b was not taken out"
            time.sleep(0.1)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(ask, [f"later{i}" for i in range(8)]))
        assert set(replies) == {"from a"}


async def test_a_pool_of_different_models_is_refused() -> None:
    """Engines whose /props name different models (or contexts) cannot share saved states."""

    def props(model: str, n_ctx: int) -> httpx.MockTransport:
        body = {
            "model_path": f"/models/{model}",
            "default_generation_settings": {"n_ctx": n_ctx},
            "build_info": "b1",
        }
        return httpx.MockTransport(lambda request: httpx.Response(200, json=body))

    def client(name: str, transport: httpx.MockTransport) -> LlamaSlotClient:
        return LlamaSlotClient(f"http://{name}", http=httpx.AsyncClient(transport=transport))

    same = [client("a", props("q.gguf", 4096)), client("b", props("q.gguf", 4096))]
    await check_alike(same)  # one model, one context: a pool
    other = [client("a", props("q.gguf", 4096)), client("b", props("gemma.gguf", 4096))]
    with pytest.raises(AgentKVError, match=r"one model .* gemma\.gguf"):
        await check_alike(other)
    with pytest.raises(AgentKVError, match="n_ctx 8192"):
        await check_alike([client("a", props("q.gguf", 4096)), client("b", props("q.gguf", 8192))])
    # An engine without /props is not compared.
    silent = httpx.MockTransport(lambda request: httpx.Response(404, json={"error": "no"}))
    await check_alike([client("a", props("q.gguf", 4096)), client("b", silent)])
