"""What engine work costs, learned from what the engine reports: prefill, decode, save, restore.

Every slot decision is a comparison of times (prefill here, or restore a saved state and prefill
less), priced from llama-server's own figures (``timings`` of every reply, ``t_ms``/``n_bytes``
of every save and restore), so the prices follow the machine. Prefill is not linear in tokens:
attention makes a token cost more the further into the context it sits. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from agentkv.snapshot import CostsView

__all__ = ["CostModel", "PrefillModel", "RateModel"]


def _position_sum(start: int, count: int) -> float:
    """Sum of the positions ``start .. start + count - 1``."""
    return count * start + count * (count - 1) / 2


@attrs.define
class PrefillModel:
    """Seconds to prefill ``count`` tokens that start at position ``start`` of a slot.

    The model is ``a * count + b * (sum of positions)``: ``a`` is the cost of a token at the start
    of the context, ``b`` how much each position further in adds. It is fitted by least squares on
    the *relative* error (a 40-token follow-up counts as much as a 12,000-token cold start), with
    exponential forgetting (``memory`` observations), starting from a prior worth ``prior``
    observations, so it follows a machine that gets busier or quieter.

    The default prior was measured with the default 0.5B model on 2 CPU cores: about 190 tokens/s
    for a 2K prompt and 82 tokens/s averaged over 11.7K.
    """

    a: float = 3.8e-3
    b: float = 1.4e-6
    memory: float = 10.0
    prior: float = 2.0
    #: Sufficient statistics (x1 = n/t, x2 = s/t, target 1): x1x1, x1x2, x2x2, x1, x2.
    _sums: list[float] = attrs.field(init=False, factory=lambda: [0.0] * 5)

    def __attrs_post_init__(self) -> None:
        for count in (2048, 12288):  # the prior: two cold prompts priced by a and b
            self._add(count, _position_sum(0, count), self.estimate(0, count), self.prior / 2)

    def _add(self, n: float, s: float, t: float, weight: float) -> None:
        x1, x2 = n / t, s / t
        for i, value in enumerate((x1 * x1, x1 * x2, x2 * x2, x1, x2)):
            self._sums[i] += weight * value

    def estimate(self, start: int, count: int) -> float:
        """Seconds to compute ``count`` tokens from position ``start`` (0 for nothing)."""
        if count <= 0:
            return 0.0
        return self.a * count + self.b * _position_sum(start, count)

    def observe(self, start: int, count: int, seconds: float) -> None:
        """Learn from one prefill the engine reported (``cache_n``, ``prompt_n``, ``prompt_ms``)."""
        if count <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        keep = 1.0 - 1.0 / self.memory
        self._sums = [value * keep for value in self._sums]
        self._add(count, _position_sum(start, count), seconds, 1.0)
        s11, s12, s22, s1, s2 = self._sums
        det = s11 * s22 - s12 * s12
        a = b = -1.0
        if det > 1e-9 * s11 * s22:
            a = (s1 * s22 - s2 * s12) / det
            b = (s2 * s11 - s1 * s12) / det
        if a <= 0 or b < 0:
            # Too little spread to see the slope, or a noisy fit that would promise free tokens:
            # a flat price per token.
            a, b = s1 / s11, 0.0
        self.a, self.b = max(a, 1e-9), b

    def tokens_per_second(self, start: int, count: int) -> float:
        """Average speed over that stretch, for reports."""
        seconds = self.estimate(start, count)
        return count / seconds if seconds > 0 else math.inf


@attrs.define
class RateModel:
    """``seconds = overhead + amount / rate``, the rate an exponentially weighted average.

    Used for decode (tokens/s, no overhead) and for slot save and restore (bytes/s plus a fixed
    cost per call).
    """

    rate: float
    overhead: float = 0.0
    weight: float = 0.3

    def estimate(self, amount: float) -> float:
        return self.overhead + (amount / self.rate if amount > 0 else 0.0)

    def observe(self, amount: float, seconds: float) -> None:
        if amount <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        seen = amount / max(seconds - self.overhead, seconds * 0.1)
        self.rate = (1 - self.weight) * self.rate + self.weight * seen


@attrs.define
class CostModel:
    """The engine's prices, as far as agentkv has seen them."""

    prefill: PrefillModel = attrs.field(factory=PrefillModel)
    #: Generated tokens per second for one request (2 CPU cores, default model: about 34).
    decode: RateModel = attrs.field(factory=lambda: RateModel(rate=30.0))
    #: Slot save to a file: bytes/s (measured 54.6 MB in 28 ms from a warm slot).
    save: RateModel = attrs.field(factory=lambda: RateModel(rate=1.0e9, overhead=0.02))
    #: Slot restore from a file: bytes/s (7.5 ms for 54.6 MB from the page cache; a cold disk is
    #: far slower, which the observations teach).
    restore: RateModel = attrs.field(factory=lambda: RateModel(rate=1.0e9, overhead=0.02))
    #: Bytes of saved state per token (12.3 KB for the default model's f16 KV cache).
    bytes_per_token: float = 12_300.0

    def observe_timings(self, timings: object) -> None:
        """Learn prefill and decode speeds from a llama-server reply's ``timings`` (anything
        else, or malformed figures, teaches nothing)."""
        if not isinstance(timings, Mapping):
            return
        try:
            cache = int(timings.get("cache_n", 0))
            computed = int(timings.get("prompt_n", 0))
            prompt_ms = float(timings.get("prompt_ms", 0.0))
            predicted = int(timings.get("predicted_n", 0))
            predicted_ms = float(timings.get("predicted_ms", 0.0))
        except (TypeError, ValueError):
            return
        if computed > 1:
            self.prefill.observe(cache, computed, prompt_ms / 1000)
        if predicted > 1:
            self.decode.observe(predicted, predicted_ms / 1000)

    def view(self) -> CostsView:
        """The prices as the operator sees them (rounded)."""
        return CostsView(
            prefill_tokens_per_s_at_0=round(self.prefill.tokens_per_second(0, 1000), 1),
            prefill_tokens_per_s_at_10k=round(self.prefill.tokens_per_second(10_000, 1000), 1),
            decode_tokens_per_s=round(self.decode.rate, 1),
            restore_bytes_per_s=round(self.restore.rate),
            bytes_per_token=round(self.bytes_per_token),
        )

    def state_bytes(self, tokens: int) -> float:
        """Expected size of a saved state holding ``tokens`` tokens."""
        return tokens * self.bytes_per_token
