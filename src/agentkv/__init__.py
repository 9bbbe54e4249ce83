"""agentkv: share one local llama.cpp engine between several coding agents.

The pure components (``MessagesTranslator``, ``SSEAssembler``, ``PrefixFingerprinter``,
``SlotManager``, ``FairScheduler``) take values and return values or events; they never do I/O.
``LlamaSlotClient`` and the engine helpers do the I/O. Names are loaded on first use, so that
``from agentkv import SlotManager`` never imports httpx or anyio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentkv._types import Fingerprint, Lease, Match, MatchKind, SlotView, Ticket
    from agentkv.client import LlamaSlotClient
    from agentkv.exceptions import (
        AgentKVError,
        EngineError,
        EngineResponseError,
        EngineTimeoutError,
        EngineUnavailableError,
        InvalidRequestError,
        PromptTooLongError,
        QueueFullError,
        SSEProtocolError,
    )
    from agentkv.fingerprint import PrefixFingerprinter
    from agentkv.scheduler import FairScheduler
    from agentkv.slots import SlotManager
    from agentkv.sse import SSEAssembler
    from agentkv.translate import EngineRequest, MessagesTranslator

__version__ = "0.1.0"

_WHERE: dict[str, str] = {
    "AgentKVError": "agentkv.exceptions",
    "EngineError": "agentkv.exceptions",
    "EngineRequest": "agentkv.translate",
    "EngineResponseError": "agentkv.exceptions",
    "EngineTimeoutError": "agentkv.exceptions",
    "EngineUnavailableError": "agentkv.exceptions",
    "FairScheduler": "agentkv.scheduler",
    "Fingerprint": "agentkv._types",
    "InvalidRequestError": "agentkv.exceptions",
    "Lease": "agentkv._types",
    "LlamaSlotClient": "agentkv.client",
    "Match": "agentkv._types",
    "MatchKind": "agentkv._types",
    "MessagesTranslator": "agentkv.translate",
    "PrefixFingerprinter": "agentkv.fingerprint",
    "PromptTooLongError": "agentkv.exceptions",
    "QueueFullError": "agentkv.exceptions",
    "SSEAssembler": "agentkv.sse",
    "SSEProtocolError": "agentkv.exceptions",
    "SlotManager": "agentkv.slots",
    "SlotView": "agentkv._types",
    "Ticket": "agentkv._types",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    try:
        module = _WHERE[name]
    except KeyError:
        raise AttributeError(f"module 'agentkv' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
