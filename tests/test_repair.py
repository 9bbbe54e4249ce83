"""Tool calls written as text: validation, JSON repair and extraction, measured on a corpus."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv.callscan import CallScanner, HoldOutlook, fence_label, may_become_fence_line
from agentkv.repair import ExtractedCall, extract_tool_calls, repair_arguments, repair_json
from agentkv.schema import validate

CORPUS_DIR = Path(__file__).parent / "fixtures" / "tool_calls"
TOOLS: dict[str, Any] = json.loads((CORPUS_DIR / "tools.json").read_text())
SCHEMAS: dict[str, Any] = {name: tool["input_schema"] for name, tool in TOOLS.items()}
CORPUS: list[dict[str, Any]] = [
    json.loads(line)
    for line in (CORPUS_DIR / "corpus.jsonl").read_text().splitlines()
    if line.strip()
]
DOC = Path(__file__).parent.parent / "docs" / "repair.md"

# Defects whose fix is unambiguous; a malformed record with only these, and an intended call, is
# one the repair must recover.
SLIPS = {"trailing-comma", "missing-closer", "missing-quote", "unclosed-tag", "unclosed-fence"}


def _declared(record: dict[str, Any]) -> dict[str, Any]:
    return {name: SCHEMAS[name] for name in record["tools"]}


def _extract(record: dict[str, Any]) -> tuple[ExtractedCall, ...]:
    return extract_tool_calls(record["text"], _declared(record)).calls


def _as_labels(calls: tuple[ExtractedCall, ...]) -> list[dict[str, Any]]:
    return [{"name": call.name, "input": call.input} for call in calls]


def _call_of(value: dict[str, Any]) -> dict[str, Any]:
    """A call shape read independently of the code under test."""
    if "function" in value:
        value = value["function"]
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    return {"name": value["name"], "input": arguments}


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [r for r in CORPUS if r["kind"] == kind]


def _measure() -> dict[str, int]:
    """Corpus composition and the repair figures, as docs/repair.md reports them."""
    malformed = _by_kind("malformed")
    repairable = [r for r in malformed if r["intended"] and set(r["defects"]) <= SLIPS]
    intended = [r for r in malformed if r["intended"]]
    return {
        "records": len(CORPUS),
        "model": sum(r["source"] == "model" for r in CORPUS),
        "hand": sum(r["source"] == "hand" for r in CORPUS),
        "valid": len(_by_kind("valid")),
        "malformed": len(malformed),
        "plain": len(_by_kind("plain")),
        "repairable": len(repairable),
        "repaired": sum(_as_labels(_extract(r)) == r["intended"] for r in repairable),
        "intended": len(intended),
        "recovered": sum(_as_labels(_extract(r)) == r["intended"] for r in intended),
    }


# -- the corpus ------------------------------------------------------------------------------------


def test_corpus_has_enough_of_each_kind() -> None:
    """The corpus holds at least 40 valid and 40 malformed records, from the model and by hand."""
    kinds = Counter(r["kind"] for r in CORPUS)
    sources = Counter(r["source"] for r in CORPUS)
    assert kinds["valid"] >= 40
    assert kinds["malformed"] >= 40
    assert sources["model"] > 0 and sources["hand"] > 0
    assert len({r["id"] for r in CORPUS}) == len(CORPUS)
    assert all(set(r["tools"]) <= set(SCHEMAS) for r in CORPUS)


@pytest.mark.parametrize("record", CORPUS, ids=[r["id"] for r in CORPUS])
def test_extraction_matches_the_label(record: dict[str, Any]) -> None:
    """Each record gives exactly the calls its label expects."""
    assert _as_labels(_extract(record)) == record["expect"]["calls"]


@pytest.mark.parametrize("record", _by_kind("valid"), ids=[r["id"] for r in _by_kind("valid")])
def test_valid_calls_come_back_unchanged(record: dict[str, Any]) -> None:
    """A well-formed call is returned exactly as json.loads reads it, with no fixes."""
    expected = [_call_of(json.loads(text)) for text in record["call_json"]]
    assert all(text in record["text"] for text in record["call_json"])
    calls = _extract(record)
    assert _as_labels(calls) == expected
    assert all(call.fixes == () for call in calls)


def test_no_emitted_call_fails_its_schema() -> None:
    """Over the whole corpus every emitted call names a declared tool and validates."""
    emitted = [(r, call) for r in CORPUS for call in _extract(r)]
    assert emitted
    for record, call in emitted:
        assert call.name in record["tools"]
        assert validate(call.input, SCHEMAS[call.name]) == []


def test_malformed_records_never_yield_an_unintended_call() -> None:
    """Repair only ever recovers a call a reader sees was meant; it never invents another."""
    for record in _by_kind("malformed"):
        for call in _as_labels(_extract(record)):
            assert call in record["intended"], record["id"]


def test_every_plain_answer_stays_text() -> None:
    """Prose answers give no call and keep their text."""
    for record in _by_kind("plain"):
        found = extract_tool_calls(record["text"], _declared(record))
        assert found.calls == ()
        assert found.text == record["text"].strip()


def test_repair_rate_is_complete_and_documented() -> None:
    """Every slip-only record is repaired, and docs/repair.md states the measured figures."""
    m = _measure()
    assert m["repaired"] == m["repairable"] > 0
    doc = " ".join(DOC.read_text().split())  # line breaks do not matter
    stated = {
        "records": rf"\b{m['records']} records\b",
        "sources": rf"\b{m['model']} from the model\b.*\b{m['hand']} written by hand\b",
        "kinds": rf"\b{m['valid']} valid\b.*\b{m['malformed']} malformed\b.*\b{m['plain']} plain\b",
        "repair": rf"\b{m['repaired']} of {m['repairable']}\b",
        "recall": rf"\b{m['recovered']} of {m['intended']}\b",
    }
    for what, pattern in stated.items():
        assert re.search(pattern, doc), f"docs/repair.md does not state the {what}: {m}"


# -- validate --------------------------------------------------------------------------------------

SCHEMA_CASES: list[tuple[Any, dict[str, Any], list[str]]] = [
    ({"city": "Paris"}, SCHEMAS["get_weather"], []),
    ({}, SCHEMAS["get_weather"], ["$: 'city' is a required property"]),
    ({"city": 3}, SCHEMAS["get_weather"], ["$.city: 3 is not of type 'string'"]),
    (
        {"city": "A", "x": 1},
        SCHEMAS["get_weather"],
        ["$: Additional properties are not allowed ('x' was unexpected)"],
    ),
    ({"file_path": "/a", "offset": 2.0}, SCHEMAS["Read"], []),
    (
        {"file_path": "/a", "offset": 2.5},
        SCHEMAS["Read"],
        ["$.offset: 2.5 is not of type 'integer'"],
    ),
    (
        {"file_path": "/a", "limit": 0},
        SCHEMAS["Read"],
        ["$.limit: 0 is less than the minimum of 1"],
    ),
    (
        {"command": "ls", "timeout": True},
        SCHEMAS["Bash"],
        ["$.timeout: True is not of type 'number'"],
    ),
    (
        {"todos": [{"content": "", "status": "pending", "activeForm": "x"}]},
        SCHEMAS["TodoWrite"],
        ["$.todos[0].content: '' should be non-empty"],
    ),
    ([1, 2, 3], {"type": "array", "maxItems": 2}, ["$: [1, 2, 3] is too long"]),
    ([], {"type": "array", "minItems": 1}, ["$: [] should be non-empty"]),
    (None, {"type": ["string", "null"]}, []),
    # JSON's true is not 1.
    (True, {"const": 1}, ["$: 1 was expected"]),
    (1, {"enum": [True, "1"]}, ["$: 1 is not one of [True, '1']"]),
    ("ab", {"pattern": "^a"}, []),
    ("ba", {"pattern": "^a"}, ["$: 'ba' does not match '^a'"]),
    (
        5,
        {"anyOf": [{"type": "string"}, {"minimum": 10}]},
        ["$: 5 is not valid under any of the given schemas"],
    ),
    (
        5,
        {"oneOf": [{"type": "integer"}, {"type": "number"}]},
        ["$: 5 is valid under each of {'type': 'number'}, {'type': 'integer'}"],
    ),
    ({"a": 1}, {"additionalProperties": {"type": "string"}}, ["$.a: 1 is not of type 'string'"]),
    # A local $ref is followed (the hand-written checker ignored it).
    (
        {"a": 1},
        {"$defs": {"s": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/s"}}},
        ["$.a: 1 is not of type 'string'"],
    ),
    # A schema that cannot be applied checks nothing: a $ref to nothing, an invalid pattern.
    ({"a": 1}, {"$ref": "#/definitions/x", "format": "uri", "x-anything": 1}, []),
    ("a", {"pattern": "("}, []),
    (1, False, ["$: False schema does not allow 1"]),
]


@pytest.mark.parametrize(("instance", "schema", "errors"), SCHEMA_CASES)
def test_validate_reports_each_violation_by_path(
    instance: Any, schema: dict[str, Any], errors: list[str]
) -> None:
    """validate names the path and the rule of every violation, and nothing for valid input."""
    assert validate(instance, schema) == errors


# -- repair_json -----------------------------------------------------------------------------------

REPAIRS = [
    ('{"a": 1,}', {"a": 1}, ("removed 1 trailing comma",)),
    ("[1, 2 , ]", [1, 2], ("removed 1 trailing comma",)),
    ('{"a": [1,], "b": {"c": 2,},}', {"a": [1], "b": {"c": 2}}, ("removed 3 trailing commas",)),
    ('{"a": {"b": [1', {"a": {"b": [1]}}, ("added missing ']}}' at the end",)),
    (
        '{"a": "x',
        {"a": "x"},
        ("closed an unterminated string at the end", "added missing '}' at the end"),
    ),
    ('```json\n{"a": 1}\n```', {"a": 1}, ("removed code fence",)),
    ('```\n{"a": 1,}\n```', {"a": 1}, ("removed code fence", "removed 1 trailing comma")),
    ('{"s": "a,}"', {"s": "a,}"}, ("added missing '}' at the end",)),
    ('  \n{"a": 1}\n ', {"a": 1}, ()),
]


@pytest.mark.parametrize(("text", "value", "fixes"), REPAIRS)
def test_repair_json_fixes_clear_slips(text: str, value: Any, fixes: tuple[str, ...]) -> None:
    """Trailing commas, missing closers at the end and code fences are repaired and reported."""
    outcome = repair_json(text)
    assert outcome is not None
    assert (outcome.value, outcome.fixes) == (value, fixes)
    assert json.loads(outcome.repaired_text) == value


REFUSALS = [
    "{'a': 1}",
    "{a: 1}",
    '{"a": 1 // note\n}',
    '{"a": 1 "b": 2}',
    '{"a": True}',
    '{"a": NaN}',
    '{"a": 1}}',
    '{"a": [1}',
    '{"a":',
    '{"a": 1,',
    '{"a": "x\\',
    '{"a": tru',
    "[,]",
    "",
    "plain words",
]


@pytest.mark.parametrize("text", REFUSALS)
def test_repair_json_refuses_anything_it_would_have_to_guess(text: str) -> None:
    """Quotes, comments, unquoted keys, missing commas, literals and cuts mid-value are refused."""
    assert repair_json(text) is None


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
json_objects = st.dictionaries(st.text(), json_values, max_size=5)


@given(json_values)
def test_valid_json_is_never_altered(value: Any) -> None:
    """repair_json of any JSON text gives its value back, unchanged, with no fixes."""
    text = json.dumps(value)
    outcome = repair_json(text)
    assert outcome is not None
    assert (outcome.value, outcome.repaired_text, outcome.fixes) == (value, text, ())


@given(json_objects, st.booleans(), st.data())
def test_cutting_closers_at_the_end_is_undone(
    value: dict[str, Any], compact: bool, data: st.DataObject
) -> None:
    """Dropping any number of the final closing braces/brackets is repaired back to the value."""
    text = json.dumps(value, separators=(",", ":") if compact else None)
    closers = len(text) - len(text.rstrip("}]"))
    cut = data.draw(st.integers(1, closers))
    outcome = repair_json(text[:-cut])
    assert outcome is not None
    assert outcome.value == value
    assert outcome.fixes != ()


@given(json_objects)
def test_extraction_emits_exactly_the_schema_valid_inputs(arguments: dict[str, Any]) -> None:
    """A whole-reply call is emitted unchanged when its input validates, and never otherwise."""
    text = json.dumps({"name": "get_weather", "arguments": arguments})
    found = extract_tool_calls(text, {"get_weather": SCHEMAS["get_weather"]})
    if validate(arguments, SCHEMAS["get_weather"]):
        assert found.calls == ()
        assert found.text == text
    else:
        assert found.calls == (ExtractedCall("get_weather", arguments),)
        assert found.text == ""


# -- extract_tool_calls ----------------------------------------------------------------------------


def test_leftover_text_keeps_the_prose_around_accepted_calls() -> None:
    """Prose before and after a tagged call survives; the call itself is cut out."""
    text = (
        'First I read it.\n<tool_call>\n{"name": "Read", "arguments": {"file_path": "/a"}}\n'
        "</tool_call>\nThen I decide."
    )
    found = extract_tool_calls(text, {"Read": SCHEMAS["Read"]})
    assert found.calls == (ExtractedCall("Read", {"file_path": "/a"}),)
    assert found.text == "First I read it.\n\nThen I decide."


def test_rejected_candidates_stay_in_the_text_with_a_reason() -> None:
    """A tag naming an undeclared tool stays text, and the rejection says why."""
    text = '<tool_call>\n{"name": "Nope", "arguments": {}}\n</tool_call>'
    found = extract_tool_calls(text, {"Read": SCHEMAS["Read"]})
    assert found.calls == ()
    assert found.text == text
    assert [r.reason for r in found.rejected] == ["unknown tool 'Nope'"]


def test_without_repair_only_intact_json_counts() -> None:
    """repair=False (a reply cut off by the token limit) accepts intact calls, not repaired ones."""
    tools = {"Read": SCHEMAS["Read"]}
    intact = '{"name": "Read", "arguments": {"file_path": "/a"}}'
    assert extract_tool_calls(intact, tools, repair=False).calls != ()
    assert extract_tool_calls(intact[:-1], tools, repair=False).calls == ()
    assert extract_tool_calls(intact[:-1], tools).calls != ()


def test_fences_pair_in_order() -> None:
    """The closing fence of a shell block does not open a JSON block."""
    text = '```bash\nls\n```\nThen:\n```json\n{"name": "Glob", "arguments": {"pattern": "*"}}\n```'
    found = extract_tool_calls(text, {"Glob": SCHEMAS["Glob"]})
    assert found.calls == (ExtractedCall("Glob", {"pattern": "*"}),)
    assert found.text == "```bash\nls\n```\nThen:"


def test_a_tool_without_schema_takes_any_object() -> None:
    """A declared tool with no input_schema accepts any object input, including none."""
    found = extract_tool_calls('{"name": "ping"}', {"ping": None})
    assert found.calls == (ExtractedCall("ping", {}),)


# -- repair_arguments ------------------------------------------------------------------------------

ARGUMENTS = [
    ('{"command": "ls",}', {"command": "ls"}),
    ('{"command": "ls"', {"command": "ls"}),
    ('{"command": "ls"}', {"command": "ls"}),
    ('{"name": "Bash", "arguments": {"command": "ls"}}', {"command": "ls"}),
    ('{"name": "Read", "arguments": {"command": "ls"}}', None),
    ('{"cmd": "ls"}', None),
    ("{'command': 'ls'}", None),
    ('["ls"]', None),
    ("", None),
]


@pytest.mark.parametrize(("text", "expected"), ARGUMENTS)
def test_repair_arguments_returns_only_schema_valid_input(
    text: str, expected: dict[str, Any] | None
) -> None:
    """Broken argument strings are repaired or unwrapped only into input the schema accepts."""
    assert repair_arguments("Bash", text, SCHEMAS["Bash"]) == expected


def test_blank_arguments_mean_an_empty_input_when_the_schema_allows_it() -> None:
    """Blank arguments are ``{}`` for a tool that needs no input."""
    assert repair_arguments("Glob", " ", {"type": "object"}) == {}


# -- while a reply is held: CallScanner ------------------------------------------------------------


def _prefixes(text: str) -> list[str]:
    return [text[:n] for n in range(1, len(text) + 1)]


def could_become_call(text: str, tools: dict[str, Any]) -> bool:
    return CallScanner(tools).feed(text).can_be_call


def _held_records() -> list[dict[str, Any]]:
    """Records that start where a call may start (the assembler holds them from the start)."""
    return [r for r in CORPUS if r["text"].lstrip().startswith(("{", "```", "<tool_call>"))]


def _held_with_calls() -> list[dict[str, Any]]:
    return [r for r in _held_records() if _extract(r)]


@pytest.mark.parametrize("record", _held_with_calls(), ids=[r["id"] for r in _held_with_calls()])
def test_a_held_reply_that_gives_a_call_is_never_given_up(record: dict[str, Any]) -> None:
    """For every corpus reply that yields a call, every prefix can still become a call."""
    tools = _declared(record)
    for prefix in _prefixes(record["text"]):
        assert could_become_call(prefix, tools), prefix


def test_the_corpus_replies_without_a_call_are_given_up() -> None:
    """Every held corpus reply that yields no call is ruled out, except the three cut off where a
    valid call could still follow; and it counts as an attempt exactly when it would be retried."""
    still_open = {"hand-cut-after-colon", "hand-cut-after-comma", "hand-cut-in-escape"}
    given_up = 0
    for record in _held_records():
        if _extract(record):
            continue
        tools = _declared(record)
        outlook = CallScanner(tools).feed(record["text"])
        if record["id"] in still_open:
            assert outlook.can_be_call and outlook.committed, record["id"]
            continue
        assert not outlook.can_be_call, record["id"]
        found = extract_tool_calls(record["text"], tools)
        assert outlook.attempt == (not found.calls and bool(found.rejected)), record["id"]
        given_up += 1
    assert given_up >= 40


@given(st.sampled_from(_held_records()), st.lists(st.integers(1, 400), max_size=8))
def test_reading_in_pieces_is_reading_whole(record: dict[str, Any], cuts: list[int]) -> None:
    """The scanner's verdict does not depend on how the text is split."""
    text, tools = record["text"], _declared(record)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    scanner = CallScanner(tools)
    for a, b in itertools.pairwise(bounds):
        scanner.feed(text[a:b])
    assert scanner.outlook == CallScanner(tools).feed(text)
    assert scanner.text == text


@given(json_objects, st.sampled_from(["bare", "fence", "tag", "openai"]), st.booleans())
def test_every_prefix_of_a_valid_call_may_become_a_call(
    arguments: dict[str, Any], shape: str, indent: bool
) -> None:
    """However a valid call is written (and JSON-formatted), no prefix of it is given up."""
    tool = {"Any": {"type": "object"}}
    call: dict[str, Any] = {"name": "Any", "arguments": arguments}
    if shape == "openai":
        call = {"type": "function", "function": {"name": "Any", "arguments": json.dumps(arguments)}}
    body = json.dumps(call, indent=2 if indent else None, ensure_ascii=False)
    text = {
        "bare": body,
        "fence": f"```json\n{body}\n```",
        "tag": f"<tool_call>\n{body}\n</tool_call>",
        "openai": body,
    }[shape]
    assert extract_tool_calls(text, tool).calls
    scanner = CallScanner(tool)
    for char in text:
        assert scanner.feed(char).can_be_call
    assert scanner.outlook.committed


def test_a_call_whose_input_holds_the_tag_text_is_still_a_call() -> None:
    """Found by the property above: a bare call whose input has ``<tool_call>`` in a string is
    one call, not an unclosed tag around its tail."""
    tool = {"Any": {"type": "object"}}
    for arguments in ({"<tool_call>": None}, {"note": "write <tool_call> then JSON"}):
        text = json.dumps({"name": "Any", "arguments": arguments})
        found = extract_tool_calls(text, tool)
        assert [(c.name, c.input) for c in found.calls] == [("Any", arguments)], found
        assert found.text == "" and not found.rejected
        scanner = CallScanner(tool)
        assert all(scanner.feed(char).can_be_call for char in text)
    # a tag after prose that starts like an object still counts as the tag
    tagged = '{"a": 1} then <tool_call>\n{"name": "Any", "arguments": {"x": 1}}\n</tool_call>'
    assert [c.input for c in extract_tool_calls(tagged, tool).calls] == [{"x": 1}]


HELD = {"get_weather": SCHEMAS["get_weather"], "Read": SCHEMAS["Read"], "Write": SCHEMAS["Write"]}

GIVEN_UP = [
    # (text, is it a call written wrongly, worth the retry?)
    ("```python\n", False),
    ("```bash", False),
    ("```json\nls -la", False),
    ("<tool_call>\nRead the file", False),
    ('{"name": "weather"', True),
    ('{"name": "get_weather", "city": "Paris"', True),
    ('{"nam": "Read"', True),
    ('{"name": 3', True),
    ('{"name": "Read", "arguments": ["a"]', True),
    ('{"name": "Read", "arguments": {"path": "/a"', True),
    ('{"name": "Read", "arguments": {"file_path": 7', True),
    ('{"name": "Read", "arguments": {"file_path": "/a", "limit": "ten"', True),
    ('{"name": "Write", "arguments": {"file_path": "/a", "content": "line 1\nline 2', True),
    ("{'name': 'Read'", True),
    ('{"name": "Read", "arguments": {"file_path": "/a"}} and then I will edit it', True),
    ('{"name": "Read", "arguments": {"file_path": "/a"}}}', True),
    ('{"name": "Read", "arguments": {"file_path": "/a", "offset": NaN', True),
    ('{"name": "Read", "arguments": {"file_path": "/a"}}\n```', True),
    ('<tool_call>\n{"name": "Read", "arguments": {}}\n</tool_call>', True),
]


@pytest.mark.parametrize(("text", "attempt"), GIVEN_UP)
def test_text_that_cannot_become_a_call_is_given_up(text: str, attempt: bool) -> None:
    """Each of these prefixes rules a valid call out, whatever follows."""
    outlook = CallScanner(HELD).feed(text)
    assert outlook == HoldOutlook(can_be_call=False, attempt=attempt)
    assert not could_become_call(text, HELD)


STILL_POSSIBLE = [
    ("", False),
    ("  \n", False),
    ("<tool_ca", False),
    ("``", False),
    ("```js", False),
    ("```json\n", False),
    ("```\n  {", False),
    ("<tool_call>\n```json\n", False),  # a fence inside a tag: repair_json can still read it
    ("{", False),
    ('{"na', False),
    ('{"name": "get_w', False),
    ('{"type": "function", "function": {"name": "Rea', False),
    ('{"arguments": {"city": "Oslo"}, "name": "get', False),  # arguments first: name unknown
    ('{"name": "Read"', True),
    ('{"name": "Read", "arguments": {"file_path": "/a", "offset": 1', True),
    ('{"name": "Read", "arguments": {"file_path": "/a"},}', True),  # a trailing comma: repaired
    ('{"name": "Write", "arguments": {"file_path": "/a", "content": "x = \\"}\\"\\n', True),
    ('{"name": "Read", "arguments": {"file_path": "/a"}}\n{"name": "Re', True),
    ('```json\n{"name": "Read", "arguments": {"file_path": "/a"}}\n```\nThat reads it.', True),
    ('<tool_call>{"name": "Read", "arguments": {"file_path": "/a"}}</tool_call> and more', True),
]


@pytest.mark.parametrize(("text", "committed"), STILL_POSSIBLE)
def test_text_that_may_still_become_a_call_is_kept(text: str, committed: bool) -> None:
    """Each of these may still be completed into a valid call (committed: it names a tool)."""
    outlook = CallScanner(HELD).feed(text)
    assert outlook.can_be_call
    assert outlook.committed == committed
    assert could_become_call(text, HELD)


def test_fence_lines_are_the_extractors_fence_lines() -> None:
    """A line is a fence line exactly when the extractor's pattern says so, and its prefixes
    are the lines that may still become one."""
    lines = ["```", "```json", "  ```json  ", "\t```tool_call", "```json x", "````", "``", " x```"]
    for line in lines:
        matched = re.fullmatch(r"[ \t]*```(?P<label>[^\s`]*)[ \t]*", line)
        assert fence_label(line) == (matched.group("label") if matched else None)
        if matched:
            assert all(may_become_fence_line(p) for p in _prefixes(line))
    assert not may_become_fence_line("```json x")
    assert not may_become_fence_line("text")
