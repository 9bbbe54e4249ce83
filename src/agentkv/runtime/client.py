"""LlamaSlotClient: llama-server as the runtime's :class:`~agentkv.runtime.seam.Engine`.

A :class:`~agentkv.runtime.transport.LinkedEngine`, as the OpenAI-compatible engines' clients are:
its link (connections, the safe retries, the error map, readiness) is the
:class:`~agentkv.runtime.transport.EngineTransport` it holds. It adds what is llama-server's own:
slots, prompt templating and tokenizing (with :class:`PromptMemo`), slot files and raw
completions.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Unpack

import anyio

from agentkv.exceptions import EngineResponseError, EngineStreamBrokenError
from agentkv.prompts import PromptMemo, PromptStats, marker_candidates, template_key
from agentkv.runtime.error_map import map_httpx_error
from agentkv.runtime.health import wait_until_ready
from agentkv.runtime.transport import CHAT_PATH, LinkedEngine, LinkOptions

if TYPE_CHECKING:
    from agentkv.runtime.hints import EngineHints

__all__ = ["CHAT_PATH", "LlamaSlotClient", "map_httpx_error", "wait_until_ready"]

log = logging.getLogger("agentkv.client")

#: How many prompts tokenized in pieces are checked against the engine's whole tokenizing.
SPLIT_CHECKS = 3
#: At most this many strings are asked about at once, and this many remembered in all.
_LEARN_AT_ONCE = 16
_MARKERS_MAX = 512


class LlamaSlotClient(LinkedEngine):
    """Async client for llama-server that pins chat requests to a slot; its arguments are
    :class:`~agentkv.runtime.transport.LinkedEngine`'s (``templating_limit`` bounds its
    ``/apply-template``, ``/tokenize`` and ``/detokenize`` calls)."""

    #: The engine has slots agentkv pins requests to, and saves and restores their KV cache as
    #: files (the prefix store). An engine that places requests itself
    #: (:mod:`agentkv.runtime.adapters`) has neither.
    slot_files: ClassVar[bool] = True
    engine_name: ClassVar[str] = "llama-server"

    def __init__(
        self, base_url: str, *, templating_limit: int = 4, **link: Unpack[LinkOptions]
    ) -> None:
        super().__init__(base_url, templating_limit=templating_limit, **link)
        self._vision: bool | None = None
        #: The engine's templating and tokenizing answers, for the same question asked again.
        self.memo = PromptMemo()
        #: Where the prompt answers came from: kept, in pieces, or asked of the engine.
        self.prompt_stats = PromptStats()
        #: Special tokens the engine confirmed (text → id), and strings it did not.
        self._markers: dict[str, int] = {}
        self._not_markers: set[str] = set()
        #: Prompts tokenized in pieces and found right so far; None: pieces gave a wrong answer.
        self._split_checks: int | None = 0

    # -- chat ---------------------------------------------------------------------------------

    @staticmethod
    def _chat_body(body: Mapping[str, Any], slot: int | None, *, stream: bool) -> dict[str, Any]:
        # id_slot pins the request to the slot whose KV cache holds its prefix; cache_prompt lets
        # llama-server reuse that cache instead of recomputing the whole prompt.
        return {
            **body,
            "stream": stream,
            "id_slot": -1 if slot is None else slot,
            "cache_prompt": True,
        }

    async def chat(
        self, body: Mapping[str, Any], *, slot: int | None, hints: EngineHints | None = None
    ) -> dict[str, Any]:
        """Non-streaming chat completion on ``slot`` (None: any idle slot); the JSON reply with
        ``timings``. ``hints`` are for engines that place requests themselves; llama-server is
        placed by agentkv and needs none."""
        payload = self._chat_body(body, slot, stream=False)
        data = await self._transport.request_json(
            "POST", CHAT_PATH, "chat completion", json_body=payload, safe=False
        )
        return self._expect(data, dict, "chat completion")

    @contextlib.asynccontextmanager
    async def stream(
        self, body: Mapping[str, Any], *, slot: int | None, hints: EngineHints | None = None
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Streaming chat completion on ``slot``; yields an iterator of parsed chunk dicts
        (``hints``: as for :meth:`chat`).

        Leaving the ``async with`` block (also by cancellation) closes the upstream response, which
        makes llama-server stop generating and free the slot.
        """
        payload = self._chat_body(body, slot, stream=True)
        response = await self._transport.send(
            "POST", CHAT_PATH, "chat completion", payload, stream=True
        )
        async with self._transport.streaming(response, "chat completion") as chunks:
            yield chunks

    # -- prompt accounting --------------------------------------------------------------------

    async def tokenize(
        self, content: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        """Token ids of ``content``; special-token text (``<|im_start|>``) is parsed as such
        unless ``parse_special`` is False."""
        payload = {"content": content, "add_special": add_special, "parse_special": parse_special}
        async with self._templating:
            data = await self._transport.request_json(
                "POST", "/tokenize", "tokenize", json_body=payload
            )
        tokens = self._expect(data, list, "tokenize", "tokens")
        # With with_pieces the entries are objects; we never ask for that, so ints are expected.
        return [int(t["id"]) if isinstance(t, Mapping) else int(t) for t in tokens]

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        """The prompt text llama-server's chat template makes of a chat ``body``."""
        async with self._templating:
            data = await self._transport.request_json(
                "POST", "/apply-template", "apply-template", json_body=dict(body)
            )
        return self._expect(data, str, "apply-template", "prompt")

    async def prompt_tokens(self, body: Mapping[str, Any]) -> list[int]:
        """The prompt tokens of a chat ``body``, exactly as llama-server computes them; an answer
        the engine gave before comes from :attr:`memo` (:mod:`agentkv.prompts`)."""
        memo, stats = self.memo, self.prompt_stats
        key = template_key(body, time.strftime("%Y-%m-%d"))  # strftime_now: the local day
        prompt = memo.template(key)
        if prompt is None:
            prompt = await self.apply_template(body)
            memo.keep_template(key, prompt)
            stats.templates_asked += 1
        else:
            stats.templates_kept += 1
        tokens = memo.tokens(prompt)
        if tokens is None:
            tokens = await self._tokenize_prompt(prompt)
            memo.keep_tokens(prompt, tokens)
        else:
            stats.tokens_kept += 1
        return tokens

    def prompt_answers(self) -> PromptStats:
        """Where the prompt answers came from (:attr:`prompt_stats`)."""
        return self.prompt_stats

    async def _tokenize_prompt(self, prompt: str) -> list[int]:
        """A templated prompt's tokens; when it begins like a prompt tokenized before, only its
        rest from a special token on is sent (:meth:`PromptMemo.split`)."""
        # llama-server tokenizes the templated chat prompt with add_special=True and
        # parse_special=True; the chat template already wrote any BOS the model wants.
        found = self.memo.nearest(prompt) if self._split_checks is not None else None
        split = None
        if found is not None:
            base, shared = found
            await self._learn_markers(self.memo.window(base, shared))
            split = self.memo.split(prompt, base, shared, self._markers)
        if split is None:
            self.prompt_stats.tokens_whole += 1
            return await self.tokenize(prompt, add_special=True)
        tokens = split.head + await self.tokenize(split.text)
        if self._split_checks is not None and self._split_checks < SPLIT_CHECKS:
            # The first answers made this way are checked against the engine's whole answer.
            whole = await self.tokenize(prompt, add_special=True)
            if whole != tokens:
                log.warning(
                    "%s tokenizes a prompt differently from its pieces; prompts are tokenized "
                    "whole from now on",
                    self.engine_name,
                )
                self._split_checks = None
                self.prompt_stats.tokens_whole += 1
                return whole
            self._split_checks += 1
        self.prompt_stats.tokens_pieces += 1
        return tokens

    async def _learn_markers(self, text: str) -> None:
        """Ask the engine which of the strings in ``text`` that look like special tokens are: one
        token when parsed as special, other tokens when not."""
        known = self._markers.keys() | self._not_markers
        for candidate in sorted(marker_candidates(text) - known)[:_LEARN_AT_ONCE]:
            if len(self._markers) + len(self._not_markers) >= _MARKERS_MAX:
                return
            ids = await self.tokenize(candidate)
            if len(ids) == 1 and await self.tokenize(candidate, parse_special=False) != ids:
                self._markers[candidate] = ids[0]
            else:
                self._not_markers.add(candidate)

    @contextlib.asynccontextmanager
    async def prefill(
        self, tokens: list[int] | tuple[int, ...], *, slot: int
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Compute ``tokens`` into ``slot``'s cache and generate nothing worth keeping.

        A streamed ``/completion`` of the raw token ids with one predicted token (llama-server
        always samples at least one) and prompt progress on: the chunks report
        ``prompt_progress`` while it computes, and the last one its ``timings``. The slot then
        holds ``tokens``, ready to be saved or extended by the real request. Leaving the block
        early cancels the computation; the slot keeps what was computed so far.
        """
        payload = {
            "prompt": list(tokens),
            "n_predict": 1,
            "id_slot": slot,
            "cache_prompt": True,
            "stream": True,
            "return_progress": True,
            "temperature": 0.0,
        }

        async def chunks() -> AsyncGenerator[dict[str, Any], None]:
            # Computing tokens into a slot is safe to repeat, and the second time llama-server
            # reuses what the first computed: a stream that broke is asked for once more.
            for attempt in (1, 2):
                response = await self._transport.send(
                    "POST", "/completion", "prefill", payload, stream=True, safe=True
                )
                try:
                    async with self._transport.streaming(response, "prefill") as chunks:
                        async for chunk in chunks:
                            yield chunk
                    return
                except EngineStreamBrokenError as exc:
                    if attempt == 2:
                        raise
                    self._transport.note_resent()
                    log.info("%s; computing the rest once more", exc.message)

        stream = chunks()
        try:
            yield stream
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    @contextlib.asynccontextmanager
    async def complete(
        self, payload: Mapping[str, Any], *, slot: int
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """A streamed raw ``/completion`` on ``slot`` (``payload`` holds ``prompt`` as token
        ids and the sampling settings); yields an iterator of its chunks. Leaving the block
        closes the response, which stops the generation."""
        body = {**payload, "id_slot": slot, "cache_prompt": True, "stream": True}
        response = await self._transport.send(
            "POST", "/completion", "completion", body, stream=True
        )
        async with self._transport.streaming(response, "completion") as chunks:
            yield chunks

    async def detokenize(self, tokens: list[int] | tuple[int, ...]) -> str:
        """The text of ``tokens``, as the engine's tokenizer writes it."""
        async with self._templating:
            data = await self._transport.request_json(
                "POST", "/detokenize", "detokenize", json_body={"tokens": list(tokens)}
            )
        return self._expect(data, str, "/detokenize", "content")

    async def props(self) -> dict[str, Any]:
        """``GET /props``: the server's settings (``modalities``, ``default_generation_settings``,
        …)."""
        data = await self._transport.request_json("GET", "/props", "props")
        return self._expect(data, dict, "/props")

    async def accepts_images(self) -> bool:
        """Whether the engine's model can see images (``/props`` ``modalities.vision``), asked
        once. A server too old to say is assumed to: it then refuses images itself."""
        if self._vision is None:
            try:
                modalities = (await self.props()).get("modalities")
            except EngineResponseError:  # no /props: an older server, or not llama-server
                modalities = None
            vision = modalities.get("vision") if isinstance(modalities, Mapping) else None
            self._vision = vision if isinstance(vision, bool) else True
        return self._vision

    async def metrics(self) -> str:
        """``GET /metrics`` (llama-server started with ``--metrics``): Prometheus text."""
        response = await self._transport.send("GET", "/metrics", "metrics", safe=True)
        return response.text

    # -- slots --------------------------------------------------------------------------------

    async def slots(self) -> list[dict[str, Any]]:
        """``GET /slots``: one dict per slot (``id``, ``n_ctx``, ``is_processing``, ...)."""
        data = await self._transport.request_json("GET", "/slots", "slots")
        return self._expect(data, list, "/slots")

    async def save_slot(self, slot: int, filename: str) -> dict[str, Any]:
        """Write ``slot``'s KV cache to ``filename`` inside llama-server's ``--slot-save-path``."""
        return await self._slot_action(slot, "save", {"filename": filename})

    async def restore_slot(self, slot: int, filename: str) -> dict[str, Any]:
        """Load ``slot``'s KV cache from ``filename`` (saved earlier by :meth:`save_slot`)."""
        return await self._slot_action(slot, "restore", {"filename": filename})

    async def erase_slot(self, slot: int) -> dict[str, Any]:
        """Drop ``slot``'s KV cache."""
        return await self._slot_action(slot, "erase", {})

    async def _slot_action(self, slot: int, action: str, body: dict[str, Any]) -> dict[str, Any]:
        data = await self._transport.request_json(
            "POST",
            f"/slots/{int(slot)}",
            f"slot {action}",
            json_body=body,
            params={"action": action},
        )
        return self._expect(data, dict, f"slot {action}")
