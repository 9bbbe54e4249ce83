"""Compaction planning and rewriting (pure)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from agentkv.compaction import (
    SUMMARY_OPEN,
    Compaction,
    CompactionStore,
    fold_share,
    plan_compaction,
    rebase,
    summary_request,
)
from agentkv.fingerprint import PrefixFingerprinter
from agentkv.snapshot import PendingCompactionRow

FP = PrefixFingerprinter()
TOOLS = [{"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}}]


def call(n: int) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"toolu_{n}",
                "type": "function",
                "function": {"name": "Read", "arguments": f'{{"file_path": "f{n}.py"}}'},
            }
        ],
    }


def result(n: int) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"toolu_{n}", "content": f"contents of f{n}.py"}


def body(*messages: dict[str, Any]) -> dict[str, Any]:
    return {
        "messages": [{"role": "system", "content": "You are a coding agent."}, *messages],
        "tools": TOOLS,
        "max_tokens": 100,
    }


def chat(turns: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for n in range(turns):
        out += [{"role": "user", "content": f"question {n}"}, call(n), result(n)]
        out.append({"role": "assistant", "content": f"answer {n}"})
    return out


def compaction_for(request: dict[str, Any], keep: int, summary: str = "S") -> Compaction:
    plan = plan_compaction(request, agent="a", keep_recent=keep, fingerprinter=FP)
    assert plan is not None
    return Compaction(plan, summary, created_at=0.0)


def test_plan_keeps_the_recent_messages_and_the_system_head() -> None:
    """All but the last ``keep_recent`` messages are replaced; system and tools stay."""
    request = body(*chat(3))
    compaction = compaction_for(request, keep=4)
    out = compaction.apply(request)
    assert out["messages"][0] == request["messages"][0]
    assert out["tools"] == TOOLS
    assert out["messages"][1]["content"].startswith(SUMMARY_OPEN)
    assert out["messages"][2:] == request["messages"][-4:]


def test_cut_never_separates_a_tool_call_from_its_result() -> None:
    """A cut that would start the kept part with a tool result moves back to the call."""
    request = body(*chat(3))
    # keep_recent=2 would keep [tool result 2, answer 2]: the cut moves back to the call.
    compaction = compaction_for(request, keep=2)
    kept = compaction.apply(request)["messages"][2:]
    assert kept[0]["role"] == "assistant" and kept[0]["tool_calls"]
    assert kept[1]["role"] == "tool"


def test_nothing_to_gain_gives_no_plan() -> None:
    """A conversation no longer than what must be kept is not compacted."""
    request = body({"role": "user", "content": "hi"})
    assert plan_compaction(request, agent="a", keep_recent=6, fingerprinter=FP) is None


def test_rewrite_applies_while_the_client_keeps_its_full_history() -> None:
    """Later requests that extend the compacted prefix are rewritten; an edited history is not."""
    first = body(*chat(3))
    store = CompactionStore()
    assert store.begin("a")
    store.end("a", compaction_for(first, keep=4, summary="the summary"))
    later = body(*chat(3), {"role": "user", "content": "next question"})
    out, fingerprint, applied = store.rewrite("a", later, FP)
    assert len(applied) == 1
    assert "the summary" in out["messages"][1]["content"]
    assert out["messages"][-1] == {"role": "user", "content": "next question"}
    assert fingerprint == FP.fingerprint(out)
    edited = body(*chat(3))
    edited["messages"][1] = {"role": "user", "content": "a different first question"}
    out, _, applied = store.rewrite("a", edited, FP)
    assert applied == [] and out == edited
    # Another agent's identical history is not rewritten with this agent's summary.
    assert store.rewrite("b", later, FP)[2] == []


def test_second_compaction_applies_on_top_of_the_first() -> None:
    """Compactions chain: the second was planned on the already compacted request."""
    store = CompactionStore()
    first = body(*chat(3))
    store.begin("a")
    store.end("a", compaction_for(first, keep=4, summary="one"))
    grown = body(*chat(6))
    compacted, _, _ = store.rewrite("a", grown, FP)
    store.begin("a")
    store.end("a", compaction_for(compacted, keep=4, summary="two"))
    out, _, applied = store.rewrite("a", body(*chat(6)), FP)
    assert [c.summary for c in applied] == ["one", "two"]
    assert "two" in out["messages"][1]["content"]
    assert out["messages"][2:] == grown["messages"][-4:]


def test_only_one_compaction_per_agent_runs_at_a_time() -> None:
    """begin refuses a second in-flight compaction for the same agent."""
    store = CompactionStore()
    assert store.begin("a") and not store.begin("a") and store.begin("b")
    store.end("a", None)
    assert store.begin("a")
    assert PendingCompactionRow("a", True) in store.snapshot()


def test_summary_request_carries_the_replaced_turns() -> None:
    """The summariser sees the replaced messages, tool calls included, and nothing after them."""
    request = body(*chat(3))
    compaction = compaction_for(request, keep=4)
    asked = summary_request(request, compaction.plan, max_tokens=50)
    transcript = asked["messages"][1]["content"]
    assert "question 0" in transcript and "calls tool Read" in transcript
    assert "contents of f1.py" in transcript
    assert "answer 2" not in transcript
    assert asked["max_tokens"] == 50


@given(turns=st.integers(1, 6), keep=st.integers(0, 10), extra=st.booleans())
def test_compacted_requests_stay_well_formed(turns: int, keep: int, extra: bool) -> None:
    """After any cut: the kept part never starts with a tool result, and ends as the original."""
    messages = chat(turns)
    if extra:
        messages.append({"role": "user", "content": "more"})
    request = body(*messages)
    plan = plan_compaction(request, agent="a", keep_recent=keep, fingerprinter=FP)
    if plan is None:
        return
    out = Compaction(plan, "S", created_at=0.0).apply(request)
    kept = out["messages"][2:]
    assert not kept or kept[0]["role"] != "tool"
    assert kept == request["messages"][len(request["messages"]) - len(kept) :]
    assert len(kept) >= min(keep, len(messages))


def test_a_fold_takes_the_share_that_brings_the_prompt_under_the_low_mark() -> None:
    """Incremental compaction folds the oldest messages holding the share of the prompt it must
    lose: a quarter of the band below the low mark; nothing at or under it."""
    assert fold_share(1000, low=1000, high=1500) == 0.0
    assert fold_share(1200, low=1000, high=1400) == (1200 - 900) / 1200
    request = body(*chat(8))
    share = 0.25
    plan = plan_compaction(request, agent="a", keep_recent=4, fingerprinter=FP, share=share)
    everything = plan_compaction(request, agent="a", keep_recent=4, fingerprinter=FP)
    assert plan is not None and everything is not None
    assert 2 <= plan.cut < everything.cut
    # the folded messages hold at least the share, one message fewer does not
    conversation = request["messages"][1:]
    size = len(json.dumps(request, ensure_ascii=False))
    held = [len(json.dumps(m, ensure_ascii=False)) for m in conversation]
    covering = next(n for n in range(1, len(held) + 1) if sum(held[:n]) >= share * size)
    assert plan.cut <= covering
    # moved back only to keep a call with its results
    moved = conversation[plan.cut : covering]
    assert all(m["role"] == "tool" for m in moved[1:])
    assert not moved or moved[0].get("tool_calls")
    # never into the recent messages, never between a call and its result
    assert plan_compaction(request, agent="a", keep_recent=4, fingerprinter=FP, share=1.0) == (
        everything
    )
    for share in (0.1, 0.2, 0.3, 0.45, 0.6):
        cut = plan_compaction(request, agent="a", keep_recent=4, fingerprinter=FP, share=share)
        assert cut is None or conversation[cut.cut]["role"] != "tool"


def test_a_fold_on_top_of_earlier_ones_stands_alone() -> None:
    """A fold planned on the rewritten request (its first message the running summary) is kept
    as a plan on the client's own request: applied alone it gives what the chain gave, and the
    compactions it folds are forgotten, however many folds come."""
    store = CompactionStore()
    raw = body(*chat(3))
    store.begin("a")
    store.end("a", compaction_for(raw, keep=4, summary="one"))
    for turns, summary in ((5, "two"), (7, "three"), (9, "four"), (11, "five"), (13, "six")):
        raw = body(*chat(turns))
        rewritten, _, applied = store.rewrite("a", raw, FP)
        assert applied and rewritten["messages"][1]["content"].startswith(SUMMARY_OPEN)
        plan = plan_compaction(rewritten, agent="a", keep_recent=4, fingerprinter=FP, share=0.3)
        assert plan is not None
        chained = Compaction(plan, summary, created_at=0.0).apply(rewritten)
        alone = Compaction(rebase(plan, raw, applied, FP), summary, created_at=0.0)
        assert alone.apply(raw) == chained
        store.begin("a")
        store.end("a", alone, replaces=applied)
        assert [c.summary for c in store.rewrite("a", raw, FP)[2]] == [summary]
    # the next request of the conversation is rewritten with the last fold alone
    later = body(*chat(13), {"role": "user", "content": "next"})
    out, _, applied = store.rewrite("a", later, FP)
    assert [c.summary for c in applied] == ["six"]
    assert out["messages"][-1] == {"role": "user", "content": "next"}
