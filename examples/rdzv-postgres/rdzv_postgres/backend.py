"""``postgresql://`` — the KV protocol on one PostgreSQL server (psycopg 3).

URL (see :mod:`rdzv_postgres` for every query key)::

    postgresql://[USER[:PASSWORD]@]HOST[:PORT]/RUN_ID?dbname=NAME&namespace=NS&operation_timeout=S

The rendezvous URL's last path segment is always the run id, so the database
is named by the ``dbname`` query key (default ``postgres``), never by the path.

Tables (``NS`` is the ``namespace``, default ``rdzv``; created on first use)::

    NS_meta    (id = 1, revision, compacted, format)   the keyspace revision: ONE row, the write lock
    NS_kv      (key text COLLATE "C" PRIMARY KEY, value bytea, revision bigint, expires_at timestamptz)
    NS_events  (revision bigint PRIMARY KEY, kind text, key text COLLATE "C", value bytea)

How it works
    * **Writes** are one transaction each: ``SELECT ... FROM NS_meta FOR UPDATE``
      takes the keyspace lock and reads the revision and the server's clock
      (``clock_timestamp()``); then expired rows are purged, the key's row is
      read and checked (``create``, compare-and-swap by revision, ``add``), and
      one final statement writes the rows, the events (one per revision),
      the new revision and a ``NOTIFY``. Writers are serialised by the lock, so
      revisions are issued in commit order: a watcher never sees revision
      ``r + 1`` committed before ``r``. Under ``READ COMMITTED`` each statement
      after the lock sees every earlier commit, so check-then-write is atomic.
    * **TTL** is an expiry timestamp taken from the SERVER's clock; no client
      clock decides an expiry. Whoever first finds a row past its expiry — a
      writer, ``get``, ``list`` or a watcher — deletes it in a write
      transaction, with a ``DELETE`` event and a fresh revision. ``refresh``
      moves ``expires_at`` only (no event, no new revision).
    * **Watch** ``LISTEN``\\ s on the channel ``NS_events`` and runs one poll
      statement (one snapshot): the revision, the compaction point, the
      seconds until the next expiry (server clock) and the matching events.
      With nothing to return it waits for a notification, but no longer than
      the next expiry (then it purges) and :data:`RECHECK` seconds (a bounded
      re-check, should a notification ever be lost). ``NOTIFY`` is sent by the
      writing transaction itself, so it arrives only once the write is visible.
    * **History**: ``NS_events`` keeps the last ``history_limit`` events
      (default :data:`HISTORY_LIMIT`); trimming records the highest revision
      removed in ``NS_meta.compacted``, and a watch from an older revision
      raises :class:`~rdzv_core.errors.HistoryCompactedError`.
    * **Connections**: a small pool per backend object (autocommit; each
      connection used by one thread at a time). ``operation_timeout`` (seconds,
      default 10) is the connect timeout and the server-side
      ``statement_timeout`` and ``lock_timeout``; exceeding it raises
      :class:`~rdzv_core.errors.BackendTimeoutError`. A server that stops answering
      altogether (``SIGSTOP``, a silent network) cannot enforce those, so a
      client-side watchdog (one thread per process) shuts the socket of a call
      still running ``2 * operation_timeout + 1`` seconds after it began (a
      watch: its ``timeout`` later): the call raises ``BackendTimeoutError`` and the
      connection is dropped from the pool.

Server requirements: PostgreSQL >= 12 (15 tested). The user needs ``CREATE``
on the first schema of its ``search_path`` for the first run (PostgreSQL 15
grants no ``CREATE`` on ``public`` to ordinary users: give the user a schema
of its own name), then ``SELECT, INSERT, UPDATE, DELETE`` on the three tables.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import socket
import threading
import time
from typing import Any, Callable, Iterator, TypeVar

import psycopg
from psycopg import errors as pg_errors

from . import CAPABILITIES as _CAPABILITIES

from rdzv_core.errors import (
    BackendClosedError,
    BackendConnectionError,
    BackendTimeoutError,
    CompareFailedError,
    HistoryCompactedError,
    InvalidURLError,
    KeyExistsError,
    KeyNotFoundError,
    KVError,
    RdzvError,
)
from rdzv_core.kv import Entry, Event, EventType, KVBackend, parse_counter

__all__ = [
    "PostgresBackend",
    "CAPABILITIES",
    "HISTORY_LIMIT",
    "MAX_VALUE_BYTES",
    "DEFAULT_OPERATION_TIMEOUT",
    "RECHECK",
]

log = logging.getLogger(__name__)

#: Events kept in ``NS_events`` unless the URL sets ``history_limit``.
HISTORY_LIMIT = 10_000
#: Largest value accepted (bytes); each value is held twice while its event is kept.
MAX_VALUE_BYTES: int = _CAPABILITIES.max_value_bytes or 0
#: Seconds a call may take when the URL sets no ``operation_timeout``.
DEFAULT_OPERATION_TIMEOUT = 10.0
#: Longest wait (seconds) of a watch between two polls, even without a notification.
RECHECK = 1.0
#: Most events one ``watch`` call returns (callers watch again for the rest).
WATCH_BATCH = 1000
#: Idle connections kept per backend object.
POOL_IDLE = 4
#: How often (seconds) a waiting watch looks whether the backend was closed.
_CLOSE_CHECK = 0.2
_FORMAT = 1
_NAMESPACE = re.compile(r"[a-z_][a-z0-9_]{0,39}")
#: Errors that mean "no answer in time": statement_timeout, lock_timeout, connect timeout.
_TIMEOUTS: tuple[type[Exception], ...] = (pg_errors.QueryCanceled, pg_errors.LockNotAvailable) + (
    (pg_errors.ConnectionTimeout,) if hasattr(pg_errors, "ConnectionTimeout") else ()
)

CAPABILITIES = _CAPABILITIES  # one definition, in the package (registering imports no psycopg)

T = TypeVar("T")


class _Alarm:
    """One armed call of the :class:`_Watchdog`; ``fired`` once its socket was shut."""

    __slots__ = ("deadline", "conn", "fired")

    def __init__(self, deadline: float, conn: psycopg.Connection[Any]) -> None:
        self.deadline, self.conn, self.fired = deadline, conn, False


class _Watchdog:
    """Shuts the socket of a connection whose call outlived its deadline (a server that stopped answering).

    One daemon thread per process serves every backend; it sleeps until the
    earliest deadline. Arming and disarming happen under the same lock as the
    shutdown, so a connection that is back in its pool is never touched.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: set[_Alarm] = set()
        self._thread: threading.Thread | None = None
        self._wake = float("inf")  # when the thread will next look (monotonic)

    @contextlib.contextmanager
    def guard(self, conn: psycopg.Connection[Any], seconds: float) -> Iterator[_Alarm]:
        alarm = _Alarm(time.monotonic() + seconds, conn)
        with self._cond:
            self._armed.add(alarm)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rdzv-postgres-watchdog", daemon=True)
                self._thread.start()
            if alarm.deadline < self._wake:  # only an earlier deadline needs the thread awake now
                self._cond.notify()
        try:
            yield alarm
        finally:
            with self._cond:
                self._armed.discard(alarm)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for alarm in [a for a in self._armed if a.deadline <= now]:
                    self._armed.discard(alarm)
                    alarm.fired = True
                    _shutdown(alarm.conn)
                self._wake = min((a.deadline for a in self._armed), default=now + 60.0)
                self._cond.wait(max(self._wake - now, 0.001))


def _shutdown(conn: psycopg.Connection[Any]) -> None:
    """Shut ``conn``'s socket down: whatever waits on it fails at once (the socket stays owned by libpq)."""
    try:
        fd = conn.pgconn.socket
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except (OSError, psycopg.Error):
        pass  # already closed


_WATCHDOG = _Watchdog()
_Row = tuple[bytes, int, "datetime.datetime | None"]  # value, revision, expires_at


class _SQL:
    """The statements of one namespace (table names are validated identifiers, never user data)."""

    def __init__(self, ns: str) -> None:
        self.meta, self.kv, self.events, self.channel = f"{ns}_meta", f"{ns}_kv", f"{ns}_events", f"{ns}_events"
        meta, kv, events = self.meta, self.kv, self.events
        self.schema = [
            f"CREATE TABLE IF NOT EXISTS {meta} (id integer PRIMARY KEY CHECK (id = 1),"
            " revision bigint NOT NULL, compacted bigint NOT NULL, format integer NOT NULL)",
            f"INSERT INTO {meta} VALUES (1, 0, 0, {_FORMAT}) ON CONFLICT (id) DO NOTHING",
            f'CREATE TABLE IF NOT EXISTS {kv} (key text COLLATE "C" PRIMARY KEY, value bytea NOT NULL,'
            " revision bigint NOT NULL, expires_at timestamptz)",
            f"CREATE INDEX IF NOT EXISTS {kv}_expires ON {kv} (expires_at) WHERE expires_at IS NOT NULL",
            f"CREATE TABLE IF NOT EXISTS {events} (revision bigint PRIMARY KEY,"
            f" kind text NOT NULL CHECK (kind IN ('put', 'delete')), key text COLLATE \"C\" NOT NULL, value bytea)",
        ]
        self.lock = f"SELECT revision, compacted, clock_timestamp() FROM {meta} WHERE id = 1 FOR UPDATE"
        # Both parts run on one snapshot: a row of ``key`` that is purged here is also returned below.
        self.purge_and_read = (
            f"WITH purged AS (DELETE FROM {kv} WHERE expires_at <= %(now)s RETURNING key, expires_at)"
            " SELECT true, key, NULL::bytea, NULL::bigint, expires_at FROM purged"
            f" UNION ALL SELECT false, key, value, revision, expires_at FROM {kv} WHERE key = %(key)s"
        )
        self.finish = (
            f"WITH put AS (INSERT INTO {kv} (key, value, revision, expires_at)"
            "   SELECT * FROM unnest(%(put_keys)s::text[], %(put_values)s::bytea[], %(put_revs)s::bigint[],"
            "                        %(put_expires)s::timestamptz[])"
            "   ON CONFLICT (key) DO UPDATE SET value = excluded.value, revision = excluded.revision,"
            "   expires_at = excluded.expires_at),"
            f" del AS (DELETE FROM {kv} WHERE key = ANY(%(del_keys)s::text[])),"
            f" ev AS (INSERT INTO {events} (revision, kind, key, value)"
            "   SELECT * FROM unnest(%(ev_revs)s::bigint[], %(ev_kinds)s::text[], %(ev_keys)s::text[],"
            "                        %(ev_values)s::bytea[])),"
            f" trim_ AS (DELETE FROM {events} WHERE revision <= %(compacted)s),"
            f" meta AS (UPDATE {meta} SET revision = %(revision)s, compacted = %(compacted)s WHERE id = 1)"
            " SELECT pg_notify(%(channel)s, %(revision)s::text) WHERE %(notify)s"
        )
        self.refresh = f"UPDATE {kv} SET expires_at = %(expires)s WHERE key = %(key)s"
        self.get = f"SELECT value, revision, expires_at <= statement_timestamp() FROM {kv} WHERE key = %(key)s"

    def key_range(self, prefix: str) -> tuple[str, dict[str, str]]:
        """SQL condition selecting keys that start with ``prefix`` (a range, never ``LIKE``)."""
        if not prefix:
            return "true", {}
        return "key >= %(lo)s AND key < %(hi)s", {"lo": prefix, "hi": prefix[:-1] + chr(ord(prefix[-1]) + 1)}

    def list(self, prefix: str) -> tuple[str, dict[str, str]]:
        where, args = self.key_range(prefix)
        return (
            f"SELECT m.revision, k.key, k.value, k.revision, k.expires_at <= statement_timestamp()"
            f" FROM {self.meta} m LEFT JOIN {self.kv} k ON {where.replace('key', 'k.key')}"
            " WHERE m.id = 1 ORDER BY k.key",
            args,
        )

    def list_in_txn(self, prefix: str) -> tuple[str, dict[str, str]]:
        where, args = self.key_range(prefix)
        return f"SELECT key, value, revision FROM {self.kv} WHERE {where} ORDER BY key", args

    def poll(self, prefix: str) -> tuple[str, dict[str, Any]]:
        """Revision, compaction point, seconds to the next expiry and the first matching events (one snapshot)."""
        where, args = self.key_range(prefix)
        return (
            "SELECT m.revision, m.compacted,"
            f" extract(epoch FROM (SELECT min(expires_at) FROM {self.kv}) - statement_timestamp())::float8,"
            " e.revision, e.kind, e.key, e.value"
            f" FROM {self.meta} m LEFT JOIN LATERAL (SELECT revision, kind, key, value FROM {self.events}"
            f"   WHERE revision > %(after)s AND {where} ORDER BY revision LIMIT {WATCH_BATCH}) e ON true"
            " WHERE m.id = 1 ORDER BY e.revision",
            args,
        )


class _Txn:
    """One write transaction holding the keyspace lock; collects rows and events for one final statement.

    Attributes:
        now: the server's ``clock_timestamp()`` once the lock was held (aware ``datetime``).
        revision: the keyspace revision, advanced by :meth:`record`.
        row: ``(value, revision, expires_at)`` of the key the transaction is about, or ``None``.
    """

    def __init__(self, cur: psycopg.Cursor[Any], q: _SQL, key: str | None) -> None:
        self.cur, self.q = cur, q
        row = cur.execute(q.lock).fetchone()
        if row is None:
            raise KVError(f"table {q.meta} has no revision row: the store was damaged", key)
        self.start = self.revision = int(row[0])
        self.compacted = int(row[1])
        self.now: datetime.datetime = row[2]
        self.events: list[tuple[int, str, str, bytes | None]] = []
        self.puts: dict[str, tuple[bytes, int, datetime.datetime | None]] = {}
        self.deletes: list[str] = []
        self.notify = False
        purged: list[tuple[datetime.datetime, str]] = []
        self.row: _Row | None = None
        for is_purged, k, value, revision, expires_at in cur.execute(q.purge_and_read, {"now": self.now, "key": key}):
            if is_purged:
                purged.append((expires_at, k))
            else:
                self.row = (value, revision, expires_at)
        for _, k in sorted(purged):  # in expiry order, each with its own revision
            if k == key:
                self.row = None
            self.record(EventType.DELETE, k, None)
        if purged:
            log.debug("expired %d key(s) at revision %d", len(purged), self.revision)

    def record(self, kind: EventType, key: str, value: bytes | None) -> int:
        """Advance the revision and log one event; return the new revision."""
        self.revision += 1
        self.events.append((self.revision, kind.value, key, value))
        return self.revision

    def expiry(self, ttl: float | None) -> datetime.datetime | None:
        """``ttl`` seconds after :attr:`now` (server clock), or ``None``."""
        return None if ttl is None else self.now + datetime.timedelta(seconds=ttl)

    def write(self, key: str, value: bytes, expires: datetime.datetime | None) -> Entry:
        """Store ``key`` with a new revision and a ``PUT`` event."""
        rev = self.record(EventType.PUT, key, value)
        self.puts[key] = (value, rev, expires)
        return Entry(key, value, rev)

    def remove(self, key: str) -> None:
        """Delete ``key`` with a ``DELETE`` event."""
        self.deletes.append(key)
        self.record(EventType.DELETE, key, None)

    def check_revision(self, key: str, expected: int) -> _Row:
        if self.row is None:
            raise KeyNotFoundError(f"key {key!r} not found", key)
        if self.row[1] != expected:
            raise CompareFailedError(f"key {key!r} is at revision {self.row[1]}, not {expected}", key, expected,
                                     self.row[1])
        return self.row

    def finish(self, history_limit: int) -> None:
        """Write rows, events, the revision (trimming old events) and ``NOTIFY``, in one statement."""
        if not self.events and not self.notify:
            return
        compacted = self.compacted
        if self.revision - compacted > history_limit + max(history_limit // 10, 1):
            compacted = self.revision - history_limit  # trim in batches, not on every write
        puts = list(self.puts.items())
        self.cur.execute(
            self.q.finish,
            {
                "put_keys": [k for k, _ in puts],
                "put_values": [v[0] for _, v in puts],
                "put_revs": [v[1] for _, v in puts],
                "put_expires": [v[2] for _, v in puts],
                "del_keys": self.deletes,
                "ev_revs": [e[0] for e in self.events],
                "ev_kinds": [e[1] for e in self.events],
                "ev_keys": [e[2] for e in self.events],
                "ev_values": [e[3] for e in self.events],
                "compacted": compacted,
                "revision": self.revision,
                "channel": self.q.channel,
                "notify": bool(self.events) or self.notify,
            },
        )


class _Pool:
    """Autocommit connections, each used by one thread at a time; at most :data:`POOL_IDLE` kept idle."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]]) -> None:
        self._connect = connect
        self._idle: list[psycopg.Connection[Any]] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._orphans: list[psycopg.Connection[Any]] = []  # inherited through fork(): never touched
        self.closed = False

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's sockets are not ours to use or close
                self._orphans += self._idle
                self._idle, self._pid = [], os.getpid()
            if self.closed:
                raise BackendClosedError("postgresql backend is closed")
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._connect()
        try:
            yield conn
        finally:
            keep = not conn.closed and not conn.broken
            if keep and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                try:
                    conn.rollback()
                except psycopg.Error:
                    keep = False
            with self._lock:
                keep = keep and not self.closed and self._pid == os.getpid() and len(self._idle) < POOL_IDLE
                if keep:
                    self._idle.append(conn)
            if not keep:
                conn.close()

    def close(self) -> None:
        """Close the idle connections; connections in use are closed when they come back."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
            mine = self._pid == os.getpid()
        for conn in idle if mine else ():
            conn.close()


class PostgresBackend(KVBackend):
    """The KV protocol on PostgreSQL; see the module docstring.

    Args:
        conninfo: libpq connection parameters (``host``, ``port``, ``dbname``,
            ``user``, ``password``, ``sslmode``, ...); never logged.
        namespace: table-name prefix, ``[a-z_][a-z0-9_]{0,39}`` (str, default ``"rdzv"``).
        operation_timeout: seconds (float > 0) for connecting, for one statement and
            for waiting on the keyspace lock.
        history_limit: events kept for watchers (int >= 100).

    Raises:
        InvalidURLError: a bad ``namespace``, ``history_limit`` or ``operation_timeout``;
            the server rejected the user/password; the database does not exist.
        BackendConnectionError, BackendTimeoutError: the server cannot be reached.
        KVError: the tables exist but hold another store format, or the user lacks privileges.
    """

    capabilities = CAPABILITIES

    def __init__(
        self,
        conninfo: dict[str, Any],
        *,
        namespace: str = "rdzv",
        operation_timeout: float = DEFAULT_OPERATION_TIMEOUT,
        history_limit: int = HISTORY_LIMIT,
    ) -> None:
        if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
            raise InvalidURLError("namespace", namespace, "must match [a-z_][a-z0-9_]{0,39} (it names tables)")
        if isinstance(operation_timeout, bool) or not isinstance(operation_timeout, (int, float)) or not (
            0 < operation_timeout < float("inf")
        ):
            raise InvalidURLError("operation_timeout", operation_timeout, "must be a finite number of seconds > 0")
        if isinstance(history_limit, bool) or not isinstance(history_limit, int) or history_limit < 100:
            raise InvalidURLError("history_limit", history_limit, "must be an integer >= 100")
        self.namespace = namespace
        self.operation_timeout = float(operation_timeout)
        self.history_limit = history_limit
        self.host = conninfo.get("host", "")
        self.port = conninfo.get("port")
        self.dbname = conninfo.get("dbname", "")
        self.user = conninfo.get("user")
        ms = max(1, round(self.operation_timeout * 1000))
        self._conninfo = {
            **conninfo,
            # libpq's connect_timeout is whole seconds, at least 2.
            "connect_timeout": max(2, round(self.operation_timeout)),
            "options": f"-c statement_timeout={ms} -c lock_timeout={ms} -c idle_in_transaction_session_timeout="
            f"{max(ms, 60_000)}",
            "application_name": "rdzv",
            "keepalives": 1,
            "keepalives_idle": 5,
            "keepalives_interval": 2,
            "keepalives_count": 3,
        }
        self._sql = _SQL(namespace)
        self._pool = _Pool(self._connect)
        try:
            self._init_schema()
        except BaseException:
            self._pool.close()
            raise
        log.debug("opened %r", self)

    def __repr__(self) -> str:
        user = f"{self.user}@" if self.user else ""
        return f"PostgresBackend('postgresql://{user}{self.host}:{self.port}', dbname={self.dbname!r}, " \
               f"namespace={self.namespace!r})"

    # -- plumbing ------------------------------------------------------------------------------
    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(autocommit=True, **self._conninfo)

    @contextlib.contextmanager
    def _session(
        self, key: str | None, conn: psycopg.Connection[Any] | None = None, extra: float = 0.0
    ) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection (or ``conn``, already guarded) with psycopg errors mapped onto
        :mod:`rdzv_core.errors`, guarded by the watchdog for ``2 * operation_timeout + 1 + extra`` seconds."""
        alarm: _Alarm | None = None
        try:
            if conn is not None:
                yield conn
            else:
                with self._pool.connection() as pooled:
                    with _WATCHDOG.guard(pooled, 2 * self.operation_timeout + 1.0 + extra) as alarm:
                        yield pooled
        except psycopg.Error as exc:
            if self._closed:
                raise BackendClosedError(f"{type(self).__name__} was closed during the call", key) from exc
            if alarm is not None and alarm.fired:
                raise BackendTimeoutError(
                    f"postgresql at {self.host}:{self.port} stopped answering: the call was cut after "
                    f"2 * operation_timeout + 1 = {2 * self.operation_timeout + 1:g}s", key
                ) from None
            raise self._map_error(exc, key) from (None if isinstance(exc, psycopg.OperationalError) else exc)

    def _map_error(self, exc: psycopg.Error, key: str | None) -> RdzvError:
        where = f"postgresql at {self.host}:{self.port}"
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        state = exc.sqlstate or ""
        if isinstance(exc, _TIMEOUTS):
            return BackendTimeoutError(f"{where} did not answer within operation_timeout={self.operation_timeout}s: "
                                  f"{text}", key)
        if state in ("28P01", "28000") or "password authentication failed" in text:
            return InvalidURLError("password", "***", f"{where} rejected the user/password: {text}")
        if state == "3D000" or ("database" in text and "does not exist" in text):
            return InvalidURLError("dbname", self.dbname, f"{where} has no such database")
        if isinstance(exc, pg_errors.InsufficientPrivilege):
            return KVError(f"{where}: the user lacks a privilege on the {self.namespace}_* tables: {text}", key)
        if isinstance(exc, psycopg.OperationalError):
            return BackendConnectionError(f"cannot use {where}: {text}", key)
        return KVError(f"{where} answered with an error: {text}", key)

    def _init_schema(self) -> None:
        q = self._sql
        with self._session(None) as conn:
            exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (q.meta,)).fetchone()
            if not (exists and exists[0]):
                with conn.transaction():
                    # One creator at a time: concurrent CREATE ... IF NOT EXISTS can collide in pg_type.
                    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"rdzv:{q.meta}",))
                    for statement in q.schema:
                        conn.execute(statement)  # type: ignore[arg-type]
            row = conn.execute(f"SELECT format FROM {q.meta} WHERE id = 1").fetchone()  # type: ignore[arg-type]
        if row is None or row[0] != _FORMAT:
            raise KVError(f"table {q.meta} holds store format {row and row[0]}; this rdzv_postgres reads {_FORMAT}")

    def _write(self, key: str | None, body: Callable[[_Txn], T], conn: psycopg.Connection[Any] | None = None) -> T:
        """Run ``body`` in one write transaction (after purging expired rows); commit unless it raises."""
        with self._session(key, conn) as c:
            with c.transaction():
                txn = _Txn(c.cursor(), self._sql, key)
                result = body(txn)
                txn.finish(self.history_limit)
            return result

    def _purge(self, conn: psycopg.Connection[Any]) -> None:
        self._write(None, lambda txn: None, conn)

    # -- the protocol --------------------------------------------------------------------------
    def _do_get(self, key: str) -> Entry | None:
        with self._session(key) as conn:
            row = conn.execute(self._sql.get, {"key": key}).fetchone()  # type: ignore[arg-type]
            if row is None:
                return None
            if not row[2]:
                return Entry(key, row[0], row[1])
            self._purge(conn)  # it has expired: delete it (and whatever else is due), with events
            return None

    def _do_list(self, prefix: str) -> tuple[list[Entry], int]:
        query, args = self._sql.list(prefix)
        with self._session(prefix) as conn:
            rows = conn.execute(query, args).fetchall()  # type: ignore[arg-type]
            if not any(r[4] for r in rows):
                return [Entry(r[1], r[2], r[3]) for r in rows if r[1] is not None], int(rows[0][0])
            in_txn, args = self._sql.list_in_txn(prefix)

            def body(txn: _Txn) -> tuple[list[Entry], int]:
                return [Entry(*r) for r in txn.cur.execute(in_txn, args)], txn.revision  # type: ignore[arg-type]

            return self._write(prefix, body, conn)

    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry:
        def body(txn: _Txn) -> Entry:
            if txn.row is not None:
                raise KeyExistsError(f"key {key!r} exists (revision {txn.row[1]})", key)
            return txn.write(key, value, txn.expiry(ttl))

        return self._write(key, body)

    def _do_put(self, key: str, value: bytes, ttl: float | None) -> Entry:
        return self._write(key, lambda txn: txn.write(key, value, txn.expiry(ttl)))

    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry:
        def body(txn: _Txn) -> Entry:
            txn.check_revision(key, expected_revision)
            return txn.write(key, value, txn.expiry(ttl))

        return self._write(key, body)

    def _do_compare_and_delete(self, key: str, expected_revision: int) -> None:
        def body(txn: _Txn) -> None:
            txn.check_revision(key, expected_revision)
            txn.remove(key)

        self._write(key, body)

    def _do_delete(self, key: str) -> bool:
        def body(txn: _Txn) -> bool:
            if txn.row is None:
                return False
            txn.remove(key)
            return True

        return self._write(key, body)

    def _do_refresh(self, key: str, ttl: float) -> None:
        def body(txn: _Txn) -> None:
            if txn.row is None:
                raise KeyNotFoundError(f"key {key!r} not found (expired or deleted)", key)
            expires = txn.expiry(ttl)
            txn.cur.execute(self._sql.refresh, {"expires": expires, "key": key})
            old = txn.row[2]
            # Watchers sleep until the next expiry they know of: wake them if this one comes sooner.
            txn.notify = old is None or (expires is not None and expires < old)

        self._write(key, body)

    def _do_add(self, key: str, delta: int) -> int:
        def body(txn: _Txn) -> int:
            row = txn.row
            total = (0 if row is None else parse_counter(key, row[0])) + delta
            txn.write(key, str(total).encode("ascii"), None if row is None else row[2])  # keeps its TTL
            return total

        return self._write(key, body)

    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        deadline = time.monotonic() + timeout
        scanned = after_revision  # events up to here are known not to match
        query, args = self._sql.poll(prefix)
        listen = f"LISTEN {self._sql.channel}"
        with self._session(prefix, extra=timeout) as conn:
            conn.execute(listen)  # type: ignore[arg-type]  (before the first poll: no commit slips between)
            try:
                while True:
                    rows = conn.execute(query, {**args, "after": scanned}).fetchall()  # type: ignore[arg-type]
                    head, compacted, until_expiry = int(rows[0][0]), int(rows[0][1]), rows[0][2]
                    if scanned < compacted:
                        raise HistoryCompactedError(
                            f"events after revision {scanned} were compacted (oldest kept: {compacted + 1}); re-read",
                            prefix,
                        )
                    if scanned > head:
                        raise HistoryCompactedError(
                            f"revision {scanned} is ahead of the store's ({head}): its tables were recreated; re-read",
                            prefix,
                        )
                    if until_expiry is not None and until_expiry <= 0:
                        self._purge(conn)
                        continue
                    events = [_event(r[3:]) for r in rows if r[3] is not None]
                    if events:
                        return events
                    scanned = head
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._closed:
                        return []
                    wait = min(remaining, RECHECK)
                    if until_expiry is not None:
                        wait = min(wait, until_expiry + 0.001)
                    self._wait_for_notify(conn, wait)
            finally:
                if not conn.closed and not conn.broken:
                    with contextlib.suppress(psycopg.Error):
                        conn.execute("UNLISTEN *")

    def _wait_for_notify(self, conn: psycopg.Connection[Any], seconds: float) -> None:
        """Return at the first notification on ``conn``, after ``seconds``, or soon after :meth:`close`."""
        end = time.monotonic() + seconds
        while not self._closed:
            left = end - time.monotonic()
            if left <= 0:
                return
            for _ in conn.notifies(timeout=min(left, _CLOSE_CHECK), stop_after=1):
                return

    def _do_close(self) -> None:
        self._pool.close()


def _event(row: tuple[Any, ...]) -> Event:
    revision, kind, key, value = row
    if kind == "put":
        return Event(EventType.PUT, key, int(revision), bytes(value))
    return Event(EventType.DELETE, key, int(revision))
