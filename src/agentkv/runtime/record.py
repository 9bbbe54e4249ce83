"""One request's record: its status and what the slot table shows, and the log line it ends in.

Its status moves along :data:`_NEXT` (queued → running → ok, or suspended and running again, or
cancelled or failed before it ended). The runtime logs it at INFO when it ends
(``agentkv.runtime``), with the fields as ``record.agentkv_request`` for a JSON log formatter.

::

    request agent=coder priority=1 slot=0 source=slot cached=11830/12004 computed=174
        ttft=0.61s total=4.20s output=96 status=ok
        diverged="token 11830 in message 7 block 1: reused 11830, computed 174, ~0.4 s"

(one line; wrapped here). ``diverged`` appears only when the record says where the prompt left
the best cached candidate; ``parent`` and ``description`` only for a sub-agent (where known);
``retried``, ``suspended=N``, ``stopped=…``, ``joined=N`` only when they happened.
"""

from __future__ import annotations

import enum
import logging
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from cachetools import LRUCache

from agentkv._types import Source
from agentkv.reply import Usage
from agentkv.snapshot import AgentTotals, Divergence, RequestView
from agentkv.translate import first_difference

__all__ = [
    "RequestHistory",
    "RequestRecord",
    "RequestStatus",
    "divergence_text",
    "request_fields",
    "request_line",
]

log = logging.getLogger("agentkv.runtime")

#: A cached sequence a prompt was compared with: a description, the tokens it shared with the
#: prompt, and its prompt sections.
Candidate = tuple[str, int, tuple[tuple[str, str], ...]]


class RequestStatus(enum.StrEnum):
    """Where a request is in its life (a string enum: it compares and serialises as its value)."""

    QUEUED = "queued"
    RUNNING = "running"
    #: It gave its slot up to a more urgent request and waits to resume.
    SUSPENDED = "suspended"
    OK = "ok"
    CANCELLED = "cancelled"
    FAILED = "error"


_STOPPED = frozenset({RequestStatus.CANCELLED, RequestStatus.FAILED})
#: The moves a status may make (an ended status makes none).
_NEXT: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.QUEUED: _STOPPED | {RequestStatus.RUNNING},
    RequestStatus.RUNNING: _STOPPED | {RequestStatus.OK, RequestStatus.SUSPENDED},
    RequestStatus.SUSPENDED: _STOPPED | {RequestStatus.RUNNING},
}


@attrs.define
class RequestRecord:
    """What the slot table shows about one request."""

    agent: str
    priority: int
    ticket: int = 0
    #: The agent that started this one and the description of its call, where known.
    parent: str | None = None
    description: str | None = None
    #: A sub-agent's request: whether its parent waited for it.
    waited_on: bool | None = None
    #: Order in which requests got their slot (1, 2, …): shows what the scheduler chose.
    dispatch_seq: int | None = None
    slot: int | None = None
    #: Where the cached part came from: "slot", "store" or "none".
    source: str | None = None
    #: Prompt tokens, and how many agentkv planned to find cached.
    prompt_tokens: int = 0
    planned_reuse: int = 0
    #: As llama-server reported them: computed and reused prompt tokens, generated tokens.
    computed_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    #: Speculative decoding, as llama-server reported it: tokens drafted, and those accepted.
    draft_tokens: int = 0
    draft_accepted: int = 0
    #: The engine's own time decoding the reply (``predicted_ms``), in seconds.
    decode_s: float = 0.0
    #: Tokens of a shareable head computed on its own first, to be saved for others.
    checkpoint_tokens: int | None = None
    #: The slot's previous content was saved before it was overwritten.
    parked: bool = False
    queued_s: float = 0.0
    ttft_s: float | None = None
    total_s: float | None = None
    #: The reply tried a tool call that could not be recovered, and was asked for again.
    retried: bool = False
    #: Times the request gave its slot up to a more urgent one and resumed later.
    suspended: int = 0
    #: Why generation was cut short by agentkv (deadline, repetition), if it was.
    stopped: str | None = None
    #: Clients attached to this request (more than one: a retry joined it).
    attached: int = 1
    #: While the prompt is computed: tokens of it cached or computed so far (engine progress).
    prefilled: int | None = None
    #: Seconds since the first output token, while generating.
    generating_s: float | None = None
    #: Why the prompt was not all cached (:meth:`explain`).
    divergence: dict[str, Any] | None = None
    #: Output chunks streamed so far (about one token each): the decoding speed, live.
    generated: int = 0
    status: RequestStatus = attrs.field(default=RequestStatus.QUEUED, converter=RequestStatus)
    #: The Anthropic error type (``overloaded_error``…) of a failed request.
    error_type: str | None = None

    def advance(self, status: RequestStatus, error_type: str | None = None) -> None:
        """Move to ``status``; a move :data:`_NEXT` does not allow is a bug, refused with a
        :class:`RuntimeWarning` (an error in the tests)."""
        if status not in _NEXT.get(self.status, ()):
            warnings.warn(
                f"request of agent {self.agent}: no move from {self.status.value} to "
                f"{status.value}",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        self.status = status
        if status is RequestStatus.FAILED:
            self.error_type = error_type or "api_error"
        elif status is RequestStatus.SUSPENDED:
            self.suspended += 1

    # -- what the request's owners report (the exchange, its relay, the agent tree) ----------

    def label(self, parent: str, description: str | None, waited_on: bool | None) -> None:
        """Its place in the agent tree: started by ``parent`` through the call ``description``,
        and whether the parent waits for it."""
        self.parent, self.description, self.waited_on = parent, description, waited_on

    def learn_description(self, description: str | None) -> None:
        """A sub-agent's call description, once its parent's continuation names it."""
        if self.parent is not None and self.description is None:
            self.description = description

    def attach(self) -> None:
        """One more client follows the request (a retry joined it)."""
        self.attached += 1

    def parked_slot(self) -> None:
        """The slot's previous content was saved before it was overwritten."""
        self.parked = True

    def restored_nothing(self) -> None:
        """The planned restore gave nothing: the prompt is computed from the slot as it is."""
        self.source = Source.NONE.value

    def checkpointed(self, tokens: int) -> None:
        """A shareable head of ``tokens`` was computed and saved on its own first."""
        self.checkpoint_tokens = tokens

    def head_computed(self, timings: Mapping[str, Any]) -> None:
        """The prompt's shareable head was computed on its own first, with ``timings``: what
        that call computed and found cached counts as this request's."""
        cached, computed = int(timings.get("cache_n", 0)), int(timings.get("prompt_n", 0))
        self.checkpoint_tokens = cached + computed
        self.computed_tokens += computed
        self.cached_tokens = cached

    def retry(self) -> None:
        """The reply tried a tool call that could not be recovered: it is asked for again."""
        self.retried = True

    def stop(self, reason: str) -> None:
        """agentkv cut generation short (deadline, repetition)."""
        self.stopped = reason

    def output_chunk(self) -> None:
        """An output chunk (about one token) arrived from the engine."""
        self.generated += 1

    def first_event(self, seconds: float) -> None:
        """The client got its first event of the reply ``seconds`` after arrival."""
        if self.ttft_s is None:
            self.ttft_s = round(seconds, 4)

    def progress(self, done: int) -> None:
        """Prompt tokens cached or computed so far (the engine's prompt progress)."""
        self.prefilled = done

    def account(self, timings: Mapping[str, Any]) -> int:
        """One engine call's ``timings``: tokens computed and reused, drafts, decode time.
        Returns the tokens that call found cached (``cache_n``)."""
        cached = int(timings.get("cache_n", 0))
        self.computed_tokens += int(timings.get("prompt_n", 0))
        if self.checkpoint_tokens is None:  # else the head this request computed is in it
            self.cached_tokens = max(self.cached_tokens, cached)
        self.draft_tokens += int(timings.get("draft_n", 0) or 0)
        self.draft_accepted += int(timings.get("draft_n_accepted", 0) or 0)
        self.decode_s += float(timings.get("predicted_ms", 0.0) or 0.0) / 1000
        return cached

    def leased(self, slot: int, source: str, reuse: int, seq: int | None, queued_s: float) -> None:
        """The request got ``slot`` (the ``seq``-th lease handed out) after ``queued_s`` seconds
        in the queue, with ``reuse`` tokens planned from ``source``: it runs."""
        self.slot, self.source, self.planned_reuse = slot, source, reuse
        self.dispatch_seq, self.queued_s = seq, round(queued_s, 4)
        self.advance(RequestStatus.RUNNING)

    def running_for(self, seconds: float) -> None:
        """The request has run ``seconds`` since it arrived (what is generating for, live)."""
        if self.ttft_s is not None:
            self.generating_s = round(seconds - self.ttft_s, 3)

    def ended(self, seconds: float, usage: Usage) -> None:
        """The request ended ``seconds`` after it arrived, having generated what ``usage`` says
        (the assembler's)."""
        if self.total_s is None:
            self.total_s = round(seconds, 4)
        self.output_tokens = usage.output_tokens

    def explain(
        self,
        seconds: float,
        sections: tuple[tuple[str, str], ...],
        candidate: Candidate | None,
    ) -> None:
        """Record why the prompt was not all cached, when a notable part was computed: where it
        parted from ``candidate`` (the best cached sequence when it got its slot), in tokens and
        in ``sections``, and the ``seconds`` its computation took."""
        if self.computed_tokens < 32:
            return
        divergence: dict[str, Any] = {
            "reused": self.cached_tokens,
            "computed": self.computed_tokens,
            "seconds": round(seconds, 3),
        }
        if candidate is None:
            divergence.update(position=0, section=None, candidate=None)
        else:
            described, shared, theirs = candidate
            divergence.update(
                position=shared, section=first_difference(sections, theirs), candidate=described
            )
        self.divergence = divergence

    @property
    def outcome(self) -> str:
        """The status as one word for views and metrics: the error type for a failed request."""
        if self.status is RequestStatus.FAILED:
            return self.error_type or "api_error"
        return self.status.value

    def view(self) -> RequestView:
        """The record as the operator's view shows it, frozen; ``status`` as shown."""
        data = attrs.asdict(self, recurse=False)
        data["status"] = self.shown_status
        data["divergence"] = Divergence(**self.divergence) if self.divergence else None
        return RequestView(**data)

    @property
    def shown_status(self) -> str:
        """``ok``, ``running``… or ``error: <type>``, as the log line and the page show it."""
        if self.status is RequestStatus.FAILED:
            return f"error: {self.outcome}"
        return self.status.value


def request_fields(record: RequestRecord) -> dict[str, Any]:
    """The facts of the request line, as data."""
    fields = {name: getattr(record, name) for name in _LINE_FIELDS}
    fields["status"] = record.shown_status
    if record.divergence:
        fields["divergence"] = dict(record.divergence)
    return fields


#: The record's fields in :func:`request_fields`, in order (``status`` as shown).
_LINE_FIELDS = (
    "agent",
    "parent",
    "description",
    "waited_on",
    "priority",
    "slot",
    "source",
    "prompt_tokens",
    "cached_tokens",
    "computed_tokens",
    "output_tokens",
    "draft_tokens",
    "draft_accepted",
    "queued_s",
    "ttft_s",
    "total_s",
    "status",
    "retried",
    "suspended",
    "stopped",
    "attached",
)


def request_line(record: RequestRecord) -> str:
    """The request as one ``key=value`` line (values with spaces are quoted)."""
    parts = [
        "request",
        f"agent={_quoted(record.agent)}",
        *_tree_parts(record),
        f"priority={record.priority}",
        f"slot={_or_dash(record.slot)}",
        f"source={_or_dash(record.source)}",
        f"cached={record.cached_tokens}/{record.prompt_tokens}",
        f"computed={record.computed_tokens}",
        f"ttft={_seconds(record.ttft_s)}",
        f"total={_seconds(record.total_s)}",
        f"output={record.output_tokens}",
        *([f"drafts={record.draft_accepted}/{record.draft_tokens}"] if record.draft_tokens else []),
        f"status={_quoted(record.shown_status)}",
    ]
    happened = [
        ("retried", record.retried),
        (f"suspended={record.suspended}", record.suspended),
        (f"stopped={record.stopped}", record.stopped),
        (f"joined={record.attached - 1}", record.attached > 1),
        (f"diverged={_quoted(divergence_text(record.divergence or {}))}", record.divergence),
    ]
    return " ".join([*parts, *(part for part, shown in happened if shown)])


def _tree_parts(record: RequestRecord) -> list[str]:
    """``parent=…``, ``description=…`` and ``waited_on`` or ``background`` for a sub-agent."""
    parts = []
    if record.parent:
        parts.append(f"parent={_quoted(record.parent)}")
    if record.description:
        parts.append(f"description={_quoted(record.description)}")
    if record.parent and record.waited_on is not None:
        parts.append("waited_on" if record.waited_on else "background")
    return parts


def divergence_text(divergence: Mapping[str, Any]) -> str:
    """Where a prompt left the best cached candidate, in words: ``position`` (token),
    ``section`` ("tool 3 (Bash)"), ``reused``, ``computed`` and ``seconds``, then any other key
    as ``key=value``."""
    known = {"position", "section", "reused", "computed", "seconds"}
    position, section = divergence.get("position"), divergence.get("section")
    where = [f"token {position}"] if position is not None else []
    where += [f"in {section}"] if section else []
    costs = [
        f"{k} {divergence[k]}" for k in ("reused", "computed") if divergence.get(k) is not None
    ]
    seconds = divergence.get("seconds")
    if isinstance(seconds, int | float):
        costs.append(f"~{seconds:.1f} s")
    extra = [f"{k}={v}" for k, v in divergence.items() if k not in known]
    words = [" ".join(where), ", ".join(costs), " ".join(extra)]
    return ": ".join(word for word in words if word)


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _quoted(text: str) -> str:
    if not text or any(c in text for c in ' "='):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


@attrs.define(eq=False)
class RequestHistory:
    """The requests that ended: the most recent records, each agent's totals (the least recently
    seen agents are dropped past ``max_agents``), and the listeners told of every one."""

    max_recent: int = 64
    max_agents: int = 256
    _recent: list[RequestRecord] = attrs.field(init=False, factory=list)
    _agents: LRUCache[str, Counter[str]] = attrs.field(
        init=False, default=attrs.Factory(lambda self: LRUCache(self.max_agents), takes_self=True)
    )
    _listeners: list[Callable[[RequestRecord], None]] = attrs.field(init=False, factory=list)

    def add_listener(self, listener: Callable[[RequestRecord], None]) -> None:
        self._listeners.append(listener)

    def add(self, record: RequestRecord) -> None:
        """A request ended: tell the listeners, keep the record, count it, log its line."""
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:  # a broken listener must not break the request path
                log.exception("request listener failed")
        self._recent.append(record)
        del self._recent[: -self.max_recent]
        totals = self._agents.pop(record.agent, None) or Counter()
        totals.update(
            requests=1, prompt_tokens=record.prompt_tokens, cached_tokens=record.cached_tokens
        )
        totals["priority"] = record.priority
        self._agents[record.agent] = totals  # the least recently seen agent out past the bound
        log.info("%s", request_line(record), extra={"agentkv_request": request_fields(record)})

    def records(self) -> list[RequestRecord]:
        """The most recent records, oldest first."""
        return list(self._recent)

    def agents(self) -> dict[str, AgentTotals]:
        """Per agent seen: requests, prompt and cached tokens, and the last priority."""
        return {agent: AgentTotals(**totals) for agent, totals in self._agents.items()}
