"""The runtime's settings: one frozen attrs value, each field documented once.

Every field carries its help text in ``metadata["help"]``; the server's command line and the
configuration table in the docs are generated from these fields (``agentkv_server.cli``), so the
three cannot drift apart. ``metadata["flag"]`` names the command-line option where it is not
simply the field name with dashes, and ``False`` keeps a field off the command line (it is
derived from the engine instead).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import attrs

from agentkv.limits import RequestLimits
from agentkv.scheduler import DEFAULT_AGING, DEFAULT_MAX_QUEUE, DEFAULT_TIE_WINDOW
from agentkv.slots import DEFAULT_LEASE_TTL
from agentkv.sse import DEFAULT_COALESCE_CHARS, DEFAULT_COALESCE_SECONDS

__all__ = ["GiB", "RuntimeConfig", "priority_or_off", "setting"]

GiB = 1 << 30


def setting(
    default: Any, help: str, *, converter: Any = None, validator: Any = None, **metadata: Any
) -> Any:
    """An attrs field with its documentation attached."""
    return attrs.field(
        default=default,
        converter=converter,
        validator=validator,
        metadata={"help": help, **metadata},
    )


def priority_or_off(text: str) -> int | None:
    """A priority (0–3) from the command line, or None for ``off``."""
    if text.strip().lower() in ("off", "none", "never"):
        return None
    value = int(text)
    if not 0 <= value <= 3:
        raise ValueError(f"a priority is 0 to 3, not {value}")
    return value


def _ge(minimum: float) -> Any:
    return attrs.validators.optional(attrs.validators.ge(minimum))


#: Settings of one group of ``agentkv-server --help``.
_scheduling = functools.partial(setting, group="scheduling")
_streaming = functools.partial(setting, group="streaming")
_prompts = functools.partial(setting, group="prompts")
_long_contexts = functools.partial(setting, group="long contexts")
_prefix_store = functools.partial(setting, group="prefix store")


@attrs.frozen
class RuntimeConfig:
    """How the runtime schedules, places, bounds and stores the requests of one engine."""

    # -- the engine's shape (read from llama-server, not set by hand) -------------------------
    n_slots: int = setting(
        2,
        "llama-server slots (-np); must equal the engine's, which the server reads from /slots",
        flag=False,
    )
    ctx_per_slot: int | None = setting(
        None,
        "context tokens per slot; read from the engine (None: unknown, no length checks)",
        flag=False,
    )

    # -- scheduling -------------------------------------------------------------------------------
    aging: float = _scheduling(
        DEFAULT_AGING,
        "priority levels a request gains per second of waiting (0.1: a P3 request outranks a "
        "fresh P0 after 30 s)",
    )
    max_queue: int = _scheduling(
        DEFAULT_MAX_QUEUE, "requests allowed to wait at once; more get 529 overloaded_error"
    )
    tie_window: float = _scheduling(
        DEFAULT_TIE_WINDOW,
        "scores this close count as a tie, won by a request whose prefix is cached",
    )
    lease_ttl: float = _scheduling(
        DEFAULT_LEASE_TTL,
        "seconds a slot lease may go without engine progress before the watchdog reclaims it "
        "(a leak or a hung engine)",
    )
    watchdog_interval: float = setting(15.0, "seconds between watchdog sweeps", flag=False)
    preempt_from: int | None = _scheduling(
        1,
        "a priority-0 request may suspend a running request of this priority or less urgent "
        "(its progress is saved to the prefix store and it resumes later, nothing computed "
        "twice); 'off': never",
        metavar="P",
        parse=priority_or_off,
    )

    agent_tree: bool = _scheduling(
        True,
        "recognise Claude Code's sub-agents (x-claude-code-agent-id) as agents of their own under "
        "the coordinator that started them, at its priority while it waits for them; off: a "
        "sub-agent is its session's agent",
        flag="--no-agent-tree",
    )
    background_agent_offset: int = _scheduling(
        1,
        "priority levels a sub-agent runs less urgent than its parent when the parent does not "
        "wait for it (run_in_background); 0: always the parent's priority",
        metavar="LEVELS",
        validator=attrs.validators.in_(range(4)),
    )

    # -- streaming --------------------------------------------------------------------------------
    ping_interval: float = _streaming(5.0, "seconds of silence after which a stream gets a ping")
    coalesce_chars: int = setting(
        DEFAULT_COALESCE_CHARS, "flush text deltas after this many characters", flag=False
    )
    coalesce_seconds: float = setting(
        DEFAULT_COALESCE_SECONDS, "or after this many seconds", flag=False
    )
    client_timeout: float = _streaming(
        1800.0,
        "seconds a client waits for a whole reply (Claude Code: API_TIMEOUT_MS, which the "
        "printed lines set to this); generation stops in time to answer within it",
    )
    retry_grace: float = _streaming(
        30.0,
        "seconds a request keeps running after its client went away, so that the client's "
        "retry of the same request joins it instead of computing it again",
    )

    # -- prompts ----------------------------------------------------------------------------------
    check_prompt_length: bool = setting(
        True,
        "refuse prompts that cannot fit a slot with 'prompt is too long' and cap max_tokens",
        flag=False,
    )
    output_reserve: int = setting(
        256, "tokens kept free for the reply when checking that a prompt fits", flag=False
    )
    session_layout: bool = _prompts(
        True,
        "put a client's session context (Claude Code's environment note and reminders) before "
        "the user's words, and Claude Code's project-specific lines after what every project "
        "shares, so that fresh agents share it",
        flag="--no-session-layout",
    )
    limits: RequestLimits = setting(  # noqa: RUF009 - attrs field, not a dataclass default
        RequestLimits(),
        "bounds on a request's shape (tools, messages, images…), checked before any engine work",
        flag=False,
    )
    tool_repair: bool = _prompts(
        True,
        "turn tool calls the model writes as text into tool_use blocks, with one constrained retry",
        flag="--no-tool-repair",
    )

    # -- long contexts ----------------------------------------------------------------------------
    compaction: bool = _long_contexts(
        True, "summarise an agent's oldest turns when its prompt grows long", flag="--no-compaction"
    )
    compact_at: int | None = _long_contexts(
        None,
        "compact when a prompt passes this many tokens (default: three quarters of a slot)",
        metavar="TOKENS",
    )
    compact_from: int | None = _long_contexts(
        None,
        "incremental compaction: after a turn whose prompt passes this many tokens, fold the "
        "oldest turns into the agent's running summary in idle time, so that its prompt stays "
        "between this and the high-water mark instead of growing to it (default: off)",
        metavar="TOKENS",
        validator=_ge(1),
    )
    compact_keep_messages: int = _long_contexts(
        6, "recent messages compaction never touches", flag="--compact-keep", metavar="N"
    )

    prepare_compaction: bool = _long_contexts(
        True,
        "when a Claude Code agent's last reply put it past its compaction point, generate the "
        "compaction request it will send next in idle time, and serve it when the request comes "
        "exactly as predicted",
        flag="--no-prepare-compaction",
    )
    prepared_wait: float = _long_contexts(
        1800.0,
        "seconds a prepared compaction reply waits for its agent's request before it is dropped",
        metavar="SECONDS",
        validator=_ge(0),
    )
    claude_config_dir: str | None = setting(
        None,
        "where Claude Code keeps its transcripts, which its conversation after a compaction "
        "names (unset: $CLAUDE_CONFIG_DIR, else ~/.claude, until a client's request names another)",
        flag=False,
    )

    # -- the prefix store -------------------------------------------------------------------------
    store_dir: Path | None = setting(  # noqa: RUF009 - attrs field, not a dataclass default
        None,
        "directory of saved slot states (llama-server's --slot-save-path); unset: no store",
        converter=attrs.converters.optional(Path),
        flag=False,
    )
    store_budget: int = _prefix_store(
        4 * GiB, "bytes the prefix store may use on disk", metavar="BYTES", validator=_ge(0)
    )
    store_context_ttl: float = _prefix_store(
        6 * 3600.0, "seconds after which an unused agent context is deleted (its agent is gone)"
    )
    stop_save: float = _prefix_store(
        15.0,
        "seconds a clean stop may spend saving what idle slots hold that the store does not (each "
        "agent's latest context), so that agents find it again after a restart; 0: never",
        metavar="SECONDS",
        validator=_ge(0),
    )
    park_min: int = _prefix_store(
        256,
        "an agent's context is saved before its slot is overwritten when it holds at least this "
        "many tokens the store does not have",
        metavar="TOKENS",
    )
    split_min: int = _prefix_store(
        1024,
        "a prompt head of at least this many uncached tokens is computed and saved on its own "
        "first, so that other agents restore it",
        metavar="TOKENS",
    )
    share_min: int = setting(
        512,
        "a request waits for another's shared head only when it gains at least this many tokens",
        flag=False,
    )
    engine_batch: int = setting(
        512,
        "prompt tokens the engine computes in one batch (llama-server's -b, as agentkv launches "
        "it): two requests whose last prompt tokens would share a batch go one after the other",
        flag=False,
    )

    @property
    def compaction_threshold(self) -> int | None:
        """The prompt size (tokens) past which an agent's context is compacted, if known."""
        if self.compact_at is not None:
            return self.compact_at
        return None if self.ctx_per_slot is None else (self.ctx_per_slot * 3) // 4
