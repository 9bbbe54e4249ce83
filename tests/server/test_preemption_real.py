"""Pre-emption on a real llama-server: the urgent request goes first, the displaced one resumes
where it stopped and its client gets a whole, correct reply; nothing is computed twice."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.conftest import Live, start_live

pytestmark = pytest.mark.engine

# About 2,500 tokens that only the background agent sends: a prefill of many seconds on a CPU.
FACTS = "\n".join(f"Fact {i}: the crate in bay {i} holds {i * 3} parts." for i in range(180))
SECRET = "The secret word is PERIWINKLE."


@pytest.fixture(scope="module")
def live_preempt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with start_live(tmp_path_factory.mktemp("preempt"), preempt_from=1) as server:
        yield server


def post(
    live: Live, agent: str, priority: int, messages: list[dict[str, Any]], **extra: Any
) -> Any:
    body = {"model": "m", "max_tokens": 64, "temperature": 0, "messages": messages, **extra}
    headers = {"x-agent-id": agent, "x-agent-priority": str(priority)}
    response = httpx.post(f"{live.url}/v1/messages", json=body, headers=headers, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def computed(live: Live) -> float:
    """llama-server's own count of prompt tokens computed so far."""
    headers = {"authorization": f"Bearer {live.engine_key}"} if live.engine_key else {}
    text = httpx.get(f"{live.engine_url}/metrics", headers=headers, timeout=30).text
    for line in text.splitlines():
        if line.startswith("llamacpp:prompt_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("no prompt_tokens_total in llama-server's metrics")


def wait(live: Live, condition: Any, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition(live.runtime):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_prefill_suspended_for_p0_resumes_without_computing_anything_twice(
    live_preempt: Live,
) -> None:
    live = live_preempt
    results: dict[str, Any] = {}
    question = [{"role": "user", "content": f"{FACTS}\n{SECRET}\nWhat is the secret word?"}]
    before = computed(live)

    def background() -> None:
        results["bg"] = post(live, "background", 2, question)

    thread = threading.Thread(target=background)
    thread.start()
    wait(
        live,
        lambda rt: any(r.agent == "background" and (r.prefilled or 0) > 500 for r in rt.running()),
        "background prefill under way",
    )
    started = time.monotonic()
    urgent = post(live, "coordinator", 0, [{"role": "user", "content": "Say: ready"}])
    urgent_s = time.monotonic() - started
    thread.join(timeout=600)
    records = {r.agent: r for r in live.runtime.records()}
    assert records["background"].suspended == 1
    assert records["coordinator"].suspended == 0
    assert urgent["content"][0]["text"].strip()
    assert "PERIWINKLE" in results["bg"]["content"][0]["text"].upper()
    # Prompt tokens the engine computed: each prompt once (plus one token per resume, which
    # llama-server always evaluates to sample from).
    total = records["background"].prompt_tokens + records["coordinator"].prompt_tokens
    assert computed(live) - before <= total + 4
    print(
        f"P0 answered in {urgent_s:.1f} s while a {records['background'].prompt_tokens}-token "
        f"prefill was suspended"
    )


def test_a_reply_suspended_mid_decode_continues_correctly(live_preempt: Live) -> None:
    live = live_preempt
    results: dict[str, Any] = {}
    count = [{"role": "user", "content": "Count from 1 to 40, separated by spaces. Only numbers."}]

    def background(name: str) -> None:
        results[name] = post(live, name, 2, count, max_tokens=200)

    threads = [threading.Thread(target=background, args=(f"counter-{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    wait(
        live,
        lambda rt: sum(1 for r in rt.running() if r.ttft_s is not None) == 2,
        "both slots generating",
    )
    time.sleep(1.0)
    urgent = post(live, "coordinator", 0, [{"role": "user", "content": "Say: ready"}])
    for thread in threads:
        thread.join(timeout=600)
    assert urgent["content"][0]["text"].strip()
    suspended = [
        r for r in live.runtime.records() if r.agent.startswith("counter-") and r.suspended
    ]
    assert len(suspended) == 1
    texts = {name: results[name]["content"][0]["text"] for name in ("counter-0", "counter-1")}
    for name, text in texts.items():
        numbers = [int(w) for w in text.replace(",", " ").split() if w.isdigit()]
        # Each reply counts on: no number repeated, none skipped (the default model stops at
        # 20, whatever the prompt asks).
        assert len(numbers) >= 15 and numbers == list(range(1, len(numbers) + 1)), (name, text)
    # The same request, decoded greedily: the reply that was suspended and resumed is the one
    # that ran through, character for character.
    assert texts["counter-0"] == texts["counter-1"], texts
