"""``FileBackend``: the KV protocol on an SQLite file shared by the processes of one host.

Every write is one ``BEGIN IMMEDIATE`` transaction (after this process's write lock); reads are
one statement each; blocked watches wait for the process's one poller per store file. The
design (journal, TTLs, history, corrupt storage): docs/backends/file.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from typing import Callable, Iterator, TypeVar

from rdzv_backends.file._settings import CAPABILITIES, DB_NAME, DEFAULT_OPERATION_TIMEOUT
from rdzv_backends.file._sql import (
    _FORMAT,
    _GET,
    _LIST,
    _SCHEMA,
    _WATCH,
    HISTORY_LIMIT,
    WATCH_BATCH,
    _check_row,
    _compacted_message,
    _connect,
    _event,
    _head,
    _meta_int,
    _range,
    _statements,
    _switch_to_wal,
    _Txn,
    map_error,
)
from rdzv_backends.file._watch import _FORK_ORPHANS, _shared, _Shared, _Waiter
from rdzv_core.errors import (
    BackendClosedError,
    BackendConnectionError,
    CorruptEntryError,
    HistoryCompactedError,
    InvalidURLError,
    KeyExistsError,
    KeyNotFoundError,
    KVError,
)
from rdzv_core.forksafe import PerProcess
from rdzv_core.kv import Entry, Event, KVBackend, call_budget, parse_counter

__all__ = ["FileBackend", "HISTORY_LIMIT", "DB_NAME", "POOL_IDLE"]

log = logging.getLogger(__name__)

#: Idle connections kept per backend object: enough for the concurrent reads of hundreds of
#: agent threads (a new connection costs an open, a schema parse and a statement cache; with 4,
#: most reads at N = 1,024 opened one). Each holds about 3 file descriptors.
POOL_IDLE = 32

T = TypeVar("T")


class _Idle:
    """One process's idle connections of a :class:`_Pool`, and the lock guarding them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conns: list[sqlite3.Connection] = []


class _Pool:
    """Connections to one store file, each used by one thread at a time."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self.closed = False
        # this process's idle connections; a forked child's first use parks the parent's (never closed there)
        self._idle: PerProcess[_Idle] = PerProcess(_Idle, forget=lambda idle: _FORK_ORPHANS.extend(idle.conns))

    @contextlib.contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        """Check a connection out for the duration of the ``with`` block."""
        idle = self._idle.get()
        with idle.lock:
            if self.closed:
                raise BackendClosedError(f"file backend for {self.path!r} is closed")
            conn = idle.conns.pop() if idle.conns else None
        if conn is None:
            conn = _connect(self.path, self.timeout)
        try:
            yield conn
        finally:
            broken = False
            if conn.in_transaction:
                try:
                    conn.rollback()
                except sqlite3.Error:
                    broken = True
            with idle.lock:
                keep = not broken and not self.closed and self._idle.current() is idle and len(idle.conns) < POOL_IDLE
                if keep:
                    idle.conns.append(conn)
            if not keep:
                conn.close()

    def close(self) -> None:
        """Close the idle connections; those in use close when they are returned."""
        idle = self._idle.current()  # None: no connection of this process (a forked child parked the parent's)
        if idle is None:
            self.closed = True
            return
        with idle.lock:
            self.closed = True
            conns, idle.conns = idle.conns, []
        for conn in conns:
            conn.close()


class FileBackend(KVBackend):
    """SQLite-backed backend for processes on one host (docs/backends/file.md).

    Args:
        directory: absolute path of the store's directory (str); created (mode
            0700) if missing. The store is ``directory/rdzv.sqlite3``.
        operation_timeout: seconds an operation may wait for the write lock
            (float > 0) before raising :class:`~rdzv_core.errors.BackendTimeoutError`.

    Raises:
        InvalidURLError: ``directory`` is not absolute, or ``operation_timeout`` is not > 0.
        BackendConnectionError: the directory or file cannot be created or opened.
        CorruptEntryError: (``key=None``) the file is not an SQLite database, or not an rdzv store.
        KVError: the file is an rdzv store of another format version.
    """

    capabilities = CAPABILITIES

    def __init__(self, directory: str, operation_timeout: float = DEFAULT_OPERATION_TIMEOUT) -> None:
        if not isinstance(directory, str) or not os.path.isabs(directory):
            raise InvalidURLError("path", directory, "file:// needs an absolute directory")
        if isinstance(operation_timeout, bool) or not isinstance(operation_timeout, (int, float)) or not (
            0 < operation_timeout < float("inf")
        ):
            raise InvalidURLError("operation_timeout", operation_timeout, "must be a finite number of seconds > 0")
        self.directory = directory
        self.path = os.path.join(directory, DB_NAME)
        self.operation_timeout = float(operation_timeout)
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        except OSError as exc:
            raise BackendConnectionError(f"cannot create the store {self.path!r}: {exc.strerror}", None) from None
        self._lock_key = os.path.realpath(self.path)
        self._pool = _Pool(self.path, self.operation_timeout)
        try:
            self._init_schema()
        except BaseException:
            self._pool.close()
            raise
        log.debug("opened %s (operation_timeout=%ss)", self.path, self.operation_timeout)

    def __repr__(self) -> str:
        return f"FileBackend(directory={self.directory!r})"

    # -- plumbing ------------------------------------------------------------
    def _init_schema(self) -> None:
        with self._translate(), self._pool.connection() as conn:
            budget = call_budget(self.operation_timeout)
            deadline = time.monotonic() + budget
            with self._shared().locked(budget):  # the switch writes too: threads of this process queue here
                _switch_to_wal(conn, self.path, deadline)
                conn.execute("BEGIN IMMEDIATE")
                for statement in _statements(_SCHEMA):  # not executescript(): it would COMMIT first
                    conn.execute(statement)
                fmt = _meta_int(conn, "format", self.path)
                _meta_int(conn, "revision", self.path)
                conn.execute("COMMIT")
            if fmt != _FORMAT:
                raise KVError(f"{self.path!r} has store format {fmt}; this rdzv reads format {_FORMAT}")

    def _shared(self) -> _Shared:
        return _shared(self._lock_key, self.path)

    @contextlib.contextmanager
    def _translate(self) -> Iterator[None]:
        """Translate ``sqlite3`` errors into the :mod:`rdzv_core.errors` hierarchy."""
        start = time.monotonic()
        try:
            yield
        except sqlite3.Error as exc:
            if self._closed and isinstance(exc, sqlite3.ProgrammingError):
                raise BackendClosedError(f"{self!r} is closed") from exc
            raise map_error(exc, self.path, self.operation_timeout, time.monotonic() - start) from exc

    def _write(self, body: Callable[[_Txn], T], conn: sqlite3.Connection | None = None) -> T:
        """Run ``body`` in a write transaction (after purging expired keys); commit unless it raises."""
        with self._translate(), contextlib.ExitStack() as stack:
            if conn is None:
                conn = stack.enter_context(self._pool.connection())
            return self._shared().transaction(conn, call_budget(self.operation_timeout), body)

    def _read(self, sql: str, args: tuple[object, ...], build: Callable[[list[tuple[object, ...]], int], T]) -> T:
        """``build(rows, revision)`` of one statement joined to :data:`_HEAD` (one snapshot).

        If a key has expired, the statement runs again inside a write transaction
        that purges first, and ``revision`` is that transaction's.
        """
        with self._translate(), self._pool.connection() as conn:
            rows = conn.execute(sql, args).fetchall()
            revision, next_expiry = _head(rows[0][0], rows[0][1], self.path)
            if next_expiry is None or next_expiry > time.time():
                return build(rows, revision)
            return self._write(lambda txn: build(txn.conn.execute(sql, args).fetchall(), txn.revision), conn)

    # -- the protocol ----------------------------------------------------------
    def _do_get(self, key: str) -> Entry | None:
        def build(rows: list[tuple[object, ...]], revision: int) -> Entry | None:
            _, _, found, value, rev, expires = rows[0]
            return None if found is None else Entry(key, *_check_row(self.path, key, (value, rev, expires))[:2])

        return self._read(_GET, (key,), build)

    def _do_ttl_remaining(self, key: str) -> float | None:
        def build(rows: list[tuple[object, ...]], revision: int) -> float | None:
            _, _, found, value, rev, expires = rows[0]
            if found is None:
                raise KeyNotFoundError(f"key {key!r} not found (expired or deleted)", key)
            expiry = _check_row(self.path, key, (value, rev, expires))[2]
            return None if expiry is None else max(0.0, expiry - time.time())

        return self._read(_GET, (key,), build)

    def _do_list(self, prefix: str) -> tuple[list[Entry], int]:
        where, args = _range(prefix, "kv.key")

        def build(rows: list[tuple[object, ...]], revision: int) -> tuple[list[Entry], int]:
            entries = [
                Entry(k, *_check_row(self.path, k, (v, r, e))[:2])  # type: ignore[arg-type]
                for _, _, k, v, r, e in rows
                if k is not None  # the one row of an empty range
            ]
            return entries, revision

        return self._read(_LIST.format(where=where), args, build)

    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry:
        def body(txn: _Txn) -> Entry:
            if txn.row(key) is not None:
                raise KeyExistsError(f"key {key!r} exists", key)
            return txn.write(key, value, txn.expiry(ttl))

        return self._write(body)

    def _do_put(self, key: str, value: bytes, ttl: float | None) -> Entry:
        return self._write(lambda txn: txn.write(key, value, txn.expiry(ttl)))

    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry:
        def body(txn: _Txn) -> Entry:
            txn.check_revision(key, expected_revision)
            return txn.write(key, value, txn.expiry(ttl))

        return self._write(body)

    def _do_compare_and_delete(self, key: str, expected_revision: int) -> None:
        def body(txn: _Txn) -> None:
            txn.check_revision(key, expected_revision)
            txn.remove(key)

        self._write(body)

    def _do_delete(self, key: str) -> bool:
        def body(txn: _Txn) -> bool:
            if not txn.exists(key):  # a corrupt row is deleted too
                return False
            txn.remove(key)
            return True

        return self._write(body)

    def _do_refresh(self, key: str, ttl: float) -> None:
        def body(txn: _Txn) -> None:
            if txn.row(key) is None:
                raise KeyNotFoundError(f"key {key!r} not found (expired or deleted)", key)
            txn.conn.execute("UPDATE kv SET expires = ? WHERE key = ?", (txn.now + ttl, key))

        self._write(body)

    def _do_add(self, key: str, delta: int) -> int:
        def body(txn: _Txn) -> int:
            row = txn.row(key)
            total = (0 if row is None else parse_counter(key, row[0])) + delta
            txn.write(key, str(total).encode("ascii"), None if row is None else row[2])  # keeps its TTL
            return total

        return self._write(body)

    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        deadline = time.monotonic() + timeout
        events, after_revision = self._scan(prefix, after_revision)
        if events or timeout <= 0 or self._closed:
            return events
        poller = self._shared().poller
        waiter = _Waiter(prefix, after_revision, self, self.operation_timeout)
        poller.register(waiter)
        try:
            if not self._closed:  # close() between the scan and register() found no waiter to end
                waiter.done.wait(max(deadline - time.monotonic(), 0.0))
        finally:
            poller.unregister(waiter)  # after this, the poller no longer touches it
        if waiter.error is not None:
            cls, message, key = waiter.error
            raise cls(message, key)
        return waiter.events

    def _scan(self, prefix: str, after: int) -> tuple[list[Event], int]:
        """Events under ``prefix`` after revision ``after`` in one statement (one snapshot),
        purging due expiries first; and the revision known to be scanned up to."""
        where, args = _range(prefix)
        sql = _WATCH.format(where=where, limit=WATCH_BATCH)
        with self._translate(), self._pool.connection() as conn:
            rows = conn.execute(sql, (after, *args)).fetchall()
            revision, next_expiry = _head(rows[0][0], rows[0][1], self.path)
            if next_expiry is not None and next_expiry <= time.time():
                self._write(lambda txn: None, conn)  # purges, emitting DELETE events
                rows = conn.execute(sql, (after, *args)).fetchall()
                revision, _ = _head(rows[0][0], rows[0][1], self.path)
        if after < revision - HISTORY_LIMIT:
            raise HistoryCompactedError(_compacted_message(after, revision), prefix)
        events: list[Event] = []
        for _, _, rev, type_, key, value in rows:
            if rev is None:  # the one row of an empty result
                continue
            try:
                events.append(_event(self.path, rev, type_, key, value))
            except CorruptEntryError:
                if events:
                    return events, events[-1].revision  # the good ones first; the next watch raises
                raise
        if len(events) == WATCH_BATCH:
            return events, events[-1].revision
        return events, max(after, revision)

    def _do_close(self) -> None:
        self._pool.close()
        self._shared().poller.release(self)
