"""The connection pool of :mod:`rdzv_backends.redis`: redis-py connections, used directly.

Instead of redis-py's ``BlockingConnectionPool`` and client, whose per-call work costs more than
the call with hundreds of threads (docs/backends/redis.md, "The connection pool"); redis-py still
speaks the protocol (its ``Connection`` objects parse the replies).
"""

from __future__ import annotations

import select
import socket
import threading
import time
from typing import Any, Callable

import redis

from rdzv_core.forksafe import PerProcess

#: Seconds between looks at the idle list by a call waiting for a connection (all max_connections busy).
_POOL_RECHECK = 0.05


class _Conns:
    """One process's connections of a :class:`_Pool`: idle ones, every one made, and the lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.freed = threading.Condition(self.lock)
        self.idle: list[Any] = []
        self.made: set[Any] = set()  # every connection not yet dropped (close() disconnects them)
        self.waiting = 0  # threads waiting for a connection (under the lock)


class _Pool:
    """Connections of one backend: idle ones last-in first-out, at most ``limit``; a call waits up
    to ``timeout`` seconds for a free one (then redis-py's ``ConnectionError("No connection
    available.")``, mapped to :class:`~rdzv_core.errors.BackendTimeoutError`). A forked child forgets
    the parent's connections (it must not share their sockets).
    """

    def __init__(self, make: Callable[[], Any], limit: int, timeout: float) -> None:
        self._make = make
        self._limit = limit
        self._timeout = timeout
        self._closed = False
        self._conns: PerProcess[_Conns] = PerProcess(_Conns)  # a forked child starts with none

    def acquire(self, timeout: float | None = None) -> Any:
        """A connection for one call; give it back with :meth:`release`.

        Args:
            timeout: seconds to wait for a free one (``None``: the pool's ``timeout``).

        Raises:
            redis.ConnectionError: the pool is closed, or none came free within the timeout.
        """
        conns = self._conns.get()
        if not self._closed:
            try:
                return conns.idle.pop()  # atomic: no lock on the usual path
            except IndexError:
                pass
        with conns.lock:
            deadline = None
            while True:
                if self._closed:
                    raise redis.ConnectionError("the backend is closed")
                if conns.idle:
                    return conns.idle.pop()
                if len(conns.made) < self._limit:
                    conn = self._make()
                    conns.made.add(conn)
                    return conn
                now = time.monotonic()
                if deadline is None:
                    deadline = now + (self._timeout if timeout is None else timeout)
                if now >= deadline:
                    raise redis.ConnectionError("No connection available.")
                conns.waiting += 1
                try:  # a release does not take the lock: look again now and then
                    conns.freed.wait(min(deadline - now, _POOL_RECHECK))
                finally:
                    conns.waiting -= 1

    def release(self, conn: Any) -> None:
        """Give back a connection from :meth:`acquire`. (After :meth:`close`, which disconnected it,
        it may land in the idle list: nobody takes it from there.)"""
        conns = self._conns.get()
        conns.idle.append(conn)  # atomic: no lock on the usual path
        if conns.waiting:
            with conns.lock:
                conns.freed.notify()

    def close(self) -> None:
        """Disconnect every connection, those in use too (their calls fail); later calls fail."""
        conns = self._conns.get()
        with conns.lock:
            self._closed = True
            made = list(conns.made)
            conns.made.clear()
            conns.idle.clear()
            conns.freed.notify_all()
        for conn in made:
            conn.disconnect()


def _stale(sock: socket.socket) -> bool:
    """Whether a connection at rest (every reply read) has something to read: only EOF or an error
    can be there (no pub/sub, no client tracking on these connections)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))
