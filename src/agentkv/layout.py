"""Claude Code's project-specific text, recognised so that it can sit at the end of the shared head.

Claude Code's prompt is the same for every project but for a few lines: the memory directory in
its system prompt (``<HOME>/.claude/projects/<project path, dashed>/memory/``), the working
directory, platform and date in its environment note, and the git status reminder. The session
layout moves these out of the way and keeps their words: the system prompt names the memory
directory instead of spelling out its path, and the path joins the note's facts in two small
blocks (:func:`facts_blocks`, the session's and the project's) that sit after everything
projects share and before the user's words; the git status reminder puts its values last
(:func:`project_reminder_layout`). Two fresh agents in two projects then differ only in their
last hundred or so tokens.

Pure text functions. Each recognises the shape Claude Code 2.1.328 sends and returns ``None``
for anything else, so a prompt it does not recognise is sent as the client wrote it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs

__all__ = [
    "MEMORY_REFERENCE",
    "PROJECT_HEADER",
    "SESSION_HEADER",
    "SessionFacts",
    "facts_blocks",
    "is_project_reminder",
    "project_reminder_layout",
    "split_memory_dir",
    "split_note",
]

#: The memory directory as Claude Code names it inside backticks in its system prompt.
_MEMORY_DIR = re.compile(r"`((?:~|/)[^`\n]*/\.claude/projects/[^`\n/]+/memory/?)`")

#: What the system prompt says instead of the path: the same directory, by the name it has in
#: the project's facts block.
MEMORY_REFERENCE = "the memory directory listed under # Environment (this project)"

#: The first lines of the two facts blocks: the environment note's heading, marked as the part
#: of one session (the machine, the day) and the part of one project.
SESSION_HEADER = "# Environment (this session)"
PROJECT_HEADER = "# Environment (this project)"

#: Each block's lines in order. ``date`` and ``memory`` stand for the date line and the memory
#: directory; the rest are the environment note's bullets of that name. The machine's facts are
#: the same for every project on it, ``Is a git repository`` for most; the paths come last.
_SESSION_ORDER = ("Platform", "Shell", "OS Version", "Is a git repository", "date")
_PROJECT_ORDER = (
    "memory",
    "Primary working directory",
    "Additional working directories",
)
_FACT_KEYS = tuple(k for k in (*_SESSION_ORDER, *_PROJECT_ORDER) if k not in ("date", "memory"))
_FACT_LINE = re.compile(r"^ - (?P<key>" + "|".join(re.escape(k) for k in _FACT_KEYS) + r"): \S")
_DATE_LINE = re.compile(r"^Today's date is [^\n]+\.$")
_NOTE_HEADING = "# Environment"
_NOTE_LEAD = "You have been invoked in the following environment:"

#: The lead line of Claude Code's user-context reminder: git status (and a project's CLAUDE.md),
#: all of it the project's own.
_PROJECT_REMINDER_LEAD = "As you answer the user's questions, you can use the following context:"
_PROJECT_REMINDER_CLOSE = "Claude Code attached this context automatically;"


@attrs.frozen
class SessionFacts:
    """One session's facts, each line as Claude Code wrote it."""

    #: ``" - Key: value"`` lines from the environment note.
    lines: tuple[str, ...] = ()
    #: The ``Today's date is …`` line.
    date: str | None = None
    #: The memory directory's path, from the system prompt.
    memory_dir: str | None = None

    def __bool__(self) -> bool:
        return bool(self.lines or self.date or self.memory_dir)

    def merge(self, other: SessionFacts) -> SessionFacts:
        return SessionFacts(
            lines=(*self.lines, *other.lines),
            date=self.date or other.date,
            memory_dir=self.memory_dir or other.memory_dir,
        )


def split_memory_dir(texts: Sequence[str]) -> tuple[list[str], str] | None:
    """System texts with the memory directory named instead of spelt out, and its path.

    None unless the texts name exactly one such directory (once or more): then they are left as
    they are.
    """
    found = {m.group(1) for text in texts for m in _MEMORY_DIR.finditer(text)}
    if len(found) != 1:
        return None
    (path,) = found
    quoted = f"`{path}`"
    return [text.replace(quoted, MEMORY_REFERENCE) for text in texts], path


def split_note(text: str) -> tuple[str, SessionFacts] | None:
    """An environment note without its session facts, and the facts.

    Recognised: a ``# Environment`` heading, the ``You have been invoked in the following
    environment:`` line right after it, then bullet lines; the facts are the bullets named in
    the table above (other bullets are instructions and stay) and a ``Today's date is …`` line
    anywhere in the note. None for any other note.
    """
    lines = text.split("\n")
    try:
        heading = lines.index(_NOTE_HEADING)
    except ValueError:
        return None
    if heading + 1 >= len(lines) or lines[heading + 1].rstrip() != _NOTE_LEAD:
        return None
    kept: list[str] = []
    facts: list[str] = []
    date: str | None = None
    in_list = False
    for number, line in enumerate(lines):
        if number == heading + 1:
            in_list = True
        elif in_list and not line.startswith(" - "):
            in_list = False
        if in_list and _FACT_LINE.match(line):
            facts.append(line)
        elif date is None and _DATE_LINE.match(line):
            date = line
        else:
            kept.append(line)
    if not facts and date is None:
        return None
    while kept and not kept[-1].strip():
        kept.pop()  # the date line ended the note; drop the blank line before it
    return "\n".join(kept), SessionFacts(lines=tuple(facts), date=date)


def project_reminder_layout(text: str) -> str | None:
    """Claude Code's user-context reminder with its closing paragraph right after its first line.

    The reminder opens with a line and closes with a paragraph that are the same in every project
    (``Claude Code attached this context automatically; …``); between them is the git status.
    With the closing paragraph moved up, the reminder's own words come first and the project's
    values last, so projects share the reminder up to their first value. None for any other text.
    """
    if not is_project_reminder(text):
        return None
    opening = text[: len(text) - len(text.lstrip())] + "<system-reminder>\n"
    closing = "\n</system-reminder>"
    end = text.rstrip()
    if not (text.startswith(opening) and end.endswith(closing)):
        return None
    trailing = text[len(end) :]
    body = end[len(opening) : -len(closing)]
    lead, _, rest = body.partition("\n")
    paragraphs = rest.split("\n\n")
    if len(paragraphs) < 2 or not paragraphs[-1].startswith(_PROJECT_REMINDER_CLOSE):
        return None
    moved = "\n".join([lead, paragraphs[-1], "\n\n".join(paragraphs[:-1])])
    return opening + moved + closing + trailing


def is_project_reminder(text: str) -> bool:
    """Whether a ``<system-reminder>`` block is Claude Code's user context (git status, a
    project's CLAUDE.md): text of this project alone."""
    body = text.lstrip().removeprefix("<system-reminder>").lstrip()
    return body.startswith(_PROJECT_REMINDER_LEAD)


def facts_blocks(facts: SessionFacts) -> tuple[str | None, str | None]:
    """The facts as two ``<system-reminder>`` blocks: the session's (machine, whether it is a
    git repository, date), shared by most projects on one machine, and the project's (its paths);
    None for a block with nothing to say."""
    ranked = [(m.group("key"), line) for line in facts.lines if (m := _FACT_LINE.match(line))]
    if facts.date:
        ranked.append(("date", facts.date))
    if facts.memory_dir:
        ranked.append(("memory", f" - Memory directory: `{facts.memory_dir}`"))

    def block(header: str, order: tuple[str, ...]) -> str | None:
        # sorted() is stable: lines of one kind keep their order.
        lines = sorted(
            (item for item in ranked if item[0] in order), key=lambda i: order.index(i[0])
        )
        body = [header, *(t for _, t in lines)]
        return "\n".join(["<system-reminder>", *body, "</system-reminder>"]) if lines else None

    return block(SESSION_HEADER, _SESSION_ORDER), block(PROJECT_HEADER, _PROJECT_ORDER)
