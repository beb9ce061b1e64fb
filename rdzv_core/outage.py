"""Log a retried failure once per outage, not once per failed attempt.

A backend that is down for a minute makes a keep-alive, the agent's
waiting-node check and the rendezvous retry loop fail several times a second
each; a line per attempt buries everything else. :class:`OutageLog` logs the
first failure of a streak at WARNING, the rest at DEBUG, and the first success
after a streak once at INFO with the number of failures. :class:`Responsiveness`
tells since when a client has seen the backend answer without a break.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

__all__ = ["OutageLog", "Responsiveness", "LATEST_JUDGEMENT", "judged_at"]

#: A keep-alive key seen missing by a prompt look is judged lost at the latest this many keep-alive TTLs
#: later, however often the looker's own calls stall meanwhile (``docs/design.md``, "The backend away").
LATEST_JUDGEMENT = 3


def judged_at(answering_since: float, missing_since: float, ttl: float) -> float:
    """When (``time.monotonic()``) a keep-alive key first seen missing at ``missing_since`` is judged lost: once
    the backend has answered without a break since ``answering_since`` for ``ttl`` seconds (the keep-alive
    TTL), and at the latest :data:`LATEST_JUDGEMENT` TTLs after it was first seen missing."""
    return min(answering_since + ttl, missing_since + LATEST_JUDGEMENT * ttl)


class OutageLog:
    """WARNING at the first failure of a streak, DEBUG while it lasts, INFO once it ends.

    Args:
        emit: ``emit(level, msg, *args)``: a :meth:`logging.Logger.log`, or a
            function that adds context (run id, rank) and calls one.

    Attributes:
        failures: failed attempts in the current streak (int; 0 when none).

    Not thread-safe: one instance per retrying loop (or per key).
    """

    def __init__(self, emit: Callable[..., None]) -> None:
        self._emit = emit
        self.failures = 0

    def failed(self, msg: str, *args: Any) -> None:
        """Log one failed attempt: ``msg % args`` at WARNING if it starts a streak, else at DEBUG."""
        self._emit(logging.DEBUG if self.failures else logging.WARNING, msg, *args)
        self.failures += 1

    def recovered(self, msg: str, *args: Any) -> None:
        """End a streak, if one is going on: log ``msg % args`` at INFO, followed by
        "after N failed attempt(s)". Does nothing when the last attempt did not fail."""
        if self.failures:
            self._emit(logging.INFO, msg + " after %d failed attempt(s)", *args, self.failures)
            self.failures = 0


class Responsiveness:
    """Since when one client has seen the backend answer promptly, without a break.

    Fed with the client's regular calls (:meth:`begin` at the start of each, :meth:`record` at its end): a
    call that failed, took longer than ``slow`` seconds, or started more than ``max_gap`` seconds after the
    previous one ended (the client, or its process, was held up) restarts the period at the call's end; a
    call still in flight after ``slow`` seconds, or no call begun for more than ``max_gap`` seconds (the
    process was paused or starved and its next call has not run yet), breaks it now, until :meth:`idle`
    says the calls stopped on purpose. The rendezvous judges a missing keep-alive
    key a real loss only once the period spans a whole keep-alive TTL (``docs/design.md``, "The backend
    away"): a key that vanished while the backend was away from everybody gets the same TTL to be written
    again that a member always has.

    Args:
        slow: seconds after which a call counts as a stall (> 0).
        max_gap: seconds between two calls beyond which the client counts as held up (> 0).

    Thread-safe.
    """

    def __init__(self, slow: float, max_gap: float) -> None:
        self.slow, self.max_gap = slow, max_gap
        self._since = time.monotonic()
        self._broken = -float("inf")
        self._last = self._since  # when the last call ended (at first: when the calls were set up)
        self._idle = False
        self._inflight: list[float] = []  # start times of calls begun and not yet recorded
        self._lock = threading.Lock()

    def begin(self) -> float:
        """A call starts now: its start (``time.monotonic()``), to pass to :meth:`record`."""
        started = time.monotonic()
        with self._lock:
            self._inflight.append(started)
        return started

    def record(self, started: float, ended: float, ok: bool) -> None:
        """One call from ``started`` to ``ended`` (``time.monotonic()`` seconds); ``ok``: it answered."""
        with self._lock:
            if started in self._inflight:
                self._inflight.remove(started)
            if not ok or ended - started > self.slow or self._late(started):
                self._since = max(self._since, ended)
                self._broken = max(self._broken, ended)
            self._last = max(self._last, ended)

    def broken(self) -> None:
        """The backend failed to answer just now: the period restarts now."""
        now = time.monotonic()
        with self._lock:
            self._since, self._broken = max(self._since, now), max(self._broken, now)

    def idle(self) -> None:
        """The calls stopped on purpose (e.g. a keep-alive stopped): the time since the last one is no hold-up."""
        with self._lock:
            self._idle = True

    def _late(self, started: float) -> bool:
        """Whether a call begun at ``started`` came more than ``max_gap`` seconds after the previous one ended
        (lock held)."""
        return started - self._last > self.max_gap

    def _stalled_now(self) -> float:
        """Now if a call has been in flight longer than ``slow``, or the pending call (now, if none was begun)
        is late while the calls go on; else ``-inf`` (lock held)."""
        now = time.monotonic()
        pending = min(self._inflight, default=now)  # when the call in flight began; now if none has
        stalled = now - pending > self.slow or (not self._idle and self._late(pending))
        return now if stalled else -float("inf")

    @property
    def since(self) -> float:
        """``time.monotonic()`` since which every call answered promptly (the start, if none failed yet;
        now, while a call is stalled or overdue)."""
        with self._lock:
            return max(self._since, self._stalled_now())

    @property
    def last_break(self) -> float:
        """``time.monotonic()`` of the last failed, stalled or held-up call (``-inf`` if none; now, while a
        call is stalled or overdue)."""
        with self._lock:
            return max(self._broken, self._stalled_now())
