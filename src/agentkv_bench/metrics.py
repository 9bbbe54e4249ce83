"""What llama-server itself counts, and the yardstick it is compared against.

Prefill is read from llama-server's own Prometheus counters (``GET /metrics``; it needs
``--metrics``), parsed with ``prometheus_client``, so no configuration reports on itself:

- ``llamacpp:prompt_tokens_total`` sums the prompt tokens it computed (``timings.prompt_n``);
- ``llamacpp:prompt_tokens_cached_total`` sums the ones it reused (``cache_n``).

The minimum is the prefill no cache can avoid, from the prompts as the engine tokenizes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import httpx
from prometheus_client.parser import text_string_to_metric_families

from agentkv import LlamaSlotClient, MessagesTranslator
from agentkv_bench.workload import Workload, minimum_prefill

if TYPE_CHECKING:
    from agentkv_bench.engines import Engine

__all__ = [
    "COUNTERS",
    "Counters",
    "PrefillYardstick",
    "counting",
    "parse_counters",
    "read_counters",
]

#: The report's name for each llama-server counter (sample names as llama-server writes them).
COUNTERS = {
    "prompt_computed": "llamacpp:prompt_tokens_total",
    "prompt_cached": "llamacpp:prompt_tokens_cached_total",
    "predicted": "llamacpp:tokens_predicted_total",
    "prompt_seconds": "llamacpp:prompt_seconds_total",
}

Counters = dict[str, float]


def parse_counters(text: str, names: Mapping[str, str] = COUNTERS) -> Counters:
    """The counters named in ``names`` (report name → sample name) from Prometheus text; a
    counter llama-server did not report is 0."""
    samples = {
        sample.name: float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return {key: samples.get(name, 0.0) for key, name in names.items()}


async def read_counters(
    http: httpx.AsyncClient, engine_url: str, api_key: str | None = None
) -> Counters:
    """llama-server's counters now (``api_key``: its key, when it has one)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    response = await http.get(engine_url + "/metrics", headers=headers, timeout=30)
    response.raise_for_status()
    return parse_counters(response.text)


def difference(after: Counters, before: Counters) -> Counters:
    return {key: after[key] - before.get(key, 0.0) for key in after}


@contextlib.asynccontextmanager
async def counting(engine: Engine) -> AsyncIterator[Counters]:
    """``engine``'s llama-server counters over the block: what it yields holds their difference
    once the block ends."""
    counters: Counters = {}
    url, key = engine.engine_url, engine.engine_key
    async with httpx.AsyncClient() as http:
        before = await read_counters(http, url, key)
        yield counters
        counters.update(difference(await read_counters(http, url, key), before))


@attrs.frozen
class PrefillYardstick:
    """The prompts' token counts: ``minimum`` (every shared prefix counted once) and ``naive``
    (every prompt computed whole)."""

    minimum: int
    naive: int
    requests: int

    @classmethod
    def of(cls, sequences: Sequence[Sequence[int]]) -> PrefillYardstick:
        return cls(
            minimum=minimum_prefill(sequences),
            naive=sum(len(s) for s in sequences),
            requests=len(sequences),
        )


async def token_sequences(
    engine: Engine, bodies: Iterable[Mapping[str, Any]], *, session_layout: bool = True
) -> list[list[int]]:
    """Token ids of each request's prompt, as ``engine``'s llama-server templates and tokenizes
    it after agentkv's translation. ``session_layout=False`` renders the messages in the order
    the client sent them, as llama-server's own ``/v1/messages`` does."""
    translator = MessagesTranslator(session_layout=session_layout)
    async with LlamaSlotClient(engine.engine_url, api_key=engine.engine_key) as client:
        return [await client.prompt_tokens(translator.translate(body).body) for body in bodies]


async def yardsticks(engine: Engine, workloads: Sequence[Workload]) -> dict[str, PrefillYardstick]:
    """The yardstick of ``workloads`` (all their requests), in both layouts: ``"client"`` (as
    sent; llama-server's own route) and ``"agentkv"`` (agentkv's session layout)."""
    bodies = [body for w in workloads for _, _, body in w.canonical_order()]
    return {
        layout: PrefillYardstick.of(
            await token_sequences(engine, bodies, session_layout=layout == "agentkv")
        )
        for layout in ("client", "agentkv")
    }
