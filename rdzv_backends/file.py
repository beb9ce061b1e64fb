"""``file:///ABS/DIR/RUN_ID`` — an embedded, server-less backend for one host, on SQLite.

Every process and thread on the machine that opens the same directory shares
one keyspace, stored in ``DIR/rdzv.sqlite3`` (the directory is created with mode
0700 if missing; the run id does not change the file). It is the default for
single-host jobs: no server to start, state survives the processes.

How it works
    * **Transactions.** Every write (create, put, compare-and-swap, compare-and-
      delete, delete, refresh, add) is one ``BEGIN IMMEDIATE`` transaction, so
      check-and-write is atomic across processes. Threads of one process first
      take a process-wide lock per store file (fair queueing instead of SQLite's
      busy-sleep); across processes SQLite's busy handler waits. Both waits are
      bounded by ``operation_timeout`` (query key, seconds, default 30); a lock
      held longer raises :class:`~rdzv_core.errors.BackendTimeout`.
    * **Connections.** A small pool per backend object: an operation checks a
      connection out, uses it from its own thread only, and returns it. At most
      :data:`POOL_IDLE` idle connections are kept; a forked child never touches
      its parent's connections (SQLite forbids it) and opens its own.
    * **Journal.** WAL mode, ``synchronous=NORMAL``: a process killed (even with
      ``kill -9``) mid-transaction leaves nothing behind — SQLite rolls the
      unfinished transaction back and the OS drops its locks. A power loss may
      lose the last commits, never corrupt the file. WAL needs shared memory:
      the directory must be on a local file system (not NFS).
    * **Revisions and events.** ``meta.revision`` is the keyspace-wide counter;
      every write adds exactly one row to ``events (revision, type, key, value)``,
      of which the last :data:`HISTORY_LIMIT` are kept. So events after ``r`` are
      complete iff ``r >= revision - HISTORY_LIMIT``; an older ``after_revision``
      raises :class:`~rdzv_core.errors.HistoryCompacted`. Events hold values too:
      the file grows to about twice the live data plus the values of the last
      :data:`HISTORY_LIMIT` writes.
    * **TTL.** A key with a TTL stores its expiry as wall-clock time
      (``time.time()``, the one clock every process on the host shares). Expired
      rows are deleted, each with a ``DELETE`` event and a fresh revision, by the
      first write, read or watch poll that finds one (in a write transaction).
      A watcher sleeps no later than the next expiry, so an expiry is seen
      within :data:`POLL_MAX` plus a transaction even if nobody else touches
      the store. A jump of the wall clock moves every expiry with it.
    * **Watch.** Polls ``meta.revision`` and the next expiry with one indexed
      read, every :data:`POLL_MIN` seconds at first, backing off to
      :data:`POLL_MAX` while nothing changes; it scans ``events`` only when the
      revision moved. Prefixes select keys with a range (``key >= p AND key < p'``
      where ``p'`` is ``p`` with its last character incremented), never ``LIKE``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from typing import Callable, Iterator, TypeVar

from rdzv_core.errors import (
    BackendClosed,
    BackendConnectionError,
    BackendTimeout,
    CompareFailed,
    HistoryCompacted,
    InvalidURLError,
    KeyExists,
    KeyNotFound,
    KVError,
)
from rdzv_core.kv import Capabilities, Entry, Event, EventType, KVBackend, parse_counter
from rdzv_core.plugins import BackendSpec, backend_plugin
from rdzv_core.url import RendezvousURL, to_positive_float

__all__ = ["FileBackend", "HISTORY_LIMIT", "DB_NAME", "plugin"]

log = logging.getLogger(__name__)

#: Events kept for watchers (the count etcd v2 keeps, too).
HISTORY_LIMIT = 10_000
#: File name of the store inside the URL's directory.
DB_NAME = "rdzv.sqlite3"
#: First and longest watch poll interval (seconds).
POLL_MIN, POLL_MAX = 0.005, 0.05
#: Idle connections kept per backend object.
POOL_IDLE = 4
#: Most events one ``watch`` call returns (callers watch again for the rest).
WATCH_BATCH = 1000
#: Bytes the write-ahead log is truncated to after a checkpoint.
WAL_SIZE_LIMIT = 16 * 1024 * 1024
DEFAULT_OPERATION_TIMEOUT = 30.0
_FORMAT = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta (name, value) VALUES ('revision', 0), ('format', 1);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY, value BLOB NOT NULL, revision INTEGER NOT NULL, expires REAL
);
CREATE INDEX IF NOT EXISTS kv_expires ON kv (expires) WHERE expires IS NOT NULL;
CREATE TABLE IF NOT EXISTS events (
    revision INTEGER PRIMARY KEY, type TEXT NOT NULL, key TEXT NOT NULL, value BLOB
);
"""
_POLL = (
    "SELECT (SELECT value FROM meta WHERE name = 'revision'),"
    " (SELECT min(expires) FROM kv WHERE expires IS NOT NULL)"
)
_ROW = "SELECT value, revision, expires FROM kv WHERE key = ?"

# SQLite primary result codes (``sqlite3.SQLITE_*`` exist only from Python 3.11).
_BUSY_CODES = frozenset({5, 6})  # SQLITE_BUSY, SQLITE_LOCKED
_UNAVAILABLE_CODES = frozenset({3, 8, 10, 13, 14})  # PERM, READONLY, IOERR, FULL, CANTOPEN

# One lock per store file and process: threads queue here before BEGIN IMMEDIATE.
_WRITE_LOCKS: dict[str, threading.Lock] = {}
_WRITE_LOCKS_GUARD = threading.Lock()
# Connections inherited through fork(): never used or closed in the child.
_FORK_ORPHANS: list[sqlite3.Connection] = []


def _process_lock(key: str) -> threading.Lock:
    """This process's write lock for the store file ``key`` (created on first use)."""
    with _WRITE_LOCKS_GUARD:
        return _WRITE_LOCKS.setdefault(key, threading.Lock())


def _reset_after_fork() -> None:
    # A parent's thread may have held a lock at fork(); the child starts with fresh ones.
    global _WRITE_LOCKS_GUARD
    _WRITE_LOCKS_GUARD = threading.Lock()
    _WRITE_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)

T = TypeVar("T")


class _Txn:
    """One open write transaction: the revision counter and the event log.

    Attributes:
        conn: the connection, inside ``BEGIN IMMEDIATE``.
        now: wall-clock time (``time.time()``) the transaction judges expiry by.
        revision: the keyspace revision, advanced by :meth:`record`.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.now = time.time()
        self.revision = self.start = int(conn.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()[0])

    def record(self, type_: EventType, key: str, value: bytes | None) -> int:
        """Advance the revision and log one event; return the new revision."""
        self.revision += 1
        self.conn.execute(
            "INSERT INTO events (revision, type, key, value) VALUES (?, ?, ?, ?)",
            (self.revision, type_.value, key, value),
        )
        return self.revision

    def purge_expired(self) -> None:
        """Delete every row whose expiry has passed, each with a ``DELETE`` event."""
        expired = self.conn.execute(
            "SELECT key FROM kv WHERE expires IS NOT NULL AND expires <= ? ORDER BY expires, key", (self.now,)
        ).fetchall()
        for (key,) in expired:
            self.conn.execute("DELETE FROM kv WHERE key = ?", (key,))
            self.record(EventType.DELETE, key, None)
        if expired:
            log.debug("expired %d key(s) at revision %d", len(expired), self.revision)

    def row(self, key: str) -> tuple[bytes, int, float | None] | None:
        """``(value, revision, expires)`` of a live key, or ``None``."""
        return self.conn.execute(_ROW, (key,)).fetchone()

    def write(self, key: str, value: bytes, expires: float | None) -> Entry:
        """Store ``key`` with a new revision and a ``PUT`` event."""
        rev = self.record(EventType.PUT, key, value)
        self.conn.execute(
            "INSERT OR REPLACE INTO kv (key, value, revision, expires) VALUES (?, ?, ?, ?)",
            (key, value, rev, expires),
        )
        return Entry(key, value, rev)

    def remove(self, key: str) -> None:
        """Delete ``key`` with a ``DELETE`` event."""
        self.conn.execute("DELETE FROM kv WHERE key = ?", (key,))
        self.record(EventType.DELETE, key, None)

    def expiry(self, ttl: float | None) -> float | None:
        return None if ttl is None else self.now + ttl

    def finish(self) -> None:
        """Store the revision and drop events older than the last :data:`HISTORY_LIMIT`."""
        if self.revision != self.start:
            self.conn.execute("UPDATE meta SET value = ? WHERE name = 'revision'", (self.revision,))
            self.conn.execute("DELETE FROM events WHERE revision <= ?", (self.revision - HISTORY_LIMIT,))

    def check_revision(self, key: str, expected: int) -> tuple[bytes, int, float | None]:
        row = self.row(key)
        if row is None:
            raise KeyNotFound(f"key {key!r} not found", key)
        if row[1] != expected:
            raise CompareFailed(f"key {key!r} is at revision {row[1]}, not {expected}", key, expected, row[1])
        return row


class _Pool:
    """Connections to one store file, each used by one thread at a time."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self.closed = False
        self._idle: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
        except BaseException:
            conn.close()
            raise
        return conn

    @contextlib.contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        """Check a connection out for the duration of the ``with`` block."""
        if self._pid != os.getpid():  # forked: the parent's connections (and lock state) are not ours
            _FORK_ORPHANS.extend(self._idle)
            self._idle, self._lock, self._pid = [], threading.Lock(), os.getpid()
        with self._lock:
            if self.closed:
                raise BackendClosed(f"file backend for {self.path!r} is closed")
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._connect()
        try:
            yield conn
        finally:
            broken = False
            if conn.in_transaction:
                try:
                    conn.rollback()
                except sqlite3.Error:
                    broken = True
            with self._lock:
                keep = not broken and not self.closed and self._pid == os.getpid() and len(self._idle) < POOL_IDLE
                if keep:
                    self._idle.append(conn)
            if not keep:
                conn.close()

    def close(self) -> None:
        """Close the idle connections; those in use close when they are returned."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
            mine = self._pid == os.getpid()
        if not mine:
            _FORK_ORPHANS.extend(idle)
            return
        for conn in idle:
            conn.close()


class FileBackend(KVBackend):
    """SQLite-backed backend for processes on one host; see the module docstring.

    Args:
        directory: absolute path of the store's directory (str); created (mode
            0700) if missing. The store is ``directory/rdzv.sqlite3``.
        operation_timeout: seconds an operation may wait for the write lock
            (float > 0) before raising :class:`~rdzv_core.errors.BackendTimeout`.

    Raises:
        InvalidURLError: ``directory`` is not absolute, or ``operation_timeout`` is not > 0.
        BackendConnectionError: the directory or file cannot be created or opened.
        KVError: the file exists but is not an rdzv store.
    """

    capabilities = Capabilities(
        multi_host=False,
        server_side_ttl=False,
        native_watch=False,
        persistent=True,
        max_value_bytes=64 * 1024 * 1024,
        ttl_resolution=0.1,
    )

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
        with self._guard(), self._pool.connection() as conn:
            if conn.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
                raise KVError(f"{self.path!r}: could not switch SQLite to WAL mode")
            with self._locked():
                conn.execute("BEGIN IMMEDIATE")
                for statement in _statements(_SCHEMA):  # not executescript(): it would COMMIT first
                    conn.execute(statement)
                fmt = conn.execute("SELECT value FROM meta WHERE name = 'format'").fetchone()[0]
                conn.execute("COMMIT")
            if fmt != _FORMAT:
                raise KVError(f"{self.path!r} has store format {fmt}; this rdzv reads format {_FORMAT}")

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Translate ``sqlite3`` errors into the :mod:`rdzv_core.errors` hierarchy."""
        try:
            yield
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc

    def _translate(self, exc: sqlite3.Error) -> KVError:
        code = getattr(exc, "sqlite_errorcode", None)
        primary = None if code is None else code & 0xFF
        text = str(exc)
        if primary in _BUSY_CODES or (primary is None and ("locked" in text or "busy" in text)):
            return BackendTimeout(
                f"{self.path!r} stayed locked for more than operation_timeout={self.operation_timeout}s "
                f"(another process holds a write transaction): {text}"
            )
        if self._closed and isinstance(exc, sqlite3.ProgrammingError):
            return BackendClosed(f"{self!r} is closed")
        if primary in _UNAVAILABLE_CODES:
            return BackendConnectionError(f"cannot use the store {self.path!r}: {text}")
        return KVError(f"SQLite error on {self.path!r}: {text}")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold this process's write lock for the store (bounded by ``operation_timeout``)."""
        lock = _WRITE_LOCKS.get(self._lock_key) or _process_lock(self._lock_key)
        if not lock.acquire(timeout=self.operation_timeout):
            raise BackendTimeout(
                f"{self.path!r}: another thread of this process held the write lock for more than "
                f"operation_timeout={self.operation_timeout}s"
            )
        try:
            yield
        finally:
            lock.release()

    def _write(self, body: Callable[[_Txn], T], conn: sqlite3.Connection | None = None) -> T:
        """Run ``body`` in a write transaction (after purging expired keys); commit unless it raises."""
        with self._guard(), contextlib.ExitStack() as stack:
            if conn is None:
                conn = stack.enter_context(self._pool.connection())
            stack.enter_context(self._locked())
            conn.execute("BEGIN IMMEDIATE")
            try:
                txn = _Txn(conn)
                txn.purge_expired()
                result = body(txn)
                txn.finish()
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.rollback()
                raise
            return result

    def _read(self, body: Callable[[sqlite3.Connection, int], T]) -> T:
        """Run ``body(conn, revision)`` on one snapshot; purge first if a key has expired."""
        with self._guard(), self._pool.connection() as conn:
            conn.execute("BEGIN")
            try:
                revision, next_expiry = conn.execute(_POLL).fetchone()
                if next_expiry is None or next_expiry > time.time():
                    result = body(conn, int(revision))
                    conn.execute("COMMIT")
                    return result
            finally:
                if conn.in_transaction:
                    conn.rollback()
            return self._write(lambda txn: body(txn.conn, txn.revision), conn)

    # -- the protocol ----------------------------------------------------------
    def _do_get(self, key: str) -> Entry | None:
        def body(conn: sqlite3.Connection, revision: int) -> Entry | None:
            row = conn.execute(_ROW, (key,)).fetchone()
            return None if row is None else Entry(key, row[0], row[1])

        return self._read(body)

    def _do_list(self, prefix: str) -> tuple[list[Entry], int]:
        where, args = _range(prefix)

        def body(conn: sqlite3.Connection, revision: int) -> tuple[list[Entry], int]:
            rows = conn.execute(f"SELECT key, value, revision FROM kv WHERE {where} ORDER BY key", args)
            return [Entry(k, v, r) for k, v, r in rows], revision

        return self._read(body)

    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry:
        def body(txn: _Txn) -> Entry:
            if txn.row(key) is not None:
                raise KeyExists(f"key {key!r} exists", key)
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
            if txn.row(key) is None:
                return False
            txn.remove(key)
            return True

        return self._write(body)

    def _do_refresh(self, key: str, ttl: float) -> None:
        def body(txn: _Txn) -> None:
            if txn.row(key) is None:
                raise KeyNotFound(f"key {key!r} not found (expired or deleted)", key)
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
        scanned = after_revision  # events up to here are known not to match
        interval = POLL_MIN
        with self._guard(), self._pool.connection() as conn:
            while True:
                revision, next_expiry = conn.execute(_POLL).fetchone()
                if next_expiry is not None and next_expiry <= time.time():
                    self._write(lambda txn: None, conn)  # purges, emitting DELETE events
                    continue
                if revision > scanned:
                    events, scanned = self._scan(conn, prefix, scanned)
                    if events:
                        return events
                    interval = POLL_MIN
                now = time.monotonic()
                if now >= deadline or self._closed:
                    return []
                pause = min(interval, deadline - now)
                if next_expiry is not None:
                    pause = min(pause, max(next_expiry - time.time(), 0.0) + 0.001)
                time.sleep(pause)
                interval = min(interval * 2, POLL_MAX)

    def _scan(self, conn: sqlite3.Connection, prefix: str, after: int) -> tuple[list[Event], int]:
        """Events under ``prefix`` after revision ``after`` (one snapshot); and the revision scanned up to."""
        where, args = _range(prefix)
        conn.execute("BEGIN")
        try:
            revision = int(conn.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()[0])
            if after < revision - HISTORY_LIMIT:
                raise HistoryCompacted(
                    f"events after revision {after} were compacted (oldest kept: {revision - HISTORY_LIMIT + 1})",
                    prefix,
                )
            rows = conn.execute(
                f"SELECT revision, type, key, value FROM events WHERE revision > ? AND {where} "
                f"ORDER BY revision LIMIT {WATCH_BATCH}",
                (after, *args),
            ).fetchall()
            conn.execute("COMMIT")
        finally:
            if conn.in_transaction:
                conn.rollback()
        events = [Event(EventType(t), k, r, v) for r, t, k, v in rows]
        return events, (rows[-1][0] if len(rows) == WATCH_BATCH else revision)

    def _do_close(self) -> None:
        self._pool.close()


def _range(prefix: str) -> tuple[str, tuple[str, ...]]:
    """SQL condition and arguments selecting keys that start with ``prefix``."""
    if not prefix:
        return "1", ()
    return "key >= ? AND key < ?", (prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]


def _open(url: RendezvousURL) -> FileBackend:
    if any(host not in ("", "localhost") for host, _ in url.hosts):
        raise InvalidURLError("host", url.redacted(), "file:// URLs name no host (file:///ABS/DIR/RUN_ID)")
    if not url.path:
        raise InvalidURLError("path", url.redacted(), "file:// needs a directory: file:///ABS/DIR/RUN_ID")
    return FileBackend("/" + url.path, url.params.get("operation_timeout", DEFAULT_OPERATION_TIMEOUT))


#: Registers ``file://`` through the ``rdzv`` entry point, like any plugin.
plugin = backend_plugin(
    BackendSpec(
        schemes=("file",),
        open=_open,
        capabilities=FileBackend.capabilities,
        query_keys={"operation_timeout": to_positive_float},
        uses_path=True,
        description="SQLite file shared by the processes of one host (no server)",
    )
)
