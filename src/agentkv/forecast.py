"""Claude Code's next request, predicted from the request and reply before it.

Three requests are predicted (docs/claude-code.md, "What the compaction request contains"): the
compaction request, after a reply that ended its turn with the context (input, cache read, cache
creation and output tokens) at ``window − min(max_tokens, 20000) − 13000``: the previous request
with the reply and the instruction appended, every other field as it was (only a
``cache_control`` mark moves, which the engine never sees; never after a session's first reply;
one between tool calls carries the tool's result and cannot be known); its retry, after a reply
without ``<summary>``: the instruction with a paragraph added; and the request after the summary,
as a prefix up to the user's next words (:meth:`CompactionForecast.predict_after`; reminders of
files the conversation read are not predicted, so such a prediction holds up to the kept
message). A new client version's instruction is learnt from the first start-of-turn compaction
seen. Pure: values in, values out.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from agentkv.translate import BILLING_HEADER_PREFIX

__all__ = [
    "CLAUDE_CODE_BUFFER",
    "COMPACTION_ENDS",
    "ESTIMATE_SLACK",
    "MAX_RESERVED_OUTPUT",
    "CompactionForecast",
    "compaction_point",
    "context_tokens",
    "has_summary",
    "how_after_differs",
    "is_claude_code",
    "reaches_point",
    "reply_text",
    "shipped_instruction",
    "shipped_retry_paragraph",
    "summary_text",
]

#: Tokens Claude Code keeps free below its reply's reserve (the "autocompact buffer").
CLAUDE_CODE_BUFFER = 13000
#: Claude Code reserves ``min(max_tokens, this)`` of the window for the reply.
MAX_RESERVED_OUTPUT = 20000
#: Claude Code adds its own estimate of what came after the reported usage (measured: 2 tokens
#: after a one-word reply): a reply within this many tokens below the point is predicted too.
ESTIMATE_SLACK = 16

#: Claude Code's system prompt says who it is in one of these (the ``-p`` mode names the SDK).
_CLAUDE_CODE_MARKERS = ("You are Claude Code", "Claude Agent SDK")
_BILLING_VERSION = BILLING_HEADER_PREFIX + " cc_version="


@functools.cache
def _shipped(name: str) -> str:
    """A text Claude Code 2.1.328 sends, as shipped in the package data."""
    text = importlib.resources.files("agentkv").joinpath("data", name).read_text(encoding="utf-8")
    return text.removesuffix("\n")


def shipped_instruction() -> str:
    """The compaction instruction Claude Code 2.1.328 sends (6,912 characters)."""
    return _shipped("claude_code_compaction.txt")


def shipped_retry_paragraph() -> str:
    """What Claude Code 2.1.328 adds to the instruction when it asks again after a reply without
    ``<summary>`` (two newlines, then 394 characters)."""
    return "\n\n" + _shipped("claude_code_compaction_retry.txt")


#: What the request after a compaction opens its summary message with.
AFTER_OPENING = "This session is being continued from a previous conversation that ran out"
_TRANSCRIPT = re.compile(r"read the full transcript at: (.+)/projects/[^/\n]+/[^/\n]+\.jsonl\n")
_DATE = re.compile(r"Today's date is (\d{4}-\d\d-\d\d)\.")
_ENVIRONMENT = "# Environment\n"
_ENVIRONMENT_NOTE = re.compile(
    r"(# Environment\n.*?\nYou are powered by the model [^\n]*)\n\n(.*?)\n\nToday's date is [^\n]*",
    flags=re.S,
)
_DEFERRED = "The following deferred tools are now available"
_ATTRIBUTION = "<system-reminder>\nAttribution"
_GIT_STATUS = "<system-reminder>\nAs you answer the user's questions"
#: The user's next words in a predicted request (they are not known; the session layout puts
#: everything else of that turn before them).
NEXT_WORDS = "…"
#: How a compaction reply Claude Code reads may have ended (it does not look at why).
COMPACTION_ENDS = ("end_turn", "max_tokens")
#: What JavaScript's ``trim()`` removes (Python's ``strip()`` removes ``\x1c``–``\x1f`` and
#: ``\x85`` too, and keeps ``\ufeff``).
_JS_SPACE = (
    "\t\n\v\f\r \u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000\ufeff"
)
#: A line that opens a summary (JavaScript's ``^`` in multiline mode: after any line break).
_OPEN_SUMMARY = re.compile(r"(?:^|(?<=[\n\r\u2028\u2029]))[ \t]*<summary>")
#: A ``<`` that would open (or close) the tag Claude Code wraps the tool names in.
_SUMMARY_TAG = re.compile(r"<(?=\s*(?:/\s*)?tools-used-before-summary\b)", flags=re.I)


def _tag(text: str, name: str) -> tuple[int, int, str] | None:
    """The first ``<name>`` and the first ``</name>`` after it: their span and what is between,
    or None when either is missing (as Claude Code finds a tag)."""
    start = text.find(f"<{name}>")
    if start == -1:
        return None
    inner = start + len(name) + 2
    end = text.find(f"</{name}>", inner)
    if end == -1:
        return None
    return start, end + len(name) + 3, text[inner:end]


def _without_analysis(text: str) -> str:
    found = _tag(text, "analysis")
    return text if found is None else text[: found[0]] + text[found[1] :]


def has_summary(reply: str) -> bool:
    """Claude Code takes ``reply`` (a compaction reply's text) as a summary, and does not ask
    again: once its first ``<analysis>…</analysis>`` is dropped, a ``<summary>…</summary>`` is in
    it, or a line that begins with ``<summary>`` (captured: ``open_summary``)."""
    rest = _without_analysis(reply)
    return _tag(rest, "summary") is not None or _OPEN_SUMMARY.search(rest) is not None


def summary_text(reply: str) -> str:
    """The summary as Claude Code puts it into the next conversation: a ``<`` that would open
    its own ``tools-used-before-summary`` tag escaped, the first ``<analysis>…</analysis>``
    dropped, the first ``<summary>…</summary>`` written ``Summary:`` and its trimmed text, runs
    of blank lines made one, the whole trimmed."""
    text = _SUMMARY_TAG.sub("&lt;", reply)
    text = _without_analysis(text)
    found = _tag(text, "summary")
    if found is not None:
        text = f"{text[: found[0]]}Summary:\n{found[2].strip(_JS_SPACE)}{text[found[1] :]}"
    return re.sub(r"\n\n+", "\n\n", text).strip(_JS_SPACE)


def reply_text(reply: Mapping[str, Any]) -> str | None:
    """What Claude Code reads of a compaction reply, trimmed; None when that is empty (then
    Claude Code has no summary at all).

    Claude Code keeps each block of a streamed reply as a message of its own, and reads the
    last text block that holds ``<summary>``, else the last text block (captured:
    ``two_blocks``, ``two_blocks_no_summary``). A reply has several text blocks when text held
    back as a possible tool call was released as a block of its own (at the token limit, say)."""
    content = reply.get("content")
    if not isinstance(content, Sequence) or isinstance(content, str):
        return None
    texts = [
        str(block.get("text") or "")
        for block in content
        if isinstance(block, Mapping) and block.get("type") == "text"
    ]
    tagged = [text for text in texts if "<summary>" in text]
    chosen = tagged[-1] if tagged else texts[-1] if texts else ""
    return chosen.strip(_JS_SPACE) or None


def _system_texts(system: Any) -> list[str]:
    return [b["text"] for b in _blocks(system) if isinstance(b.get("text"), str)]


def _engine_system(system: Any) -> list[str]:
    """The system texts the engine sees: Claude Code's billing line (which changes with every
    request) is never sent (:data:`agentkv.translate.BILLING_HEADER_PREFIX`)."""
    return [t for t in _system_texts(system) if not t.startswith(BILLING_HEADER_PREFIX)]


def is_claude_code(body: Mapping[str, Any]) -> bool:
    """The request comes from Claude Code: its system prompt opens with Claude Code's billing line
    (``x-anthropic-billing-header: cc_version=…``) or says it is Claude Code."""
    texts = _system_texts(body.get("system"))
    if texts and texts[0].startswith(_BILLING_VERSION):
        return True
    return any(marker in text for text in texts for marker in _CLAUDE_CODE_MARKERS)


def _last_text(content: Any) -> str | None:
    """A message's last text: the string, or its last text block."""
    texts = [block.get("text") for block in _blocks(content) if block.get("type") == "text"]
    return texts[-1] if texts and isinstance(texts[-1], str) else None


def _whole_text(content: Any) -> str | None:
    """A message's content when it is text alone: a string, or one text block."""
    texts = _block_texts(content)
    alone = len(texts) == 1 and (isinstance(content, str) or len(content) == 1)
    return texts[0] if alone else None


def _messages(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    return [m for m in messages if isinstance(m, Mapping)]


def context_tokens(usage: Mapping[str, Any]) -> int:
    """Claude Code's context after a reply: input, cache read, cache creation and output."""
    fields = (
        "input_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
        "output_tokens",
    )
    return sum(int(usage.get(name) or 0) for name in fields)


def compaction_point(window: int, max_tokens: int) -> int:
    """The context at which Claude Code compacts before its next turn."""
    return window - min(max_tokens, MAX_RESERVED_OUTPUT) - CLAUDE_CODE_BUFFER


def reaches_point(body: Mapping[str, Any], context: int, window: int) -> bool:
    """A reply to ``body`` that leaves Claude Code's context at ``context`` tokens is followed by
    a compaction (within :data:`ESTIMATE_SLACK` of the point, or past it)."""
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int):
        return False
    return context + ESTIMATE_SLACK >= compaction_point(window, max_tokens)


@attrs.frozen
class CompactionForecast:
    """What Claude Code's next request is, when it is a compaction that can be known now.

    ``instruction`` is the text of the compaction request's last message: the shipped one until a
    start-of-turn compaction request with another is seen (:meth:`learn` returns the forecast that
    knows it).
    """

    instruction: str = attrs.field(factory=shipped_instruction)
    #: What a retry adds to the instruction (after a reply without ``<summary>``).
    retry_paragraph: str = attrs.field(factory=shipped_retry_paragraph)
    #: Claude Code's configuration directory (``~/.claude``), where it keeps the transcripts the
    #: summary message names: the client's machine's, learnt from its first such message.
    config_dir: str | None = None

    @property
    def first_line(self) -> str:
        """What every compaction request's instruction begins with."""
        return self.instruction.split("\n", 1)[0]

    def is_compaction(self, body: Mapping[str, Any]) -> bool:
        """The request is a Claude Code compaction: its last user message's text begins with the
        instruction's first line (at the start of a turn, or after a tool's result)."""
        messages = _messages(body)
        if not messages or messages[-1].get("role") != "user":
            return False
        text = _last_text(messages[-1].get("content"))
        return text is not None and text.startswith(self.first_line)

    def learn(self, body: Mapping[str, Any]) -> CompactionForecast:
        """The forecast after seeing ``body``: a start-of-turn compaction request (its last
        message a user message that is the instruction alone) with an instruction that is not the
        known one teaches it. A retry's instruction (the known one and a paragraph more) or one
        with added instructions extends the known one and teaches nothing."""
        if not self.is_compaction(body):
            return self._learn_config_dir(body)
        text = _whole_text(_messages(body)[-1].get("content"))
        if text is None or text.startswith(self.instruction):
            return self
        return attrs.evolve(self, instruction=text)

    def _learn_config_dir(self, body: Mapping[str, Any]) -> CompactionForecast:
        """A request after a compaction names its transcript: the directory it is in."""
        messages = _messages(body)
        if not messages:
            return self
        for text in _block_texts(messages[0].get("content")):
            if text.startswith(AFTER_OPENING):
                found = _TRANSCRIPT.search(text)
                if found is not None and found.group(1) != self.config_dir:
                    return attrs.evolve(self, config_dir=found.group(1))
        return self

    def _asked(self, body: Mapping[str, Any], reply: Mapping[str, Any]) -> str | None:
        """The instruction of Claude Code's compaction request ``body`` when its last message is
        that text alone and ``reply`` ended as Claude Code reads it; else None."""
        messages = _messages(body)
        if (
            not is_claude_code(body)
            or not self.is_compaction(body)
            or len(messages) != len(body.get("messages") or ())
            or reply.get("stop_reason") not in COMPACTION_ENDS
        ):
            return None
        return _whole_text(messages[-1].get("content"))

    def predict_retry(
        self, body: Mapping[str, Any], reply: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """The retry Claude Code sends when ``reply``, the whole reply to the compaction request
        ``body``, ended its turn without ``<summary>``: the same request with the retry paragraph
        added to the instruction. None for any other request or reply (a retry is not retried,
        and a compaction with added instructions is not predicted)."""
        if self._asked(body, reply) != self.instruction:
            return None
        said = reply_text(reply)
        if said is None or has_summary(said):
            return None  # no text: Claude Code has no summary and does not ask again
        ask = {"role": "user", "content": self.instruction + self.retry_paragraph}
        return {**body, "messages": [*body["messages"][:-1], ask]}

    def predict_after(
        self,
        body: Mapping[str, Any],
        reply: Mapping[str, Any],
        first: Mapping[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """The request Claude Code sends after the start-of-turn compaction ``body`` (or its
        retry) was answered with ``reply``, its user's words :data:`NEXT_WORDS`; None when it
        cannot be known (no known configuration directory, a conversation laid out otherwise
        than Claude Code 2.1.328's) or does not come next (a first reply without a summary is
        asked for again).

        After a retry whose reply has no summary either, Claude Code goes on with the *first*
        reply (captured: ``retry_twice_differs``): ``first`` is that reply, and without it
        nothing is predicted."""
        asked = self._asked(body, reply)
        if self.config_dir is None or asked not in (
            self.instruction,
            self.instruction + self.retry_paragraph,
        ):
            return None
        messages = _messages(body)
        said = reply_text(reply)
        failed = said is None or not has_summary(said)
        # A retry cut at the token limit failed too, whatever it holds (captured: retry_cut).
        if asked != self.instruction and (failed or reply.get("stop_reason") == "max_tokens"):
            said = None if first is None else reply_text(first)
        elif failed:
            return None  # the retry comes first (or, with no text, no summary at all)
        kept = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
        first_texts = _block_texts(messages[0].get("content"))
        note = _note_after(messages)
        transcript = self._transcript(body, messages)
        if (
            said is None
            or kept is None
            or not first_texts
            or not first_texts[0].startswith(_GIT_STATUS)
            or note is None
            or transcript is None
        ):
            return None
        git_status = first_texts[0] if first_texts[0].endswith("\n") else first_texts[0] + "\n"
        ours = [_blocks(m.get("content")) for m in messages if m.get("role") == "assistant"]
        tools = sorted(
            {str(b.get("name")) for bs in ours for b in bs if b.get("type") == "tool_use"}
        )
        # The summary message that opens the conversation after a compaction.
        opening = (
            _shipped("claude_code_after_compaction.txt")
            .replace("{tools}", ",".join(tools))
            .replace("{transcript}", transcript)
            .replace("{summary}", summary_text(said))
        )
        texts = _role_texts(messages, "user")
        attribution = next((t for t in reversed(texts) if t.startswith(_ATTRIBUTION)), None)
        last = [*([attribution] if attribution is not None else []), NEXT_WORDS]
        date, deferred = note
        after = [
            {"role": "user", "content": [_text(git_status), _text(opening)]},
            {"role": "system", "content": f"Today's date is {date}."},
            dict(kept),
            {"role": "user", "content": [_text(t) for t in last]},
            {"role": "system", "content": [_text(deferred)]},
        ]
        return {**body, "messages": after}

    def _transcript(
        self, body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]
    ) -> str | None:
        """Where Claude Code keeps this session's transcript: its configuration directory, the
        project (the working directory, every character but a letter or digit a ``-``), the
        session id."""
        metadata = body.get("metadata")
        user_id = metadata.get("user_id") if isinstance(metadata, Mapping) else None
        try:
            session = json.loads(user_id)["session_id"] if isinstance(user_id, str) else None
        except (ValueError, KeyError, TypeError):
            session = None
        notes = _role_texts(messages, "system")
        found = (re.search(r"Primary working directory: ([^\n]+)", t) for t in reversed(notes))
        project = next((f.group(1) for f in found if f is not None), None)
        if not isinstance(session, str) or project is None or self.config_dir is None:
            return None
        slug = re.sub(r"[^A-Za-z0-9]", "-", project)
        return f"{self.config_dir}/projects/{slug}/{session}.jsonl"

    def predict(
        self, body: Mapping[str, Any], reply: Mapping[str, Any], window: int
    ) -> dict[str, Any] | None:
        """The compaction request Claude Code sends next, or None when none can be known now.

        ``body`` is the request that was answered, ``reply`` the whole reply as one Messages API
        Message (its ``content``, ``stop_reason`` and ``usage``), ``window`` Claude Code's context
        window (``CLAUDE_CODE_MAX_CONTEXT_TOKENS``, which agentkv has it set to its slot size).
        """
        messages = _messages(body)
        if (
            not is_claude_code(body)
            or self.is_compaction(body)
            or len(messages) != len(body.get("messages") or ())
            or not any(m.get("role") == "assistant" for m in messages)
            or reply.get("stop_reason") != "end_turn"
        ):
            return None
        usage = reply.get("usage")
        if not isinstance(usage, Mapping) or not reaches_point(body, context_tokens(usage), window):
            return None
        content = reply.get("content")
        if not isinstance(content, list) or not content:
            return None
        said = {"role": "assistant", "content": [dict(block) for block in content]}
        ask = {"role": "user", "content": self.instruction}
        return {**body, "messages": [*body["messages"], said, ask]}


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _unmarked(value: Any) -> Any:
    """``value`` without its ``cache_control`` marks, at any depth."""
    if isinstance(value, Mapping):
        return {k: _unmarked(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list | tuple):
        return [_unmarked(v) for v in value]
    return value


def _seen(block: Mapping[str, Any]) -> str:
    """A content block as the engine sees it: its text, or its JSON without ``cache_control``."""
    if block.get("type") == "text" and isinstance(block.get("text"), str):
        return str(block["text"])
    return json.dumps(_unmarked(block), sort_keys=True)


def _apart(want: str, got: str) -> str:
    """Where two texts part: the character, and a few on each side of it in both."""
    at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
    at = min(len(want), len(got)) if at is None else at
    start = max(0, at - 40)
    return f"char {at}: predicted {want[start : at + 40]!r}, sent {got[start : at + 40]!r}"


def how_after_differs(predicted: Mapping[str, Any], sent: Mapping[str, Any]) -> str | None:
    """Where ``sent``, the request that followed a compaction, parts from what
    :meth:`CompactionForecast.predict_after` predicted, in words; None when it is the prediction
    with the user's words (the block that was :data:`NEXT_WORDS`) in their place. What the engine
    never sees (``cache_control``) does not count."""
    if _engine_system(predicted.get("system")) != _engine_system(sent.get("system")):
        return "its system differs"
    if _unmarked(predicted.get("tools")) != _unmarked(sent.get("tools")):
        return "its tools differ"
    want, got = _messages(predicted), _messages(sent)
    for index, (ours, theirs) in enumerate(zip(want, got, strict=False)):
        if ours.get("role") != theirs.get("role"):
            return f"message {index} is {theirs.get('role')}, predicted {ours.get('role')}"
        blocks, sent_blocks = _blocks(ours.get("content")), _blocks(theirs.get("content"))
        for number, (block, other) in enumerate(zip(blocks, sent_blocks, strict=False)):
            if block.get("type") == "text" and block.get("text") == NEXT_WORDS:
                continue
            if _seen(block) != _seen(other):
                return f"message {index} block {number}, {_apart(_seen(block), _seen(other))}"
        if len(blocks) != len(sent_blocks):
            return f"message {index} has {len(sent_blocks)} blocks, predicted {len(blocks)}"
    if len(want) != len(got):
        return f"{len(got)} messages, predicted {len(want)}"
    return None


def _blocks(content: Any) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [_text(content)]
    if isinstance(content, Sequence):
        return [b for b in content if isinstance(b, Mapping)]
    return []


def _block_texts(content: Any) -> list[str]:
    return [
        b["text"]
        for b in _blocks(content)
        if b.get("type") == "text" and isinstance(b.get("text"), str)
    ]


def _role_texts(messages: Sequence[Mapping[str, Any]], role: str) -> list[str]:
    """The text blocks of every ``role`` message, in order."""
    return [t for m in messages if m.get("role") == role for t in _block_texts(m.get("content"))]


def _note_after(messages: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    """The date, and the session note that follows the user's words after a compaction: after
    an earlier compaction, the note as it came then; else the session's environment note with
    its environment section moved to the end and its date taken out."""
    notes = _role_texts(messages, "system")
    dates = [d for t in notes for d in _DATE.findall(t)]
    if not dates:
        return None
    deferred = next((t for t in reversed(notes) if t.startswith(_DEFERRED)), None)
    if deferred is not None:
        return dates[-1], deferred
    environment = next((t for t in notes if t.startswith(_ENVIRONMENT)), None)
    if environment is None:
        return None
    found = _ENVIRONMENT_NOTE.fullmatch(environment)
    if found is None:
        return None
    return dates[-1], found.group(2) + "\n\n" + found.group(1)
