"""The watch poller of :mod:`rdzv_backends.file`, and what the backends of one process share per store file.

Per process and store file one :class:`_Shared` (:func:`_shared`, keyed by the file's real path):
the write lock threads take before ``BEGIN IMMEDIATE`` (:meth:`_Shared.transaction`) and the
:class:`_Poller`, the one thread that polls the file for every blocked ``watch`` of the process
(docs/backends/file.md, "Watch"). A forked child forgets them (:class:`~rdzv_core.forksafe.PerProcess`); the
parent's connections go to :data:`_FORK_ORPHANS`, never used or closed in the child.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from typing import Callable, Iterator, TypeVar

from rdzv_backends._waiters import Waiter, WaiterRegistry
from rdzv_backends.file._sql import (
    HISTORY_LIMIT,
    WATCH_BATCH,
    _compacted_message,
    _connect,
    _event,
    _events_by_revision,
    _meta_int,
    _poll,
    _Txn,
    map_error,
)
from rdzv_core.errors import BackendTimeoutError, CorruptEntryError, HistoryCompactedError, KVError
from rdzv_core.forksafe import PerProcess
from rdzv_core.kv import Event, KVBackend

log = logging.getLogger(__name__)

#: First and longest poll interval of the watch poller (seconds).
POLL_MIN, POLL_MAX = 0.005, 0.05
#: Seconds the watch poller thread waits for a new watch before it exits.
POLLER_LINGER = 1.0

T = TypeVar("T")


class _Waiter(Waiter):
    """One blocked ``watch`` registered with the poller.

    ``cursor``: events up to this revision are known not to concern it (read and written by the
    poller thread once registered). The poller fills ``events`` or ``error`` (a ``(class, message,
    key)`` triple, raised by the watching thread) under its condition, then sets ``done``.
    ``timeout``: the owner's ``operation_timeout`` (seconds).
    """

    __slots__ = ("cursor", "timeout", "error", "done")

    def __init__(self, prefix: str, cursor: int, owner: KVBackend, timeout: float) -> None:
        super().__init__(prefix, owner)
        self.cursor = cursor
        self.timeout = timeout
        self.error: tuple[type[KVError], str, str | None] | None = None
        self.done = threading.Event()


class _Poller:
    """The one thread of this process that polls a store file for every blocked watch."""

    def __init__(self, shared: "_Shared") -> None:
        self._shared = shared
        self._cond = threading.Condition()
        self._waiters: WaiterRegistry[_Waiter] = WaiterRegistry()
        self._poked = False
        self._thread: threading.Thread | None = None
        self.conn: sqlite3.Connection | None = None  # the poller thread's own

    @property
    def _count(self) -> int:
        """Registered waiters (read without the lock by :meth:`poke` and tests)."""
        return len(self._waiters)

    # -- called by watching / writing threads ------------------------------------------------
    def register(self, waiter: _Waiter) -> None:
        """Add ``waiter``; start the thread if none runs."""
        with self._cond:
            self._waiters.add(waiter)
            if self._thread is None:
                name = f"rdzv-file-poller {self._shared.path}"
                self._thread = threading.Thread(target=self._run, name=name, daemon=True)
                self._thread.start()
            elif self._count == 1:
                self._cond.notify()  # it is lingering

    def unregister(self, waiter: _Waiter) -> None:
        """Remove ``waiter`` (no-op if the poller already finished it)."""
        with self._cond:
            self._waiters.discard(waiter)

    def poke(self) -> None:
        """A write of this process committed: poll now rather than at the next tick."""
        if self._count:  # unlocked read: a missed poke costs one poll interval
            with self._cond:
                self._poked = True
                self._cond.notify()

    def release(self, owner: KVBackend) -> None:
        """End the blocked watches of ``owner`` (it is being closed)."""
        with self._cond:
            for waiter in self._waiters.of_owner(owner):
                waiter.done.set()

    # -- the poller thread -----------------------------------------------------------------------
    def _finish(self, waiter: _Waiter, events: list[Event], error: tuple[type[KVError], str, str | None] | None
                ) -> bool:
        """Hand ``events`` or ``error`` to ``waiter`` and unregister it (call with ``_cond`` held);
        return whether it was still waiting. The caller wakes it."""
        if self._waiters.discard(waiter):
            waiter.events, waiter.error = events, error
            return True
        return False

    @staticmethod
    def _wake(finished: list[_Waiter]) -> None:
        """Wake the ``finished`` watches, all at once (no relay as in memory://: docs/backends/file.md)."""
        for waiter in finished:
            waiter.done.set()

    def _run(self) -> None:
        interval = POLL_MIN
        try:
            while True:
                with self._cond:
                    if not self._count:
                        self._cond.wait(POLLER_LINGER)
                        if not self._count:  # decided under the lock that register() takes
                            self._close_conn()
                            self._thread = None
                            return
                    self._poked = False
                    waiters = list(self._waiters)
                timeout = min(w.timeout for w in waiters)
                try:
                    changed, next_expiry = self._tick(waiters, timeout)
                except (sqlite3.Error, KVError) as exc:
                    error = exc if isinstance(exc, KVError) else map_error(exc, self._shared.path, timeout)
                    log.debug("watch poller of %s: %s", self._shared.path, error)
                    with self._cond:
                        self._wake([w for w in waiters if self._finish(w, [], (type(error), str(error), error.key))])
                    self._close_conn()
                    continue
                interval = POLL_MIN if changed else min(interval * 2, POLL_MAX)
                pause = interval
                if next_expiry is not None:
                    pause = min(pause, max(next_expiry - time.time(), 0.0) + 0.001)
                with self._cond:
                    if not self._poked and self._count:
                        self._cond.wait(pause)
        except BaseException as exc:  # a bug: never leave watches waiting for a dead thread
            log.error("watch poller of %s failed", self._shared.path, exc_info=True)
            with self._cond:
                self._close_conn()
                self._thread = None
                failure = (KVError, f"watch poller of {self._shared.path!r} failed: {exc!r}", None)
                stranded = list(self._waiters)
                self._wake([w for w in stranded if self._finish(w, [], failure)])
            raise

    def _close_conn(self) -> None:
        """Close the poller thread's connection (only that thread calls this)."""
        conn, self.conn = self.conn, None
        if conn is not None and self._shared.mine():
            conn.close()

    def _tick(self, waiters: list[_Waiter], timeout: float) -> tuple[bool, float | None]:
        """One poll: purge due expiries, deliver new events; return (revision moved, next expiry)."""
        path = self._shared.path
        if self.conn is None:
            self.conn = _connect(path, timeout)
        conn = self.conn
        revision, next_expiry = _poll(conn, path)
        if next_expiry is not None and next_expiry <= time.time():
            self._shared.transaction(conn, timeout, lambda txn: None)  # purges, emitting DELETE events
            revision, next_expiry = _poll(conn, path)
        if revision <= min(w.cursor for w in waiters):
            return False, next_expiry
        self._scan(conn, waiters)
        return True, next_expiry

    def _scan(self, conn: sqlite3.Connection, waiters: list[_Waiter]) -> None:
        """Read the events after the waiters' cursors once (one snapshot) and deliver them."""
        path = self._shared.path
        by_prefix: WaiterRegistry[_Waiter] = WaiterRegistry()  # this poll's snapshot of the waiters
        for waiter in waiters:
            by_prefix.add(waiter)
        conn.execute("BEGIN")
        try:
            revision = _meta_int(conn, "revision", path)
            oldest = revision - HISTORY_LIMIT
            live = [w for w in waiters if w.cursor >= oldest]
            matched: dict[int, list[_Waiter]] = {}  # revision -> the waiters it concerns
            if live:
                low = min(w.cursor for w in live)
                for rev, key in conn.execute("SELECT revision, key FROM events WHERE revision > ?", (low,)):
                    for waiter in by_prefix.matching(key if type(key) is str else ""):
                        if rev > waiter.cursor >= oldest:
                            matched.setdefault(rev, []).append(waiter)
            rows = _events_by_revision(conn, sorted(matched))
            conn.execute("COMMIT")
        finally:
            if conn.in_transaction:
                conn.rollback()
        found: dict[_Waiter, list[Event]] = {}
        failed: dict[_Waiter, tuple[type[KVError], str, str | None]] = {}
        for rev in sorted(matched):
            for waiter in matched[rev]:
                if waiter in failed or len(found.get(waiter, ())) >= WATCH_BATCH:
                    continue
                try:
                    found.setdefault(waiter, []).append(_event(path, *rows[rev]))
                except CorruptEntryError as exc:
                    if not found.get(waiter):  # deliver the good events before it first
                        failed[waiter] = (CorruptEntryError, str(exc), exc.key)
        finished = []
        with self._cond:
            for waiter in waiters:
                if waiter.cursor < oldest:
                    done = self._finish(waiter, [], (HistoryCompactedError, _compacted_message(waiter.cursor, revision),
                                                     waiter.prefix))
                elif found.get(waiter):
                    done = self._finish(waiter, found[waiter], None)
                elif waiter in failed:
                    done = self._finish(waiter, [], failed[waiter])
                else:
                    waiter.cursor = max(waiter.cursor, revision)
                    done = False
                if done:
                    finished.append(waiter)
            self._wake(finished)


class _Shared:
    """Per process and store file: the write lock and the watch poller."""

    def __init__(self, path: str, files: _Files) -> None:
        self.path = path
        self.files = files  # the process's registry it belongs to
        self.lock = threading.Lock()  # threads queue here before BEGIN IMMEDIATE
        self.poller = _Poller(self)

    def mine(self) -> bool:
        """Whether it belongs to this process (not to the parent of a forked child)."""
        return _FILES.current() is self.files

    @contextlib.contextmanager
    def locked(self, timeout: float) -> Iterator[None]:
        """Hold this process's write lock for the store (at most ``timeout`` seconds of waiting)."""
        if not self.lock.acquire(timeout=timeout):
            raise BackendTimeoutError(
                f"{self.path!r}: another thread of this process held the write lock for more than "
                f"operation_timeout={timeout}s"
            )
        try:
            yield
        finally:
            self.lock.release()

    def transaction(self, conn: sqlite3.Connection, timeout: float, body: Callable[[_Txn], T]) -> T:
        """Run ``body`` in a write transaction on ``conn`` (after purging expired keys) under the
        write lock; commit unless it raises, then poke the poller.

        Raises ``sqlite3.Error`` untranslated (callers translate) and :class:`BackendTimeoutError`.
        """
        with self.locked(timeout):
            conn.execute("BEGIN IMMEDIATE")
            try:
                txn = _Txn(conn, self.path)
                txn.purge_expired()
                result = body(txn)
                txn.finish()
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.rollback()
                raise
        self.poller.poke()
        return result


# Connections inherited through fork(): never used or closed in the child.
_FORK_ORPHANS: list[sqlite3.Connection] = []


class _Files:
    """One process's :class:`_Shared` per store file (keyed by its real path), and the lock guarding them."""

    def __init__(self) -> None:
        self.guard = threading.Lock()
        self.by_path: dict[str, _Shared] = {}


def _orphan_pollers(files: _Files) -> None:
    """In a forked child: the parent's poller connections are never touched (their threads are gone)."""
    _FORK_ORPHANS.extend(s.poller.conn for s in files.by_path.values() if s.poller.conn is not None)


#: A forked child starts afresh (a parent's thread may have held a lock at fork()).
_FILES: PerProcess[_Files] = PerProcess(_Files, forget=_orphan_pollers)


def _shared(lock_key: str, path: str) -> _Shared:
    """This process's :class:`_Shared` for the store file ``lock_key`` (created on first use)."""
    files = _FILES.get()
    shared = files.by_path.get(lock_key)
    if shared is None:
        with files.guard:
            shared = files.by_path.get(lock_key)
            if shared is None:
                shared = files.by_path[lock_key] = _Shared(path, files)
    return shared
