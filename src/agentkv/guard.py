"""RepetitionGuard: notice when a generation has fallen into a degenerate loop.

Small models sometimes repeat themselves until the token limit (``ok ok ok …``, one line, one
block of code, ``}}}}``), and Claude Code asks for up to 32,000 tokens. A loop, by default, is
the last ``L`` characters being exactly periodic with a period of at most ``max_period``, where
``L`` is at least ``min_repeats`` periods and ``min_chars`` characters; the defaults were checked
against 280 MB of code and text (see docs/troubleshooting.md). The guard keeps the last
``2 * window`` characters and looks at the tail once every ``check_every`` new characters with a
few C-level string searches, so a long reply costs time linear in its length. Pure: no I/O.
"""

from __future__ import annotations

import attrs

from agentkv.tokens import common_prefix

__all__ = ["Repetition", "RepetitionGuard", "cut_tail", "periodic_suffix"]


@attrs.frozen
class Repetition:
    """A loop found at the end of the text: ``unit`` repeated over the last ``length`` characters.

    ``length`` counts from where the repetition starts (the first copy of ``unit`` included) to the
    end of the text seen so far; it is at most the guard's window.
    """

    unit: str
    length: int

    @property
    def period(self) -> int:
        """The length of the repeated unit, in characters."""
        return len(self.unit)

    @property
    def repeats(self) -> float:
        """How many times the unit was written (the last copy may be partial)."""
        return self.length / len(self.unit)

    def describe(self) -> str:
        """One line for logs: ``'ok ' repeated 160 times (480 characters)``."""
        shown = self.unit if len(self.unit) <= 40 else self.unit[:37] + "..."
        return f"{shown!r} repeated {self.repeats:.0f} times ({self.length} characters)"


def periodic_suffix(text: str, period: int) -> int:
    """The length of the longest suffix of ``text`` with the given period.

    That is the largest ``L`` such that ``text[i] == text[i + period]`` for every ``i`` in the last
    ``L`` characters but the final ``period``; it is at least ``min(period, len(text))``: the text
    read backwards compared with itself ``period`` characters on, by :func:`common_prefix`.
    """
    if period <= 0 or period >= len(text):
        return len(text)
    backwards = text[::-1]
    return period + common_prefix(backwards[period:], backwards)


@attrs.define
class RepetitionGuard:
    """Fed generated text piece by piece; reports the first degenerate loop at its end, and then
    keeps reporting it (``tripped``) and ignores further text.

    Thresholds, in characters: ``min_chars``, the shortest loop; ``min_repeats``, the fewest copies
    of the unit; ``max_period``, the longest unit looked for; ``check_every``, how much new text
    may arrive between two looks at the tail (the detection delay).
    """

    min_chars: int = 800
    min_repeats: int = 10
    max_period: int = 1024
    check_every: int = 64
    #: How many recurrences of the tail's last characters are tried as candidate periods.
    max_candidates: int = 32

    _tail: str = attrs.field(default="", init=False)
    #: Text fed since the last look, joined onto the tail at the next look (not on every piece).
    _pending: list[str] = attrs.field(factory=list, init=False)
    _unchecked: int = attrs.field(default=0, init=False)
    _tripped: Repetition | None = attrs.field(default=None, init=False)

    @property
    def window(self) -> int:
        """The most text one look at the tail examines."""
        return max(self.min_chars, self.min_repeats * self.max_period)

    @property
    def buffered(self) -> int:
        """How many characters the guard keeps (at most ``2 * window``, whatever it was fed)."""
        return len(self._tail) + self._unchecked

    @property
    def tripped(self) -> Repetition | None:
        """The loop reported, once there is one."""
        return self._tripped

    def feed(self, text: str) -> Repetition | None:
        """Add generated text; the loop its tail now ends in, if any (then on every later call)."""
        if self._tripped is not None or not text:
            return self._tripped
        self._pending.append(text)
        self._unchecked += len(text)
        if self._unchecked >= self.check_every:
            window = self.window
            tail = self._tail + "".join(self._pending)
            self._pending.clear()
            self._unchecked = 0
            # Less than check_every characters arrive before the next join: two windows at most.
            if len(tail) > 2 * window - self.check_every:
                tail = tail[-window:]
            self._tail = tail
            self._tripped = self._look(tail[-window:])
        return self._tripped

    def reset(self) -> None:
        """Forget everything (a new reply begins)."""
        self._tail, self._unchecked, self._tripped = "", 0, None
        self._pending.clear()

    def _look(self, tail: str) -> Repetition | None:
        n = len(tail)
        if n < self.min_chars:
            return None
        # If the tail repeats with period p over at least p + k characters, its last k characters
        # occur again exactly p characters earlier: those recurrences are the candidate periods.
        k = min(32, self.min_chars // 2)
        probe = tail[n - k :]
        limit = n - 1  # a recurrence ends before the text does
        for _ in range(self.max_candidates):
            found = tail.rfind(probe, 0, limit)
            if found < 0:
                return None
            period = n - k - found
            if period > self.max_period:
                return None
            needed = max(self.min_chars, self.min_repeats * period)
            if needed <= n and tail[n - needed : n - period] == tail[n - needed + period :]:
                length = periodic_suffix(tail, period)
                return Repetition(tail[n - length : n - length + period], length)
            limit = found + k - 1
        return None


def cut_tail(text: str, drop: int) -> tuple[str, int]:
    """``text`` less its last ``drop`` characters (at most all), and how many are left to drop."""
    if drop <= 0:
        return text, 0
    kept = max(0, len(text) - drop)
    return text[:kept], drop - (len(text) - kept)
