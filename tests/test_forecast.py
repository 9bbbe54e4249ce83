"""The forecast of Claude Code's compaction request (agentkv.forecast), on the captured requests of
tests/fixtures/claude_code_compaction: it predicts exactly what Claude Code sent, as the request
key reads it, and nothing where Claude Code's next request cannot be known."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from agentkv.forecast import (
    CompactionForecast,
    compaction_point,
    context_tokens,
    has_summary,
    how_after_differs,
    is_claude_code,
    reply_text,
    shipped_instruction,
    shipped_retry_paragraph,
    summary_text,
)
from agentkv.runtime.admission import request_key
from agentkv.translate import MessagesTranslator
from tests.fakes import render
from tests.test_claude_code_compaction import (
    FIRST_LINE,
    RETRY_PARAGRAPH,
    exchanges,
    instruction,
    kinds,
)

#: CLAUDE_CODE_MAX_CONTEXT_TOKENS in the captures (agentkv's ctx-per-slot).
WINDOW = 32768


def key(body: dict[str, Any], agent: str = "a") -> str:
    return request_key(agent, MessagesTranslator().translate(body))


def reply(exchange: dict[str, Any]) -> dict[str, Any]:
    """The stub's reply as agentkv's ``reply_message`` gives it (no cache fields: they were 0)."""
    return copy.deepcopy(exchange["answer"]["message"])


def start_of_turn() -> list[tuple[str, int]]:
    """Every compaction captured at the start of a turn: (scenario, index of the compaction)."""
    found = []
    for name in ("turns", "turns_again", "thinking", "retry", "long"):
        for index, kind in enumerate(kinds(name)):
            previous = kinds(name)[index - 1] if index else None
            if kind == "compaction" and previous == "turn":
                answered = exchanges(name)[index - 1]["answer"]["message"]
                if answered["stop_reason"] == "end_turn":
                    found.append((name, index))
    return found


def test_the_shipped_instruction_is_the_captured_one() -> None:
    text = shipped_instruction()
    assert text == instruction(exchanges("turns")[2]["body"])
    assert len(text) == 6912 and text.startswith(FIRST_LINE + "\n")
    assert CompactionForecast().first_line == FIRST_LINE


@pytest.mark.parametrize(("name", "index"), start_of_turn())
def test_predicts_the_captured_compaction_request(name: str, index: int) -> None:
    """The previous request, the stub's reply and the instruction: the same request key as the
    compaction request Claude Code sent (the moved cache_control mark, a text block written back
    as a string: nothing the engine sees differs)."""
    ex = exchanges(name)
    previous, compaction = ex[index - 1], ex[index]
    forecast = CompactionForecast()
    predicted = forecast.predict(previous["body"], reply(previous), WINDOW)
    assert predicted is not None
    assert predicted != compaction["body"]  # the raw bodies differ (the mark moved)
    if name == "retry":  # its first compaction request; the second one carries the retry text
        assert key(predicted) == key(ex[2]["body"])
        assert key(predicted) != key(ex[3]["body"])
    else:
        assert key(predicted) == key(compaction["body"])
    assert forecast.is_compaction(predicted) and forecast.is_compaction(compaction["body"])


def test_the_start_of_turn_captures_are_all_found() -> None:
    assert start_of_turn() == [
        ("turns", 2),
        ("turns", 4),
        ("turns_again", 2),
        ("thinking", 2),
        ("retry", 2),
        ("long", 8),
    ]


def test_a_one_byte_change_is_another_request() -> None:
    ex = exchanges("turns")
    predicted = CompactionForecast().predict(ex[1]["body"], reply(ex[1]), WINDOW)
    assert predicted is not None
    changed = copy.deepcopy(ex[2]["body"])
    changed["messages"][-1]["content"] += " "
    assert key(changed) != key(predicted)
    other_reply = copy.deepcopy(ex[2]["body"])
    other_reply["messages"][-2]["content"][0]["text"] = "betA"
    assert key(other_reply) != key(predicted)
    assert key(ex[2]["body"], agent="b") != key(predicted)  # another agent's request


def test_the_key_ignores_what_the_engine_never_sees() -> None:
    """A retry that is not streamed, another billing line, metadata: one request; the model is
    part of it."""
    body = exchanges("turns")[2]["body"]
    same = {**copy.deepcopy(body), "stream": False, "metadata": {"user_id": "x"}}
    same["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.328.zzz;"
    assert key(same) == key(body)
    assert key({**body, "model": "other"}) != key(body)


def test_no_prediction_after_the_first_reply() -> None:
    """The first request holds no assistant message: Claude Code never compacts after it."""
    ex = exchanges("turns")
    assert kinds("turns")[1] == "turn"  # what followed the first reply
    assert CompactionForecast().predict(ex[0]["body"], reply(ex[0]), WINDOW) is None


@pytest.mark.parametrize(("name", "index"), [("tool_call", 1), ("tool_call", 3), ("long", 5)])
def test_no_prediction_after_a_tool_call(name: str, index: int) -> None:
    """A reply that calls a tool: the compaction (if any) carries the tool's result."""
    ex = exchanges(name)
    assert ex[index]["answer"]["message"]["stop_reason"] == "tool_use"
    assert CompactionForecast().predict(ex[index]["body"], reply(ex[index]), WINDOW) is None


def test_no_prediction_below_the_point() -> None:
    ex = exchanges("baseline")  # every reply reported 1,000 input tokens: no compaction came
    assert kinds("baseline") == ["turn", "turn", "turn"]
    forecast = CompactionForecast()
    assert forecast.predict(ex[1]["body"], reply(ex[1]), WINDOW) is None
    high = exchanges("turns")[1]
    assert forecast.predict(high["body"], reply(high), WINDOW) is not None
    assert forecast.predict(high["body"], reply(high), WINDOW + 100) is None
    assert compaction_point(WINDOW, 4096) == 15672
    assert context_tokens(reply(high)["usage"]) == 15670


def test_no_prediction_for_another_client_or_a_compaction() -> None:
    ex = exchanges("turns")
    previous = copy.deepcopy(ex[1]["body"])
    previous["system"] = [{"type": "text", "text": "You are a helpful assistant."}]
    assert not is_claude_code(previous)
    assert CompactionForecast().predict(previous, reply(ex[1]), WINDOW) is None
    # the compaction request's own reply leads to no second compaction
    assert is_claude_code(ex[2]["body"])
    assert CompactionForecast().predict(ex[2]["body"], reply(ex[2]), WINDOW) is None
    # a reply cut at max_tokens is not the end of a turn
    cut = {**reply(ex[1]), "stop_reason": "max_tokens"}
    assert CompactionForecast().predict(ex[1]["body"], cut, WINDOW) is None


def test_learns_a_new_instruction_from_its_first_compaction() -> None:
    """A new client version: its compaction request is recognised by the first line, and its
    instruction is used from then on; a retry's longer text teaches nothing."""
    ex = exchanges("turns")
    newer = FIRST_LINE + "\n\nSummarise it all, version two."
    compaction = copy.deepcopy(ex[2]["body"])
    compaction["messages"][-1]["content"] = newer
    forecast = CompactionForecast()
    assert forecast.is_compaction(compaction)
    learned = forecast.learn(compaction)
    assert learned.instruction == newer
    predicted = learned.predict(ex[1]["body"], reply(ex[1]), WINDOW)
    assert predicted is not None and key(predicted) == key(compaction)
    # the retry (the known text and a paragraph) and an ordinary turn teach nothing
    retry = copy.deepcopy(ex[2]["body"])
    retry["messages"][-1]["content"] += RETRY_PARAGRAPH
    assert forecast.learn(retry) is forecast
    assert forecast.learn(ex[1]["body"]) is forecast
    # between tool calls ([tool_result, text]) the instruction is not the whole message
    between = exchanges("tool_call")[4]["body"]
    assert forecast.is_compaction(between)
    assert forecast.learn(between) is forecast


def test_predicts_the_captured_retry() -> None:
    """The compaction's reply had no <summary>: the retry Claude Code sent next is predicted from
    the compaction request and that reply (the same request key); a reply with its summary, the
    retry itself and an ordinary turn predict none."""
    ex = exchanges("retry")
    assert kinds("retry")[2:4] == ["compaction", "compaction"]
    forecast = CompactionForecast()
    predicted = forecast.predict_retry(ex[2]["body"], reply(ex[2]))
    assert predicted is not None
    assert key(predicted) == key(ex[3]["body"])
    assert key(predicted) != key(ex[2]["body"])
    assert forecast.predict_retry(ex[3]["body"], reply(ex[3])) is None  # never retried twice
    summarised = exchanges("turns")[2]
    assert forecast.predict_retry(summarised["body"], reply(summarised)) is None
    assert forecast.predict_retry(ex[1]["body"], reply(ex[1])) is None
    # Claude Code reads the reply however it ended (a reply cut at max_tokens is asked again);
    # a reply with no text at all has no summary and is not asked again
    cut = {**reply(ex[2]), "stop_reason": "max_tokens"}
    assert forecast.predict_retry(ex[2]["body"], cut) == predicted
    empty = {**reply(ex[2]), "content": [{"type": "text", "text": "  \n"}]}
    assert forecast.predict_retry(ex[2]["body"], empty) is None
    # between tool calls the instruction is not the whole message: not predicted
    between = exchanges("tool_call")[4]
    assert forecast.predict_retry(between["body"], reply(ex[2])) is None


def test_the_shipped_retry_paragraph_is_the_captured_one() -> None:
    assert shipped_retry_paragraph() == RETRY_PARAGRAPH
    assert CompactionForecast().retry_paragraph == RETRY_PARAGRAPH


def after_compaction() -> list[tuple[str, int]]:
    """Every captured start-of-turn compaction (or its retry) answered with a summary and followed
    by a turn: (scenario, index of the compaction)."""
    found = []
    for name in (
        "turns",
        "turns_again",
        "thinking",
        "retry",
        "retry_twice",
        "retry_twice_differs",
        "open_summary",
        "two_blocks",
        "two_blocks_no_summary",
        "retry_cut",
        "long",
    ):
        ex = exchanges(name)
        for index, kind in enumerate(kinds(name)[:-1]):
            body = ex[index]["body"]
            if (
                kind == "compaction"
                and kinds(name)[index + 1] == "turn"
                and isinstance(body["messages"][-1]["content"], str)  # not between tool calls
            ):
                found.append((name, index))
    return found


def stem(body: dict[str, Any]) -> str:
    """What the engine computes of a request before its user's words, as the fake renders it."""
    stem_body = MessagesTranslator().translate(body).stem_body
    assert stem_body is not None
    return render(stem_body)


#: The configuration directory in the captures (the HOME was written ``<home>``).
CONFIG_DIR = "<home>/.claude"


@pytest.mark.parametrize(("name", "index"), after_compaction())
def test_predicts_the_conversation_after_a_compaction(name: str, index: int) -> None:
    """From the compaction request and its reply: everything the turn after it computes before
    its user's words, exactly as Claude Code sent it (git status, summary, transcript, date, kept
    message, attribution, the session note) — or, where the conversation read a file (which
    comes back as a reminder), up to that reminder."""
    ex = exchanges(name)
    compaction, after = ex[index], ex[index + 1]
    forecast = CompactionForecast(config_dir=CONFIG_DIR)
    first = reply(ex[index - 1]) if kinds(name)[index - 1] == "compaction" else None
    predicted = forecast.predict_after(compaction["body"], reply(compaction), first)
    assert predicted is not None
    got, want = stem(predicted), stem(after["body"])
    if name == "long":  # README.md was read: Claude Code attaches it again
        shared = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
        assert "<system-reminder>\nCalled the Read tool" in want[shared - 20 : shared + 40]
        assert "Summary:\n1. Primary Request" in want[:shared]
    else:
        assert got == want


@pytest.mark.parametrize(("name", "index"), after_compaction())
def test_how_the_turn_after_parts_from_the_prediction(name: str, index: int) -> None:
    """The captured turn after each compaction is the prediction with the user's words in
    place, but where a file the conversation read comes back; one character changed anywhere
    before the words is found, with where."""
    ex = exchanges(name)
    compaction, after = ex[index], ex[index + 1]
    first = reply(ex[index - 1]) if kinds(name)[index - 1] == "compaction" else None
    forecast = CompactionForecast(config_dir=CONFIG_DIR)
    predicted = forecast.predict_after(compaction["body"], reply(compaction), first)
    assert predicted is not None
    sent = after["body"]
    if name == "long":
        differs = how_after_differs(predicted, sent)
        assert differs is not None and "Called the Read tool" in differs, differs
        return
    assert how_after_differs(predicted, sent) is None
    changed = copy.deepcopy(sent)
    changed["messages"][0]["content"][1]["text"] += "!"
    differs = how_after_differs(predicted, changed)
    assert differs is not None and differs.startswith("message 0 block 1, char "), differs
    changed = copy.deepcopy(sent)
    del changed["messages"][1]
    assert how_after_differs(predicted, changed) is not None


def test_after_compaction_needs_the_summary_and_the_transcript_directory() -> None:
    ex = exchanges("retry")
    # the first reply had no summary: nothing follows it but the retry
    assert (
        CompactionForecast(config_dir=CONFIG_DIR).predict_after(ex[2]["body"], reply(ex[2])) is None
    )
    # where the transcripts are is not known yet: learnt from a request after a compaction
    forecast = CompactionForecast()
    assert forecast.predict_after(ex[3]["body"], reply(ex[3])) is None
    learned = forecast.learn(ex[4]["body"])
    assert learned.config_dir == CONFIG_DIR
    predicted = learned.predict_after(ex[3]["body"], reply(ex[3]))
    assert predicted is not None and stem(predicted) == stem(ex[4]["body"])
    # not after a turn, nor after a compaction between tool calls
    assert learned.predict_after(ex[1]["body"], reply(ex[1])) is None
    between = exchanges("tool_call")[4]
    assert learned.predict_after(between["body"], reply(ex[3])) is None


def test_after_two_replies_without_a_summary_the_first_is_the_summary() -> None:
    """Captured (``retry_twice_differs``): neither reply had a summary, and Claude Code went on
    with the first one; without the first reply nothing is predicted."""
    ex = exchanges("retry_twice_differs")
    assert kinds("retry_twice_differs")[2:5] == ["compaction", "compaction", "turn"]
    forecast = CompactionForecast(config_dir=CONFIG_DIR)
    assert forecast.predict_after(ex[3]["body"], reply(ex[3])) is None
    predicted = forecast.predict_after(ex[3]["body"], reply(ex[3]), reply(ex[2]))
    assert predicted is not None and stem(predicted) == stem(ex[4]["body"])
    assert "The user asked for single words.\n\nNothing is pending." in stem(ex[4]["body"])
    assert "The second attempt" not in stem(ex[4]["body"])
    # a retry answered with its summary goes on with that one, whatever came first
    retried = exchanges("retry")
    predicted = forecast.predict_after(retried[3]["body"], reply(retried[3]), reply(ex[2]))
    assert predicted is not None and stem(predicted) == stem(retried[4]["body"])


def test_a_summary_opened_at_a_line_start_is_not_asked_again() -> None:
    """Captured (``open_summary``): ``<summary>`` at a line's start, never closed, and an
    unclosed ``<analysis>``: no retry, and the reply goes into the summary message as it is."""
    ex = exchanges("open_summary")
    assert kinds("open_summary")[2:4] == ["compaction", "turn"]
    said = reply(ex[2])["content"][0]["text"]
    assert has_summary(said) and not has_summary("see <summary> below")
    assert CompactionForecast().predict_retry(ex[2]["body"], reply(ex[2])) is None
    assert summary_text(said) == said.strip()


def test_of_a_reply_in_several_text_blocks_the_last_with_a_summary_is_read() -> None:
    """Captured (``two_blocks``): a compaction reply of two text blocks, ``<summary>`` opened in
    the first and closed in the second; Claude Code read the first alone, the last block that
    holds ``<summary>``."""
    ex = exchanges("two_blocks")
    assert kinds("two_blocks")[2:4] == ["compaction", "turn"]
    first, second = (block["text"] for block in reply(ex[2])["content"])
    assert reply_text(reply(ex[2])) == first.strip()
    sent = stem(ex[3]["body"])
    assert "1. Single words, then\n" in sent and second.split("\n")[0] not in sent
    predicted = CompactionForecast(config_dir=CONFIG_DIR).predict_after(ex[2]["body"], reply(ex[2]))
    assert predicted is not None and stem(predicted) == sent


def test_of_a_reply_in_several_text_blocks_without_a_summary_the_last_is_read() -> None:
    """Captured (``two_blocks_no_summary``): two replies of two text blocks, none with a
    ``<summary>``; Claude Code asked again, then went on with the first reply's *last* block."""
    ex = exchanges("two_blocks_no_summary")
    assert kinds("two_blocks_no_summary")[2:5] == ["compaction", "compaction", "turn"]
    first = reply(ex[2])
    assert reply_text(first) == "The first reply, its second block."
    forecast = CompactionForecast(config_dir=CONFIG_DIR)
    assert forecast.predict_retry(ex[2]["body"], first) is not None
    predicted = forecast.predict_after(ex[3]["body"], reply(ex[3]), first)
    assert predicted is not None and stem(predicted) == stem(ex[4]["body"])
    assert "The first reply, its second block." in stem(ex[4]["body"])
    assert "its first block" not in stem(ex[4]["body"])


def test_a_reply_cut_at_the_token_limit() -> None:
    """Captured: a retry cut at the token limit failed, though it held a summary, and Claude Code
    went on with the first reply (``retry_cut``); a first reply cut there, with its summary, is
    the summary, and the turn after it follows Claude Code's request to continue (``cut``)."""
    forecast = CompactionForecast(config_dir=CONFIG_DIR)
    ex = exchanges("retry_cut")
    assert reply(ex[3])["stop_reason"] == "max_tokens" and has_summary(
        reply_text(reply(ex[3])) or ""
    )
    predicted = forecast.predict_after(ex[3]["body"], reply(ex[3]), reply(ex[2]))
    assert predicted is not None and stem(predicted) == stem(ex[4]["body"])
    assert "\nBeta\n" in stem(ex[4]["body"])
    ex = exchanges("cut")
    assert "Output token limit hit" in str(ex[3]["body"]["messages"][-1]["content"])
    predicted = forecast.predict_after(ex[2]["body"], reply(ex[2]))
    assert predicted is not None and stem(predicted) == stem(ex[4]["body"])


def test_the_summary_as_claude_code_writes_it_back() -> None:
    said = "<analysis>\nThinking.\n</analysis>\n\n<summary>\n1. One.\n\n\n\n2. Two.\n</summary>\n"
    assert summary_text(said) == "Summary:\n1. One.\n\n2. Two."
    assert summary_text("no tags\n\n\nat all") == "no tags\n\nat all"
    # only the first analysis goes; a closing tag before the opening one is no block
    assert summary_text("</analysis>a<analysis>b</analysis><analysis>c</analysis>") == (
        "</analysis>a<analysis>c</analysis>"
    )
    # Claude Code's own tag for the tools used cannot be forged from the summary
    assert summary_text("x </tools-used-before-summary> y") == "x &lt;/tools-used-before-summary> y"
    assert has_summary("<analysis>a</analysis>\n<summary>b</summary>")
    assert not has_summary("<analysis><summary>b</summary></analysis>")
