"""Context compaction: replace an agent's oldest turns with a summary, on agentkv's side only.

The client keeps sending the whole conversation; agentkv remembers, per agent, which prefix (by
fingerprint) a summary now stands for, and sends the engine the summary and the recent turns. The
cut folds all but the last ``keep_recent`` messages, or (incremental compaction, ``fold_share``)
only the oldest messages that hold the share of the prompt it must lose, the running summary with
them. The system head and the tool list are never touched, a cut never separates an assistant's
``tool_calls`` from their ``tool`` results, and the last ``keep_recent`` messages are never
summarised. Pure: the server decides when to run it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from agentkv._types import Fingerprint
from agentkv.fingerprint import PrefixFingerprinter
from agentkv.snapshot import CompactionRow, PendingCompactionRow

__all__ = [
    "Compaction",
    "CompactionPlan",
    "CompactionStore",
    "fold_share",
    "plan_compaction",
    "rebase",
    "summary_request",
]

SUMMARY_INSTRUCTIONS = (
    "You summarise the beginning of a conversation between a user and a coding assistant so that "
    "the assistant can continue without it. Keep every fact that later turns may need: the task, "
    "decisions, file names, function names, commands run and their results, errors, and what is "
    "still open. Write plain sentences, at most 200 words. Do not add anything that is not in the "
    "conversation."
)
#: The wrapper the summary is sent in, as the first message after the system prompt.
SUMMARY_OPEN = "<conversation-summary>\nSummary of the earlier part of this conversation:\n"
SUMMARY_CLOSE = "\n</conversation-summary>"
#: Characters of one message kept in the transcript given to the summariser.
_TRANSCRIPT_MESSAGE_CHARS = 2000


def _head_length(messages: Sequence[Mapping[str, Any]]) -> int:
    return next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))


@attrs.frozen
class CompactionPlan:
    """Which messages of an engine request a compaction replaces.

    ``cut`` counts conversation messages after the system head. ``key`` is the fingerprint block
    that covers system, tools and those ``cut`` messages, at position ``block_index``; a later
    request whose fingerprint has the same block there starts with the same prefix.
    """

    agent: str
    cut: int
    key: str
    block_index: int


@attrs.frozen
class Compaction:
    """A finished compaction: the summary that now stands for a prefix of one agent's history."""

    plan: CompactionPlan
    summary: str
    created_at: float
    tokens_before: int = 0
    tokens_after: int = 0

    @property
    def saved_tokens(self) -> int:
        return max(0, self.tokens_before - self.tokens_after)

    def matches(self, fingerprint: Fingerprint) -> bool:
        index = self.plan.block_index
        return len(fingerprint.blocks) > index and fingerprint.blocks[index] == self.plan.key

    def apply(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The request with the planned messages replaced by the summary (no match check)."""
        messages = list(body["messages"])
        head = _head_length(messages)
        kept = messages[head + self.plan.cut :]
        summary = {"role": "user", "content": SUMMARY_OPEN + self.summary.strip() + SUMMARY_CLOSE}
        return {**body, "messages": [*messages[:head], summary, *kept]}


def fold_share(tokens: int, low: int, high: int) -> float:
    """The share of a ``tokens``-long prompt that incremental compaction folds: enough to bring it
    a quarter of the band below the low mark (so that a fold is not due again at the next
    turn), 0 while it is at or under the low mark."""
    if tokens <= low or tokens <= 0:
        return 0.0
    target = max(0, low - max(0, high - low) // 4)
    return min(1.0, (tokens - target) / tokens)


def plan_compaction(
    body: Mapping[str, Any],
    *,
    agent: str,
    keep_recent: int,
    fingerprinter: PrefixFingerprinter,
    min_messages: int = 2,
    share: float | None = None,
) -> CompactionPlan | None:
    """Plan to replace all but the last ``keep_recent`` messages, or, given a ``share`` of the
    prompt to lose (:func:`fold_share`), only the oldest messages that hold it (measured in
    characters of the request, its system head and tools counted, which are never cut); None if
    too little to gain."""
    messages = list(body.get("messages") or [])
    head = _head_length(messages)
    conversation = messages[head:]
    cut = len(conversation) - max(0, keep_recent)
    if share is not None:
        cut = min(cut, _covering(body, conversation, share))
    # A tool result stays with the assistant message that called the tool, in the kept part.
    while 0 < cut < len(conversation) and conversation[cut].get("role") == "tool":
        cut -= 1
    if cut < min_messages:
        return None
    return _plan(agent, body, cut, fingerprinter)


def rebase(
    plan: CompactionPlan,
    raw: Mapping[str, Any],
    applied: Sequence[Compaction],
    fingerprinter: PrefixFingerprinter,
) -> CompactionPlan:
    """``plan``, made on the request as the compactions ``applied`` rewrote it, as a plan on the
    client's own request ``raw``: its summary (which folds theirs, the first message it replaces)
    then stands alone for every message they and it replace, so that they can be forgotten."""
    if not applied:
        return plan
    covered = 0
    for compaction in applied:  # each folds the summary before it
        covered = compaction.plan.cut if covered == 0 else covered + compaction.plan.cut - 1
    return _plan(plan.agent, raw, covered + plan.cut - 1, fingerprinter)


def _plan(
    agent: str, body: Mapping[str, Any], cut: int, fingerprinter: PrefixFingerprinter
) -> CompactionPlan:
    """The plan that replaces the first ``cut`` conversation messages of ``body``."""
    messages = list(body.get("messages") or [])
    head = _head_length(messages)
    prefix = fingerprinter.fingerprint({**body, "messages": messages[: head + cut]})
    return CompactionPlan(
        agent=agent, cut=cut, key=prefix.blocks[-1], block_index=len(prefix.blocks) - 1
    )


def _covering(
    body: Mapping[str, Any], conversation: Sequence[Mapping[str, Any]], share: float
) -> int:
    """How many of the oldest conversation messages hold ``share`` of the whole request."""
    held = itertools.accumulate(len(json.dumps(m, ensure_ascii=False)) for m in conversation)
    wanted = share * len(json.dumps(body, ensure_ascii=False))
    return next((n for n, size in enumerate(held, start=1) if size >= wanted), len(conversation))


def _render(message: Mapping[str, Any]) -> str:
    role = str(message.get("role", "?"))
    content = message.get("content")
    if isinstance(content, list):  # image and text parts: keep the text
        text = "\n".join(
            str(part.get("text", "[image]")) for part in content if isinstance(part, Mapping)
        )
    else:
        text = "" if content is None else str(content)
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call.get("function", {}) if isinstance(call, Mapping) else {}
        text += f"\n[calls tool {function.get('name')} with {function.get('arguments')}]"
    if len(text) > _TRANSCRIPT_MESSAGE_CHARS:
        half = _TRANSCRIPT_MESSAGE_CHARS // 2
        text = text[:half] + "\n[…]\n" + text[-half:]
    label = {"tool": "tool result", "user": "user", "assistant": "assistant"}.get(role, role)
    return f"{label}: {text.strip()}"


def summary_request(
    body: Mapping[str, Any], plan: CompactionPlan, *, max_tokens: int = 320
) -> dict[str, Any]:
    """The engine request that asks the model to summarise the planned messages."""
    messages = list(body["messages"])
    head = _head_length(messages)
    transcript = "\n\n".join(_render(m) for m in messages[head : head + plan.cut])
    ask = f"Summarise this conversation:\n\n{transcript}\n\nWrite the summary now."
    return {
        "messages": [
            {"role": "system", "content": SUMMARY_INSTRUCTIONS},
            {"role": "user", "content": ask},
        ],
        "max_tokens": max_tokens,
        "temperature": 0.2,
    }


@attrs.define
class CompactionStore:
    """Per agent, the compactions in force, oldest first; and which agents have one in flight."""

    max_per_agent: int = 4
    #: Agents whose compactions are kept; the least recently compacted are forgotten first.
    max_agents: int = 256
    _done: dict[str, list[Compaction]] = attrs.field(factory=dict)
    _pending: set[str] = attrs.field(factory=set)

    def begin(self, agent: str) -> bool:
        """Mark a compaction for ``agent`` as in flight; False if one already is."""
        if agent in self._pending:
            return False
        self._pending.add(agent)
        return True

    def end(
        self, agent: str, compaction: Compaction | None, replaces: Sequence[Compaction] = ()
    ) -> None:
        """Clear the in-flight mark and remember the result, if any, in place of the compactions
        it ``replaces`` (those it was planned on top of: it stands for all they stood for)."""
        self._pending.discard(agent)
        if compaction is not None:
            done = [c for c in self._done.pop(agent, []) if not any(c is r for r in replaces)]
            done.append(compaction)
            del done[: -self.max_per_agent]
            self._done[agent] = done  # most recent last
            while len(self._done) > self.max_agents:
                del self._done[next(iter(self._done))]

    def pending(self, agent: str) -> bool:
        return agent in self._pending

    def latest(self, agent: str) -> Compaction | None:
        """The agent's most recent compaction, if any."""
        done = self._done.get(agent)
        return done[-1] if done else None

    def rewrite(
        self, agent: str, body: Mapping[str, Any], fingerprinter: PrefixFingerprinter
    ) -> tuple[dict[str, Any], Fingerprint, list[Compaction]]:
        """Apply every compaction of ``agent`` whose prefix this request still starts with.

        Compactions are applied oldest first, each to the output of the one before, because a
        later compaction was planned on an already compacted request.
        """
        current = dict(body)
        fingerprint = fingerprinter.fingerprint(current)
        applied: list[Compaction] = []
        for compaction in self._done.get(agent, []):
            if compaction.matches(fingerprint):
                current = compaction.apply(current)
                fingerprint = fingerprinter.fingerprint(current)
                applied.append(compaction)
        return current, fingerprint, applied

    def snapshot(self) -> tuple[CompactionRow | PendingCompactionRow, ...]:
        """What the operator's view shows: one row per compaction in force, then the pending."""
        in_force = tuple(
            CompactionRow(
                agent=agent,
                messages_replaced=c.plan.cut,
                tokens_before=c.tokens_before,
                tokens_after=c.tokens_after,
                saved_tokens=c.saved_tokens,
                summary_chars=len(c.summary),
            )
            for agent, done in sorted(self._done.items())
            for c in done
        )
        pending = tuple(PendingCompactionRow(agent, True) for agent in sorted(self._pending))
        return in_force + pending
