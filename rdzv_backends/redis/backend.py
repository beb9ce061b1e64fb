"""``RedisBackend``: the KV protocol on one Redis server, every write one Lua script.

Revisions never run behind the server's clock; TTLs are the server's; a watch polls the log
(:mod:`rdzv_backends.redis._lua`) and waits for its prefix's pub/sub channel
(:mod:`rdzv_backends.redis._listener`). Layout, algorithms and server requirements:
docs/backends/redis.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import socket
import time
from typing import Any, Iterator, Sequence, cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rdzv_backends.redis._settings import (
    CAPABILITIES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_OPERATION_TIMEOUT,
    DEFAULT_PORT,
)
from rdzv_backends.redis._config import TLSFiles, namespace_prefix, tls_files
from rdzv_backends._tls import certificate_error, handshake, refused_certificate
from rdzv_backends.redis._errors import TRUSTED_CA_OPTION, _copy_error, _ErrorMap, _find_cause
from rdzv_backends.redis import _server
from rdzv_backends.redis._listener import _Notifier, _Waiter
from rdzv_backends.redis._lua import _INT64, _PRELUDE, _SCRIPTS, HISTORY_LIMIT
from rdzv_backends.redis._pool import _Pool, _stale
from rdzv_core.errors import (
    BackendClosedError,
    BackendConnectionError,
    CompareFailedError,
    CorruptEntryError,
    HistoryCompactedError,
    InvalidURLError,
    KeyExistsError,
    KeyNotFoundError,
    KVError,
)
from rdzv_core.kv import Entry, Event, EventType, KVBackend, call_budget
from rdzv_core.url import RendezvousURL

__all__ = ["RedisBackend", "open_url"]

log = logging.getLogger(__name__)

#: Log entries one poll script scans at most.
_WATCH_BATCH = 256


class RedisBackend(KVBackend):
    """The KV protocol on one Redis server (layout and algorithms: docs/backends/redis.md).

    Args:
        host: server host name or address (str).
        port: TCP port (int).
        db: database number (int >= 0).
        username: ACL user, or ``None`` for ``default`` (a user without password sends ``""``).
        password: password, or ``None``; never logged or shown.
        namespace: ``None`` (keys under ``rdzv:``) or a name (keys under ``rdzv:NAME:``).
        operation_timeout: seconds any call may take (connect, each reply, and the wait for a
            free pooled connection).
        tls: :class:`TLSFiles` to speak TLS, or ``None`` for plain TCP.
        max_connections: pooled connections at most (int >= 1, default
            :data:`DEFAULT_MAX_CONNECTIONS`); more concurrent calls wait for one. Waiting
            watches hold none; the listener has its own.
        allow_eviction: accept a server that evicts keys (``maxmemory`` with a policy other than
            ``noeviction``), with a WARNING (:attr:`server_warnings`); default ``False``: refused.

    Raises:
        BackendConnectionError: the server refused or dropped the connection (``open`` pings).
        BackendTimeoutError: the server did not answer within ``operation_timeout``.
        InvalidURLError: the server rejected the password (``password``) or the database
            number (``db``), or its TLS certificate did not verify (``cacert``) or was issued
            for another name (``host``).
        UnsuitableServerError: the server runs in cluster mode, or evicts keys and ``allow_eviction``
            is not set (:mod:`rdzv_backends.redis._server`).
    """

    capabilities = CAPABILITIES

    def __init__(
        self,
        host: str,
        port: int = DEFAULT_PORT,
        *,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        namespace: str | None = None,
        operation_timeout: float = DEFAULT_OPERATION_TIMEOUT,
        tls: TLSFiles | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        allow_eviction: bool = False,
    ) -> None:
        connection_class, address, where = self._connection_target(host, port, tls)
        self._errmap = _ErrorMap(host, port, db, tls, operation_timeout, max_connections, namespace_prefix(namespace),
                                 username, password is not None, where)
        self.host, self.port, self.db = host, port, db
        self.username = username
        self.namespace = namespace
        self.operation_timeout = operation_timeout
        self.tls = tls
        self.max_connections = max_connections
        self.allow_eviction = allow_eviction
        ns = namespace_prefix(namespace)
        self.prefix = ns
        self._data = ns + "k/"
        self._index_keys = [ns + "#rev", ns + "#log", ns + "#keys", ns + "#ttl", ns + "#epoch", ns + "#last"]
        self._scratch = ns + "#add"
        #: How every connection is made: this backend's pool and its listener's (class, kwargs).
        self._connection_args: tuple[type[Any], dict[str, Any]] = (connection_class, dict(
            **address,
            db=db,
            username=username,
            # AUTH needs a password with a user; any works for a ``nopass`` user.
            password="" if password is None and username is not None else password,
            socket_timeout=operation_timeout,
            socket_connect_timeout=operation_timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            protocol=2,  # RESP2, no CLIENT SETINFO: docs/backends/redis.md, "The connection pool"
            driver_info=None,
            **(tls.connection_kwargs() if tls is not None else {}),
        ))
        self._pool = _Pool(lambda: connection_class(**self._connection_args[1]), max_connections, operation_timeout)
        self._scripts = {name: _Script(_PRELUDE + body) for name, body in _SCRIPTS.items()}
        self._notifier = _Notifier.of(
            (host, port, db, username, self._connection_args[1]["password"],
             None if tls is None else (tls.cacert, tls.cert, tls.key), ns, operation_timeout),
            self._errmap, self._index_keys, repr(self), self._connection_args)
        try:
            self._ping_at_open()
            self._check_server()
        except BaseException:
            self._notifier.release(self)
            self._pool.close()
            raise
        log.debug("opened %r", self)

    def _connection_target(self, host: str, port: int,
                           tls: TLSFiles | None) -> tuple[type[Any], dict[str, Any], str]:
        """Where this backend's connections go: the redis-py connection class, the keyword arguments
        that name the server (``host``, ``port``), and how error messages name it."""
        return (redis.SSLConnection if tls is not None else redis.Connection), {"host": host, "port": port}, \
            f"redis at {host}:{port}"

    def _ping_at_open(self) -> None:
        """The first command. A lost connection is looked into: with TLS, one handshake of our own reads
        whether the server refused the client certificate (or demands one), which redis-py may report as
        a mere EOF; without TLS, a reset connection hints at a TLS-only port."""
        started = time.monotonic()
        try:
            with self._translate(None):
                self._call("PING")
        except BackendConnectionError as exc:
            if self.tls is not None:
                self._check_certificate(self.operation_timeout - (time.monotonic() - started))
            elif isinstance(exc.__cause__, redis.exceptions.ConnectionError) and (
                    _find_cause(exc.__cause__, ConnectionResetError) is not None
                    or "closed by server" in str(exc.__cause__)):
                raise BackendConnectionError(f"{exc}; the server closed the connection: it may require TLS (then use "
                                             "rediss://), or it is not a Redis server") from exc.__cause__
            raise

    def _check_server(self) -> None:
        """Refuse a server in cluster mode or one that evicts keys (:func:`_server.check_server`), from one
        ``INFO``; a user the ACL denies ``INFO`` is not refused: a WARNING says the server went unchecked."""
        where = f"{self.host}:{self.port}"
        with self._translate(None):
            try:
                info = _server.parse_info(cast(bytes, self._call("INFO")))
            except redis.exceptions.NoPermissionError:
                warning = (f"Redis at {where}: cannot check for eviction and cluster mode, the ACL user may not run "
                           f"INFO (add +info to its rules)")
                log.warning("%s", warning)
                self.server_warnings = (warning,)
                return
        self.server_warnings = _server.check_server(info, where, self.allow_eviction)

    def _check_certificate(self, seconds: float) -> None:
        """One TLS handshake and ``PING`` (Python's ``ssl``, at most ``seconds``): raises the
        :class:`InvalidURLError` naming ``cert`` if the server answers with an alert refusing it."""
        assert self.tls is not None
        if seconds <= 0:
            return
        try:
            raw = socket.create_connection((self.host, self.port), timeout=seconds)
        except OSError:
            return
        try:
            handshake(self.tls.context, raw, self.host, b"PING\r\n")
        except OSError as exc:  # ssl.SSLError too
            reason = refused_certificate(exc, self.tls.cert is not None)
            if reason is not None:
                raise certificate_error(f"{self.host}:{self.port}", self.tls.cert, reason,
                                        TRUSTED_CA_OPTION) from None

    def __repr__(self) -> str:
        scheme = "rediss" if self.tls is not None else "redis"
        user = f"{self.username}@" if self.username else ""
        return f"RedisBackend('{scheme}://{user}{self.host}:{self.port}', db={self.db}, prefix={self.prefix!r})"

    # -- plumbing ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _translate(self, key: str | None) -> Iterator[None]:
        """Map redis-py errors onto :mod:`rdzv_core.errors`; anything raised by a call that
        :meth:`close` cut short becomes :class:`~rdzv_core.errors.BackendClosedError`."""
        try:
            yield
        except Exception as exc:
            if self._closed:
                raise BackendClosedError(f"{type(self).__name__} was closed during the call", key) from exc
            mapped = self._errmap.map(exc, key)
            if mapped is None:
                raise
            raise mapped from (None if isinstance(mapped, (InvalidURLError, CorruptEntryError)) else exc)

    def _call(self, *command: Any) -> Any:
        """Send one command on a pooled connection and return the server's raw (RESP2) reply.

        redis-py's errors propagate (callers translate them); a connection that failed other
        than by an error reply is disconnected (it reconnects when next used)."""
        budget = call_budget(self.operation_timeout)
        conn = self._pool.acquire(budget)
        short = budget < self.operation_timeout  # the caller's deadline (rdzv_core.kv.call_deadline) is sooner
        try:
            sock = conn._sock  # redis-py keeps the socket there; None: not connected (yet, or any more)
            if sock is not None and _stale(sock):
                conn.disconnect()  # the server closed it (restart, idle timeout): send on a new one
                sock = None
            if short:
                budget = call_budget(self.operation_timeout)
                if sock is None:  # connect (and AUTH/SELECT) within the budget too
                    conn.socket_connect_timeout = conn.socket_timeout = budget
                    try:
                        conn.connect()
                    finally:
                        conn.socket_connect_timeout = conn.socket_timeout = self.operation_timeout
                conn._sock.settimeout(budget)
            conn.send_command(*command, check_health=False)
            return conn.read_response()
        except redis.exceptions.ResponseError:
            raise  # an error reply: the connection is in step
        except BaseException:
            conn.disconnect()
            raise
        finally:
            if short and conn._sock is not None:  # still connected: the next call gets the full timeout
                conn._sock.settimeout(self.operation_timeout)
            self._pool.release(conn)

    def _run(self, name: str, key: str | None, *args: Any, extra_key: str | None = None) -> Any:
        keys = self._index_keys + ([extra_key] if extra_key is not None else [])
        script = self._scripts[name]
        with self._translate(key):
            try:
                return self._call("EVALSHA", script.sha, len(keys), *keys, self.prefix, HISTORY_LIMIT, *args)
            except redis.exceptions.NoScriptError:  # a new or restarted server: load it, once per server
                self._call("SCRIPT", "LOAD", script.text)
                return self._call("EVALSHA", script.sha, len(keys), *keys, self.prefix, HISTORY_LIMIT, *args)

    def _run_key(self, name: str, key: str, *args: Any) -> Any:
        return self._run(name, key, key, *args, extra_key=self._data + key)

    # -- the protocol --------------------------------------------------------------------------
    def _do_ttl_remaining(self, key: str) -> float | None:
        """``PTTL`` of the key's data hash (the server's clock, milliseconds)."""
        with self._translate(key):
            ms = int(cast(int, self._call("PTTL", self._data + key)))
        if ms == -2:
            raise KeyNotFoundError(f"key {key!r} not found (expired or deleted)", key)
        return None if ms < 0 else ms / 1000.0

    def _do_get(self, key: str) -> Entry | None:
        with self._translate(key):
            try:
                flat = cast("list[bytes]", self._call("HGETALL", self._data + key))
            except redis.exceptions.ResponseError as exc:
                if "WRONGTYPE" not in str(exc):
                    raise
                raise self._errmap.corrupt(f"CORRUPT KEY {key} is not a hash") from None
        if not flat:
            return None
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        value, rev = fields.get(b"v"), fields.get(b"r")
        if value is None or rev is None or not rev.isdigit():
            raise self._errmap.corrupt(f"CORRUPT KEY {key} is a hash without the fields v and r (a decimal revision)")
        return Entry(key, value, int(rev))

    def _do_list(self, prefix: str) -> tuple[list[Entry], int]:
        revision, flat = self._run("list", prefix, prefix)
        entries = [Entry(flat[i].decode(), flat[i + 1], int(flat[i + 2])) for i in range(0, len(flat), 3)]
        return entries, int(revision)

    def _do_create(self, key: str, value: bytes, ttl: float | None) -> Entry:
        status, rev = self._run_key("create", key, value, _ttl_ms(ttl))
        if status == 0:
            raise KeyExistsError(f"key {key!r} exists (revision {rev})", key)
        return Entry(key, value, int(rev))

    def _do_put(self, key: str, value: bytes, ttl: float | None) -> Entry:
        return Entry(key, value, int(self._run_key("put", key, value, _ttl_ms(ttl))))

    def _do_compare_and_swap(self, key: str, value: bytes, expected_revision: int, ttl: float | None) -> Entry:
        result = self._run_key("cas", key, value, _ttl_ms(ttl), expected_revision)
        _check_compare(key, expected_revision, result)
        return Entry(key, value, int(result[1]))

    def _do_compare_and_delete(self, key: str, expected_revision: int) -> None:
        _check_compare(key, expected_revision, self._run_key("cad", key, expected_revision))

    def _do_delete(self, key: str) -> bool:
        return bool(self._run_key("delete", key))

    def _do_refresh(self, key: str, ttl: float) -> None:
        if not self._run_key("refresh", key, _ttl_ms(ttl)):
            raise KeyNotFoundError(f"key {key!r} not found (expired or deleted)", key)

    def _do_add(self, key: str, delta: int) -> int:
        if not _INT64[0] <= delta <= _INT64[1]:
            raise KVError(f"add({key!r}, {delta}): Redis counters are 64-bit signed integers", key)
        result = self._run("add", key, key, delta, extra_key=self._scratch)
        if result[0] == 0:
            raise CorruptEntryError(f"value at {key!r} is not a decimal integer (add stores ASCII decimal); "
                               f"delete it to recover", key)
        if result[0] == 1:
            raise KVError(f"add({key!r}, {delta}) leaves the 64-bit range: {result[1]}", key)
        return int(result[1])

    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        deadline = time.monotonic() + timeout
        after = after_revision  # every event under the prefix up to here has been looked at
        waiter: _Waiter | None = None
        covered = False  # every later one reaches the waiter as a message: its subscription predates the poll
        start: int | None = after  # where the next poll begins; None: there is nothing to poll
        woken = False  # the next poll follows a wait (so the waiter's hint may tell where to begin)
        checked = False  # a poll found after_revision in the server's history (heard events may then answer)
        try:
            if timeout > 0:
                waiter, start = self._notifier.begin(self, prefix, after)
                covered = waiter is not None
            while not self._closed:
                if start is not None:
                    if waiter is not None:
                        waiter.wake.clear()  # from here on, a wake-up means: poll again
                        hint, heard = self._notifier.take_hint(waiter)
                        if woken and covered and checked and hint and heard and not any(
                                0 < after_revision < epoch - 1 for epoch, _ in heard):
                            # Every event after `after` under the prefix was announced since the last
                            # look, each with its key and value, in the history `after_revision` is
                            # from (else the poll reports it lost): they are the answer.
                            fresh = [event for _, event in heard if event.revision > after]
                            if fresh:
                                return fresh
                        if woken and covered and hint is not None:
                            start = max(after, hint - 1)  # nothing under the prefix lies between: skip it
                    woken = False
                    polled_at = time.monotonic()
                    result = self._run("poll", prefix, after_revision, prefix, _WATCH_BATCH, start)
                    if result[0] == -1:
                        raise _history_lost(prefix, after_revision, result[1].decode(), int(result[2]))
                    checked = True
                    last, scanned, wake_ms, matched = result
                    if matched:
                        return [_event(item) for item in matched]
                    after = start = int(last)
                    if scanned >= _WATCH_BATCH and not self._closed:
                        continue  # more history to scan (at most HISTORY_LIMIT entries), even at timeout 0
                    if waiter is None and deadline > time.monotonic() and not self._closed:
                        next_deadline = None if wake_ms < 0 else time.monotonic() + wake_ms / 1000
                        waiter = self._notifier.add(self, prefix, after, polled_at, deadline - time.monotonic(),
                                                    next_deadline)
                    if waiter is not None:
                        covered = self._notifier.covers(waiter, polled_at, after)
                if deadline <= time.monotonic() or self._closed or waiter is None:
                    return []
                waiter.after = after
                if waiter.wake.wait(deadline - time.monotonic()):
                    if waiter.error is not None:
                        raise _copy_error(waiter.error, prefix) from waiter.error
                elif covered and waiter.hint is None:
                    # Nothing was announced, so nothing under the prefix came: only check that the
                    # history still reaches `after` (HistoryCompactedError if the server lost its data).
                    result = self._run("poll", prefix, after_revision, prefix, 1, after)
                    if result[0] == -1:
                        raise _history_lost(prefix, after_revision, result[1].decode(), int(result[2]))
                    return [_event(item) for item in result[3]]
                start, woken = after, True
            return []
        except BackendClosedError:
            return []  # close() ended the watch
        finally:
            if waiter is not None:
                self._notifier.remove(waiter)

    def _do_close(self) -> None:
        self._notifier.release(self)
        self._pool.close()


class _Script:
    """A Lua script's text and SHA-1 (what ``EVALSHA`` names it by)."""

    __slots__ = ("text", "sha")

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


def _ttl_ms(ttl: float | None) -> str:
    """A TTL in whole milliseconds (at least 1) as the scripts take it; ``""`` for none."""
    return "" if ttl is None else str(max(1, round(ttl * 1000)))


def _check_compare(key: str, expected: int, result: Sequence[Any]) -> None:
    if result[0] == 0:
        raise KeyNotFoundError(f"key {key!r} not found", key)
    if result[0] == 1:
        actual = int(result[1])
        raise CompareFailedError(f"key {key!r} is at revision {actual}, not {expected}", key, expected, actual)


def _event(item: Sequence[Any]) -> Event:
    rev, kind, key = int(item[0]), item[1], item[2].decode()
    if kind == b"p":
        return Event(EventType.PUT, key, rev, item[3])
    return Event(EventType.DELETE, key, rev)


def _history_lost(prefix: str, after: int, why: str, revision: int) -> HistoryCompactedError:
    if why == "trimmed":
        detail = f"the log was trimmed (next kept: {revision})"
    elif why == "diverged":
        detail = (f"the server's history never issued it (it went from revision {revision} to a later one): it "
                  f"lost writes the caller saw (a failover to a replica that missed them, or an older snapshot)")
    elif why == "ahead":
        detail = f"the server's revision is {revision}, behind it: it lost data (restart without persistence?)"
    else:
        detail = f"this history began at revision {revision}: the server lost the one before"
    return HistoryCompactedError(f"events after revision {after} are gone: {detail}; re-read", prefix)


_FROM_URL: Any = object()


def open_url(url: RendezvousURL, tls: TLSFiles | None = _FROM_URL) -> RedisBackend:
    """Open a :class:`RedisBackend` for a parsed ``redis://`` / ``rediss://`` URL of one host.

    Args:
        tls: the URL's checked TLS files (:func:`~rdzv_backends.redis._config.tls_files`), if the
            caller has them; else they are read from ``url``.

    Raises:
        InvalidURLError: TLS options without ``rediss``; a TLS file problem.
        BackendUnavailableError: see :class:`RedisBackend`.
    """
    host, port = url.hosts[0]
    params = url.params
    if tls is _FROM_URL:
        tls = tls_files(url.scheme, params)
    return RedisBackend(
        host,
        port or DEFAULT_PORT,
        db=params.get("db", 0),
        username=url.username,
        password=url.password,
        namespace=params.get("namespace"),
        operation_timeout=params.get("operation_timeout", DEFAULT_OPERATION_TIMEOUT),
        tls=tls,
        max_connections=params.get("max_connections", DEFAULT_MAX_CONNECTIONS),
        allow_eviction=params.get("allow_eviction", False),
    )
