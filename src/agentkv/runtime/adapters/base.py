"""The OpenAI-compatible path: an engine that places requests itself, behind the client's seam.

:class:`OpenAIEngineClient` is the runtime's :class:`~agentkv.runtime.seam.Engine` for an engine
such as vLLM, SGLang or NVIDIA Dynamo, reached through its ``/v1/chat/completions``. It is a
:class:`~agentkv.runtime.transport.LinkedEngine`, as llama-server's client is (connections,
retries, the error map, readiness, errors in the engine's name), and asks the engine what an
OpenAI-compatible engine answers:

- no slot: the ``slot`` argument is ignored (no ``id_slot``, no ``cache_prompt``); agentkv's
  "slots" are only how many requests it sends the engine at once, and the engine's own scheduler
  and prefix cache decide where each runs. The client has no slot files (:attr:`slot_files`), so
  the runtime has no prefix store, and so no parking, restores, checkpoints or suspensions;
- the request names the engine's model, asks for the usage on the last chunk
  (``stream_options.include_usage``) and leaves out llama-server's own fields;
- the engine's own hints (:class:`~agentkv.runtime.hints.EngineHints`) go where the engine
  documents them: each engine's subclass writes them (:meth:`hint_fields`, :meth:`hint_headers`);
- the reply's ``usage`` (``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``) is read
  back as the ``timings`` block the runtime reads from llama-server, so the request records and
  ``/metrics`` say what the engine computed and what its cache held.

The runtime still needs a prompt's size in tokens (the length check, ``max_tokens`` capping,
compaction, ``count_tokens``): an adapter whose engine tokenizes chat bodies asks it
(:mod:`agentkv.runtime.adapters.vllm`); the others estimate (:func:`estimated_tokens`), at the
characters per token the engine's own ``usage.prompt_tokens`` showed so far (:class:`Calibration`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import time
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any, ClassVar, Unpack
from urllib.parse import quote

import attrs
import httpx

from agentkv.exceptions import EngineError, EngineResponseError
from agentkv.prompts import PromptStats
from agentkv.runtime.chunks import ChunkStream
from agentkv.runtime.error_map import parse_json
from agentkv.runtime.hints import EngineHints
from agentkv.runtime.transport import CHAT_PATH, LinkedEngine, LinkOptions, in_name_of

__all__ = [
    "CHARS_PER_TOKEN",
    "Calibration",
    "EngineCard",
    "OpenAIEngineClient",
    "Usage",
    "adapter_shape",
    "estimated_tokens",
    "header_value",
]

log = logging.getLogger("agentkv.client")

#: Fields of agentkv's engine body that only llama-server takes (slot pinning, prompt progress).
LLAMA_ONLY_FIELDS = frozenset(
    {"id_slot", "cache_prompt", "return_progress", "timings_per_token", "n_predict"}
)

#: The estimate's characters per token: byte-pair tokenizers of code and English text average
#: 3.5–4.5 characters a token.
CHARS_PER_TOKEN = 4


@attrs.frozen
class EngineCard:
    """What ``GET /v1/models`` says of the model agentkv uses."""

    model: str
    #: The model's context length, where the engine reports it (vLLM and SGLang do).
    max_model_len: int | None = None


@attrs.frozen
class Usage:
    """A reply's token counts, as the engine reported them."""

    prompt_tokens: int
    completion_tokens: int
    #: Prompt tokens the engine's prefix cache held; None when the engine does not say.
    cached_tokens: int | None = None

    def timings(self, decode_seconds: float | None) -> dict[str, Any]:
        """The counts as llama-server's ``timings`` block, which the runtime reads: computed
        (``prompt_n``), cached (``cache_n``) and generated (``predicted_n``) tokens; the decode
        time when it was measured here. No prefill time: the time to the first token includes
        the engine's own queue."""
        cached = min(self.cached_tokens or 0, self.prompt_tokens)
        timings: dict[str, Any] = {
            "prompt_n": self.prompt_tokens - cached,
            "cache_n": cached,
            "predicted_n": self.completion_tokens,
        }
        if decode_seconds is not None and decode_seconds > 0:
            timings["predicted_ms"] = decode_seconds * 1000.0
        return timings


def header_value(text: str) -> str:
    """``text`` as an HTTP header value: as it is when it is printable ASCII, else
    percent-encoded (agent ids may hold any printable character; a header holds ASCII)."""
    if text.isascii() and text.isprintable():
        return text
    return quote(text, safe=" !#$&'()*+,-./:;<=>?@[]^_`{|}~")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(
            str(part.get("text") or "") if isinstance(part, Mapping) else "" for part in content
        )
    return ""


def _estimate_text(body: Mapping[str, Any]) -> str:
    """The text a chat template would make of ``body``, roughly: the tools, then each message's
    role, text and tool calls, in prompt order (so that prompts sharing a head share a prefix)."""
    parts = []
    tools = body.get("tools")
    if tools:
        parts.append(json.dumps(tools, ensure_ascii=False, sort_keys=True))
    for message in body.get("messages") or ():
        if not isinstance(message, Mapping):
            continue
        parts.append(f"<{message.get('role')}>")
        parts.append(_content_text(message.get("content")))
        parts.append(_content_text(message.get("reasoning_content")))
        calls = message.get("tool_calls")
        if calls:
            parts.append(json.dumps(calls, ensure_ascii=False, sort_keys=True))
    return "\n".join(parts)


def estimated_tokens(
    body: Mapping[str, Any], *, chars_per_token: float = CHARS_PER_TOKEN
) -> list[int]:
    """A stand-in for the prompt tokens of a chat ``body`` for an engine that does not tokenize
    chat bodies: one value per ``chars_per_token`` characters of its text, each a digest of
    those characters, so that the count is about right and two prompts that begin alike begin
    with the same values."""
    text = _estimate_text(body)
    step = max(1.0, chars_per_token)
    cuts = [round(k * step) for k in range(math.ceil(len(text) / step) + 1)]
    return [zlib.crc32(text[a:b].encode()) for a, b in itertools.pairwise(cuts)]


@attrs.define
class Calibration:
    """How many tokens the engine counts for the text of a prompt, learnt from the
    ``usage.prompt_tokens`` of its replies (recent ones weigh more)."""

    #: Reported prompt tokens and the text's characters, decayed sums.
    tokens: float = 0.0
    chars: float = 0.0
    keep: float = 0.9

    def observe(self, chars: int, tokens: int) -> None:
        if chars > 0 and tokens > 0:
            self.tokens = self.tokens * self.keep + tokens
            self.chars = self.chars * self.keep + chars

    @property
    def chars_per_token(self) -> float:
        """Characters of prompt text per engine token: :data:`CHARS_PER_TOKEN` until a reply
        says otherwise (bounded to 1–16)."""
        if self.tokens <= 0:
            return float(CHARS_PER_TOKEN)
        return min(max(self.chars / self.tokens, 1.0), 16.0)


class OpenAIEngineClient(LinkedEngine):
    """Any OpenAI-compatible engine that places requests itself; no hints.

    ``model`` is the model name the engine serves (None: the first of its ``/v1/models``). The
    other arguments are :class:`~agentkv.runtime.transport.LinkedEngine`'s (``templating_limit``
    bounds the tokenizing calls, where the engine has them).
    """

    #: The ``--engine-kind`` of ``agentkv-server``.
    kind: ClassVar[str] = "openai"
    engine_name: ClassVar[str] = "the OpenAI-compatible engine"
    slot_files: ClassVar[bool] = False
    #: The engine's launch flag without which it reports no cached tokens (for the log line).
    cache_report_flag: ClassVar[str | None] = None
    #: The engine continues a last assistant message when asked to (``continue_final_message``),
    #: as llama-server does by itself; used to continue a reply whose stream broke.
    continues_final_message: ClassVar[bool] = False

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        templating_limit: int = 4,
        **link: Unpack[LinkOptions],
    ) -> None:
        super().__init__(base_url, templating_limit=templating_limit, **link)
        self.model = model
        self.card: EngineCard | None = None
        #: What the engine's usage says about the estimate's characters per token.
        self.calibration = Calibration()
        self._told_no_cache = False

    # -- what each engine adds ------------------------------------------------------------------

    def hint_fields(self, hints: EngineHints) -> dict[str, Any]:
        """Body fields carrying ``hints`` in the engine's own terms (none here)."""
        return {}

    def hint_headers(self, hints: EngineHints) -> dict[str, str]:
        """Request headers carrying ``hints`` in the engine's own terms (none here)."""
        return {}

    def refused_hint(self, error: EngineResponseError) -> bool:
        """Whether ``error`` is the engine refusing a hint it was not started to take; the
        adapter then stops sending it and the request is sent once more (an error status means
        the engine computed nothing)."""
        return False

    def read_usage(self, chunk: Mapping[str, Any]) -> Usage | None:
        """The token counts of a reply or its last chunk, if it carries them: OpenAI's
        ``usage.prompt_tokens``, ``usage.completion_tokens`` and
        ``usage.prompt_tokens_details.cached_tokens``."""
        usage = chunk.get("usage")
        if not isinstance(usage, Mapping):
            return None
        try:
            prompt = int(usage.get("prompt_tokens") or 0)
            completion = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
            cached = None if cached is None else int(cached)
        except (TypeError, ValueError):
            return None
        if cached is None and not self._told_no_cache:
            self._told_no_cache = True
            flag = f" (start it with {self.cache_report_flag})" if self.cache_report_flag else ""
            log.info(
                "%s reports no cached prompt tokens%s: every prompt token counts as computed",
                self.engine_name,
                flag,
            )
        return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)

    # -- the engine's model -------------------------------------------------------------------

    async def describe(self) -> EngineCard:
        """The model agentkv uses and its context length, from ``GET /v1/models`` (asked once)."""
        if self.card is not None:
            return self.card
        data = await self._transport.request_json("GET", "/v1/models", "models")
        models = data.get("data") if isinstance(data, Mapping) else None
        cards = [m for m in models or () if isinstance(m, Mapping) and isinstance(m.get("id"), str)]
        if self.model is not None:
            chosen = next((m for m in cards if m["id"] == self.model), {"id": self.model})
        elif cards:
            chosen = cards[0]
        else:
            raise EngineResponseError(
                f"{self.engine_name} serves no model (/v1/models: {data!r:.200})"
            )
        length = chosen.get("max_model_len")
        self.card = EngineCard(
            model=str(chosen["id"]),
            max_model_len=length if isinstance(length, int) and length > 0 else None,
        )
        self.model = self.card.model
        return self.card

    async def _model_name(self) -> str:
        return self.model if self.model is not None else (await self.describe()).model

    # -- chat ---------------------------------------------------------------------------------

    def request_body(
        self, body: Mapping[str, Any], hints: EngineHints | None, model: str, *, stream: bool
    ) -> dict[str, Any]:
        """The engine's chat body for agentkv's ``body``."""
        payload = {k: v for k, v in body.items() if k not in LLAMA_ONLY_FIELDS}
        payload["model"] = model
        payload["stream"] = stream
        if stream:
            payload["stream_options"] = {
                **(body.get("stream_options") or {}),
                "include_usage": True,
            }
        else:
            payload.pop("stream_options", None)
        response_format = payload.get("response_format")
        if isinstance(response_format, Mapping) and isinstance(
            response_format.get("json_schema"), Mapping
        ):
            # OpenAI's schema (and vLLM's and SGLang's) requires the schema's name.
            schema = {"name": "reply", **response_format["json_schema"]}
            payload["response_format"] = {**response_format, "json_schema": schema}
        messages = payload.get("messages")
        if self.continues_final_message and messages and messages[-1].get("role") == "assistant":
            # A reply that continues (its stream broke): extend the last message, as
            # llama-server does by itself, instead of starting a new turn.
            payload["continue_final_message"] = True
            payload["add_generation_prompt"] = False
        if hints is not None:
            payload.update(self.hint_fields(hints))
        return payload

    async def _open(
        self, body: Mapping[str, Any], hints: EngineHints | None, *, stream: bool
    ) -> httpx.Response:
        """Send a chat completion; a hint the engine refuses is dropped and it is sent again."""
        model = await self._model_name()
        for attempt in (1, 2):
            payload = self.request_body(body, hints, model, stream=stream)
            headers = self.hint_headers(hints) if hints is not None else None
            try:
                return await self._transport.send(
                    "POST",
                    CHAT_PATH,
                    "chat completion",
                    payload,
                    stream=stream,
                    headers=headers,
                )
            except EngineResponseError as exc:
                if attempt == 2 or not self.refused_hint(exc):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def chat(
        self, body: Mapping[str, Any], *, slot: int | None, hints: EngineHints | None = None
    ) -> dict[str, Any]:
        """A non-streamed chat completion (``slot`` is ignored: the engine places it); the JSON
        reply, with its ``usage`` also as ``timings``."""
        response = await self._open(body, hints, stream=False)
        data = self._expect(parse_json(response.text, "chat completion"), dict, "chat completion")
        usage = self.read_usage(data)
        if usage is not None:
            data["timings"] = usage.timings(None)
            self.calibration.observe(len(_estimate_text(body)), usage.prompt_tokens)
        return data

    @contextlib.asynccontextmanager
    async def stream(
        self, body: Mapping[str, Any], *, slot: int | None, hints: EngineHints | None = None
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """A streamed chat completion (``slot`` is ignored); the chunks, the last one's ``usage``
        also as ``timings``. Leaving the block closes the response, which stops the engine
        generating."""
        response = await self._open(body, hints, stream=True)
        async with (
            self._transport.streaming(response, "chat completion") as chunks,
            contextlib.aclosing(self._with_usage(chunks, len(_estimate_text(body)))) as usage,
        ):
            yield usage

    async def _with_usage(
        self, chunks: ChunkStream, chars: int
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The chunks of one streamed completion, with the last chunk's ``usage`` turned into the
        ``timings`` block the runtime reads (see :meth:`Usage.timings`); an error names this
        engine where the stream's says llama-server."""
        first: float | None = None
        try:
            async for chunk in chunks:
                now = time.monotonic()
                if first is None and chunk.get("choices"):
                    first = now
                usage = self.read_usage(chunk)
                if usage is not None:
                    # The usage is the engine's documented report; a ``timings`` block of its own
                    # (llama-server sends one too) is not part of the contract and is replaced.
                    decode = None if first is None else now - first
                    chunk = {**chunk, "timings": usage.timings(decode)}
                    self.calibration.observe(chars, usage.prompt_tokens)
                yield chunk
        except EngineError as exc:
            raise in_name_of(exc, self.engine_name) from exc.__cause__

    # -- prompt accounting --------------------------------------------------------------------

    async def prompt_tokens(self, body: Mapping[str, Any]) -> list[int]:
        """The prompt's tokens as far as agentkv can know them: :func:`estimated_tokens`, at the
        characters per token the engine's replies showed (:attr:`calibration`)."""
        return estimated_tokens(body, chars_per_token=self.calibration.chars_per_token)

    def prompt_answers(self) -> PromptStats:
        """None kept or asked: prompt sizes come from the engine's ``/tokenize`` or an
        estimate."""
        return PromptStats()

    async def tokenize(
        self, content: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        """An estimate of ``content``'s tokens (see :func:`estimated_tokens`)."""
        return estimated_tokens(
            {"messages": [{"role": "", "content": content}]},
            chars_per_token=self.calibration.chars_per_token,
        )

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        raise self._unsupported("templating a prompt")

    async def detokenize(self, tokens: list[int] | tuple[int, ...]) -> str:
        raise self._unsupported("detokenizing")

    async def accepts_images(self) -> bool:
        """Assumed: the engine refuses images itself when its model cannot see them."""
        return True

    # -- no slots -----------------------------------------------------------------------------

    def _unsupported(self, what: str) -> EngineError:
        return EngineResponseError(
            f"{self.engine_name} places requests itself: agentkv has no slot to pin, save or "
            f"restore there ({what})"
        )

    async def slots(self) -> list[dict[str, Any]]:
        raise self._unsupported("/slots")

    async def save_slot(self, slot: int, filename: str) -> dict[str, Any]:
        raise self._unsupported("slot save")

    async def restore_slot(self, slot: int, filename: str) -> dict[str, Any]:
        raise self._unsupported("slot restore")

    async def erase_slot(self, slot: int) -> dict[str, Any]:
        raise self._unsupported("slot erase")

    @contextlib.asynccontextmanager
    async def prefill(
        self, tokens: list[int] | tuple[int, ...], *, slot: int
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        raise self._unsupported("prefill into a slot")
        yield  # pragma: no cover - an async context manager needs a yield

    @contextlib.asynccontextmanager
    async def complete(
        self, payload: Mapping[str, Any], *, slot: int
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        raise self._unsupported("raw completion on a slot")
        yield  # pragma: no cover - an async context manager needs a yield


async def adapter_shape(
    client: OpenAIEngineClient, slots: int, ctx_per_slot: int | None
) -> tuple[int, int | None]:
    """Requests sent at once (``slots``, as given) and the context a prompt is checked against:
    ``ctx_per_slot``, else the model's length as ``/v1/models`` reports it."""
    card = await client.describe()
    ctx = ctx_per_slot if ctx_per_slot is not None else card.max_model_len
    log.info(
        "%s serves %s (context %s); agentkv sends it up to %d requests at once",
        client.engine_name,
        card.model,
        ctx if ctx is not None else "unknown",
        slots,
    )
    return slots, ctx
