"""Token prefixes and the learned cost model."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from agentkv.costs import CostModel, PrefillModel, RateModel
from agentkv.tokens import common_prefix, digest


def _naive(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@given(st.lists(st.integers(0, 3), max_size=60), st.lists(st.integers(0, 3), max_size=60))
def test_common_prefix_matches_a_plain_loop(a: list[int], b: list[int]) -> None:
    """The binary search gives exactly the first differing position."""
    assert common_prefix(a, b) == _naive(a, b)
    assert common_prefix(tuple(a), b) == _naive(a, b)


def test_common_prefix_on_long_prompts() -> None:
    """Two 12,000-token prompts that differ at one place share everything before it."""
    rng = random.Random(7)
    a = tuple(rng.randrange(150_000) for _ in range(12_000))
    b = (*a[:9_475], -1, *a[9_476:])
    assert common_prefix(a, b) == 9_475
    assert common_prefix(a, a[:5_000]) == 5_000
    assert common_prefix((), a) == 0


def test_digest_is_stable_and_tells_sequences_apart() -> None:
    assert digest((1, 2, 3)) == digest([1, 2, 3])
    assert digest((1, 2, 3)) != digest((1, 2, 4))
    assert len(digest(())) == 24


def test_prefill_prior_matches_the_measured_cpu_speeds() -> None:
    """The prior reproduces the figures it was taken from (2 cores, default model)."""
    model = PrefillModel()
    assert 170 < model.tokens_per_second(0, 2_000) < 210
    assert 75 < model.tokens_per_second(0, 11_700) < 95


def test_prefill_model_learns_a_faster_engine() -> None:
    """After a few observations of a GPU-like engine, the estimates follow it."""
    model = PrefillModel()
    for start, count in [(0, 4000), (4000, 8000), (0, 12000), (9000, 300), (0, 500)] * 4:
        true_seconds = 2e-4 * count + 2e-9 * (count * start + count * (count - 1) / 2)
        model.observe(start, count, true_seconds)
    truth = 2e-4 * 10_000 + 2e-9 * (10_000 * 9_999 / 2)
    assert abs(model.estimate(0, 10_000) - truth) / truth < 0.25
    # Later positions cost more than early ones.
    assert model.estimate(10_000, 1_000) > model.estimate(0, 1_000)


def test_prefill_model_never_promises_free_tokens() -> None:
    """Noisy observations cannot drive the price of a token to zero or below."""
    model = PrefillModel()
    for _ in range(30):
        model.observe(0, 100, 0.001)
        model.observe(10_000, 100, 5.0)
    assert model.estimate(0, 100) > 0
    assert model.estimate(20_000, 100) > 0
    model.observe(0, 0, 1.0)  # nothing computed: ignored
    model.observe(0, 10, float("nan"))


def test_rate_model_follows_observations() -> None:
    rate = RateModel(rate=100.0, overhead=0.01)
    for _ in range(20):
        rate.observe(1_000, 0.01 + 1_000 / 500.0)
    assert 450 < rate.rate < 550
    assert rate.estimate(0) == 0.01


def test_cost_model_state_bytes() -> None:
    costs = CostModel(bytes_per_token=20_000.0)
    assert costs.state_bytes(10) == costs.bytes_per_token * 10 == 200_000


def test_cost_model_learns_from_llama_server_timings() -> None:
    """A reply's timings teach prefill and decode speeds; malformed timings teach nothing."""
    costs = CostModel()
    before = (costs.prefill.estimate(0, 1000), costs.decode.rate)
    for junk in (None, "timings", {"prompt_n": "many"}, {"prompt_n": 1, "predicted_n": 1}):
        costs.observe_timings(junk)
    assert (costs.prefill.estimate(0, 1000), costs.decode.rate) == before
    for _ in range(20):  # an engine ten times faster than the prior at both
        costs.observe_timings(
            {
                "cache_n": 0,
                "prompt_n": 1000,
                "prompt_ms": 500.0,
                "predicted_n": 300,
                "predicted_ms": 1000.0,
            }
        )
    assert costs.prefill.estimate(0, 1000) < before[0] / 2
    assert costs.decode.rate > 200
