"""The SQL of :mod:`rdzv_backends.file`: schema, statements, one write transaction (:class:`_Txn`),
the checks of rows this module did not write, and the mapping of ``sqlite3`` errors
(:func:`map_error`). Used by the backend and by its watch poller (docs/backends/file.md).
"""

from __future__ import annotations

import logging
import sqlite3
import time

from rdzv_core.errors import (
    BackendConnectionError,
    BackendTimeoutError,
    CompareFailedError,
    CorruptEntryError,
    KeyNotFoundError,
    KVError,
)
from rdzv_core.kv import Entry, Event, EventType

log = logging.getLogger(__name__)

#: Events kept for watchers (the count etcd v2 keeps, too).
HISTORY_LIMIT = 10_000
#: Most events one ``watch`` call returns (callers watch again for the rest).
WATCH_BATCH = 1000
#: Old events are deleted once every this many revisions (so up to HISTORY_LIMIT + 63 are kept).
PRUNE_EVERY = 64
#: Bytes the write-ahead log is truncated to after a checkpoint.
WAL_SIZE_LIMIT = 16 * 1024 * 1024
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

_EventRow = tuple[int, object, object, object]  # an ``events`` row: revision, type, key, value


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
            CorruptEntryError: the row was not written by this module.
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
            raise KeyNotFoundError(f"key {key!r} not found", key)
        if row[1] != expected:
            raise CompareFailedError(f"key {key!r} is at revision {row[1]}, not {expected}", key, expected, row[1])
        return row


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

    A contested switch of a new file answers ``SQLITE_BUSY`` at once, without SQLite's busy
    handler (docs/backends/file.md, "Journal"); once one switch is done the pragma is a read.
    Retried with a short back-off until ``deadline`` (``time.monotonic()``), then the last
    ``SQLITE_BUSY`` is raised.

    Raises:
        sqlite3.OperationalError: untranslated; KVError: the file stays out of WAL mode.
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


def map_error(exc: sqlite3.Error, path: str, timeout: float, waited: float | None = None) -> KVError:
    """The :mod:`rdzv_core.errors` exception for an ``sqlite3`` error on the store ``path``
    (``waited``: seconds the failed call took, if known)."""
    code = getattr(exc, "sqlite_errorcode", None)
    primary = None if code is None else code & 0xFF
    text = str(exc)
    if _is_busy(exc):
        if waited is not None and waited < timeout / 2:  # SQLite gave up without waiting (no busy handler)
            return BackendTimeoutError(
                f"{path!r} was locked by another connection and SQLite gave up after {waited:.3f}s, "
                f"without waiting for operation_timeout={timeout}s: {text}"
            )
        return BackendTimeoutError(
            f"{path!r} stayed locked for more than operation_timeout={timeout}s "
            f"(another process holds a write transaction): {text}"
        )
    if primary in _UNAVAILABLE_CODES:
        return BackendConnectionError(f"cannot use the store {path!r}: {text}")
    if primary in _DAMAGED_CODES:
        return CorruptEntryError(
            f"{path!r} is not an intact SQLite database ({text}); move it away or delete it "
            f"(every key in it is lost), then open the store again",
            None,
        )
    if "no such table" in text or "no such column" in text:
        return CorruptEntryError(f"{path!r} is an SQLite database but not an rdzv store ({text}); move it away", None)
    return KVError(f"SQLite error on {path!r}: {text}")


def _meta_int(conn: sqlite3.Connection, name: str, path: str) -> int:
    """The integer ``meta.value`` of ``name``; :class:`CorruptEntryError` (``key=None``) if it is not one."""
    row = conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
    if row is None or type(row[0]) is not int:
        raise _bad_meta(name, None if row is None else row, path)
    return row[0]


def _bad_meta(name: str, row: tuple[object] | None, path: str) -> CorruptEntryError:
    found = "missing" if row is None else f"{_SQL_TYPES.get(type(row[0]), '?')} {row[0]!r:.40}"
    return CorruptEntryError(
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
    """``row`` (value, revision, expires) if this module could have written it, else :class:`CorruptEntryError`."""
    value, revision, expires = row
    if type(key) is not str:
        raise CorruptEntryError(
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
        raise CorruptEntryError(
            f"key {key!r} in {path!r} holds {problem} (written by another tool?); delete(key) removes it", key
        )
    return value, revision, expires  # type: ignore[return-value]


def _event(path: str, revision: int, type_: object, key: object, value: object) -> Event:
    """The :class:`Event` of an ``events`` row; :class:`CorruptEntryError` (``key=None``) if rdzv did not write it."""
    if type(key) is str:
        if type_ == "put" and type(value) is bytes:
            return Event(EventType.PUT, key, revision, value)
        if type_ == "delete" and value is None:
            return Event(EventType.DELETE, key, revision)
    raise CorruptEntryError(
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
