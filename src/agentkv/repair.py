"""Conservative recovery of tool calls that a small model wrote as text.

Small models asked to call tools in ``auto`` mode often answer with the call as text: bare JSON
(``{"name": "Read", "arguments": {...}}``), a fenced ```` ```json ```` block, or Qwen's
``<tool_call>`` tags, sometimes with a slip such as a trailing comma or a missing final brace. This
module finds such calls and repairs only slips whose fix is unambiguous. It promises that every
call it returns names a declared tool and that its input validates against that tool's
``input_schema``; anything else stays text. Pure: no I/O.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from agentkv.schema import Schema, json_type, validate

__all__ = [
    "CALL_FENCE_LABELS",
    "ExtractedCall",
    "RejectedCandidate",
    "RepairOutcome",
    "ToolCallExtraction",
    "extract_tool_calls",
    "repair_arguments",
    "repair_json",
]

# -- JSON repair -----------------------------------------------------------------------------------


@attrs.frozen
class RepairOutcome:
    """A parsed value, the text it was parsed from, and the fixes that text needed (none if any)."""

    value: Any
    repaired_text: str
    fixes: tuple[str, ...]


def _reject_constant(name: str) -> Any:
    # NaN and Infinity parse in Python but are not JSON; a client could not read them back.
    raise ValueError(f"{name} is not JSON")


_FENCE = re.compile(r"\A```[A-Za-z0-9_+-]*[ \t]*\n(?P<body>.*?)(?:\n[ \t]*```)?[ \t]*\Z", re.DOTALL)
_CLOSER = {"{": "}", "[": "]"}


def repair_json(text: str) -> RepairOutcome | None:
    """``text`` parsed as JSON, repairing only unambiguous slips; None when it cannot be.

    Valid JSON (after stripping surrounding whitespace) comes back unchanged with no fixes. The
    slips repaired: a markdown code fence around the JSON, a trailing comma before ``}`` or ``]``,
    and a missing closing quote, brackets or braces at the very end. Nothing else — single quotes,
    comments, unquoted keys, a missing comma mid-text — is guessed at.
    """
    stripped = text.strip()
    outcome = _parsed(stripped)
    if outcome is not None:
        return outcome
    fixes: list[str] = []
    fence = _FENCE.match(stripped)
    if fence is not None:
        stripped = fence.group("body").strip()
        fixes.append("removed code fence")
        outcome = _parsed(stripped, fixes)
        if outcome is not None:
            return outcome
    repaired = _repair_syntax(stripped, fixes)
    return None if repaired is None else _parsed(repaired, fixes)


def _parsed(text: str, fixes: Sequence[str] = ()) -> RepairOutcome | None:
    """``text`` as strict JSON (no NaN or Infinity), with the fixes that gave it; None when it
    does not parse."""
    try:
        return RepairOutcome(json.loads(text, parse_constant=_reject_constant), text, tuple(fixes))
    except ValueError:
        return None


def _repair_syntax(text: str, fixes: list[str]) -> str | None:
    """Drop trailing commas and close what is left open at the end; None on anything else odd."""
    out: list[str] = []
    stack: list[str] = []
    in_string = escaped = False
    dropped = 0
    last = ""  # the last significant character outside strings
    for i, char in enumerate(text):
        if in_string:
            out.append(char)
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                last = '"'
            continue
        if char == '"':
            in_string = True
        elif char in _CLOSER:
            stack.append(char)
        elif char in "}]":
            if not stack or _CLOSER[stack.pop()] != char:
                return None  # a mismatched or extra closer is not a slip we can read
        elif char == ",":
            rest = text[i + 1 :].lstrip()
            if rest[:1] in ("}", "]") and last not in ("", ",", ":", "[", "{"):
                dropped += 1
                continue
        out.append(char)
        if not char.isspace():
            last = char
    if dropped:
        fixes.append(f"removed {dropped} trailing comma{'s' if dropped > 1 else ''}")
    if in_string:
        if escaped:
            return None  # cut inside an escape sequence
        out.append('"')
        fixes.append("closed an unterminated string at the end")
        last = '"'
    if stack:
        if last in (",", ":"):
            return None  # cut between a key and its value, or before the next item
        closers = "".join(_CLOSER[opener] for opener in reversed(stack))
        out.append(closers)
        fixes.append(f"added missing {closers!r} at the end")
    return "".join(out)


# -- extraction ------------------------------------------------------------------------------------


@attrs.frozen
class ExtractedCall:
    """A tool call recovered from text: a declared tool and an input its schema accepts."""

    name: str
    input: dict[str, Any]
    fixes: tuple[str, ...] = ()


@attrs.frozen
class RejectedCandidate:
    """Text that looked like a tool call but is not emitted as one, and why."""

    text: str
    reason: str


@attrs.frozen
class ToolCallExtraction:
    """The calls found in a reply, the reply's remaining text, and the candidates turned down."""

    calls: tuple[ExtractedCall, ...]
    text: str
    rejected: tuple[RejectedCandidate, ...]


_TAG = re.compile(r"<tool_call>(?P<body>.*?)(?:(?P<close></tool_call>)|\Z)", re.DOTALL)
#: A fence line: three backticks and a label without spaces or backticks, between spaces or tabs.
FENCE_LINE = re.compile(r"^[ \t]*```(?P<label>[^\s`]*)[ \t]*$", re.MULTILINE)
#: The fence labels of blocks that may hold a call: a ```python block is code, not a call.
CALL_FENCE_LABELS = frozenset({"", "json", "JSON", "tool_call"})
#: The keys of a call, and of the wrapper around one (``{"function": {...}}``).
CALL_KEYS = frozenset({"name", "arguments", "parameters", "id", "type"})
WRAPPER_KEYS = frozenset({"function", "id", "type"})
_TEXT_JOIN = "\n\n"
_PARTIAL = "valid, but written together with a rejected candidate"


def extract_tool_calls(
    text: str, tools: Mapping[str, Schema | None], *, repair: bool = True
) -> ToolCallExtraction:
    """The tool calls a reply wrote as text, for declared ``tools`` (name -> input_schema).

    Looks only where a call is unmistakable: ``<tool_call>`` tags (a final unclosed tag included);
    else fenced ``json`` blocks; else a reply that is nothing but JSON objects. Prose that merely
    contains JSON gives nothing. A candidate becomes a call only if its shape is a call
    (``{"name", "arguments"|"parameters"}`` or ``{"function": {"name", "arguments"}}``), the name
    is declared, and the input validates against the schema. With ``repair=False`` (say, for a
    reply cut off by the token limit) only candidates that parse as they are count. Accepted calls
    are cut out of the text; rejected candidates stay in it.
    """
    spans = [
        (m.start(), m.end(), m.group("body"), m.group("close") is None) for m in _TAG.finditer(text)
    ]
    if not spans:
        spans = _fenced(text)
    whole = text.lstrip().startswith("{")
    if whole and spans and text[spans[0][0]] == "<":
        # A reply that is one call whose input holds the tag's text (in a string): the tag is
        # part of the call, not around one.
        found, turned_down = calls_in(text, tools, repair=repair)
        whole = bool(found) and not turned_down
    if whole and (not spans or text[spans[0][0]] == "<"):
        spans = [(0, len(text), text, False)]

    calls: list[ExtractedCall] = []
    rejected: list[RejectedCandidate] = []
    keep: list[tuple[int, int]] = []
    for start, end, body, unclosed in spans:
        found, turned_down = calls_in(body, tools, repair=repair)
        if unclosed:
            container = "unclosed <tool_call> tag" if text[start] == "<" else "unclosed code fence"
            found = [attrs.evolve(c, fixes=(container, *c.fixes)) for c in found]
        rejected.extend(turned_down)
        if found and not turned_down:
            calls.extend(found)
            keep.append((start, end))
        else:
            # Part of one block is unusable: emitting the rest would act on half of what the
            # model wrote, so the whole block stays text.
            rejected.extend(
                RejectedCandidate(json.dumps({"name": c.name, "arguments": c.input}), _PARTIAL)
                for c in found
            )
    return ToolCallExtraction(tuple(calls), _leftover(text, keep), tuple(rejected))


def _fenced(text: str) -> list[tuple[int, int, str, bool]]:
    """Fenced blocks that may hold a call: (start, end, body, unclosed) for each.

    Fence lines are paired in order, so the closing fence of a ```bash block is never mistaken
    for the opening of the next one. A fence is a candidate only if it is labelled as JSON (or
    not at all) and holds an object: ``` around a shell command is not a call.
    """
    blocks: list[tuple[int, int, str, bool]] = []
    lines = list(FENCE_LINE.finditer(text))
    for opening, closing in itertools.zip_longest(lines[::2], lines[1::2]):
        body_start = opening.end() + 1
        end = closing.end() if closing is not None else len(text)
        body = text[body_start : closing.start() if closing is not None else len(text)]
        if opening.group("label") in CALL_FENCE_LABELS and body.lstrip().startswith("{"):
            blocks.append((opening.start(), end, body, closing is None))
    return blocks


def _leftover(text: str, cut: Sequence[tuple[int, int]]) -> str:
    starts, ends = [0, *(end for _, end in cut)], [*(start for start, _ in cut), len(text)]
    pieces = [text[start:end].strip() for start, end in zip(starts, ends, strict=True)]
    return _TEXT_JOIN.join(piece for piece in pieces if piece)


def calls_in(
    body: str, tools: Mapping[str, Schema | None], *, repair: bool
) -> tuple[list[ExtractedCall], list[RejectedCandidate]]:
    """Calls in one candidate body: one JSON object, or several one after another."""
    values = _objects(body, repair=repair)
    if values is None:
        reason = "not valid JSON" if not repair else "not JSON, and no safe repair"
        return [], [RejectedCandidate(body.strip(), reason)]
    found: list[ExtractedCall] = []
    rejected: list[RejectedCandidate] = []
    for source, value, fixes in values:
        call = as_call(value, tools, fixes, repair=repair)
        if isinstance(call, str):
            rejected.append(RejectedCandidate(source, call))
        else:
            found.append(call)
    return found, rejected


def _objects(body: str, *, repair: bool) -> list[tuple[str, Any, tuple[str, ...]]] | None:
    """Each JSON value in ``body`` (whitespace between them), the last one repaired if need be."""
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    values: list[tuple[str, Any, tuple[str, ...]]] = []
    position = 0
    while True:
        while position < len(body) and body[position].isspace():
            position += 1
        if position == len(body):
            return values or None
        try:
            value, end = decoder.raw_decode(body, position)
        except ValueError:
            outcome = repair_json(body[position:]) if repair else None
            if outcome is None:
                return None
            values.append((body[position:].strip(), outcome.value, outcome.fixes))
            return values
        values.append((body[position:end], value, ()))
        position = end


def as_call(
    value: Any, tools: Mapping[str, Schema | None], fixes: tuple[str, ...], *, repair: bool
) -> ExtractedCall | str:
    """The call ``value`` spells, or the reason it is not one."""
    if not isinstance(value, dict):
        return f"not a JSON object but {json_type(value)}"
    if isinstance(value.get("function"), dict) and value.keys() <= WRAPPER_KEYS:
        value = value["function"]
    if not isinstance(value.get("name"), str):
        return "no tool name"
    if not value.keys() <= CALL_KEYS or ("arguments" in value and "parameters" in value):
        extra = sorted(value.keys() - CALL_KEYS) or ["both arguments and parameters"]
        return f"not a tool call shape (unexpected {', '.join(extra)})"
    name: str = value["name"]
    if name not in tools:
        return f"unknown tool {name!r}"
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        # The OpenAI shape: arguments as a JSON string.
        outcome = repair_json(arguments) if repair else _parsed(arguments)
        if outcome is None:
            return "arguments are a string that is not a JSON object"
        arguments, fixes = outcome.value, fixes + outcome.fixes
    if not isinstance(arguments, dict):
        return f"arguments are {json_type(arguments)}, not an object"
    schema = tools[name]
    errors = validate(arguments, object_schema(schema))
    if errors:
        return f"input does not match the {name} schema: {'; '.join(errors[:3])}"
    return ExtractedCall(name, arguments, fixes)


def object_schema(schema: Schema | None) -> Schema:
    # A tool input is always an object, whatever a schema without ``type`` would allow.
    if schema is None or schema is True:
        return {"type": "object"}
    if schema is False or "type" in schema:
        return schema
    return {**schema, "type": "object"}


def repair_arguments(
    name: str, arguments_text: str, schema: Schema | None
) -> dict[str, Any] | None:
    """The input for a structured call whose ``arguments`` string did not parse, or None.

    Repairs like :func:`repair_json`. Blank arguments mean ``{}``. A model that wrapped the whole
    call (``{"name": name, "arguments": {...}}``) gets the inner input, but only when the outer
    object itself does not fit the schema. Returns an input only if it validates.
    """
    target = object_schema(schema)
    if not arguments_text.strip():
        return {} if not validate({}, target) else None
    outcome = repair_json(arguments_text)
    if outcome is None or not isinstance(outcome.value, dict):
        return None
    value: dict[str, Any] = outcome.value
    if not validate(value, target):
        return value
    inner = value.get("arguments", value.get("parameters"))
    if value.get("name") == name and isinstance(inner, dict) and not validate(inner, target):
        return inner
    return None
