"""PromptMemo: the engine's templating and tokenizing answers, kept and bounded."""

from __future__ import annotations

import sys

from agentkv.prompts import PromptMemo, template_key

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_the_same_body_on_the_same_day_has_the_same_key() -> None:
    """Equal bodies share a key; another message, another day or another field does not."""
    key = template_key(BODY, "2026-12-02")
    assert template_key(dict(BODY), "2026-12-02") == key
    assert template_key(BODY, "2026-12-03") != key
    other = {"messages": [{"role": "user", "content": "hi!"}], "max_tokens": 4}
    assert template_key(other, "2026-12-02") != key
    assert template_key({**BODY, "tools": []}, "2026-12-02") != key


def test_answers_are_given_back() -> None:
    memo = PromptMemo()
    assert memo.template("k") is None
    assert memo.tokens("<s>hi") is None
    memo.keep_template("k", "<s>hi")
    memo.keep_tokens("<s>hi", [1, 2, 70000])
    assert memo.template("k") == "<s>hi"
    assert memo.tokens("<s>hi") == [1, 2, 70000]
    # A prompt's tokens are not a template's answer, nor the other way round.
    assert memo.template("<s>hi") is None
    assert memo.tokens("k") is None


def test_the_memo_stays_within_its_bytes_least_recently_used_out() -> None:
    """Each kept answer counts its bytes; past the bound the oldest unused ones go first."""
    prompt = "x" * 10_000
    size = sys.getsizeof(prompt)
    memo = PromptMemo(max_bytes=3 * size + 1_000)
    for i in range(3):
        memo.keep_template(f"k{i}", prompt + str(i))
    assert len(memo) == 3
    assert memo.template("k0") is not None  # used: now the most recent
    memo.keep_template("k3", prompt + "3")
    assert memo.size <= memo.max_bytes
    assert memo.template("k1") is None  # the least recently used went
    assert memo.template("k0") is not None and memo.template("k3") is not None
    # Keeping an answer again replaces it, and counts it once.
    before = memo.size
    memo.keep_template("k3", prompt + "3")
    assert memo.size == before
    # An answer larger than the whole memo is not kept, and drops nothing.
    memo.keep_tokens("y" * 100_000, range(10))
    assert memo.tokens("y" * 100_000) is None
    assert memo.template("k0") is not None
    memo.clear()
    assert (len(memo), memo.size) == (0, 0)


def test_tokens_are_kept_compactly() -> None:
    """12,000 tokens cost about 48 KB (4 bytes each) besides their prompt, not a tuple of ints."""
    memo = PromptMemo()
    prompt = "p" * 50_000
    memo.keep_tokens(prompt, range(100_000, 112_000))
    assert memo.size - sys.getsizeof(prompt) < 12_000 * 4 + 1_000
    assert memo.tokens(prompt) == list(range(100_000, 112_000))


# -- tokenizing from a kept prompt ------------------------------------------------------------

MARKERS = {"<|im_start|>": 1, "<|im_end|>": 2}


def toy_tokens(prompt: str, *, add_special: bool = True) -> list[int]:
    """A toy of llama-server's tokenizer: special tokens split the text first, then each piece
    becomes one token per word (its length plus 100), a BOS (0) first when asked."""
    out = [0] if add_special else []
    rest = prompt
    while rest:
        at = [(rest.find(m), m) for m in MARKERS if rest.find(m) >= 0]
        if not at:
            out += [100 + len(w) for w in rest.split()]
            break
        where, marker = min(at)
        out += [100 + len(w) for w in rest[:where].split()]
        out.append(MARKERS[marker])
        rest = rest[where + len(marker) :]
    return out


def turn(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


SYSTEM = turn("system", "you are a careful coding agent " * 200)


def tokenized_from_memo(memo: PromptMemo, prompt: str) -> list[int] | None:
    found = memo.nearest(prompt)
    if found is None:
        return None
    split = memo.split(prompt, *found, MARKERS)
    if split is None:
        return None
    assert prompt[split.at :] == split.text
    return split.head + toy_tokens(split.text, add_special=False)


def test_a_prompt_that_continues_a_kept_one_is_tokenized_from_its_last_shared_turn() -> None:
    memo = PromptMemo()
    first = SYSTEM + turn("user", "read the file") + "<|im_start|>assistant\n"
    memo.keep_tokens(first, toy_tokens(first))
    second = (
        SYSTEM + turn("user", "read the file") + turn("assistant", "done") + turn("user", "now")
    )
    split = memo.split(second, *memo.nearest(second), MARKERS)  # type: ignore[misc]
    assert split is not None
    # Cut at the last special token at least 64 characters inside what the two share: the end
    # of the system turn (the user's turn ends too close to where the prompts part).
    assert split.at == len(SYSTEM) - len("<|im_end|>\n")
    assert split.text.startswith("<|im_end|>\n<|im_start|>user\nread the file")
    assert split.head + toy_tokens(split.text, add_special=False) == toy_tokens(second)


def test_the_nearest_of_the_recent_prompts_is_the_base() -> None:
    """Of several kept prompts, the one sharing the longest beginning is cut from."""
    memo = PromptMemo()
    other = turn("system", "another agent entirely " * 200)
    memo.keep_tokens(other, toy_tokens(other))
    near = SYSTEM + turn("user", "one") + turn("assistant", "two")
    memo.keep_tokens(near, toy_tokens(near))
    memo.keep_tokens(SYSTEM, toy_tokens(SYSTEM))
    prompt = near + turn("user", "three")
    found = memo.nearest(prompt)
    assert found is not None and found[0] == near
    assert tokenized_from_memo(memo, prompt) == toy_tokens(prompt)
    memo.clear()
    assert memo.nearest(prompt) is None


def test_no_cut_without_a_long_shared_beginning_or_a_known_marker() -> None:
    memo = PromptMemo()
    memo.keep_tokens(SYSTEM, toy_tokens(SYSTEM))
    assert memo.nearest(turn("system", "short")) is None
    prompt = SYSTEM + turn("user", "hi")
    found = memo.nearest(prompt)
    assert found is not None
    assert memo.split(prompt, *found, {}) is None
    assert memo.split(prompt, *found, {"<|unknown|>": 9}) is None


def test_no_cut_when_the_markers_text_and_tokens_do_not_pair_up() -> None:
    """When the marker's text appears more often than its token (part of a longer special
    token, say), the cut could be anywhere: none is made."""
    memo = PromptMemo()
    prompt = SYSTEM + turn("user", "one")
    tokens = toy_tokens(prompt)
    tokens.remove(2)  # one <|im_end|> text without its token
    memo.keep_tokens(prompt, tokens)
    longer = prompt + turn("assistant", "two")
    found = memo.nearest(longer)
    assert found is not None
    assert memo.split(longer, *found, {"<|im_end|>": 2}) is None


def test_every_cut_of_random_conversations_gives_the_whole_answer() -> None:
    """Conversations that grow, fork and start over: every prompt tokenized from the memo is
    tokenized as a whole would be."""
    import random

    rng = random.Random(7)
    memo = PromptMemo()
    words = ["alpha", "be", "gamma", "delta", "<tag>", "x" * 30, "é", "\n"]
    histories: list[str] = [SYSTEM]
    cut = 0
    for _ in range(300):
        base = rng.choice(histories)
        prompt = base + turn(rng.choice(["user", "assistant"]), " ".join(rng.choices(words, k=40)))
        got = tokenized_from_memo(memo, prompt)
        if got is not None:
            cut += 1
            assert got == toy_tokens(prompt)
        memo.keep_tokens(prompt, toy_tokens(prompt))
        histories.append(prompt)
    assert cut > 200
