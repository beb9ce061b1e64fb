"""Exponential back-off with "full jitter": the one retry pause of the project.

The ``n``-th delay (counting from 0) is drawn uniformly from ``[0, min(cap, base * 2**n))`` -- the
"Full Jitter" formula of Marc Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog, 2015
(https://aws.amazon.com/blogs/architecture/exponential-backoff-and-jitter/), which spreads the
retries of clients that failed together best and makes the least work of the variants compared there.
With ``base == cap`` the window does not grow: a constant pause with the same jitter.

Users: the rendezvous attempts (``rendezvous/node.py``, the setup stagger in ``rendezvous/machine.py``),
the keep-alive's retries (``keepalive.py``), the round watch's retries (``roundwatch.py``), the
handler's close at shutdown (``handler.py``), the c10d Store's compare-and-swap loops (``store.py``),
and the backends' operation deadlines and race retries (``rdzv_backends/_concurrency.py``).
"""

from __future__ import annotations

import random
import time
from typing import Callable

__all__ = ["Backoff"]

#: The exponent stops growing here (``2**16`` times ``base`` is past any cap in use; no float overflow).
_MAX_EXPONENT = 16


class Backoff:
    """Exponentially growing, fully jittered pauses: ``base`` seconds doubling per pause up to ``cap``.

    Args:
        base: the first window, in seconds (> 0).
        cap: the largest window, in seconds (>= ``base``).
        rng: the random source (``random.Random``; the module's shared one by default), for tests.
        clock: ``time.monotonic``-like clock (seconds) that deadlines given to :meth:`sleep` are on.
        sleeper: ``time.sleep``-like function :meth:`sleep` pauses with.

    Attributes:
        pauses: how many delays were drawn since construction or the last :meth:`reset` (int).

    Raises:
        ValueError: ``base`` is not > 0 or ``cap`` is below ``base``.
    """

    __slots__ = ("base", "cap", "pauses", "_uniform", "_clock", "_sleep")

    def __init__(
        self, base: float, cap: float, *, rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic, sleeper: Callable[[float], object] = time.sleep,
    ) -> None:
        if not base > 0 or not cap >= base:
            raise ValueError(f"back-off needs 0 < base <= cap, got base={base!r}, cap={cap!r}")
        self.base, self.cap, self.pauses = base, cap, 0
        self._uniform: Callable[[float, float], float] = random.uniform if rng is None else rng.uniform
        self._clock, self._sleep = clock, sleeper

    def window(self) -> float:
        """The current window (seconds): ``min(cap, base * 2**pauses)``; the next delay is below it."""
        return min(self.cap, self.base * (2.0 ** min(self.pauses, _MAX_EXPONENT)))

    def delay(self) -> float:
        """Draw the next delay (seconds, uniform in ``[0, window)``) and grow the window; no sleep."""
        value = self._uniform(0.0, self.window())
        self.pauses += 1
        return value

    def reset(self) -> None:
        """Start again from ``base`` (after a success)."""
        self.pauses = 0

    def sleep(self, until: float | None = None) -> bool:
        """Sleep the next :meth:`delay`, but not past ``until`` (a ``clock()`` time; ``None``: no bound).

        Returns:
            ``False`` without sleeping (nor drawing a delay) when ``until`` has passed, else ``True``.
        """
        if until is None:
            self._sleep(self.delay())
            return True
        left = until - self._clock()
        if left <= 0:
            return False
        self._sleep(min(self.delay(), left))
        return True
