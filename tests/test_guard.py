"""RepetitionGuard: degenerate loops are caught, real code and prose are not."""

from __future__ import annotations

import argparse
import difflib
import json
import textwrap
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv.guard import Repetition, RepetitionGuard, periodic_suffix

ROOT = Path(__file__).parent.parent
FIXTURES = Path(__file__).parent / "fixtures"


def pieces(text: str, size: int) -> Iterator[str]:
    return (text[i : i + size] for i in range(0, len(text), size))


def first_trip(
    chunks: Iterable[str], guard: RepetitionGuard | None = None
) -> tuple[int, Repetition]:
    """Feed chunks until the guard trips: (characters fed by then, the loop it reported)."""
    guard = guard or RepetitionGuard()
    fed = 0
    for chunk in chunks:
        fed += len(chunk)
        found = guard.feed(chunk)
        if found is not None:
            return fed, found
    raise AssertionError(f"no loop reported after {fed} characters")


def never_trips(text: str, size: int = 7) -> None:
    guard = RepetitionGuard()
    for n, chunk in enumerate(pieces(text, size)):
        found = guard.feed(chunk)
        assert found is None, f"tripped at {n * size}: {found.describe()}"


def recorded_loop() -> list[str]:
    """The default model's reply to "Write the word ok 3000 times", as streamed."""
    record = json.loads((FIXTURES / "degenerate_ok_loop.json").read_text())
    return [
        c["choices"][0]["delta"].get("content") or "" for c in record["chunks"] if c.get("choices")
    ]


# -- true positives --------------------------------------------------------------------------------


def test_the_recorded_loop_of_the_default_model_is_caught_early() -> None:
    """The real "ok ok ok" reply (400 tokens, cut by max_tokens) trips well before its end."""
    chunks = recorded_loop()
    whole = "".join(chunks)
    fed, found = first_trip(chunks)
    assert fed < len(whole) * 3 // 4
    assert found.unit.strip() == "ok" and found.period == 3
    assert found.length >= 800 and found.repeats >= 10
    copies = found.unit * (found.length // found.period + 1)
    assert whole[fed - found.length : fed] == copies[: found.length]


PROSE = (
    "I will look at the failing test first, then at the parser it exercises. "
    "The error says the tokenizer returned an empty list for a blank line.\n"
)

LOOPS = {
    "one word": "ok " * 400,
    "one character": "}" * 1000,
    "newlines": "\n" * 1000,
    "one line": 'print("hello world")\n' * 60,
    "a block of code": (
        "    for item in items:\n"
        "        total += item.price * item.quantity\n"
        "        if total > limit:\n"
        "            break\n"
    )
    * 20,
    "the same tool call": '{"name": "Read", "arguments": {"file_path": "/repo/a.py"}}\n' * 20,
    "thinking in circles": "Wait, let me reconsider the problem. " * 40,
    "a long unit": "".join(f"line {i}: {'x' * (i % 7)} and more text\n" for i in range(30)) * 11,
}


@pytest.mark.parametrize("name", LOOPS)
@pytest.mark.parametrize("size", [1, 4, 13, 200])
def test_realistic_loops_trip_after_prose(name: str, size: int) -> None:
    """Each loop, after some normal prose, trips however it is chunked, and names its unit."""
    loop = LOOPS[name]
    fed, found = first_trip(pieces(PROSE * 3 + loop, size))
    guard = RepetitionGuard()
    needed = max(guard.min_chars, guard.min_repeats * found.period)
    # Tripped no later than one look (and one chunk) after the loop grew long enough.
    assert fed <= len(PROSE * 3) + needed + guard.check_every + size
    assert found.unit in loop + loop
    assert found.length >= needed


def test_a_reported_loop_stays_reported() -> None:
    """After tripping, the guard keeps its answer and ignores further text."""
    guard = RepetitionGuard()
    _, found = first_trip(pieces("ha" * 600, 5), guard)
    assert guard.tripped == found
    assert guard.feed("quite different text") == found
    guard.reset()
    assert guard.tripped is None
    assert guard.feed("fresh start") is None


@given(
    st.text(alphabet="abcdefgh \n{}", min_size=1, max_size=40),
    st.text(alphabet="xyz.,;:\n", max_size=200),
    st.integers(min_value=1, max_value=64),
)
def test_any_unit_repeated_long_enough_trips(unit: str, before: str, size: int) -> None:
    """Whatever the unit and the text before it, enough copies of it trip the guard."""
    guard = RepetitionGuard()
    copies = (guard.min_chars + guard.check_every) // len(unit) + guard.min_repeats + 2
    _, found = first_trip(pieces(before + unit * copies, size), guard)
    assert found.period <= len(unit)
    assert len(unit) % found.period == 0  # the unit itself, or a shorter unit it is made of


# -- no false positives ----------------------------------------------------------------------------


def repository_texts() -> list[Path]:
    paths = [ROOT / "README.md"]
    for pattern in ("src/**/*.py", "tests/**/*.py", "docs/*.md", "tests/fixtures/**/*.json*"):
        paths.extend(sorted(ROOT.glob(pattern)))
    return [p for p in paths if p.name != "degenerate_ok_loop.json"]


def test_the_repository_itself_never_trips() -> None:
    """Every source, test, doc and fixture of this repository reads as normal text."""
    texts = repository_texts()
    assert sum(len(p.read_text()) for p in texts) > 200_000
    for path in texts:
        never_trips(path.read_text())


@pytest.mark.parametrize("module", [argparse, difflib, json.decoder, textwrap, typing])
def test_standard_library_code_never_trips(module: object) -> None:
    """Real-world Python, with its docstrings, tables and repeated idioms, reads as normal."""
    source = Path(str(getattr(module, "__file__", ""))).read_text()
    assert len(source.splitlines()) > 300
    never_trips(source)


def test_legitimate_repetition_in_code_does_not_trip() -> None:
    """Short repeated lines, separators and nested closers are normal in code."""
    samples = [
        "}\n" * 12 + "int main(void) { return 0; }\n",
        "# " + "-" * 118 + "\n",
        "=" * 200 + "\n",
        "\n" * 40 + "x = 1\n",
        "\n".join(f"import module_{i}" for i in range(80)),
        "\n".join(f"    {i:4d}, {i * i:6d}, {i % 3},  # row {i}" for i in range(120)),
        "| a | b | c |\n|---|---|---|\n" + "| 1 | 2 | 3 |\n" * 8,
        "assert parse('') == []\n" * 5 + "assert parse('x') == ['x']\n",
    ]
    for sample in samples:
        never_trips(sample * 2)


# -- periodic_suffix and cost ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "period", "expected"),
    [
        ("hello ok ok ok", 3, 9),
        ("abcabcabc", 3, 9),
        ("xabcabcab", 3, 8),
        ("aaaa", 1, 4),
        ("ab", 1, 1),
        ("abc", 5, 3),
    ],
)
def test_periodic_suffix(text: str, period: int, expected: int) -> None:
    """The longest suffix in which every character equals the one a period before it."""
    assert periodic_suffix(text, period) == expected


@given(st.text(max_size=60), st.integers(min_value=1, max_value=10))
def test_periodic_suffix_matches_its_definition(text: str, period: int) -> None:
    """Checked against a character-by-character reading of the definition."""
    n = len(text)
    expected = n if period >= n else period
    if period < n:
        while expected < n and text[n - expected - 1] == text[n - expected - 1 + period]:
            expected += 1
    assert periodic_suffix(text, period) == expected


def test_memory_stays_bounded_on_a_long_reply() -> None:
    """A long reply without loops keeps at most two windows of text, however it is fed."""
    guard = RepetitionGuard()
    text = " ".join(f"word{i}" for i in range(60_000))
    for chunk in pieces(text, 9):
        assert guard.feed(chunk) is None
        assert guard.buffered <= 2 * guard.window
    assert guard.feed(text) is None  # one very large piece, too
    assert guard.buffered <= 2 * guard.window
