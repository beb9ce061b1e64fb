"""A fake ``time.monotonic`` and ``time.sleep`` pair for deterministic tests of timing helpers."""

from __future__ import annotations


class FakeClock:
    """Call it for the time (seconds); :meth:`sleep` advances it and records each sleep in ``slept``."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
