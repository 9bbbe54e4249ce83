"""SGLang behind agentkv: its request ``priority``, its router's routing key, the cache hit.

What SGLang documents and agentkv uses:

- ``priority`` in the chat body (``python/sglang/srt/entrypoints/openai/protocol.py``,
  ``ChatCompletionRequest.priority``), honoured when SGLang runs with
  ``--enable-priority-scheduling``; "requests with higher priority integer values will be
  scheduled first by default" (``server_args.py``). agentkv's 0 (most urgent) … 3 (background)
  is sent as 3 … 0. Do not also pass ``--schedule-low-priority-values-first``: it turns that
  order round. Without ``--enable-priority-scheduling`` SGLang ignores the field.
- the ``X-SMG-Routing-Key`` header, one value per agent: the SGLang model gateway
  (``sglang-router``) keeps requests with one key on one worker under its
  ``consistent_hashing`` and ``manual`` policies, and the engine reads it as the request's
  ``routing_key`` (``srt/entrypoints/openai/serving_base.py``). Its default ``cache_aware``
  policy needs no hint: it matches the prompt text against each worker's radix tree.
- ``usage.prompt_tokens_details.cached_tokens``, reported when SGLang runs with
  ``--enable-cache-report``.
- ``continue_final_message``, to continue a reply whose stream broke.

SGLang's OpenAI server tokenizes no chat body, so prompt sizes are estimated
(:func:`~agentkv.runtime.adapters.base.estimated_tokens`). SGLang takes no parent/child relation.
"""

from __future__ import annotations

from typing import Any, ClassVar

from agentkv.runtime.adapters.base import OpenAIEngineClient, header_value
from agentkv.runtime.hints import EngineHints

__all__ = ["ROUTING_KEY_HEADER", "SGLangClient"]

#: The SGLang model gateway's session-affinity header.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


class SGLangClient(OpenAIEngineClient):
    """SGLang's OpenAI-compatible server (``python -m sglang.launch_server``), directly or
    behind its model gateway."""

    kind: ClassVar[str] = "sglang"
    engine_name: ClassVar[str] = "SGLang"
    cache_report_flag: ClassVar[str | None] = "--enable-cache-report"
    continues_final_message: ClassVar[bool] = True

    def hint_fields(self, hints: EngineHints) -> dict[str, Any]:
        return {"priority": hints.urgency}

    def hint_headers(self, hints: EngineHints) -> dict[str, str]:
        return {ROUTING_KEY_HEADER: header_value(hints.agent)}
