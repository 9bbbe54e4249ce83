"""agentkv: share one local llama.cpp engine between several coding agents.

The pure components (``MessagesTranslator``, ``SSEAssembler``, ``PrefixFingerprinter``,
``SlotManager``, ``FairScheduler``) take values and return values or events; they never do I/O.
``LlamaSlotClient`` does the I/O and is loaded on first use, so that importing the pure parts never
imports httpx, tenacity or anyio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentkv._types import (
    ANY_TOOL,
    AnyTool,
    Fingerprint,
    ForcedTool,
    Lease,
    SlotView,
    Ticket,
)
from agentkv.exceptions import (
    AgentKVError,
    EngineError,
    EngineResponseError,
    EngineRestartingError,
    EngineStreamBrokenError,
    EngineTimeoutError,
    EngineUnavailableError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    SSEProtocolError,
)
from agentkv.fingerprint import PrefixFingerprinter
from agentkv.guard import Repetition, RepetitionGuard
from agentkv.reply import ReplyEvent
from agentkv.scheduler import FairScheduler
from agentkv.slots import SlotManager, SlotStats
from agentkv.sse import ReplyComplete, RetryWithTools, SSEAssembler, StopRequest, Verdict
from agentkv.translate import EngineRequest, MessagesTranslator

if TYPE_CHECKING:
    from agentkv.runtime.client import LlamaSlotClient

__version__ = "0.1.0"

__all__ = [
    "ANY_TOOL",
    "AgentKVError",
    "AnyTool",
    "EngineError",
    "EngineRequest",
    "EngineResponseError",
    "EngineRestartingError",
    "EngineStreamBrokenError",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "FairScheduler",
    "Fingerprint",
    "ForcedTool",
    "InvalidRequestError",
    "Lease",
    "LlamaSlotClient",
    "MessagesTranslator",
    "PrefixFingerprinter",
    "PromptTooLongError",
    "QueueFullError",
    "Repetition",
    "RepetitionGuard",
    "ReplyComplete",
    "ReplyEvent",
    "RetryWithTools",
    "SSEAssembler",
    "SSEProtocolError",
    "SlotManager",
    "SlotStats",
    "SlotView",
    "StopRequest",
    "Ticket",
    "Verdict",
]


def __getattr__(name: str) -> Any:
    # The I/O client is imported lazily: the pure core must stay importable without httpx.
    if name == "LlamaSlotClient":
        from agentkv.runtime.client import LlamaSlotClient

        return LlamaSlotClient
    raise AttributeError(f"module 'agentkv' has no attribute {name!r}")
