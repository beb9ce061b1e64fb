"""Time budgets of etcd requests, and what a retried compare-guarded write knows.

An etcd member can hold a request for its own request timeout (5 s and more) while a new leader serves
within about a second, so one operation's deadline is shared by several attempts of its requests
(:meth:`AttemptDeadline.attempt`); ``docs/backends/etcd-v2.md`` ("Failures") explains the retry rules.
"""

from __future__ import annotations

import time

from rdzv_core.deadlines import Deadline

__all__ = ["MIN_ATTEMPT", "AttemptDeadline", "FailureBudget", "Tries"]

#: Shortest time one attempt of a request gets (seconds); see :meth:`AttemptDeadline.attempt`.
MIN_ATTEMPT = 0.5


class AttemptDeadline(Deadline):
    """An operation's :class:`~rdzv_core.deadlines.Deadline` whose attempts get a growing share of it.

    Args:
        seconds: time from now (float >= 0).
    """

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self._attempt_cap = max(MIN_ATTEMPT, seconds / 3)

    def attempt(self) -> float:
        """Seconds the next attempt of a request may take (0.0 once the deadline passed).

        ``min(remaining, cap)``: the cap starts at ``max(MIN_ATTEMPT, seconds / 3)`` and doubles with each
        attempt that ran out of time (:meth:`timed_out`), so a request held by one member is sent again (to
        the next endpoint) well before the deadline, and a merely slow server still gets the time it needs.
        """
        return min(self.remaining(), self._attempt_cap)

    def timed_out(self) -> None:
        """Note that an attempt used up its :meth:`attempt` time: the next one gets twice as long."""
        self._attempt_cap *= 2

    def failed(self) -> None:
        """Note a transport failure (see :class:`FailureBudget`); a plain deadline ignores it."""


class FailureBudget(AttemptDeadline):
    """How long a long poll (a watch) may retry transport failures.

    ``seconds`` counted from the first failure (so a server lost an hour into a
    watch still gets the full budget), never past ``cap`` (the watch's own
    deadline). Before any failure it is ``cap``.
    """

    def __init__(self, seconds: float, cap: AttemptDeadline) -> None:
        super().__init__(0.0)
        self.seconds = seconds
        self.cap = cap
        self.at = cap.at
        self._started = False

    def failed(self) -> None:
        if not self._started:
            self._started = True
            self.at = min(self.cap.at, time.monotonic() + self.seconds)


class Tries:
    """What the transport tells a compare-guarded write about the attempts of its request.

    A retried compare-guarded write (``create``, the compare-and-* writes,
    ``add``'s compare-and-swap) may meet its own earlier, applied attempt as a
    conflict. It reads such a conflict with two facts:

    * ``seen``: the highest revision the backend had seen before the first
      attempt; state at a revision ``<= seen`` predates the request, so a
      conflict with it is genuine.
    * ``maybe_applied``: set by the transport when an attempt failed after it
      may have reached etcd. Without it every conflict is genuine.

    Attributes:
        seen: a revision (int).
        maybe_applied: bool, ``False`` until the transport sets it.
    """

    __slots__ = ("seen", "maybe_applied")

    def __init__(self, seen: int) -> None:
        self.seen = seen
        self.maybe_applied = False

    def predates(self, revision: int) -> bool:
        """Whether state at ``revision`` existed before this request's first attempt was sent."""
        return revision <= self.seen
