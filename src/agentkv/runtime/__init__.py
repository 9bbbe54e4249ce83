"""The async runtime: everything between the pure core and a server.

It talks to llama-server (``client``), launches it (``engine``, ``model``), builds a runtime on
a ready engine (``assemble``), hands out slots to queued requests (``dispatcher``), runs compactions
(``compactor``) and drives one request's whole lifecycle. It uses anyio and httpx; the pure core
below it does neither.
"""

from agentkv.runtime.client import LlamaSlotClient
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.lifecycle import Exchange, Prepared, Runtime
from agentkv.runtime.record import RequestRecord, RequestStatus

__all__ = [
    "Exchange",
    "LlamaSlotClient",
    "Prepared",
    "RequestRecord",
    "RequestStatus",
    "Runtime",
    "RuntimeConfig",
]
