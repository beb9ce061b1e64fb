"""Log a retried failure once per outage, not once per failed attempt.

A backend that is down for a minute makes a keep-alive, the agent's
waiting-node check and the rendezvous retry loop fail several times a second
each; a line per attempt buries everything else. :class:`OutageLog` logs the
first failure of a streak at WARNING, the rest at DEBUG, and the first success
after a streak once at INFO with the number of failures.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

__all__ = ["OutageLog"]


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
