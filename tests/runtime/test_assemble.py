"""Engine assembly (agentkv.runtime.assemble): one home for what the CLI and the example build."""

from __future__ import annotations

import pytest

from agentkv.runtime.assemble import EngineSettings, assemble
from agentkv.runtime.config import GiB, RuntimeConfig
from agentkv_server import cli
from tests.fakes import FakeLlama
from tests.server.test_logs import fake_engine_over_http

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_the_runtime_takes_the_engines_real_shape_and_keeps_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The slot count comes from the engine's /slots (the fake has 4, the settings say 2, and a
    warning says so); the caller's other settings are kept; the client is closed on the way out."""
    with fake_engine_over_http(FakeLlama()) as url:
        settings = EngineSettings(upstream=url + "/", slots=2, store=False)
        async with assemble(settings, RuntimeConfig(max_queue=7)) as built:
            assert built.engine.base_url == url
            config = built.runtime.config
            assert (config.n_slots, config.max_queue, config.store_dir) == (4, 7, None)
            assert built.warnings == ()
            assert "llama-server has 4 slots, not 2; using 4" in caplog.text
            async with built.runtime as runtime:
                body = {
                    "model": "m",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hi"}],
                }
                message = await runtime.submit(
                    await runtime.prepare(body, agent="a", priority=1)
                ).message()
            assert message["content"][0]["text"] == "Hello from the fake engine."
        assert built.client._transport._http.is_closed


async def test_several_upstreams_are_assembled_as_one_pool() -> None:
    """Two upstreams: the runtime's client is an EnginePool over both, its slots all of theirs
    (4 each), and a request is served; both engines' clients are closed on the way out."""
    from agentkv.runtime.pool import EnginePool

    with (
        fake_engine_over_http(FakeLlama(reply="from a")) as url_a,
        fake_engine_over_http(FakeLlama(reply="from b")) as url_b,
    ):
        settings = EngineSettings(upstream=(url_a, url_b + "/"), slots=4, store=False)
        async with assemble(settings) as built:
            pool = built.client
            assert isinstance(pool, EnginePool)
            assert [m.base_url for m in pool.members] == [url_a, url_b]
            assert [m.base_url for m in built.engine.engines] == [url_a, url_b]
            assert built.runtime.config.n_slots == 8
            async with built.runtime as runtime:
                body = {
                    "model": "m",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hi"}],
                }
                message = await runtime.submit(
                    await runtime.prepare(body, agent="a", priority=1)
                ).message()
            assert message["content"][0]["text"] in ("from a", "from b")
        assert all(m.client._transport._http.is_closed for m in pool.members)


def test_the_engine_options_are_the_engine_settings() -> None:
    """agentkv-server's engine group is generated from EngineSettings: no flag, the defaults;
    each flag lands in its field."""
    parse = cli.build_parser().parse_args
    assert cli._from_args(EngineSettings, parse([])) == EngineSettings()
    flags = ["--upstream", "http://e", "--slots", "3", "--kv-budget", "2GiB", "--no-store"]
    got = cli._from_args(EngineSettings, parse(flags))
    assert got == EngineSettings(upstream="http://e", slots=3, kv_budget=2 * GiB, store=False)
    # Repeatable options: each --upstream (and --upstream-slot-dir) is one more value.
    flags = ["--upstream", "http://a", "--upstream", "http://b", "--engines", "1"]
    assert cli._from_args(EngineSettings, parse(flags)).upstream == ("http://a", "http://b")
    assert cli._from_args(EngineSettings, parse(["--engines", "3"])).engines == 3


def test_a_bad_size_is_refused_in_the_parsers_own_words(capsys: pytest.CaptureFixture[str]) -> None:
    """--kv-budget 8XB: a usage error that says what a size is, not argparse's generic words."""
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--kv-budget", "8XB"])
    assert "argument --kv-budget: not a size: '8XB'" in capsys.readouterr().err
