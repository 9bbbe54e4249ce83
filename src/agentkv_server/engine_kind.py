"""``agentkv-server --engine-kind``: which engine is behind ``--upstream``, and its client.

``llama`` (the default) is llama-server, whose slots agentkv pins, saves and restores. ``vllm``,
``sglang``, ``dynamo`` and ``openai`` (any other OpenAI-compatible server) are engines that
place requests themselves (:mod:`agentkv.runtime.adapters`): agentkv keeps its ingress, agent
identity and tree, queue, compaction and tool repair, and hands the engine its hints; ``--slots``
is then how many requests agentkv sends it at once, and there is no prefix store.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from agentkv.runtime.adapters import ADAPTERS, OpenAIEngineClient, adapter
from agentkv.runtime.adapters.base import context_tokens
from agentkv.runtime.client import LlamaSlotClient

__all__ = ["ENGINE_KINDS", "add_engine_kind", "check_engine_kind", "engine_shape", "open_client"]

log = logging.getLogger("agentkv.server")

LLAMA = "llama"
ENGINE_KINDS = (LLAMA, *sorted(ADAPTERS))


def add_engine_kind(group: argparse._ArgumentGroup) -> None:
    """The ``--engine-kind`` option."""
    group.add_argument(
        "--engine-kind",
        choices=ENGINE_KINDS,
        default=LLAMA,
        help="the engine at --upstream: llama-server (default), or an engine that places "
        "requests itself, reached through its OpenAI-compatible API (vllm, sglang, dynamo, or "
        "openai for any other; then --slots is how many requests agentkv sends it at once, "
        "--model names its model, and there is no prefix store; see docs/engines.md)",
    )


def check_engine_kind(args: argparse.Namespace) -> None:
    """Refuse what cannot work: an engine of another kind is never launched by agentkv."""
    if args.engine_kind != LLAMA and not args.upstream:
        raise SystemExit(
            f"agentkv-server: --engine-kind {args.engine_kind} needs --upstream URL "
            "(agentkv launches only llama-server)"
        )


def open_client(args: argparse.Namespace, base_url: str, **kwargs: Any) -> LlamaSlotClient:
    """The client for the engine: llama-server's, or the adapter for ``--engine-kind``."""
    if args.engine_kind == LLAMA:
        return LlamaSlotClient(base_url, **kwargs)
    model = str(args.model) if args.model is not None else None
    return adapter(args.engine_kind, base_url, model=model, **kwargs)


async def engine_shape(
    client: OpenAIEngineClient, slots: int, ctx_per_slot: int | None
) -> tuple[int, int | None]:
    """Requests sent at once (``--slots``) and the context a prompt is checked against:
    ``--ctx-per-slot``, else the model's length as ``/v1/models`` reports it."""
    card = await client.describe()
    ctx = context_tokens(card, ctx_per_slot)
    log.info(
        "%s serves %s (context %s); agentkv sends it up to %d requests at once",
        client.engine_name,
        card.model,
        ctx if ctx is not None else "unknown",
        slots,
    )
    return slots, ctx
