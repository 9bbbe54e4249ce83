"""Engines that place requests themselves, reached through their OpenAI-compatible HTTP APIs.

One adapter per engine behind the engine seam (:class:`~agentkv.runtime.seam.Engine`), as
:class:`~agentkv.runtime.client.LlamaSlotClient` is: :class:`OpenAIEngineClient` is the shared
OpenAI-compatible path (and any such engine, without hints); :class:`VLLMClient`,
:class:`SGLangClient` and :class:`DynamoClient` add their engine's hints and what it reports.
See docs/engines.md.
"""

from __future__ import annotations

from typing import Any

from agentkv.runtime.adapters.base import OpenAIEngineClient, adapter_shape, estimated_tokens
from agentkv.runtime.adapters.dynamo import DynamoClient
from agentkv.runtime.adapters.sglang import SGLangClient
from agentkv.runtime.adapters.vllm import VLLMClient

__all__ = [
    "ADAPTERS",
    "ENGINE_KINDS",
    "LLAMA",
    "DynamoClient",
    "OpenAIEngineClient",
    "SGLangClient",
    "VLLMClient",
    "adapter",
    "adapter_shape",
    "engine_name",
    "estimated_tokens",
]

#: Each ``--engine-kind`` but llama-server's, and its adapter.
ADAPTERS: dict[str, type[OpenAIEngineClient]] = {
    cls.kind: cls for cls in (VLLMClient, SGLangClient, DynamoClient, OpenAIEngineClient)
}

#: The ``--engine-kind`` of llama-server, whose slots agentkv pins, saves and restores.
LLAMA = "llama"
#: Every ``--engine-kind``: llama-server's, then the adapters'.
ENGINE_KINDS = (LLAMA, *sorted(ADAPTERS))


def engine_name(kind: str) -> str:
    """The engine of ``kind``, in words (before its client exists: the waiting line)."""
    return "llama-server" if kind == LLAMA else ADAPTERS[kind].engine_name


def adapter(kind: str, base_url: str, **kwargs: Any) -> OpenAIEngineClient:
    """The client for an engine of ``kind`` (a key of :data:`ADAPTERS`) at ``base_url``."""
    try:
        cls = ADAPTERS[kind]
    except KeyError:
        raise ValueError(
            f"no adapter for engine kind {kind!r} (known: {sorted(ADAPTERS)})"
        ) from None
    return cls(base_url, **kwargs)
