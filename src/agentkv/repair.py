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
from jsonschema import Draft202012Validator, validators

__all__ = [
    "CALL_FENCE_LABELS",
    "TAG_CLOSE",
    "TAG_OPEN",
    "CallScanner",
    "ExtractedCall",
    "HoldOutlook",
    "RejectedCandidate",
    "RepairOutcome",
    "ToolCallExtraction",
    "could_become_call",
    "extract_tool_calls",
    "fence_label",
    "json_type",
    "looks_like_call",
    "may_become_fence_line",
    "needs_retry",
    "repair_arguments",
    "repair_json",
    "validate",
]

Schema = Mapping[str, Any] | bool

# -- validation ------------------------------------------------------------------------------------

_TYPE_NAMES = ("null", "boolean", "integer", "number", "string", "array", "object")


def json_type(value: Any) -> str:
    """The JSON type name of a parsed value (``integer`` for whole numbers, as JSON Schema says)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def validate(instance: Any, schema: Schema, path: str = "$") -> list[str]:
    r"""Errors of ``instance`` against a tool ``input_schema`` (empty when it is valid).

    The schema is applied by ``jsonschema`` with the draft it names (2020-12 when it names none);
    local ``$ref``\ s are followed, ``format`` is not asserted. Each error starts with the path of
    the offending value (``$.todos[0].status``). A schema that cannot be applied (it is itself
    invalid, or refers to a document it does not hold) checks nothing, as ``{}`` would: a
    client's broken schema must not fail its request.
    """
    if not isinstance(schema, Mapping | bool):
        return []
    try:
        cls = validators.validator_for(schema, default=Draft202012Validator)
        found = list(cls(schema).iter_errors(instance))
    except Exception:
        return []
    found.sort(key=lambda e: (tuple(str(p) for p in e.absolute_path), e.message))
    return [f"{path}{e.json_path[1:]}: {e.message}" for e in found]


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


def _loads(text: str) -> Any:
    """Strict JSON: ``json.loads`` without NaN/Infinity. Raises ``ValueError``."""
    return json.loads(text, parse_constant=_reject_constant)


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
    try:
        return RepairOutcome(_loads(stripped), stripped, ())
    except ValueError:
        pass
    fixes: list[str] = []
    fence = _FENCE.match(stripped)
    if fence is not None:
        stripped = fence.group("body").strip()
        fixes.append("removed code fence")
        try:
            return RepairOutcome(_loads(stripped), stripped, tuple(fixes))
        except ValueError:
            pass
    repaired = _repair_syntax(stripped, fixes)
    if repaired is None:
        return None
    try:
        value = _loads(repaired)
    except ValueError:
        return None
    return RepairOutcome(value, repaired, tuple(fixes))


def _repair_syntax(text: str, fixes: list[str]) -> str | None:
    """Drop trailing commas and close what is left open at the end; None on anything else odd."""
    out: list[str] = []
    stack: list[str] = []
    in_string = escaped = False
    dropped = 0
    last = ""  # the last significant character outside strings
    i = 0
    while i < len(text):
        char = text[i]
        i += 1
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
            rest = text[i:].lstrip()
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
_FENCE_LINE = re.compile(r"^[ \t]*```(?P<label>[^\s`]*)[ \t]*$", re.MULTILINE)
# Only fences labelled as JSON (or unlabelled): a ```python block is code, not a call.
_CALL_LABELS = frozenset({"", "json", "JSON", "tool_call"})
#: The fence labels of blocks that may hold a call.
CALL_FENCE_LABELS = _CALL_LABELS
_CALL_KEYS = frozenset({"name", "arguments", "parameters", "id", "type"})
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
    if not spans and text.lstrip().startswith("{"):
        spans = [(0, len(text), text, False)]

    calls: list[ExtractedCall] = []
    rejected: list[RejectedCandidate] = []
    keep: list[tuple[int, int]] = []
    for start, end, body, unclosed in spans:
        found, turned_down = _calls_in(body, tools, repair=repair)
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
    lines = list(_FENCE_LINE.finditer(text))
    for opening, closing in itertools.zip_longest(lines[::2], lines[1::2]):
        body_start = opening.end() + 1
        end = closing.end() if closing is not None else len(text)
        body = text[body_start : closing.start() if closing is not None else len(text)]
        if opening.group("label") in _CALL_LABELS and body.lstrip().startswith("{"):
            blocks.append((opening.start(), end, body, closing is None))
    return blocks


def _leftover(text: str, cut: Sequence[tuple[int, int]]) -> str:
    if not cut:
        return text.strip()
    pieces: list[str] = []
    position = 0
    for start, end in cut:
        pieces.append(text[position:start])
        position = end
    pieces.append(text[position:])
    return _TEXT_JOIN.join(p.strip() for p in pieces if p.strip())


def _calls_in(
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
        call = _call(value, tools, fixes, repair=repair)
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


def _call(
    value: Any, tools: Mapping[str, Schema | None], fixes: tuple[str, ...], *, repair: bool
) -> ExtractedCall | str:
    """The call ``value`` spells, or the reason it is not one."""
    if not isinstance(value, dict):
        return f"not a JSON object but {json_type(value)}"
    if isinstance(value.get("function"), dict) and value.keys() <= {"function", "id", "type"}:
        value = value["function"]
    if not isinstance(value.get("name"), str):
        return "no tool name"
    if not value.keys() <= _CALL_KEYS or ("arguments" in value and "parameters" in value):
        extra = sorted(value.keys() - _CALL_KEYS) or ["both arguments and parameters"]
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
    errors = validate(arguments, _object_schema(schema))
    if errors:
        return f"input does not match the {name} schema: {'; '.join(errors[:3])}"
    return ExtractedCall(name, arguments, fixes)


def _parsed(text: str) -> RepairOutcome | None:
    try:
        return RepairOutcome(_loads(text), text, ())
    except ValueError:
        return None


def _object_schema(schema: Schema | None) -> Schema:
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
    target = _object_schema(schema)
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


# -- where a reply may be a call -------------------------------------------------------------------

_CALL_STARTS = ("{", "```", "<tool_call>")


def looks_like_call(text: str) -> bool | None:
    """Whether a reply that begins with ``text`` may be a tool call written as text.

    True when it starts (after whitespace) with ``{``, a code fence or ``<tool_call>``; False when
    it cannot; None while ``text`` is too short to tell (``<too``). A reply that may be a call is
    held back until it is complete, so that it can become a ``tool_use`` block instead of text.
    """
    head = text.lstrip()
    if not head:
        return None
    if head.startswith(_CALL_STARTS):
        return True
    if any(marker.startswith(head) for marker in _CALL_STARTS):
        return None
    return False


def needs_retry(text: str, tools: Mapping[str, Schema | None]) -> bool:
    """True when a complete reply tried to call a tool but no valid call can be recovered.

    The server then asks once more with constrained decoding over the declared tools.
    """
    if looks_like_call(text) is not True:
        return False
    found = extract_tool_calls(text, tools)
    return not found.calls and bool(found.rejected)


# -- while a reply is held -------------------------------------------------------------------------
#
# The assembler holds back text from the point where a call may start (see docs/repair.md). These
# helpers say, as the held text grows, whether it can still become a call, so that text which
# cannot is released at once instead of at the end of the reply.

TAG_OPEN = "<tool_call>"
TAG_CLOSE = "</tool_call>"
_FENCE_WHOLE = re.compile(r"[ \t]*```(?P<label>[^\s`]*)[ \t]*")
_FENCE_START = re.compile(r"[ \t]*(?:`{0,2}|```[^\s`]*[ \t]*)")
_JSON_SPACE = frozenset(" \t\n\r")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_WORDS = ("true", "false", "null")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
_WRAPPER_KEYS = frozenset({"function", "id", "type"})
#: The JSON type a value has, told from its first character.
_FIRST_CHAR_TYPE = {'"': "string", "{": "object", "[": "array", "t": "boolean", "f": "boolean"}


def fence_label(line: str) -> str | None:
    """The label of a fence line (``line`` without its newline), or None if it is not one.

    The same lines as the extractor's fence pattern: optional spaces or tabs, three backticks, a
    label without spaces or backticks, optional spaces or tabs.
    """
    match = _FENCE_WHOLE.fullmatch(line)
    return match.group("label") if match is not None else None


def may_become_fence_line(partial: str) -> bool:
    """Whether a line that begins with ``partial`` (no newline yet) can still be a fence line."""
    return _FENCE_START.fullmatch(partial) is not None


@attrs.frozen
class HoldOutlook:
    """What a held segment of a reply can still become (see :class:`CallScanner`).

    - ``can_be_call``: some continuation of the text may still be extracted as a valid call of a
      declared tool. Conservative: True whenever that cannot be ruled out.
    - ``committed``: a declared tool's name has been written where a call names its tool, and
      nothing so far contradicts a valid call. Such a segment is a call being written.
    - ``attempt``: it cannot become a valid call, but it is a call written wrongly: an object in a
      call position (a reply that starts with ``{``, a ``json`` fence, a tag). If the reply ended
      here, it would be worth the constrained retry (see :func:`needs_retry`).
    """

    can_be_call: bool
    committed: bool = False
    attempt: bool = False


_UNDECIDED = HoldOutlook(can_be_call=True)
_NOT_A_CALL = HoldOutlook(can_be_call=False)
_ATTEMPT = HoldOutlook(can_be_call=False, attempt=True)


def could_become_call(text: str, tools: Mapping[str, Schema | None]) -> bool:
    """False once held ``text`` can no longer become a valid call of one of ``tools``.

    ``text`` is where a call may start: a reply that begins with ``{``, a fence line labelled as
    JSON, or a ``<tool_call>`` tag. It is judged as :func:`extract_tool_calls` would judge it,
    whatever followed: False for a fence that is not JSON, a tag or fence whose body does not
    start with ``{``, text that is not the prefix of valid JSON (allowing the repairs
    :func:`repair_json` makes), an object with a key no call has, a ``name`` that is not the prefix
    of a declared tool's name, an argument the tool's schema forbids or of a type it cannot have,
    a complete candidate that is not a valid call, or a bare JSON call followed by prose. Only the
    first candidate block is judged: a later ``<tool_call>`` tag or fence is another candidate,
    which the assembler finds when it scans the released text. Use :class:`CallScanner` to judge
    text that grows; this function reads ``text`` whole.
    """
    return CallScanner(tools).feed(text).can_be_call


@attrs.define
class _Frame:
    kind: str  # "{" or "["
    role: str  # "call", "function", "args" or "other"
    state: str  # objects: key_or_end, key, colon, value, after; arrays: value_or_end, value, after
    key: str = ""
    keys: set[str] = attrs.field(factory=set)


@attrs.define
class _CallJson:
    """An incremental reader of JSON values that must each be a tool call.

    It follows the JSON grammar as :func:`json.loads` does (strict strings, no NaN), except that a
    trailing comma before a closer is allowed, as :func:`repair_json` removes it. Each complete
    value is judged as the extractor judges it. Reading a piece costs time in proportion to the
    piece (runs of plain string characters are skipped by a regular expression).

    - ``invalid``: no continuation can give valid calls (reading goes on, to see what follows);
    - ``broken``: the text is not JSON any more (reading stops);
    - ``not_object``: the text does not start with ``{``, so it is not a candidate at all;
    - ``trailing``: something other than another object followed a complete value;
    - ``named``: the value being read names a declared tool where a call names its tool.
    """

    tools: Mapping[str, Schema | None]
    invalid: bool = False
    broken: bool = False
    not_object: bool = False
    trailing: bool = False
    named: bool = False
    values: int = 0  # complete values read
    _stack: list[_Frame] = attrs.field(factory=list, init=False)
    #: The pieces of the top-level value being read.
    _value: list[str] | None = attrs.field(default=None, init=False)
    #: Where that value starts in the current piece.
    _value_from: int = attrs.field(default=0, init=False)
    #: The last complete value needed a repair: nothing may follow it.
    _repaired: bool = attrs.field(default=False, init=False)
    _in_string: bool = attrs.field(default=False, init=False)
    _string_is_key: bool = attrs.field(default=False, init=False)
    #: 0: none; 1: after a backslash; 2-5: reading \u hex digits.
    _escape: int = attrs.field(default=0, init=False)
    #: The key or tool name being read.
    _capture: list[str] | None = attrs.field(default=None, init=False)
    #: The capture holds escapes: judge it when it is complete.
    _capture_raw: bool = attrs.field(default=False, init=False)
    _literal: str | None = attrs.field(default=None, init=False)
    _name: str = attrs.field(default="", init=False)

    def feed(self, text: str) -> None:
        i, end = 0, len(text)
        self._value_from = 0
        while i < end and not self.broken and not self.trailing:
            if self._in_string:
                i = self._string_char(text, i)
                continue
            char = text[i]
            if self._literal is not None:
                if char in _NUMBER_CHARS or char.isalpha():
                    self._literal += char
                    if not self._literal_may_continue():
                        self._break()
                    i += 1
                    continue
                self._end_literal()
                if self.broken:
                    break
            self._char(text, i)
            i += 1
        if self._value is not None:
            self._value.append(text[self._value_from :])

    def _break(self) -> None:
        self.broken = self.invalid = True

    # -- strings -----------------------------------------------------------------------------

    def _string_char(self, text: str, i: int) -> int:
        if self._escape == 0 and self._capture is None:
            # The common case, inside a long value: skip plain characters in C.
            match = _STRING_RUN.match(text, i)
            if match is not None and match.end() > i:
                return match.end()
        char = text[i]
        if self._escape == 1:
            if char not in _ESCAPES:
                self._break()
            self._escape = 2 if char == "u" else 0
            self._record(char)
        elif self._escape >= 2:
            if char not in _HEX:
                self._break()
            self._escape = 0 if self._escape == 5 else self._escape + 1
            self._record(char)
        elif char == "\\":
            self._escape = 1
            self._capture_raw = True
            self._record(char)
        elif char == '"':
            self._in_string = False
            self._end_string()
        elif char < " ":
            self._break()  # a raw control character in a string: json.loads refuses it
        else:
            self._record(char)
            if self._capture is not None and not self._string_is_key and not self._capture_raw:
                partial = "".join(self._capture)
                if not any(tool.startswith(partial) for tool in self.tools):
                    self.invalid = True  # no declared tool's name starts like this
        return i + 1

    def _record(self, char: str) -> None:
        if self._capture is not None:
            self._capture.append(char)

    def _captured(self) -> str | None:
        """The key or name just read, unescaped (None if it cannot be)."""
        raw = "".join(self._capture or ())
        self._capture = None
        if not self._capture_raw:
            return raw
        try:
            value = json.loads(f'"{raw}"')
        except ValueError:
            return None
        return value if isinstance(value, str) else None

    def _end_string(self) -> None:
        frame = self._stack[-1]
        if self._string_is_key:
            key = self._captured()
            if key is None:
                self._break()
                return
            frame.key, frame.state = key, "colon"
            self._check_key(frame, key)
            return
        if self._capture is not None:
            name = self._captured()
            if name is None or name not in self.tools:
                self.invalid = True
            else:
                self._name, self.named = name, True
        frame.state = "after"

    # -- literals ----------------------------------------------------------------------------

    def _literal_may_continue(self) -> bool:
        literal = self._literal or ""
        if literal[0] in "-0123456789":
            return all(c in _NUMBER_CHARS for c in literal)
        return any(word.startswith(literal) for word in _WORDS)

    def _end_literal(self) -> None:
        literal, self._literal = self._literal or "", None
        if literal not in _WORDS and _NUMBER.fullmatch(literal) is None:
            self._break()
            return
        self._stack[-1].state = "after"

    # -- structure ---------------------------------------------------------------------------

    def _char(self, text: str, i: int) -> None:
        char = text[i]
        if not self._stack:
            self._top(char, i)
            return
        if char in _JSON_SPACE:
            return
        frame = self._stack[-1]
        state = frame.state
        if frame.kind == "{":
            if state in ("key_or_end", "key") and char == '"':
                self._open_string(key=True)
            elif state in ("key_or_end", "key", "after") and char == "}":
                self._close(text, i)
            elif state == "colon" and char == ":":
                frame.state = "value"
            elif state == "value":
                self._start_value(char, frame)
            elif state == "after" and char == ",":
                frame.state = "key"
            else:
                self._break()
        elif state in ("value_or_end", "value", "after") and char == "]":
            self._close(text, i)
        elif state in ("value_or_end", "value"):
            self._start_value(char, frame)
        elif state == "after" and char == ",":
            frame.state = "value"
        else:
            self._break()

    def _top(self, char: str, i: int) -> None:
        if char in _JSON_SPACE:
            return
        if char != "{":
            if self.values:
                self.trailing = True  # prose (or anything else) after the calls
            else:
                self.not_object = True
            self._break()
            return
        if self._repaired:
            self.invalid = True  # only the last value may need a repair
        self._value, self._value_from = [], i
        self._name, self.named = "", False
        self._stack.append(_Frame("{", "call", "key_or_end"))

    def _open_string(self, *, key: bool) -> None:
        self._in_string, self._string_is_key = True, key
        self._escape = 0
        self._capture_raw = False
        self._capture = [] if key else None

    def _start_value(self, char: str, frame: _Frame) -> None:
        role, key = frame.role, frame.key if frame.kind == "{" else ""
        child = "other"
        if role in ("call", "function") and key == "name":
            if char == '"':
                self._open_string(key=False)
                self._capture = []
                return
            self.invalid = True  # a tool name is a string
        elif role in ("call", "function") and key in ("arguments", "parameters"):
            child = "args"
            if char not in '{"':
                self.invalid = True  # arguments are an object, or a string holding one
        elif role == "call" and key == "function":
            child = "function"
            if char != "{":
                self.invalid = True
        elif role == "args":
            self._check_argument_type(key, char)
        if char == '"':
            self._open_string(key=False)
        elif char in "{[":
            state = "key_or_end" if char == "{" else "value_or_end"
            self._stack.append(_Frame(char, child, state))
        elif char in "-0123456789tfn":
            self._literal = char
        else:
            self._break()

    def _close(self, text: str, i: int) -> None:
        self._stack.pop()
        if self._stack:
            self._stack[-1].state = "after"
            return
        # A complete top-level value: it must be a valid call, as the extractor reads it.
        pieces = self._value or []
        pieces.append(text[self._value_from : i + 1])
        self._value = None
        self.values += 1
        outcome = repair_json("".join(pieces))
        call = None if outcome is None else _call(outcome.value, self.tools, (), repair=True)
        if outcome is None or not isinstance(call, ExtractedCall):
            self.invalid = True
        else:
            self._repaired = bool(outcome.fixes)

    # -- call shape and schema ---------------------------------------------------------------

    def _check_key(self, frame: _Frame, key: str) -> None:
        if frame.role == "args":
            schema = self._schema()
            if (
                isinstance(schema, Mapping)
                and schema.get("additionalProperties", True) is False
                and key not in (schema.get("properties") or {})
            ):
                self.invalid = True  # validate() would report an unexpected property
            return
        if frame.role not in ("call", "function"):
            return
        allowed = _CALL_KEYS | _WRAPPER_KEYS if frame.role == "call" else _CALL_KEYS
        frame.keys.add(key)
        if (
            key not in allowed
            or {"arguments", "parameters"} <= frame.keys
            or ("function" in frame.keys and frame.keys & {"name", "arguments", "parameters"})
        ):
            self.invalid = True

    def _schema(self) -> Schema | None:
        return _object_schema(self.tools.get(self._name)) if self.named else None

    def _check_argument_type(self, key: str, char: str) -> None:
        """An argument whose first character shows a type its property schema does not allow."""
        schema = self._schema()
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        prop = properties.get(key) if isinstance(properties, Mapping) else None
        expected = prop.get("type") if isinstance(prop, Mapping) else None
        names = [expected] if isinstance(expected, str) else expected
        if not isinstance(names, list) or not names or not set(names) <= set(_TYPE_NAMES):
            return
        if char == "-" or char.isdigit():
            # A number may still turn out to be an integer or not.
            if not {"number", "integer"} & set(names):
                self.invalid = True
            return
        actual = _FIRST_CHAR_TYPE.get(char, "null" if char == "n" else None)
        if actual is not None and actual not in names:
            self.invalid = True


@attrs.define
class CallScanner:
    """Reads a held segment of a reply as it grows and says what it can still become.

    The segment starts where a call may start: a reply that begins with ``{``, a fence line
    labelled ``json``, ``JSON``, ``tool_call`` or not labelled, or a ``<tool_call>`` tag. Each
    :meth:`feed` costs time in proportion to the new text, plus one extraction when the candidate
    block closes, so a long held reply is read once and not once per chunk. Only the first
    candidate block is judged; :func:`could_become_call` says what rules a call out.
    """

    tools: Mapping[str, Schema | None]
    _parts: list[str] = attrs.field(factory=list, init=False)
    _length: int = attrs.field(default=0, init=False)
    #: "", "bare", "tag", "fence" or "none".
    _container: str = attrs.field(default="", init=False)
    _opening_end: int = attrs.field(default=0, init=False)
    _json: _CallJson | None = attrs.field(default=None, init=False)
    #: Text not yet read: the opening, or what may start a closing tag or fence.
    _pending: str = attrs.field(default="", init=False)
    #: Fences: the current line can no longer be the closing fence.
    _line_is_body: bool = attrs.field(default=False, init=False)
    #: Tags: the first character of the body, once there is one.
    _tag_body: str = attrs.field(default="", init=False)
    _closed: bool = attrs.field(default=False, init=False)
    _block_ok: bool = attrs.field(default=False, init=False)
    _outlook: HoldOutlook = attrs.field(default=_UNDECIDED, init=False)

    @property
    def outlook(self) -> HoldOutlook:
        """The verdict on the text fed so far."""
        return self._outlook

    @property
    def text(self) -> str:
        """Everything fed so far."""
        return "".join(self._parts)

    @property
    def opening_end(self) -> int:
        """Where the opening (``{``, the fence line, the tag) ends; 1 while it is not known."""
        return self._opening_end or 1

    def feed(self, text: str) -> HoldOutlook:
        """Add text to the segment; returns the updated :attr:`outlook`."""
        if not text:
            return self._outlook
        self._parts.append(text)
        self._length += len(text)
        if self._container == "none" or self._closed:
            return self._outlook  # the first block is judged; what follows does not change that
        self._pending += text
        if not self._container and not self._open():
            return self._outlook
        if self._container == "bare":
            self._read(self._pending)
            self._pending = ""
        elif self._container == "tag":
            self._read_tag()
        else:
            self._read_fence()
        self._outlook = self._judge()
        return self._outlook

    def _open(self) -> bool:
        head = self._pending.lstrip()
        skipped = len(self._pending) - len(head)
        if head.startswith("{"):
            self._container, self._opening_end = "bare", skipped + 1
            self._json, self._pending = _CallJson(self.tools), head
            return True
        if head.startswith(TAG_OPEN):
            self._container, self._opening_end = "tag", skipped + len(TAG_OPEN)
            self._pending = head[len(TAG_OPEN) :]
            return True
        if head.startswith("```"):
            newline = head.find("\n")
            line = head if newline < 0 else head[:newline]
            label = fence_label(line)
            if newline < 0 and may_become_fence_line(line):
                partial = line[3:].rstrip(" \t")
                if any(known.startswith(partial) for known in _CALL_LABELS):
                    return False  # the label is still being written
            if newline < 0 or label not in _CALL_LABELS:
                self._container, self._outlook = "none", _NOT_A_CALL  # ```python is code
                return False
            self._container, self._opening_end = "fence", skipped + newline + 1
            self._json, self._pending = _CallJson(self.tools), head[newline + 1 :]
            return True
        if not head or any(marker.startswith(head) for marker in (TAG_OPEN, "```")):
            return False  # "<too": too short to tell
        self._container, self._outlook = "none", _NOT_A_CALL
        return False

    def _read(self, text: str) -> None:
        if self._json is not None and text:
            self._json.feed(text)

    def _read_tag(self) -> None:
        text, keep = self._pending, len(TAG_CLOSE) - 1
        if not self._tag_body:
            body = text.lstrip()
            if not body:
                self._pending = ""
                return
            self._tag_body, text = body[0], body
            if body[0] == "{":
                self._json = _CallJson(self.tools)
        close = text.find(TAG_CLOSE)
        if close < 0:
            # The end may be the start of the closing tag: it is not read as JSON yet.
            self._read(text[:-keep])
            self._pending = text[-keep:]
            return
        self._read(text[:close])
        end = self._length - len(text) + close  # where the closing tag starts in the segment
        self._close_block(self.text[self._opening_end : end])

    def _read_fence(self) -> None:
        text = self._pending
        self._pending = ""
        while text:
            newline = text.find("\n")
            line = text if newline < 0 else text[:newline]
            if newline < 0:
                if not self._line_is_body and may_become_fence_line(line):
                    self._pending = line  # may still be the closing fence line
                    return
                self._line_is_body = True
                self._read(line)
                return
            if not self._line_is_body and fence_label(line) is not None:
                start = self._length - len(text)  # the closing line's start in the segment
                self._close_block(self.text[self._opening_end : start])
                return
            self._read(text[: newline + 1])
            self._line_is_body = False
            text = text[newline + 1 :]

    def _close_block(self, body: str) -> None:
        found, rejected = _calls_in(body, self.tools, repair=True)
        self._block_ok = bool(found) and not rejected
        self._closed = True
        self._pending = ""

    def _judge(self) -> HoldOutlook:
        if self._closed:
            if self._block_ok:
                return HoldOutlook(can_be_call=True, committed=True)
            return _ATTEMPT
        reader = self._json
        if self._container == "tag" and reader is None:
            # Empty so far, or a fenced call inside the tag, which repair_json can still read.
            return _UNDECIDED if self._tag_body in ("", "`") else _NOT_A_CALL
        if reader is None:
            return _UNDECIDED
        if reader.not_object:
            return _NOT_A_CALL  # the extractor only reads blocks that hold an object
        if reader.invalid or reader.trailing:
            return _ATTEMPT
        return HoldOutlook(can_be_call=True, committed=reader.named or reader.values > 0)
