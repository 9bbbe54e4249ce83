"""Claude Code's own compaction, prepared in idle time, with the real CLI on the real engine.

One session in a project of its own, on the server the other Claude Code tests share: a first
turn whose notes take the context past Claude Code's compaction point, a short second turn (Claude
Code never compacts after a session's first reply), then — once agentkv has prepared the
compaction, its retry when the reply had no ``<summary>``, and the conversation that follows — a
third turn, which begins with Claude Code's compaction and goes on with the conversation agentkv
computed: only its words are computed then. What the default model writes in its summary is not
judged; what agentkv served and computed is.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentkv_bench.compaction import notes
from tests.claude._cli import AgentKVServer, exported, make_project, run_claude

pytestmark = [pytest.mark.claude, pytest.mark.engine]

#: A turn's bound on 2 cores (the first computes the notes and, alone, Claude Code's prompt).
TURN_BOUND_S = 900
#: Claude Code's output tokens here (the printed lines say 4,096): what the model may write in a
#: compaction reply is bounded, and so is the preparation. The point is then 32,768 − 1,024 −
#: 13,000 = 18,744 tokens of context.
MAX_OUTPUT = 1024
#: How long the preparation may take in idle time: the compaction's prompt (about 1,400 tokens
#: at Claude Code's depth), whatever the model writes (up to 1,024 tokens), the same for the retry,
#: and the conversation after it (about 2,700 tokens).
PREPARATION_BOUND_S = 1200
COMPACTED = '"query_source":"compact"'


def counters(server: AgentKVServer) -> dict[str, float]:
    """agentkv's prepared-compaction counters, by sample name (and reason)."""
    key = exported(server.env_lines).get("ANTHROPIC_API_KEY", "")
    text = httpx.get(f"{server.url}/metrics", headers={"x-api-key": key}, timeout=30).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("agentkv_prepared"):
                reason = sample.labels.get("reason")
                found[sample.name + (f"{{{reason}}}" if reason else "")] = sample.value
    return found


def grew(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@pytest.mark.timeout(3 * TURN_BOUND_S + PREPARATION_BOUND_S + 120)
def test_the_compaction_is_served_from_what_was_prepared_in_idle_time(
    agentkv_server: AgentKVServer, claude_home: Path, claude_bin: Path, tmp_path: Path
) -> None:
    project = make_project(tmp_path / "demo")

    def turn(prompt: str, *args: str) -> str:
        run = run_claude(
            [*agentkv_server.env_lines, f"export CLAUDE_CODE_MAX_OUTPUT_TOKENS={MAX_OUTPUT}"],
            prompt,
            project=project,
            home=claude_home,
            args=args,
            timeout=TURN_BOUND_S,
            claude=claude_bin,
        )
        assert not run.timed_out and run.returncode == 0, run.describe()
        return run.stdout + run.stderr

    before = counters(agentkv_server)
    # about 7,600 tokens of notes: with Claude Code's ~11,900-token prompt, past the point
    turn(notes(480, seed=7) + "\n\nReply with the single word: alpha")
    turn("Reply with the single word: beta", "--continue")

    # The reply to "beta" ended past the point: the compaction is prepared, then (its reply had
    # no summary) its retry, then the conversation after it. Wait until each of those has ended.
    agent = agentkv_server.table()["recent"][-1]["agent"]
    deadline = time.monotonic() + PREPARATION_BOUND_S
    idle_polls = 0
    while idle_polls < 2:  # idle twice in a row: nothing between one piece of work and the next
        now = counters(agentkv_server)
        table = agentkv_server.table()
        busy = [r for r in table["running"] if r["agent"] == agent]
        ended = [r for r in table["recent"] if r["agent"] == agent and r["priority"] == 3]
        started = grew(before, now, "agentkv_prepared_compactions_total") + grew(
            before, now, "agentkv_prepared_heads_total"
        )
        done = grew(before, now, "agentkv_prepared_heads_total") >= 1 and len(ended) >= started
        idle_polls = idle_polls + 1 if done and not busy else 0
        assert time.monotonic() < deadline, (now, table["running"], ended)
        time.sleep(2)
    prepared = counters(agentkv_server)
    assert grew(before, prepared, "agentkv_prepared_compactions_total") >= 1, prepared

    said = turn("Reply with the single word: gamma", "--continue")
    assert COMPACTED in said, said  # the turn began with Claude Code's compaction
    after = counters(agentkv_server)
    served = grew(prepared, after, "agentkv_prepared_compactions_served_total")
    # the compaction (and its retry, when there was one) served whole from what was prepared
    assert served == grew(before, prepared, "agentkv_prepared_compactions_total") >= 1, after
    missed = {k: v for k, v in after.items() if k.startswith("agentkv_prepared_compactions_missed")}
    assert all(v == before.get(k, 0.0) for k, v in missed.items()), missed

    # The turn on the compacted conversation: the last request of the session.
    recent = agentkv_server.table()["recent"]
    last = recent[-1]
    assert last["priority"] != 3 and last["status"] == "ok", recent[-3:]
    print(
        f"the turn after the compaction: {last['computed_tokens']} of {last['prompt_tokens']} "
        f"prompt tokens computed, first token after {last['ttft_s']} s"
    )
    # Computed in idle time before it, the turn on the compacted conversation computes only its
    # own words (and the few tokens the chat template puts around them). When it does not, the
    # server's log says where the request parted from the prediction.
    parted = [line for line in agentkv_server.log().splitlines() if "not the one computed" in line]
    why = f"{last.get('divergence')}; {parted}"
    assert grew(prepared, after, "agentkv_prepared_heads_missed_total") == 0, why
    assert last["cached_tokens"] >= 9000, why
    assert last["computed_tokens"] <= 64, why
