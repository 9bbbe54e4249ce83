"""Server settings. One frozen value, filled from the CLI or by an embedding program."""

from __future__ import annotations

import attrs

from agentkv.limits import RequestLimits
from agentkv_server.body import BodyLimits

__all__ = ["ServerConfig"]


@attrs.frozen
class ServerConfig:
    """Everything the Starlette app needs to know besides the engine client.

    ``n_slots`` must equal llama-server's ``-np``: leases are handed out per slot, and a lease for a
    slot the engine does not have fails every request pinned to it.
    """

    n_slots: int = 2
    #: Seconds of waiting that buy one priority level (score = priority - aging * waited).
    aging: float = 0.1
    #: Requests allowed to wait at once; more are refused with 529 overloaded_error.
    max_queue: int = 256
    #: Scores this close count as a tie, broken in favour of a request that hits an idle slot.
    tie_window: float = 0.25
    #: A lease held longer than this is reclaimed by the watchdog (a leak, or a hung engine).
    #: A P0 request that finds every slot busy takes the slot of a running request of at least
    #: this priority that has produced no output yet; that request queues again with its
    #: original arrival. None (the default) switches pre-emption off: in the benchmark it wasted
    #: partial prefills without improving P0's p95 (docs/benchmarks.md).
    preempt_from: int | None = None
    lease_ttl: float = 900.0
    watchdog_interval: float = 15.0
    #: Seconds of silence after which a stream gets a ``ping`` (in the queue and during prefill).
    ping_interval: float = 5.0
    #: Token coalescing in the SSE assembler: flush after this many characters or seconds.
    coalesce_chars: int = 16
    coalesce_seconds: float = 0.05
    #: Largest accepted request body; larger ones get 413 request_too_large.
    max_body_bytes: int = 32 * 1024 * 1024
    #: Deepest nesting of JSON arrays and objects in a body; deeper is a 400.
    max_json_depth: int = 64
    #: Limits on the request's shape (tools, messages, images, ...), checked before any engine
    #: work; see agentkv.limits. ``limits.images=False`` refuses image blocks (text-only engine).
    limits: RequestLimits = attrs.field(factory=RequestLimits)
    #: When set, requests must carry it as ``x-api-key`` or ``Authorization: Bearer``.
    api_key: str | None = None
    #: Context per slot in tokens, if known; used for the prompt-too-long check and max_tokens.
    ctx_per_slot: int | None = None
    #: The model id listed by ``GET /v1/models``.
    model_name: str = "agentkv-local"
    #: Count every prompt with the engine's tokenizer and refuse ones that cannot fit a slot with
    #: "prompt is too long" (needs ``ctx_per_slot``). Also caps ``max_tokens`` to what fits.
    check_prompt_length: bool = True
    #: Tokens kept free for the reply when deciding whether a prompt fits (or max_tokens, if less).
    output_reserve: int = 256
    #: Save the context a miss is about to overwrite (llama-server slot save, needs
    #: --slot-save-path) and restore it when its agent comes back: more agents than slots.
    park_contexts: bool = True
    #: Turn tool calls that the model wrote as text into tool_use blocks (auto mode), repairing
    #: clear syntax slips, and retry once with constrained decoding when that fails.
    tool_repair: bool = True
    #: Summarise an agent's oldest turns when its prompt passes ``compact_at`` tokens.
    compaction: bool = True
    #: The high-water mark in tokens; None = three quarters of ``ctx_per_slot``.
    compact_at: int | None = None
    #: Conversation messages at the end that compaction never touches.
    compact_keep_messages: int = 6

    @property
    def body_limits(self) -> BodyLimits:
        """What the body reader enforces: size and nesting depth."""
        return BodyLimits(max_bytes=self.max_body_bytes, max_depth=self.max_json_depth)

    @property
    def compaction_threshold(self) -> int | None:
        """The prompt size (tokens) past which an agent's context is compacted, if known."""
        if self.compact_at is not None:
            return self.compact_at
        return None if self.ctx_per_slot is None else (self.ctx_per_slot * 3) // 4
