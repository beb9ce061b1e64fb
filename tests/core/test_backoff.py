"""rdzv_core.backoff: the one back-off of the project (full jitter), with an injected RNG and clock."""

from __future__ import annotations

import random

import pytest
from tests.support.fake_clock import FakeClock

from rdzv_core.backoff import Backoff


class _Edges(random.Random):
    """An RNG whose ``uniform(a, b)`` returns ``b`` (the top of every window): the windows themselves."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_windows_double_from_base_up_to_cap_and_reset_starts_over() -> None:
    backoff = Backoff(base=0.05, cap=1.0, rng=_Edges())
    assert [backoff.delay() for _ in range(7)] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert backoff.pauses == 7
    backoff.reset()
    assert backoff.pauses == 0 and backoff.delay() == pytest.approx(0.05)


def test_delays_are_full_jitter_uniform_below_the_window() -> None:
    """Each delay lies in [0, window): the same seed draws the same delays (deterministic for tests)."""
    first = [Backoff(0.01, 1.0, rng=random.Random(7)).delay() for _ in range(3)]
    assert first == [Backoff(0.01, 1.0, rng=random.Random(7)).delay() for _ in range(3)]
    backoff = Backoff(base=0.01, cap=1.0, rng=random.Random(1))
    for _ in range(200):
        window = backoff.window()
        assert 0.0 <= backoff.delay() <= window
    assert backoff.window() == 1.0, "the window stops at cap (and the exponent stops growing: no overflow)"


def test_constant_window_when_base_equals_cap() -> None:
    backoff = Backoff(base=0.5, cap=0.5, rng=_Edges())
    assert [backoff.delay() for _ in range(4)] == [0.5] * 4


def test_sleep_stops_at_the_deadline_and_refuses_after_it() -> None:
    clock = FakeClock()
    backoff = Backoff(base=1.0, cap=4.0, rng=_Edges(), clock=clock, sleeper=clock.sleep)
    assert backoff.sleep(until=clock.now + 10.0) and clock.slept == [1.0]
    assert backoff.sleep(until=clock.now + 0.3) and clock.slept[-1] == pytest.approx(0.3), "cut at the deadline"
    pauses = backoff.pauses
    assert backoff.sleep(until=clock.now) is False and backoff.pauses == pauses, "no time left: no draw, no sleep"
    assert backoff.sleep() and clock.slept[-1] == 4.0, "without a deadline: the whole delay"


@pytest.mark.parametrize(("base", "cap"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0), (float("nan"), 1.0)])
def test_bad_bounds_are_refused(base: float, cap: float) -> None:
    with pytest.raises(ValueError):
        Backoff(base=base, cap=cap)
