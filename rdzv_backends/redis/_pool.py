"""The connection pool of :mod:`rdzv_backends.redis`: redis-py connections, used directly.

Instead of redis-py's ``BlockingConnectionPool`` and client, whose per-call work costs more than
the call with hundreds of threads (docs/backends/redis.md, "The connection pool"); redis-py still
speaks the protocol (its ``Connection`` objects parse the replies).
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
import weakref
from typing import Any, Callable

import redis

#: Seconds between looks at the idle list by a call waiting for a connection (all max_connections busy).
_POOL_RECHECK = 0.05


class _Pool:
    """Connections of one backend: idle ones last-in first-out, at most ``limit``; a call waits up
    to ``timeout`` seconds for a free one (then redis-py's ``ConnectionError("No connection
    available.")``, mapped to :class:`~rdzv_core.errors.BackendTimeoutError`). A forked child forgets
    the parent's connections (it must not share their sockets).
    """

    _all_pools: weakref.WeakSet[_Pool] = weakref.WeakSet()

    def __init__(self, make: Callable[[], Any], limit: int, timeout: float) -> None:
        self._make = make
        self._limit = limit
        self._timeout = timeout
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._idle: list[Any] = []
        self._made: set[Any] = set()  # every connection not yet dropped (close() disconnects them)
        self._closed = False
        self._waiting = 0  # threads waiting for a connection (under the lock)
        _Pool._all_pools.add(self)

    def acquire(self, timeout: float | None = None) -> Any:
        """A connection for one call; give it back with :meth:`release`.

        Args:
            timeout: seconds to wait for a free one (``None``: the pool's ``timeout``).

        Raises:
            redis.ConnectionError: the pool is closed, or none came free within the timeout.
        """
        if not self._closed:
            try:
                return self._idle.pop()  # atomic: no lock on the usual path
            except IndexError:
                pass
        with self._lock:
            deadline = None
            while True:
                if self._closed:
                    raise redis.ConnectionError("the backend is closed")
                if self._idle:
                    return self._idle.pop()
                if len(self._made) < self._limit:
                    conn = self._make()
                    self._made.add(conn)
                    return conn
                now = time.monotonic()
                if deadline is None:
                    deadline = now + (self._timeout if timeout is None else timeout)
                if now >= deadline:
                    raise redis.ConnectionError("No connection available.")
                self._waiting += 1
                try:  # a release does not take the lock: look again now and then
                    self._freed.wait(min(deadline - now, _POOL_RECHECK))
                finally:
                    self._waiting -= 1

    def release(self, conn: Any) -> None:
        """Give back a connection from :meth:`acquire`. (After :meth:`close`, which disconnected it,
        it may land in the idle list: nobody takes it from there.)"""
        self._idle.append(conn)  # atomic: no lock on the usual path
        if self._waiting:
            with self._lock:
                self._freed.notify()

    def close(self) -> None:
        """Disconnect every connection, those in use too (their calls fail); later calls fail."""
        with self._lock:
            self._closed = True
            conns = list(self._made)
            self._made.clear()
            self._idle.clear()
            self._freed.notify_all()
        for conn in conns:
            conn.disconnect()

    def _forget(self) -> None:
        """In a forked child: drop the parent's connections without touching their sockets."""
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._idle, self._made = [], set()
        self._waiting = 0

    @classmethod
    def _after_fork(cls) -> None:
        for pool in list(cls._all_pools):
            pool._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_Pool._after_fork)


def _stale(sock: socket.socket) -> bool:
    """Whether a connection at rest (every reply read) has something to read: only EOF or an error
    can be there (no pub/sub, no client tracking on these connections)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))
