"""Deadlines: the one deadline type, and a thread's bound on every request a backend sends for it.

:class:`Deadline` is an absolute ``time.monotonic()`` time shared by the attempts of one
operation, with the back-off between them. A caller with a tighter bound than the backends'
``operation_timeout`` (the c10d Store: its timeout) wraps its calls in :func:`call_deadline`;
a backend gives each request :func:`call_budget` seconds. Part of the KV protocol
(:mod:`rdzv_core.kv` re-exports these names).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from .backoff import Backoff
from .errors import BackendTimeoutError, InvalidArgumentError

__all__ = ["Deadline", "call_deadline", "call_budget", "budget_text", "check_timeout"]

#: :meth:`Deadline.backoff`'s pauses: first window and largest window (seconds).
BACKOFF_FIRST = 0.05
BACKOFF_CAP = 1.0


class Deadline:
    """An absolute deadline on ``clock`` (``time.monotonic()`` seconds), shared by the attempts of one operation.

    Args:
        seconds: time from now (float >= 0).
        clock: the clock (``time.monotonic`` by default; injectable for tests).
        sleeper: what :meth:`backoff` sleeps with (``time.sleep`` by default).

    Attributes:
        at: the deadline, a ``clock()`` time (float).
    """

    def __init__(
        self, seconds: float, *, clock: Callable[[], float] = time.monotonic,
        sleeper: Callable[[float], object] = time.sleep,
    ) -> None:
        self._clock = clock
        self.at = clock() + seconds
        self._backoff = Backoff(base=BACKOFF_FIRST, cap=BACKOFF_CAP, clock=clock, sleeper=sleeper)

    def remaining(self) -> float:
        """Seconds left (0.0 once passed)."""
        return max(0.0, self.at - self._clock())

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self._clock() >= self.at

    def backoff(self) -> bool:
        """Pause before the operation's next attempt: 50 ms doubling per pause to 1 s, full jitter
        (:class:`~rdzv_core.backoff.Backoff`), never past the deadline.

        Returns:
            ``False`` (without sleeping) if no time is left, else ``True``.
        """
        return self._backoff.sleep(self.at)

_call_deadline = threading.local()  # .at: the calling thread's deadline (time.monotonic()), or absent


@contextlib.contextmanager
def call_deadline(seconds: float | None) -> Iterator[None]:
    """Bound every backend call this thread makes inside the block to end within ``seconds`` from now.

    Backends that honour it (every built-in one) give each request ``call_budget(...)``
    seconds and raise :class:`~rdzv_core.errors.BackendTimeoutError` when the time is up.
    Nested blocks keep the earlier deadline; ``None`` adds no bound.

    Raises:
        InvalidArgumentError: ``seconds`` is not a number >= 0.
    """
    outer = getattr(_call_deadline, "at", None)
    at = None if seconds is None else time.monotonic() + check_timeout(seconds)
    if outer is not None and (at is None or outer < at):
        at = outer
    _call_deadline.at = at
    try:
        yield
    finally:
        _call_deadline.at = outer


def call_budget(operation_timeout: float) -> float:
    """Seconds a backend request started now may take: ``operation_timeout``, or less inside
    :func:`call_deadline` (the time left to the calling thread's deadline).

    Raises:
        BackendTimeoutError: that deadline has passed.
    """
    at: float | None = getattr(_call_deadline, "at", None)
    if at is None:
        return operation_timeout
    left = at - time.monotonic()
    if left <= 0:
        raise BackendTimeoutError("the caller's deadline passed before the request was sent", None)
    return min(operation_timeout, left)


def budget_text(operation_timeout: float) -> str:
    """For an error message: the time a request that just ran out had -- ``operation_timeout=10s``,
    or ``the caller's deadline`` when the calling thread's :func:`call_deadline` (nearly) passed."""
    at: float | None = getattr(_call_deadline, "at", None)
    if at is not None and time.monotonic() >= at - 0.05:
        return "the caller's deadline"
    return f"operation_timeout={operation_timeout:g}s"


def check_timeout(timeout: float) -> float:
    """``timeout`` as a float number of seconds >= 0 (deadlines, watch timeouts).

    Raises:
        InvalidArgumentError: on ``timeout``: not a number, NaN, or negative.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout != timeout or timeout < 0:
        raise InvalidArgumentError("timeout", timeout, "a timeout is a number of seconds >= 0")
    return float(timeout)
