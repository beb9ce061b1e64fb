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
    * **Connections.** A pool per backend object: an operation checks a
      connection out, uses it from its own thread only, and returns it. At most
      :data:`POOL_IDLE` idle connections are kept; a forked child never touches
      its parent's connections (SQLite forbids it) and opens its own.
    * **Reads.** ``get``, ``list`` and a watch's first look are one SQL
      statement each, their rows joined to ``meta.revision`` and the next expiry:
      one snapshot without ``BEGIN``/``COMMIT``. (Python's ``sqlite3`` releases
      the GIL around every statement; with hundreds of threads each release is
      a likely thread switch, so statements per operation matter.)
    * **Journal.** WAL mode, ``synchronous=NORMAL``: a process killed (even with
      ``kill -9``) mid-transaction leaves nothing behind — SQLite rolls the
      unfinished transaction back and the OS drops its locks. A power loss may
      lose the last commits, never corrupt the file. WAL needs shared memory:
      the directory must be on a local file system (not NFS). A new file is
      switched to WAL by its first opener; processes opening it at once retry
      that switch (SQLite answers a contested one ``SQLITE_BUSY`` without
      calling its busy handler) until ``operation_timeout``.
    * **Revisions and events.** ``meta.revision`` is the keyspace-wide counter;
      every write adds exactly one row to ``events (revision, type, key, value)``,
      of which the last :data:`HISTORY_LIMIT` are served (older ones are deleted
      every :data:`PRUNE_EVERY` revisions). So events after ``r`` are
      complete iff ``r >= revision - HISTORY_LIMIT``; an older ``after_revision``
      raises :class:`~rdzv_core.errors.HistoryCompacted`. Events hold values too:
      the file grows to about twice the live data plus the values of the last
      :data:`HISTORY_LIMIT` writes.
    * **TTL.** A key with a TTL stores its expiry as wall-clock time
      (``time.time()``, the one clock every process on the host shares). Expired
      rows are deleted, each with a ``DELETE`` event and a fresh revision, by the
      first write, read or watch poll that finds one (in a write transaction).
      The watch poller sleeps no later than the next expiry, so an expiry is seen
      within :data:`POLL_MAX` plus a transaction even if nobody else touches
      the store. A jump of the wall clock moves every expiry with it.
    * **Watch.** A watch first reads the events after its ``after_revision`` on
      its own (one statement; prefixes select keys with a range ``key >= p AND
      key < p'`` where ``p'`` is ``p`` with its last character incremented, never
      ``LIKE``) and returns them if there are any. Otherwise it registers with
      the process's **one poller per store file**: a thread with its own
      connection that reads ``meta.revision`` and the next expiry (one indexed
      read) every :data:`POLL_MIN` seconds at first, backing off to
      :data:`POLL_MAX` while nothing changes, and at once when a write of this
      process commits. When the revision moved it reads the new events' keys
      once for all waiting watches, fetches the values of those that some
      watch's prefix selects (a dict lookup per prefix of the key), and wakes
      only those watches; it purges due expiries itself. Other processes'
      writes are seen through the file, so the cost of waiting no longer grows
      with the number of waiting threads. The poller thread exits
      :data:`POLLER_LINGER` seconds after its last watch.

Corrupt storage
    Rows this module did not write — a ``kv`` value stored as TEXT, INTEGER,
    REAL or NULL instead of BLOB (e.g. by the ``sqlite3`` shell), a revision that
    is not a positive integer, an expiry that is not a number, or a non-decimal
    value given to ``add`` — make every operation that reads that key raise
    :class:`~rdzv_core.errors.CorruptEntry` naming it (``list`` names the first
    such key under the prefix); ``delete(key)`` removes the row and ``put``
    replaces it without reading it. Damage to the store's own bookkeeping — a
    ``meta`` value that is not an integer, an ``events`` row this module did not
    write, a missing table or column, or a file that is not an SQLite database
    at all — raises ``CorruptEntry`` with ``key=None`` and a message naming the
    file (and the row) to repair or delete. Opening a file that is not an SQLite
    database raises it too: the data is not transient trouble, so it is not a
    :class:`~rdzv_core.errors.BackendUnavailable` that callers would retry.

Code
    The watch poller and the per-process, per-file state it lives in (write
    lock, fork handling) are in :mod:`rdzv_backends._file_watch`; this module
    holds the backend, its transactions, connection pool, SQL helpers and the
    plugin registration.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from typing import Callable, Iterator, TypeVar

from rdzv_backends._file_watch import _FORK_ORPHANS, _shared, _Shared, _Waiter
from rdzv_backends._file_watch import _SHARED as _SHARED  # re-exported: tests look at it
from rdzv_backends._file_watch import POLL_MAX as POLL_MAX, POLL_MIN as POLL_MIN, POLLER_LINGER as POLLER_LINGER
from rdzv_core.errors import (
    BackendClosed,
    BackendConnectionError,
    BackendTimeout,
    CompareFailed,
    CorruptEntry,
    HistoryCompacted,
    InvalidURLError,
    KeyExists,
    KeyNotFound,
    KVError,
)
from rdzv_core.kv import Capabilities, Entry, Event, EventType, KVBackend, call_budget, parse_counter
from rdzv_core.plugins import BackendSpec, backend_plugin
from rdzv_core.url import RendezvousURL, to_positive_float

__all__ = ["FileBackend", "HISTORY_LIMIT", "DB_NAME", "plugin"]

log = logging.getLogger(__name__)

#: Events kept for watchers (the count etcd v2 keeps, too).
HISTORY_LIMIT = 10_000
#: File name of the store inside the URL's directory.
DB_NAME = "rdzv.sqlite3"
#: Idle connections kept per backend object: enough for the concurrent reads of hundreds of
#: agent threads (a new connection costs an open, a schema parse and a statement cache; with 4,
#: most reads at N = 1,024 opened one). Each holds about 3 file descriptors.
POOL_IDLE = 32
#: Most events one ``watch`` call returns (callers watch again for the rest).
WATCH_BATCH = 1000
#: Old events are deleted once every this many revisions (so up to HISTORY_LIMIT + 63 are kept).
PRUNE_EVERY = 64
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
# The revision and the next expiry, in one indexed read. Reads join their rows to it, so that
# one statement -- one snapshot, no BEGIN/COMMIT -- answers them (each statement releases and
# retakes the GIL: with hundreds of threads, fewer statements mean fewer thread switches).
_HEAD = (
    "SELECT (SELECT value FROM meta WHERE name = 'revision') AS rev,"
    " (SELECT min(expires) FROM kv WHERE expires IS NOT NULL) AS next_expiry"
)
_HEAD_AND_KV = (
    f"SELECT m.rev, m.next_expiry, kv.key, kv.value, kv.revision, kv.expires FROM ({_HEAD}) AS m LEFT JOIN kv"
)
_GET = _HEAD_AND_KV + " ON kv.key = ?"
_LIST = _HEAD_AND_KV + " ON {where} ORDER BY kv.key"
_WATCH = (
    f"SELECT m.rev, m.next_expiry, e.revision, e.type, e.key, e.value FROM ({_HEAD}) AS m LEFT JOIN "
    "(SELECT revision, type, key, value FROM events WHERE revision > ? AND {where} "
    f"ORDER BY revision LIMIT {{limit}}) AS e ORDER BY e.revision"
)
_ROW = "SELECT value, revision, expires FROM kv WHERE key = ?"
_IN_CHUNK = 500  # revisions per ``IN (...)`` query

# SQLite primary result codes (``sqlite3.SQLITE_*`` exist only from Python 3.11).
_BUSY_CODES = frozenset({5, 6})  # SQLITE_BUSY, SQLITE_LOCKED
_UNAVAILABLE_CODES = frozenset({3, 8, 10, 13, 14})  # PERM, READONLY, IOERR, FULL, CANTOPEN
_DAMAGED_CODES = frozenset({11, 26})  # SQLITE_CORRUPT, SQLITE_NOTADB
_SQL_TYPES = {bytes: "BLOB", str: "TEXT", int: "INTEGER", float: "REAL", type(None): "NULL"}

T = TypeVar("T")
_EventRow = tuple[int, object, object, object]  # an ``events`` row: revision, type, key, value


# -- one transaction ----------------------------------------------------------------------------
class _Txn:
    """One open write transaction: the revision counter and the event log.

    Attributes:
        conn: the connection, inside ``BEGIN IMMEDIATE``.
        path: the store file (for error messages).
        now: wall-clock time (``time.time()``) the transaction judges expiry by.
        revision: the keyspace revision, advanced by :meth:`record`.
    """

    def __init__(self, conn: sqlite3.Connection, path: str) -> None:
        self.conn = conn
        self.path = path
        self.now = time.time()
        self.revision, self.next_expiry = _poll(conn, path)
        self.start = self.revision

    def record(self, type_: EventType, key: str, value: bytes | None) -> int:
        """Advance the revision and log one event; return the new revision."""
        self.revision += 1
        self.conn.execute(
            "INSERT INTO events (revision, type, key, value) VALUES (?, ?, ?, ?)",
            (self.revision, type_.value, key, value),
        )
        return self.revision

    def purge_expired(self) -> None:
        """Delete every row whose expiry has passed, each with a ``DELETE`` event.

        Only numeric expiries count (a TEXT or BLOB one sorts above every number
        in SQLite); such rows are reported by the reads of their key instead.
        """
        if self.next_expiry is None or self.next_expiry > self.now:
            return
        expired = self.conn.execute(
            "SELECT key FROM kv WHERE expires IS NOT NULL AND expires <= ? AND typeof(key) = 'text' "
            "ORDER BY expires, key",
            (self.now,),
        ).fetchall()
        for (key,) in expired:
            self.conn.execute("DELETE FROM kv WHERE key = ?", (key,))
            self.record(EventType.DELETE, key, None)
        if expired:
            log.debug("expired %d key(s) at revision %d", len(expired), self.revision)

    def row(self, key: str) -> tuple[bytes, int, float | None] | None:
        """``(value, revision, expires)`` of a live key, or ``None``.

        Raises:
            CorruptEntry: the row was not written by this module.
        """
        row = self.conn.execute(_ROW, (key,)).fetchone()
        return None if row is None else _check_row(self.path, key, row)

    def exists(self, key: str) -> bool:
        """Whether a row for ``key`` exists, whatever it holds."""
        return self.conn.execute("SELECT 1 FROM kv WHERE key = ?", (key,)).fetchone() is not None

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
        """Store the revision; every :data:`PRUNE_EVERY` revisions, drop the events older
        than the last :data:`HISTORY_LIMIT`."""
        if self.revision != self.start:
            self.conn.execute("UPDATE meta SET value = ? WHERE name = 'revision'", (self.revision,))
            if self.revision // PRUNE_EVERY != self.start // PRUNE_EVERY:
                self.conn.execute("DELETE FROM events WHERE revision <= ?", (self.revision - HISTORY_LIMIT,))

    def check_revision(self, key: str, expected: int) -> tuple[bytes, int, float | None]:
        row = self.row(key)
        if row is None:
            raise KeyNotFound(f"key {key!r} not found", key)
        if row[1] != expected:
            raise CompareFailed(f"key {key!r} is at revision {row[1]}, not {expected}", key, expected, row[1])
        return row


def _transaction(conn: sqlite3.Connection, shared: _Shared, timeout: float, body: Callable[[_Txn], T]) -> T:
    """Run ``body`` in a write transaction (after purging expired keys); commit unless it raises.

    Raises ``sqlite3.Error`` untranslated; callers translate.
    """
    with shared.locked(timeout):
        conn.execute("BEGIN IMMEDIATE")
        try:
            txn = _Txn(conn, shared.path)
            txn.purge_expired()
            result = body(txn)
            txn.finish()
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.rollback()
            raise
    shared.poller.poke()
    return result


class _Pool:
    """Connections to one store file, each used by one thread at a time."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self.closed = False
        self._idle: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

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
        CorruptEntry: (``key=None``) the file is not an SQLite database, or not an rdzv store.
        KVError: the file is an rdzv store of another format version.
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
    def _guard(self) -> Iterator[None]:
        """Translate ``sqlite3`` errors into the :mod:`rdzv_core.errors` hierarchy."""
        start = time.monotonic()
        try:
            yield
        except sqlite3.Error as exc:
            if self._closed and isinstance(exc, sqlite3.ProgrammingError):
                raise BackendClosed(f"{self!r} is closed") from exc
            raise _translate(exc, self.path, self.operation_timeout, time.monotonic() - start) from exc

    def _write(self, body: Callable[[_Txn], T], conn: sqlite3.Connection | None = None) -> T:
        """Run ``body`` in a write transaction (after purging expired keys); commit unless it raises."""
        with self._guard(), contextlib.ExitStack() as stack:
            if conn is None:
                conn = stack.enter_context(self._pool.connection())
            return _transaction(conn, self._shared(), call_budget(self.operation_timeout), body)

    def _read(self, sql: str, args: tuple[object, ...], build: Callable[[list[tuple[object, ...]], int], T]) -> T:
        """``build(rows, revision)`` of one statement joined to :data:`_HEAD` (one snapshot).

        If a key has expired, the statement runs again inside a write transaction
        that purges first, and ``revision`` is that transaction's.
        """
        with self._guard(), self._pool.connection() as conn:
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
                raise KeyNotFound(f"key {key!r} not found (expired or deleted)", key)
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
            if not txn.exists(key):  # a corrupt row is deleted too
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
        events, after_revision = self._scan(prefix, after_revision)
        if events or timeout <= 0 or self._closed:
            return events
        poller = self._shared().poller
        waiter = _Waiter(prefix, after_revision, self)
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
        with self._guard(), self._pool.connection() as conn:
            rows = conn.execute(sql, (after, *args)).fetchall()
            revision, next_expiry = _head(rows[0][0], rows[0][1], self.path)
            if next_expiry is not None and next_expiry <= time.time():
                self._write(lambda txn: None, conn)  # purges, emitting DELETE events
                rows = conn.execute(sql, (after, *args)).fetchall()
                revision, _ = _head(rows[0][0], rows[0][1], self.path)
        if after < revision - HISTORY_LIMIT:
            raise HistoryCompacted(_compacted_message(after, revision), prefix)
        events: list[Event] = []
        for _, _, rev, type_, key, value in rows:
            if rev is None:  # the one row of an empty result
                continue
            try:
                events.append(_event(self.path, rev, type_, key, value))  # type: ignore[arg-type]
            except CorruptEntry:
                if events:
                    return events, events[-1].revision  # the good ones first; the next watch raises
                raise
        if len(events) == WATCH_BATCH:
            return events, events[-1].revision
        return events, max(after, revision)

    def _do_close(self) -> None:
        self._pool.close()
        self._shared().poller.release(self)


# -- helpers -------------------------------------------------------------------------------------
def _connect(path: str, timeout: float) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
    except BaseException:
        conn.close()
        raise
    return conn


def _switch_to_wal(conn: sqlite3.Connection, path: str, deadline: float) -> None:
    """``PRAGMA journal_mode = WAL`` on ``conn``, retried while another connection holds the file's lock.

    A new (empty) file starts in rollback-journal mode, and the switch writes its header
    under SQLite's exclusive lock, outside any transaction this module could queue for.
    A connection whose switch finds another connection half-way through its own gets
    ``SQLITE_BUSY`` at once: it already holds the read lock it would upgrade, so SQLite
    does not call the busy handler (that wait could deadlock). So processes opening a
    fresh directory together raced here, and the loser failed in a few milliseconds
    (issue 14, item 9). Once one switch is done the file is in WAL mode and the pragma
    is a read. Retried with a short back-off until ``deadline`` (``time.monotonic()``);
    the last ``SQLITE_BUSY`` is raised after it.
    """
    delay = 0.001
    while True:
        try:
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            break
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    if str(mode).lower() != "wal":
        raise KVError(f"{path!r}: could not switch SQLite to WAL mode (journal_mode is {mode!r})")


def _is_busy(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` is ``SQLITE_BUSY`` or ``SQLITE_LOCKED`` (by its text before Python 3.11)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is None:
        return "locked" in str(exc) or "busy" in str(exc)
    return code & 0xFF in _BUSY_CODES


def _translate(exc: sqlite3.Error, path: str, timeout: float, waited: float | None = None) -> KVError:
    """The :mod:`rdzv_core.errors` exception for an ``sqlite3`` error on the store ``path``
    (``waited``: seconds the failed call took, if known)."""
    code = getattr(exc, "sqlite_errorcode", None)
    primary = None if code is None else code & 0xFF
    text = str(exc)
    if _is_busy(exc):
        if waited is not None and waited < timeout / 2:  # SQLite gave up without waiting (no busy handler)
            return BackendTimeout(
                f"{path!r} was locked by another connection and SQLite gave up after {waited:.3f}s, "
                f"without waiting for operation_timeout={timeout}s: {text}"
            )
        return BackendTimeout(
            f"{path!r} stayed locked for more than operation_timeout={timeout}s "
            f"(another process holds a write transaction): {text}"
        )
    if primary in _UNAVAILABLE_CODES:
        return BackendConnectionError(f"cannot use the store {path!r}: {text}")
    if primary in _DAMAGED_CODES:
        return CorruptEntry(
            f"{path!r} is not an intact SQLite database ({text}); move it away or delete it "
            f"(every key in it is lost), then open the store again",
            None,
        )
    if "no such table" in text or "no such column" in text:
        return CorruptEntry(f"{path!r} is an SQLite database but not an rdzv store ({text}); move it away", None)
    return KVError(f"SQLite error on {path!r}: {text}")


def _meta_int(conn: sqlite3.Connection, name: str, path: str) -> int:
    """The integer ``meta.value`` of ``name``; :class:`CorruptEntry` (``key=None``) if it is not one."""
    row = conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
    if row is None or type(row[0]) is not int:
        raise _bad_meta(name, None if row is None else row, path)
    return row[0]


def _bad_meta(name: str, row: tuple[object] | None, path: str) -> CorruptEntry:
    found = "missing" if row is None else f"{_SQL_TYPES.get(type(row[0]), '?')} {row[0]!r:.40}"
    return CorruptEntry(
        f"{path!r}: the store's bookkeeping row meta.{name} is {found}, not an integer (written by "
        f"another tool?); repair that row, or delete the file (every key in it is lost)",
        None,
    )


def _head(revision: object, next_expiry: object, path: str) -> tuple[int, float | None]:
    """Validate the columns of :data:`_HEAD`: ``(revision, next expiry or None)``."""
    if type(revision) is not int:
        raise _bad_meta("revision", None if revision is None else (revision,), path)
    if type(next_expiry) not in (int, float):  # TEXT/BLOB expiries sort above numbers: no numeric one
        next_expiry = None
    return revision, next_expiry  # type: ignore[return-value]


def _poll(conn: sqlite3.Connection, path: str) -> tuple[int, float | None]:
    """``(revision, next expiry or None)`` in one indexed read."""
    row = conn.execute(_HEAD).fetchone()
    return _head(row[0], row[1], path)


def _check_row(path: str, key: object, row: tuple[object, object, object]) -> tuple[bytes, int, float | None]:
    """``row`` (value, revision, expires) if this module could have written it, else :class:`CorruptEntry`."""
    value, revision, expires = row
    if type(key) is not str:
        raise CorruptEntry(
            f"{path!r}: a kv row has a {_SQL_TYPES.get(type(key), '?')} key {key!r:.60}, not TEXT (written by "
            f"another tool?); delete it with sqlite3",
            None,
        )
    problem = None
    if type(value) is not bytes:
        problem = f"a {_SQL_TYPES.get(type(value), '?')} value {value!r:.40} where rdzv stores BLOB"
    elif type(revision) is not int or revision < 1:
        problem = f"revision {revision!r:.40}, not a positive integer"
    elif expires is not None and type(expires) not in (int, float):
        problem = f"expiry {expires!r:.40}, not a number"
    if problem is not None:
        raise CorruptEntry(
            f"key {key!r} in {path!r} holds {problem} (written by another tool?); delete(key) removes it", key
        )
    return value, revision, expires  # type: ignore[return-value]


def _event(path: str, revision: int, type_: object, key: object, value: object) -> Event:
    """The :class:`Event` of an ``events`` row; :class:`CorruptEntry` (``key=None``) if rdzv did not write it."""
    if type(key) is str:
        if type_ == "put" and type(value) is bytes:
            return Event(EventType.PUT, key, revision, value)
        if type_ == "delete" and value is None:
            return Event(EventType.DELETE, key, revision)
    raise CorruptEntry(
        f"{path!r}: the store's bookkeeping row events.revision = {revision} (type {type_!r:.20}, key {key!r:.60}, "
        f"{_SQL_TYPES.get(type(value), '?')} value) was not written by rdzv; delete that row with sqlite3 "
        f"(it also leaves the history after {HISTORY_LIMIT} more writes)",
        None,
    )


def _events_by_revision(conn: sqlite3.Connection, revisions: list[int]) -> dict[int, _EventRow]:
    """Full ``events`` rows (revision, type, key, value) of ``revisions``, by revision."""
    out: dict[int, _EventRow] = {}
    for i in range(0, len(revisions), _IN_CHUNK):
        chunk = revisions[i : i + _IN_CHUNK]
        marks = ",".join("?" * len(chunk))
        for row in conn.execute(f"SELECT revision, type, key, value FROM events WHERE revision IN ({marks})", chunk):
            out[row[0]] = row
    return out


def _compacted_message(after: int, revision: int) -> str:
    return f"events after revision {after} were compacted (oldest kept: {revision - HISTORY_LIMIT + 1})"


def _range(prefix: str, column: str = "key") -> tuple[str, tuple[str, ...]]:
    """SQL condition and arguments selecting the ``column`` values that start with ``prefix``."""
    if not prefix:
        return "1", ()
    return f"{column} >= ? AND {column} < ?", (prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


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
