"""PrefixFingerprinter: chained prefix fingerprints of engine bodies."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv.fingerprint import PrefixFingerprinter, canonical_json

SYSTEM = {"role": "system", "content": "You are a careful coding agent."}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def body(*turns: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": [SYSTEM, *turns], "tools": TOOLS, **extra}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


FP = PrefixFingerprinter()


def test_blocks_are_system_tools_then_each_turn() -> None:
    """A body with two turns gives four blocks whose sizes are the canonical JSON lengths."""
    fp = FP.fingerprint(body(user("hi"), assistant("hello")))
    assert len(fp.blocks) == len(fp.sizes) == 4
    assert fp.sizes[0] == len(canonical_json([SYSTEM]))
    assert fp.sizes[1] == len(canonical_json({"tools": TOOLS}))
    assert fp.sizes[2] == len(canonical_json(user("hi")))
    assert fp.sizes[3] == len(canonical_json(assistant("hello")))


def test_chain_is_sha256_of_previous_hash_and_block() -> None:
    """Each block hash covers the previous hash, so equal entries mean an equal prefix."""
    fp = FP.fingerprint(body(user("hi")))
    first = hashlib.sha256(canonical_json([SYSTEM]).encode()).hexdigest()
    second = hashlib.sha256((first + canonical_json({"tools": TOOLS})).encode()).hexdigest()
    assert fp.blocks[:2] == (first, second)


def test_canonical_json_ignores_key_order_and_whitespace() -> None:
    """Canonical JSON is the same for dicts with the same items in any order."""
    assert canonical_json({"b": 1, "a": [1, {"d": 2, "c": 3}]}) == '{"a":[1,{"c":3,"d":2}],"b":1}'
    assert json.loads(canonical_json({"x": "é"})) == {"x": "é"}


def test_keys_that_never_reach_the_prompt_are_ignored() -> None:
    """max_tokens, temperature, stream, id_slot and cache_prompt do not change the fingerprint."""
    plain = FP.fingerprint(body(user("hi")))
    noisy = FP.fingerprint(
        body(
            user("hi"),
            max_tokens=32000,
            temperature=0.7,
            top_p=0.9,
            stream=True,
            id_slot=1,
            cache_prompt=True,
        )
    )
    assert noisy == plain


def test_message_key_order_does_not_matter() -> None:
    """Two bodies that differ only in dict key order fingerprint the same."""
    a = FP.fingerprint({"tools": TOOLS, "messages": [SYSTEM, {"content": "x", "role": "user"}]})
    b = FP.fingerprint({"messages": [SYSTEM, {"role": "user", "content": "x"}], "tools": TOOLS})
    assert a == b


@pytest.mark.parametrize(
    "change",
    [
        {"tools": [*TOOLS, {"type": "function", "function": {"name": "grep"}}]},
        {"tool_choice": "required"},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
    ],
)
def test_tool_settings_change_the_tools_block(change: dict[str, Any]) -> None:
    """Tools, tool_choice and response_format all shape the prompt, so they change block 1."""
    base = FP.fingerprint(body(user("hi")))
    changed = FP.fingerprint({**body(user("hi")), **change})
    assert changed.blocks[0] == base.blocks[0]
    assert changed.blocks[1] != base.blocks[1]
    assert shared(changed, base) == 1


def test_leading_system_messages_form_one_block() -> None:
    """Several system messages at the head are one block; a later system message is a turn."""
    note = {"role": "system", "content": "environment: linux"}
    fp = FP.fingerprint({"messages": [SYSTEM, note, user("hi"), note]})
    assert fp.sizes[0] == len(canonical_json([SYSTEM, note]))
    assert len(fp.blocks) == 4  # system block, tools block, user, mid-conversation note


def test_body_without_system_or_tools_still_has_both_leading_blocks() -> None:
    """Block positions stay fixed: empty system and tools blocks are still present."""
    fp = FP.fingerprint({"messages": [user("hi")]})
    assert fp.sizes[:2] == (len("[]"), len("{}"))
    assert len(fp.blocks) == 3


def test_max_turns_limits_the_chain() -> None:
    """max_turns counts conversation messages after the system block; 0 keeps system + tools."""
    turns = [user("a"), assistant("b"), user("c")]
    assert len(PrefixFingerprinter(max_turns=0).fingerprint(body(*turns)).blocks) == 2
    two = PrefixFingerprinter(max_turns=2).fingerprint(body(*turns))
    assert two == FP.fingerprint(body(*turns[:2]))
    assert PrefixFingerprinter(max_turns=10).fingerprint(body(*turns)) == FP.fingerprint(
        body(*turns)
    )


def test_negative_max_turns_is_rejected() -> None:
    """A negative max_turns is a configuration error."""
    with pytest.raises(ValueError, match="max_turns"):
        PrefixFingerprinter(max_turns=-1)


def test_messages_must_be_a_list() -> None:
    """A body whose messages is not a list is refused rather than hashed character by character."""
    with pytest.raises(ValueError, match="messages"):
        FP.fingerprint({"messages": "hello"})


def shared(a: Any, b: Any) -> int:
    """How many leading blocks two fingerprints share."""
    count = 0
    for mine, theirs in zip(a.blocks, b.blocks, strict=False):
        if mine != theirs:
            break
        count += 1
    return count


def test_same_body_gives_the_same_fingerprint() -> None:
    """The same body gives an equal fingerprint, and a fresh fingerprinter agrees."""
    fp = FP.fingerprint(body(user("hi")))
    assert fp == PrefixFingerprinter().fingerprint(body(user("hi")))
    assert shared(fp, fp) == len(fp.blocks)


def test_a_grown_conversation_extends_the_chain() -> None:
    """A request extending an earlier one shares every block of the earlier one."""
    cached = FP.fingerprint(body(user("hi")))
    request = FP.fingerprint(body(user("hi"), assistant("hello"), user("more")))
    assert shared(request, cached) == len(cached.blocks)
    assert sum(request.sizes[: len(cached.blocks)]) == cached.total_size


def test_diverging_turns_still_share_system_and_tools() -> None:
    """Diverging first turns share only the system and tools blocks."""
    a = FP.fingerprint(body(user("hi"), assistant("x")))
    b = FP.fingerprint(body(user("bye"), assistant("x")))
    assert shared(a, b) == 2
    assert a.blocks[2:] != b.blocks[2:]


json_text = st.text(max_size=20)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool"]), "content": json_text}
    ),
    max_size=8,
)


@given(system=json_text, head=messages, tail=messages.filter(bool))
def test_extended_body_is_prefix_of_longer(system: str, head: list[Any], tail: list[Any]) -> None:
    """Appending messages to a body keeps every block of the shorter one as the chain's prefix."""
    # A conversation opens with a user turn; system messages after it are ordinary turns.
    opening = [{"role": "system", "content": system}, user("start")]
    short_body = {"messages": [*opening, *head], "tools": TOOLS}
    long_body = {**short_body, "messages": [*short_body["messages"], *tail]}
    short, long = FP.fingerprint(short_body), FP.fingerprint(long_body)
    assert len(long.blocks) > len(short.blocks)
    assert long.blocks[: len(short.blocks)] == short.blocks
    assert long.sizes[: len(short.sizes)] == short.sizes


@given(a=messages, b=messages)
def test_shared_blocks_is_the_common_run(a: list[Any], b: list[Any]) -> None:
    """Two chains agree on exactly the leading blocks that are equal."""
    fa, fb = FP.fingerprint({"messages": a}), FP.fingerprint({"messages": b})
    head_a, head_b = leading_system(a), leading_system(b)
    expected = 0
    if a[:head_a] == b[:head_b]:
        expected = 2  # system block and (empty) tools block
        for mine, theirs in zip(a[head_a:], b[head_b:], strict=False):
            if mine != theirs:
                break
            expected += 1
    assert shared(fa, fb) == expected
    assert fa.sizes[:expected] == fb.sizes[:expected]
    assert (fa == fb) == (a == b)


def leading_system(messages: list[Any]) -> int:
    count = 0
    while count < len(messages) and messages[count]["role"] == "system":
        count += 1
    return count
