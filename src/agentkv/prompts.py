"""PromptMemo: the engine's templating and tokenizing answers, kept for the same question.

Before a reply agentkv asks llama-server for the prompt its chat template makes of the request
(``/apply-template``), then for that prompt's tokens (``/tokenize``). For one loaded model both
depend on the question alone, so a question asked again (a retry, ``count_tokens`` then the
request, the shared head measured again) costs no call. A template also reads the clock
(``strftime_now`` writes today's date), so a templated prompt is kept for its day
(:func:`template_key`).

llama-server tokenizes a prompt piece by piece between its special tokens (the text is split at
each ``<|im_start|>`` first), so a kept prompt's tokens up to a special token that a new prompt
shares are the new one's too: :meth:`PromptMemo.split` cuts there, well inside the shared
beginning, and only the rest is tokenized. Which strings are special tokens is the engine's to
say (:func:`marker_candidates` only proposes them), and the client checks the first answers made
this way against the engine's whole tokenizing before it trusts them.

Bounded by the bytes kept, least recently used out: a token takes 4 bytes (an ``array``), a
prompt what ``sys.getsizeof`` says. Pure: values in, values out.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from cachetools import LRUCache

from agentkv.tokens import common_prefix

__all__ = [
    "MEMO_BYTES",
    "PromptMemo",
    "PromptStats",
    "Split",
    "marker_candidates",
    "template_key",
]

#: What a memo keeps at most, in bytes: about 150 of Claude Code's 12,000-token prompts.
MEMO_BYTES = 8 << 20
#: What an entry costs besides its value (the key, the dict's slot, the tuple).
_ENTRY_BYTES = 200
#: How many of the latest tokenized prompts a new one is compared with.
_RECENT = 8
#: A split is made this far inside the shared beginning at least (characters): a special token
#: that ends closer to where the prompts differ could be the start of a longer one.
_MARGIN = 64
#: Where special tokens are learnt from: this many characters at the start of the shared
#: beginning and at its end (a chat template writes one at every message).
_WINDOW = 8192
#: A shared beginning shorter than this is tokenized again whole: the saving would be small.
SPLIT_MIN = 2048
#: Text that could be a special token: ``<|im_start|>``, ``<start_of_turn>``, ``[INST]``.
_CANDIDATE = re.compile(r"<\|[^<>|\s]{1,48}\|>|</?[A-Za-z_][\w:.-]{0,48}>|\[/?[A-Z_]{2,24}\]")


def marker_candidates(text: str) -> set[str]:
    """The strings in ``text`` that look like special tokens (for the engine to confirm)."""
    return set(_CANDIDATE.findall(text))


@attrs.define
class PromptStats:
    """Where a client's prompt answers came from (the operator's metrics)."""

    #: Templated prompts: kept from before, or asked of the engine.
    templates_kept: int = 0
    templates_asked: int = 0
    #: Prompt tokens: kept, made from a kept prompt's and the rest (pieces), or asked whole.
    tokens_kept: int = 0
    tokens_pieces: int = 0
    tokens_whole: int = 0

    def add(self, other: PromptStats) -> PromptStats:
        pairs = zip(attrs.astuple(self), attrs.astuple(other), strict=True)
        return PromptStats(*(a + b for a, b in pairs))


@attrs.frozen
class Split:
    """A prompt's tokens from a kept prompt's: ``head``, then those of ``text`` (tokenized with no
    BOS or EOS added)."""

    head: list[int]
    text: str
    #: Where ``text`` begins in the prompt (characters).
    at: int


def template_key(body: Mapping[str, Any], day: str) -> str:
    """The key of a chat ``body``'s templated prompt on ``day`` (``"2026-12-02"``, say)."""
    text = json.dumps(body, separators=(",", ":"))
    return hashlib.sha256(f"{day}\n{text}".encode()).hexdigest()[:32]


@attrs.define(eq=False)
class PromptMemo:
    """Templated prompts by :func:`template_key`, and token ids by prompt text."""

    max_bytes: int = MEMO_BYTES
    #: (kind, key) → (value, bytes): the least recently used out beyond ``max_bytes``.
    _entries: LRUCache[tuple[str, str], tuple[str | array[int], int]] = attrs.field(init=False)
    #: The latest prompts kept with their tokens, the newest last.
    _recent: deque[str] = attrs.field(factory=lambda: deque(maxlen=_RECENT), init=False)

    @_entries.default
    def _new_entries(self) -> LRUCache[tuple[str, str], tuple[str | array[int], int]]:
        return LRUCache(maxsize=self.max_bytes, getsizeof=lambda entry: entry[1])

    @property
    def size(self) -> int:
        """Bytes kept now."""
        return int(self._entries.currsize)

    def __len__(self) -> int:
        return len(self._entries)

    def template(self, key: str) -> str | None:
        """The prompt kept for ``key``, or None."""
        value = self._get(("t", key))
        return value if isinstance(value, str) else None

    def keep_template(self, key: str, prompt: str) -> None:
        self._put(("t", key), prompt, sys.getsizeof(prompt))

    def tokens(self, prompt: str) -> list[int] | None:
        """The token ids kept for ``prompt`` (tokenized with the model's special tokens), or
        None."""
        value = self._get(("k", prompt))
        return value.tolist() if isinstance(value, array) else None

    def keep_tokens(self, prompt: str, tokens: Sequence[int]) -> None:
        ids = array("i", tokens)
        # The key holds the prompt text too (a reference, often to the template's own value).
        self._put(("k", prompt), ids, ids.itemsize * len(ids) + sys.getsizeof(prompt))
        if prompt in self._recent:
            self._recent.remove(prompt)
        self._recent.append(prompt)

    def nearest(self, prompt: str) -> tuple[str, int] | None:
        """The latest kept prompt that shares the longest beginning with ``prompt`` (at least
        :data:`SPLIT_MIN` characters), and how many characters it shares."""
        kept = [base for base in reversed(self._recent) if ("k", base) in self._entries]
        found = [(b, n) for b in kept if (n := common_prefix(prompt, b)) >= SPLIT_MIN]
        return max(found, key=lambda pair: pair[1], default=None)

    def window(self, base: str, shared: int) -> str:
        """The text of ``base`` to learn its special tokens from (:func:`marker_candidates`)."""
        end = max(0, shared - _MARGIN)
        return base[: min(end, _WINDOW)] + "\n" + base[max(_WINDOW, end - _WINDOW) : end]

    def split(
        self, prompt: str, base: str, shared: int, markers: Mapping[str, int]
    ) -> Split | None:
        """How to tokenize ``prompt`` from the kept prompt ``base`` it shares ``shared``
        characters with (:meth:`nearest`), cut at the latest special token of ``markers`` (text
        → token id) well inside what they share; None when there is no such cut (then the whole
        prompt is tokenized)."""
        if not markers:
            return None
        entry = self._entries.get(("k", base))
        if entry is None or not isinstance(entry[0], array):
            return None
        tokens = entry[0]
        end = shared - _MARGIN
        marker = max(markers, key=lambda text: base.rfind(text, 0, end))  # the first of the latest
        cut = base.rfind(marker, 0, end)
        if cut < SPLIT_MIN // 2:
            return None
        token = markers[marker]
        # Each occurrence of the marker's text is one of its token, or the count tells otherwise
        # (a longer special token holding it, say): then no cut is made.
        if base.count(marker) != tokens.count(token):
            return None
        index = -1
        for _ in range(base.count(marker, 0, cut) + 1):
            index = tokens.index(token, index + 1)
        return Split(head=tokens[:index].tolist(), text=prompt[cut:], at=cut)

    def clear(self) -> None:
        self._entries.clear()
        self._recent.clear()

    def _get(self, key: tuple[str, str]) -> str | array[int] | None:
        entry = self._entries.get(key)  # a hit counts as a use
        return None if entry is None else entry[0]

    def _put(self, key: tuple[str, str], value: str | array[int], size: int) -> None:
        size += _ENTRY_BYTES
        if size > self.max_bytes:
            return  # larger than the whole memo: not kept
        self._entries[key] = (value, size)
