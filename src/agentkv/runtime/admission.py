"""Before any response starts: a Messages body becomes a :class:`Prepared` request, or a 4xx;
and the assembler its reply will go through.

::

    translate (400 naming the field; notes or a 400 for images on a text-only engine)
    → the agent's compactions → prompt tokens (llama-server's template and tokenizer)
    → "prompt is too long", or compact now → cap max_tokens to what the slot has left
    → the shareable head: where the prompt's own words begin, measured when it can matter
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping
from typing import Any

import attrs

from agentkv.compaction import fold_share
from agentkv.exceptions import PromptTooLongError
from agentkv.runtime.compactor import Compactor
from agentkv.runtime.config import RuntimeConfig
from agentkv.runtime.contents import SlotContents
from agentkv.runtime.dispatcher import Dispatcher
from agentkv.runtime.seam import Engine
from agentkv.sse import SSEAssembler
from agentkv.tokens import Tokens, common_prefix
from agentkv.translate import EngineRequest, MessagesTranslator, has_images

__all__ = ["Admission", "Prepared", "request_key"]


@attrs.frozen
class Prepared:
    """A validated request, ready to queue: what to send, its tokens and who asks."""

    agent: str
    priority: int
    engine: EngineRequest
    tokens: Tokens = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    #: Where the shareable head of the prompt ends (the stem's tokens), when it was measured.
    boundary: int | None = None
    #: Identifies a client's retry of the same request (:func:`request_key`).
    key: str = ""
    #: The Messages body as the client sent it (a forecast of its next request reads it).
    body: Mapping[str, Any] | None = attrs.field(default=None, repr=False, eq=False)


def request_key(agent: str, engine: EngineRequest) -> str:
    """Two requests with this key are the same request: a client's retry, or the compaction
    request a prepared reply answers.

    It is read from the engine request the body translates to, before it is fitted to the slot:
    what the engine never sees (``cache_control`` marks, a lone text block written as a string,
    Claude Code's billing line, ``metadata``, ``stream``) does not make two requests differ, and
    anything the engine sees does. The model and the names of the tools the reply may call are
    added, since the reply's events name them.
    """
    stable = {k: v for k, v in engine.body.items() if k not in _UNKEYED}
    stable["model"] = engine.model
    stable["tool_names"] = list(engine.tool_names)
    # Sorted keys, ASCII escapes: as canonical as canonical_json, at half the cost on a body
    # with non-ASCII text (every Claude Code request has some). The key never leaves memory.
    text = json.dumps(stable, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256((agent + "\n" + text).encode()).hexdigest()[:32]


#: Engine body fields that follow from ``stream``: a streamed request and its non-streamed retry
#: are one request.
_UNKEYED = frozenset({"stream", "stream_options"})


@attrs.define(eq=False)
class Admission:
    """Validates and fits requests for one engine; it reads the other parts, writes none."""

    config: RuntimeConfig
    client: Engine
    translator: MessagesTranslator
    #: Its store holds the agents' compactions, rewritten into their requests.
    compactor: Compactor
    dispatcher: Dispatcher
    contents: SlotContents

    async def prepare(self, body: Mapping[str, Any], *, agent: str, priority: int) -> Prepared:
        """Validate and fit a Messages request; raises a 4xx :class:`AgentKVError` (a prompt
        that cannot fit gets ``prompt is too long``)."""
        config, compactor = self.config, self.compactor
        engine = await self.translate(body)

        def rewritten() -> tuple[dict[str, Any], bool]:
            """The engine body with the agent's compactions, and whether any applied."""
            fitted, _, applied = compactor.store.rewrite(
                agent, engine.body, compactor.fingerprinter
            )
            return fitted, bool(applied)

        fitted, compacted = engine.body, False
        if config.compaction and compactor.store.latest(agent) is not None:
            # Only an agent with compactions pays for fingerprinting its request.
            fitted, compacted = rewritten()
        tokens = tuple(await self.client.prompt_tokens(fitted))
        ctx = config.ctx_per_slot
        requested = int(fitted.get("max_tokens") or 1)
        if ctx is not None and config.check_prompt_length:
            limit = ctx - min(requested, config.output_reserve)
            if len(tokens) > limit and config.compaction:
                # Too long as it stands: compact now, at the request's own priority. A background
                # compaction of this agent that is already running is waited for instead.
                await compactor.compact(
                    agent, engine.body, len(tokens), priority=priority, background=False
                )
                fitted, compacted = rewritten()
                tokens = tuple(await self.client.prompt_tokens(fitted))
            if len(tokens) > limit:
                raise PromptTooLongError(len(tokens), limit)
            threshold, low = config.compaction_threshold, config.compact_from
            if config.compaction and low is not None and len(tokens) > low:
                # Incremental: fold a little, in idle time, to stay in the band.
                share = fold_share(len(tokens), low, max(low, threshold or low))
                compactor.schedule(agent, engine.body, len(tokens), share)
            elif config.compaction and threshold is not None and len(tokens) > threshold:
                compactor.schedule(agent, engine.body, len(tokens))
            # Claude Code asks for up to 128000 output tokens; the slot holds only what is left.
            fitted = {**fitted, "max_tokens": max(1, min(requested, ctx - len(tokens)))}
        return Prepared(
            agent=agent,
            priority=priority,
            engine=attrs.evolve(engine, body=fitted),
            tokens=tokens,
            boundary=None if compacted else await self._boundary(engine, tokens),
            key=request_key(agent, engine),
            body=body,
        )

    async def translate(self, body: Mapping[str, Any]) -> EngineRequest:
        """Translate for this engine: one that cannot see images gets notes or a 400 for them."""
        translator = self.translator
        if translator.limits.images and has_images(body) and not await self.client.accepts_images():
            translator = translator.text_only()
        return translator.translate(body)

    def assembler(self, prepared: Prepared) -> SSEAssembler:
        """The assembler that turns the engine's chunks for ``prepared`` into its events."""
        engine, config = prepared.engine, self.config
        return SSEAssembler(
            message_id="msg_" + secrets.token_hex(12),
            model=engine.model,
            forced_tool=engine.forced_tool,
            tool_names=engine.tool_names,
            coalesce_chars=config.coalesce_chars,
            coalesce_seconds=config.coalesce_seconds,
            input_tokens_hint=len(prepared.tokens),
            tool_schemas=self._repairable_tools(engine),
        )

    def _repairable_tools(self, engine: EngineRequest) -> dict[str, Any] | None:
        """Declared tools for tool-call repair: auto mode only (forced calls are constrained)."""
        if not self.config.tool_repair or "tools" not in engine.body:
            return None
        tools = engine.request.tools or ()
        return {tool.name: tool.input_schema for tool in tools if tool.input_schema is not None}

    async def count_tokens(self, body: Mapping[str, Any]) -> int:
        """``count_tokens``: the prompt size of a Messages request, as the engine counts it."""
        body = dict(body)
        body.setdefault("max_tokens", 1)  # count_tokens takes none; the prompt does not change
        engine = await self.translate(body)
        return len(await self.client.prompt_tokens(engine.body))

    async def _boundary(self, engine: EngineRequest, tokens: Tokens) -> int | None:
        """Where the shareable head ends, measured only when it could matter: a long prompt of
        which little is cached anywhere."""
        if not self.contents.enabled or engine.stem_body is None:
            return None
        if len(tokens) - self.dispatcher.available(tokens) < self.config.split_min:
            return None
        stem = await self.client.prompt_tokens(engine.stem_body)
        return common_prefix(tokens, stem)
