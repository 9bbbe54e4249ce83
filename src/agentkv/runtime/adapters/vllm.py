"""vLLM behind agentkv: its request ``priority``, its ``/tokenize``, and the cache hit in ``usage``.

What vLLM documents and agentkv uses (vLLM's OpenAI server:
``vllm/entrypoints/openai/chat_completion/protocol.py``, and its Tokenizer API,
``TokenizeChatRequest`` and ``TokenizeResponse``):

- ``priority`` in the chat body: "lower means earlier handling; default: 0", honoured when vLLM
  runs with ``--scheduling-policy priority``. agentkv's 0 (most urgent) … 3 (background) is sent
  as it is. Without that flag vLLM refuses any other value with HTTP 400 "Got priority N but
  Priority scheduling is not enabled."; the adapter then stops sending it (once, with a warning)
  and sends the request again.
- ``POST /tokenize`` with ``model``, ``messages``, ``tools`` and ``add_generation_prompt``: the
  prompt's tokens exactly as vLLM's chat template makes them (``{"tokens": [...], "count": N,
  "max_model_len": M}``).
- ``usage.prompt_tokens_details.cached_tokens`` on the last chunk, reported when vLLM runs with
  ``--enable-prompt-tokens-details``.
- ``continue_final_message`` with ``add_generation_prompt: false``, to continue a reply whose
  stream broke.

vLLM itself reads no session or agent field: placement across vLLM instances belongs to a
router in front of them, which agentkv does not address.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

from agentkv.exceptions import EngineResponseError
from agentkv.runtime.adapters.base import OpenAIEngineClient
from agentkv.runtime.hints import EngineHints

__all__ = ["VLLMClient"]

log = logging.getLogger("agentkv.client")

#: How vLLM refuses a priority when it was not started with ``--scheduling-policy priority``.
PRIORITY_REFUSED = "priority scheduling is not enabled"


class VLLMClient(OpenAIEngineClient):
    """vLLM's OpenAI-compatible server (``vllm serve``)."""

    kind: ClassVar[str] = "vllm"
    engine_name: ClassVar[str] = "vLLM"
    cache_report_flag: ClassVar[str | None] = "--enable-prompt-tokens-details"
    continues_final_message: ClassVar[bool] = True

    def __init__(self, base_url: str, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        #: False once vLLM refused a priority (not started with --scheduling-policy priority).
        self.sends_priority = True
        #: False once vLLM had no /tokenize: prompts are then estimated.
        self.tokenizes = True

    def hint_fields(self, hints: EngineHints) -> dict[str, Any]:
        return {"priority": hints.priority} if self.sends_priority else {}

    def refused_hint(self, error: EngineResponseError) -> bool:
        if (
            self.sends_priority
            and error.upstream_status == 400
            and PRIORITY_REFUSED in error.message.lower()
        ):
            self.sends_priority = False
            log.warning(
                "vLLM refuses request priorities (start it with --scheduling-policy priority); "
                "sending none"
            )
            return True
        return False

    async def _tokenize(self, body: dict[str, Any]) -> list[int] | None:
        """``POST /tokenize``; None when this vLLM has none (the caller estimates)."""
        if not self.tokenizes:
            return None
        try:
            async with self._templating:
                data = await self._transport.request_json(
                    "POST", "/tokenize", "tokenize", json_body=body
                )
        except EngineResponseError as exc:
            if exc.upstream_status not in (404, 405):
                raise
            self.tokenizes = False
            log.warning("vLLM has no /tokenize (%s); prompt sizes are estimated", exc.message)
            return None
        return [int(t) for t in self._expect(data, list, "/tokenize", "tokens")]

    async def prompt_tokens(self, body: Mapping[str, Any]) -> list[int]:
        """The prompt's tokens as vLLM's chat template and tokenizer make them."""
        request: dict[str, Any] = {
            "model": await self._model_name(),
            "messages": body.get("messages") or [],
            "add_generation_prompt": True,
        }
        if body.get("tools"):
            request["tools"] = body["tools"]
        tokens = await self._tokenize(request)
        return await super().prompt_tokens(body) if tokens is None else tokens

    async def tokenize(
        self, content: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        """vLLM's tokens of ``content`` (``parse_special`` is ignored: vLLM has no such option)."""
        request = {
            "model": await self._model_name(),
            "prompt": content,
            "add_special_tokens": add_special,
        }
        tokens = await self._tokenize(request)
        return await super().tokenize(content) if tokens is None else tokens
