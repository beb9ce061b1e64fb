"""Fork-safe lazy per-process state: made on first use, forgotten in a forked child.

After ``fork()`` a child holds copies of its parent's objects but none of its threads: a lock another
thread held stays held, a scheduler or poller thread is gone, and a connection (socket, SQLite handle,
gRPC channel) is the parent's, which the child must neither use nor close. A :class:`PerProcess` holds
such state. One ``os.register_at_fork(after_in_child=...)`` hook (registered here, once) drops every
live instance's state in the child -- handing it to the instance's ``forget`` callback first, which
may park connections so they are never closed there -- and gives each instance a new lock; the
child's first :meth:`PerProcess.get` makes its own state. Code that kept a reference to the parent's
state tells it is not its process's by :meth:`PerProcess.current` (``current() is not state``).

Users: the keep-alive scheduler (``keepalive.py``), the round watches (``roundwatch.py``), the file
backend's write locks, pollers and connection pools (``rdzv_backends/file``), the etcd v3 stream loop
(``rdzv_backends/etcd_v3/streams.py``) and the Redis connection pools and pub/sub notifiers
(``rdzv_backends/redis/_pool.py``, ``_listener.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Callable, Generic, TypeVar

__all__ = ["PerProcess"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_instances: weakref.WeakSet[PerProcess[object]] = weakref.WeakSet()
_instances_lock = threading.Lock()


class PerProcess(Generic[T]):
    """One value of type ``T`` per process: made by ``make()`` on the first :meth:`get` in each process.

    Args:
        make: makes the state; called at most once per process (under the instance's lock).
        forget: called in a forked child with the parent's state, if it was made, right before it is
            dropped (for example to keep its connections from being closed there); what it raises is
            logged and ignored. It runs in the child's only thread, in the ``fork()`` hook: it must not
            block or start threads.
    """

    __slots__ = ("_make", "_forget", "_lock", "_value", "__weakref__")

    def __init__(self, make: Callable[[], T], forget: Callable[[T], object] | None = None) -> None:
        self._make, self._forget = make, forget
        self._lock = threading.Lock()
        self._value: T | None = None
        with _instances_lock:
            _instances.add(self)  # type: ignore[arg-type]  # T is invariant; the hook only drops values

    def get(self) -> T:
        """This process's state, made now if it is the first call here."""
        value = self._value
        if value is not None:
            return value
        with self._lock:
            if self._value is None:
                self._value = self._make()
            return self._value

    def current(self) -> T | None:
        """This process's state if it was made, else ``None`` (makes nothing)."""
        return self._value

    def _drop_in_child(self) -> None:
        old, self._value = self._value, None
        self._lock = threading.Lock()
        if old is not None and self._forget is not None:
            try:
                self._forget(old)
            except Exception:  # a forget callback's bug must not break the child
                log.exception("forgetting a parent's per-process state after fork() failed")


def _after_fork_in_child() -> None:
    global _instances_lock
    _instances_lock = threading.Lock()  # a parent's thread may have held it at fork()
    for instance in list(_instances):
        instance._drop_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
