"""Which endpoint of a multi-host etcd URL an attempt goes to."""

from __future__ import annotations

import threading

__all__ = ["Endpoints"]


class Endpoints:
    """The endpoints of a multi-host URL, tried in turn (thread-safe).

    The endpoint that last worked is tried first; a failing one moves the
    preference to the next, so every operation visits each endpoint at most
    once per round (see :meth:`order`).

    Args:
        count: how many endpoints (int >= 1).

    Raises:
        ValueError: ``count`` < 1.
    """

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError("at least one endpoint")
        self.count = count
        self._current = 0
        self._lock = threading.Lock()

    def order(self) -> list[int]:
        """Endpoint indexes for one round, the preferred one first."""
        with self._lock:
            start = self._current
        return [(start + i) % self.count for i in range(self.count)]

    def failed(self, index: int) -> None:
        """Prefer the endpoint after ``index`` (if ``index`` is still preferred)."""
        with self._lock:
            if self._current == index:
                self._current = (index + 1) % self.count

    def prefer(self, indexes: list[int]) -> None:
        """Prefer the first of ``indexes`` (endpoints known to answer, e.g. at open); none: no change."""
        if indexes:
            self.worked(indexes[0])

    def worked(self, index: int) -> None:
        """Prefer ``index`` from now on."""
        with self._lock:
            self._current = index
