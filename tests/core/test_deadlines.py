"""rdzv_core.deadlines: the one Deadline type (an injected clock and sleep) and the caller's call deadline."""

from __future__ import annotations

import pytest
from tests.support.fake_clock import FakeClock

from rdzv_core.deadlines import BACKOFF_CAP, BACKOFF_FIRST, Deadline, call_budget, call_deadline
from rdzv_core.errors import BackendTimeoutError


def test_remaining_and_expired_follow_the_clock() -> None:
    clock = FakeClock(now=50.0)
    deadline = Deadline(2.0, clock=clock, sleeper=clock.sleep)
    assert deadline.at == 52.0 and deadline.remaining() == 2.0 and not deadline.expired()
    clock.now = 53.0
    assert deadline.remaining() == 0.0 and deadline.expired()


def test_backoff_pauses_within_the_window_and_never_past_the_deadline() -> None:
    clock = FakeClock()
    deadline = Deadline(1.5, clock=clock, sleeper=clock.sleep)
    windows = [BACKOFF_FIRST * 2**n for n in range(5)]
    while deadline.backoff():
        pass
    assert clock.now <= deadline.at and deadline.expired()
    assert all(0 <= s <= min(BACKOFF_CAP, w) for s, w in zip(clock.slept, windows + [BACKOFF_CAP] * 99, strict=False))
    assert deadline.backoff() is False, "no time left: no sleep"


def test_call_deadline_bounds_the_budget_and_nests_to_the_earlier() -> None:
    assert call_budget(10.0) == 10.0
    with call_deadline(1.0):
        assert call_budget(10.0) <= 1.0
        with call_deadline(5.0):
            assert call_budget(10.0) <= 1.0, "the earlier deadline stays"
    with call_deadline(0.0):
        with pytest.raises(BackendTimeoutError):
            call_budget(10.0)
