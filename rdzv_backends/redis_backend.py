"""``redis://`` and ``rediss://`` — the KV protocol on one Redis server (redis-py).

URL::

    redis://[USER[:PASSWORD]@]HOST[:PORT]/RUN_ID?db=N&namespace=NAME&operation_timeout=S&max_connections=M
    rediss://[USER[:PASSWORD]@]HOST[:PORT]/RUN_ID?cacert=CA.pem&cert=CLIENT.pem&key=CLIENT.key

The port defaults to 6379. ``rediss`` speaks TLS and verifies the server's
certificate and host name (against ``cacert``, else the system's CAs); ``cert``
and ``key`` (both or neither) present a client certificate. TLS options on a
``redis://`` URL are an error, never a silent plain-text connection. One host
only: Sentinel and Cluster are not supported. ``operation_timeout`` (seconds,
default 10) bounds every call: it is the socket connect and read timeout and
the longest wait for a pooled connection, and redis-py's own retries are
turned off, so nothing multiplies it. ``max_connections`` (default 1,024,
:data:`DEFAULT_MAX_CONNECTIONS`) caps the pool of one backend object: a call
holds a connection for its round trip only and waiting watches hold none, so
one object serves as many threads as a process runs; more calls at once queue
for a free connection rather than fail. The pool is this module's own (idle
connections last-in first-out, no lock on the usual path; a connection the
server closed while idle is replaced before use), and calls go to redis-py's
connections directly, not through its client: with 512 threads in a process,
the client's per-call work (a queue, metrics, checks) tripled the CPU of a call.

Layout. Every key of one backend lives under the *namespace* ``rdzv:``, or
``rdzv:NAME:`` with ``NAME`` percent-escaped (``urllib.parse.quote(NAME, safe="")``,
so it holds no ``:``, ``/`` or ``#`` and no namespace can reach another's keys;
store keys only ever follow the ``k/`` marker)::

    NS#rev          string   the last revision issued
    NS#epoch        string   the first revision of this history (set when there was no #rev and no log)
    NS#log          stream   one entry per revision, ID ``REV-0``: t=p|d, k=KEY, p=PREVIOUS REV[, v=VALUE]
    NS#keys         zset     every live (or not yet recorded as expired) key, score 0 (lex order)
    NS#ttl          zset     key -> its deadline, server clock in ms (the key's PEXPIREAT)
    NS#add          string   scratch for exact 64-bit arithmetic in ``add``
    NS#last         zset     PREFIX -> the revision of its latest event; member '#' -> since when it knows
    NSk/KEY         hash     v=VALUE, r=REVISION; PEXPIREAT when it has a TTL
    NS#w:PREFIX     channel  each event ("REV EPOCH p|d KEY[ VALUE]", or "REV" for a value over
                             4 KiB), published for every prefix of its key ("" too)
    NS#t            channel  a write made its key's TTL deadline the earliest one

Every operation that writes is ONE Lua script (registered once with
``register_script``; redis-py falls back from EVALSHA to SCRIPT LOAD after a
server restart empties the script cache), hence atomic.

Revisions. A script that changes something takes the next revision as
``max(#rev + 1, server clock in microseconds)`` — a per-namespace counter that
never runs behind the server's clock — stores it in ``#rev`` and XADDs the
event under it, with the revision before it (``p``), in the same script. So
the log holds every revision exactly once, in order, chained; and because new
revisions start at the clock, none is ever issued twice, even after Redis lost
or rewound its data (restart without AOF, restore of an older snapshot,
failover): a stale ``compare_and_swap`` can never match a newer entry.
``watch`` raises :class:`~rdzv_core.errors.HistoryCompacted` when the first
logged event after the caller's revision has a predecessor later than it (the
log, capped by ``MAXLEN ~ 10000`` (:data:`HISTORY_LIMIT`), trimmed what lay
between), when the caller's revision is ahead of ``#rev``, or when it is older
than ``#epoch`` (the server lost the history it came from). A rewind to an
older snapshot is not detected by watchers once newer writes pass their
revision: run Redis with AOF.

Expiry. TTLs are server-side: a write with a TTL takes ``now`` from the
server's ``TIME``, sets ``PEXPIREAT now+ttl`` on the data hash and records the
same deadline in ``#ttl``. Every script first *sweeps*: each key whose deadline
has passed (server clock) is deleted and gets its ``DELETE`` event, in deadline
order; and a script touching a key that is indexed but has no data (Redis
expired or evicted it) records its ``DELETE`` first. Recording removes the key
from ``#keys``/``#ttl`` in the same script, so each expiry is recorded exactly
once, whoever notices it first. ``get`` is a plain ``HGETALL`` (Redis never
returns an expired key), ``list`` sweeps, so the revision it returns already
counts every expiry it hides.

Watch. ``watch`` runs a *poll* script (sweep, check history, return the
matching events after the caller's revision); when nothing matches, it waits
for its prefix's channel. The poll reads the log only where its prefix has
events: every write records, for each prefix of its key, its revision in
``#last`` (pruned of prefixes whose events the log no longer holds once it has
more than 1,024; its member ``#`` says from which revision on it is complete),
so a poll from a revision at or after the prefix's latest event returns at once,
and one before it reads the log up to that event only. (Without it, at 1,024
agents every agent's watch of the round record read the round's 1,024 joins:
O(N^2) work for the server per round.) The backend objects of one process that share
server, database, user, TLS files, namespace and ``operation_timeout`` share
one *listener*: a thread with one connection of its own, subscribed to
``NS#w:PREFIX`` for the prefixes being watched (channels unused for 30 s are
dropped; the thread ends 30 s after its last watch, and with the last of those
backends). A message wakes only the waiting watches of its prefix whose
revision it passes. So an event costs one wake-up per
watch that wants it — not one per waiting watch, as a shared ``XREAD BLOCK`` on
the log would — and waiting watches hold no connection. A woken watch whose
subscription covered everything since its revision (below) returns the events
the messages carried, without a poll, unless one carried only a revision, or
the message names a history that began after the caller's revision (then the
poll reports ``HistoryCompacted``); otherwise it polls again.

No event is missed between a poll and the wait: a watch asks for its channel
before its first poll and registers after it, and polls once more if the
subscription took effect after that poll began, or if a message for it came
meanwhile. Nor is the log rescanned: once a poll that began after the
subscription read the log to its end at revision R (or the listener's own
sweep did, right after subscribing), every event under the prefix after R is
announced. A watch from at least R then polls only from just before the first
revision announced after its own, or not at all when none was (it waits; if it
times out, a one-entry poll still checks that its revision belongs to the
server's history, so lost data still gives ``HistoryCompacted``).

While any watch waits, the listener also sleeps until the next TTL deadline
(the ``sweep`` script returns it relative to the server's clock; ``NS#t``
reports an earlier one, also when a refresh moved it), then sweeps: the expiry
is recorded, published and seen by the watches of its prefix (the client only
measures the server-given interval; no client clock decides an expiry).
Measured on loopback: a change wakes a watcher in 1-2 ms, an expiry is seen
1-4 ms after its TTL. An expiry is recorded when the first client (listener or
writer) runs a script after the deadline; until one does, the key is already
invisible to ``get``/``list``. The listener pings the server after
``operation_timeout / 2`` of silence; a broken or silent connection fails the
waiting watches with the mapped error (e.g.
:class:`~rdzv_core.errors.BackendConnectionError`).

Counters. ``add`` accepts a stored value of ``-?[0-9]{1,30}`` (as
:func:`~rdzv_core.kv.parse_counter`) and adds with ``INCRBY``: exact, and a
:class:`~rdzv_core.errors.KVError` if the sum leaves the 64-bit range (c10d's
counters are 64-bit too); any other value is a
:class:`~rdzv_core.errors.CorruptEntry`. Values up to :data:`MAX_VALUE_BYTES`
(64 MiB) are accepted; each is held twice while its event is in the log.

Corrupt storage. Data this backend did not write (another tool's ``LPUSH`` or
``SET`` on ``NSk/KEY``, a hash without ``v``/``r``, a non-decimal ``#rev``, a
list where ``#keys`` belongs, a stream entry or ``#keys``/``#ttl`` member that
is not ours) makes the operation meeting it raise
:class:`~rdzv_core.errors.CorruptEntry` before it writes anything: naming the
store key for a data hash (``delete(key)``, hence ``rdzv reset``, removes
whatever the Redis key holds), or with ``key=None`` and the ``redis-cli``
command that removes the bookkeeping key (or member), and what that costs, in
the message. The scripts check types before they write, since Lua does not roll
back: the checks cost a ``TYPE`` of ``#keys`` per script.

Closing. :meth:`RedisBackend.close` wakes its waiting watches (they return
``[]``), stops the listener if no other backend uses it, and disconnects the
pool, which ends calls in flight with :class:`~rdzv_core.errors.BackendClosed`.

Server requirements: Redis >= 6.2 (7.0 tested). Use AOF persistence
(``appendonly yes``) so a restart keeps the keyspace and its history; without
it a restart loses both, and watchers from the old history get
``HistoryCompacted``. Use a ``maxmemory-policy`` of ``noeviction`` (an evicted
key is reported as deleted). No keyspace notifications or ``CONFIG`` rights are
needed. An ACL user needs its keys, its channels and these commands::

    ACL SETUSER agent on >PASSWORD resetkeys ~rdzv:* resetchannels &rdzv:*
        -@all +ping +evalsha +script|load +hgetall +time +get +set +incrby +del +exists +type
        +hmget +hset +persist +pexpireat +zadd +zrem +zscore +zmscore +zcard +zrange +zrangebylex +zrangebyscore
        +zremrangebyscore +zcount +xadd +xrange +xrevrange +publish +subscribe +unsubscribe

Code. The Lua scripts live in :mod:`rdzv_backends._redis_lua` and the listener (its thread,
sharing and wake-ups) in :mod:`rdzv_backends._redis_listener`; this module holds the backend,
URL handling, the mapping of redis-py errors and the plugin registration.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shlex
import ssl
import time
import urllib.parse
from typing import Any, Iterator, Sequence, cast

from rdzv_backends._redis_listener import _copy_error, _Notifier, _Waiter
from rdzv_backends._redis_lua import _INT64, _PRELUDE, _SCRIPTS, HISTORY_LIMIT
from rdzv_backends._redis_pool import _Pool, _stale
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
    RdzvError,
    UnknownBackendError,
)
from rdzv_core.kv import Capabilities, Entry, Event, EventType, KVBackend, call_budget
from rdzv_core.plugins import BackendSpec, backend_plugin
from rdzv_core.url import RendezvousURL, to_int, to_str

__all__ = [
    "RedisBackend",
    "TLSFiles",
    "CAPABILITIES",
    "HISTORY_LIMIT",
    "MAX_VALUE_BYTES",
    "DEFAULT_PORT",
    "DEFAULT_OPERATION_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "namespace_prefix",
    "plugin",
]

log = logging.getLogger(__name__)

DEFAULT_PORT = 6379
#: Seconds a call may take when the URL sets no ``operation_timeout``.
DEFAULT_OPERATION_TIMEOUT = 10.0
#: Pooled connections per backend object when the URL sets no ``max_connections``. A call holds
#: one only for its round trip and waiting watches hold none, so a process needs one per thread
#: that is in a call at the same moment: 1,024 covers every thread count a Python process runs
#: usefully (a smaller cap made 512 agent threads of one process queue for connections, each
#: queued thread waiting behind the others' GIL-bound round trips, and time out). Beyond it,
#: calls wait (up to ``operation_timeout``) for a free connection instead of failing.
DEFAULT_MAX_CONNECTIONS = 1024
#: Log entries one poll script scans at most.
_WATCH_BATCH = 256
#: What Redis 7 appends to an error raised by a script.
_SCRIPT_SUFFIX = re.compile(r"\s*script: \w+, on @user_script:\d+\.?\s*$")
#: What deleting a corrupt bookkeeping key costs (for the error message).
_AFTER_DELETE = {
    "#rev": "nothing is lost without it (revisions go on after the log's last)",
    "#epoch": "nothing is lost without it",
    "#log": "without it, the event history is lost: watchers get HistoryCompacted and re-read",
    "#ttl": "without it, keys with a TTL expire in Redis alone, each recorded when a client next touches it",
    "#last": "nothing is lost without it (watches read the log until the next write starts it again)",
}
#: Largest value accepted (bytes). The value is held twice (data + log), so 64 MiB, not Redis' 512 MiB.
MAX_VALUE_BYTES = 64 * 1024 * 1024
#: OpenSSL verify codes X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH.
_NAME_MISMATCH = (62, 64)

CAPABILITIES = Capabilities(
    multi_host=True,
    server_side_ttl=True,
    native_watch=True,
    persistent=True,
    tls=True,
    auth=True,
    max_value_bytes=MAX_VALUE_BYTES,
    # A watcher sleeps until the next deadline (server clock) and records the expiry
    # itself: measured lateness is a few ms on loopback; 0.1 s covers a loaded host.
    ttl_resolution=0.1,
)


# -- configuration -----------------------------------------------------------------------------
class TLSFiles:
    """Validated TLS settings of a ``rediss://`` URL.

    Args:
        cacert: CA bundle (PEM path) to verify the server against; ``None`` uses the system's CAs.
        cert: client certificate (PEM path), or ``None``; needs ``key``.
        key: the client certificate's private key (PEM path), or ``None``; needs ``cert``.

    Raises:
        InvalidURLError: naming ``cacert``, ``cert`` or ``key`` when a file is missing,
            unreadable or not what it should be, or ``cert``/``key`` comes without the other.
    """

    def __init__(self, cacert: str | None = None, cert: str | None = None, key: str | None = None) -> None:
        if cert is not None and key is None:
            raise InvalidURLError("key", None, "'cert' needs 'key' (the client certificate's private key file)")
        if key is not None and cert is None:
            raise InvalidURLError("cert", None, "'key' needs 'cert' (the client certificate file)")
        for name, path in (("cacert", cacert), ("cert", cert), ("key", key)):
            if path is not None and not os.path.isfile(path):
                raise InvalidURLError(name, path, "no such file")
            if path is not None and not os.access(path, os.R_OK):
                raise InvalidURLError(name, path, "file not readable")
        context = ssl.create_default_context()
        if cacert is not None:
            try:
                context.load_verify_locations(cafile=cacert)
            except (ssl.SSLError, ValueError) as exc:
                raise InvalidURLError("cacert", cacert, f"not a PEM CA bundle ({exc})") from None
        if cert is not None and key is not None:
            with open(cert, "rb") as f:
                if b"-----BEGIN CERTIFICATE-----" not in f.read():
                    raise InvalidURLError("cert", cert, "no PEM certificate in this file")
            try:
                context.load_cert_chain(cert, key)
            except (ssl.SSLError, ValueError) as exc:
                raise InvalidURLError("key", key, f"not the private key of 'cert' ({exc})") from None
        self.cacert, self.cert, self.key = cacert, cert, key

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``redis.Redis``: TLS on, certificate and host name verified."""
        return {"ssl": True, **self.connection_kwargs()}

    def connection_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``redis.SSLConnection`` (a pool's): certificate and host name verified."""
        return {
            "ssl_cert_reqs": "required",
            "ssl_check_hostname": True,
            "ssl_ca_certs": self.cacert,
            "ssl_certfile": self.cert,
            "ssl_keyfile": self.key,
        }


def namespace_prefix(namespace: str | None) -> str:
    """The Redis key prefix of a namespace: ``"rdzv:"``, or ``"rdzv:" + quote(namespace) + ":"``."""
    if namespace is None:
        return "rdzv:"
    return "rdzv:" + urllib.parse.quote(namespace, safe="") + ":"


class _ErrorMap:
    """How one server's redis-py errors become :mod:`rdzv_core.errors` (for a backend and its listener)."""

    def __init__(self, host: str, port: int, db: int, tls: TLSFiles | None, operation_timeout: float,
                 max_connections: int, prefix: str, username: str | None = None,
                 password_given: bool = True) -> None:
        import redis

        self.errors = redis.exceptions
        self.host, self.port, self.db, self.tls = host, port, db, tls
        self.username, self.password_given = username, password_given
        self.operation_timeout, self.max_connections, self.prefix = operation_timeout, max_connections, prefix

    def map(self, exc: Exception, key: str | None) -> RdzvError | None:
        """The error of :mod:`rdzv_core.errors` for a redis-py one (``None``: not redis-py's)."""
        errors = self.errors
        where = f"redis at {self.host}:{self.port}"
        text = str(exc)
        if isinstance(exc, errors.AuthenticationError):
            user = self.username if self.username is not None else "default"
            if not self.password_given:
                return InvalidURLError("password", None, f"{where} needs a password and the URL gives none (user "
                                       f"{user!r}): write redis://[USER]:PASSWORD@HOST ({text})")
            return InvalidURLError("password", "***", f"{where} rejected user {user!r} with the given password: "
                                   f"{text}")
        if isinstance(exc, errors.TimeoutError):
            return BackendTimeout(f"{where} did not answer within operation_timeout={self.operation_timeout}s: "
                                  f"{text}", key)
        if isinstance(exc, errors.ConnectionError):
            verify = _find_cause(exc, ssl.SSLCertVerificationError)
            if verify is not None and verify.verify_code in _NAME_MISMATCH:
                return InvalidURLError("host", self.host, f"the TLS certificate of {where} is not issued for "
                                       f"this name: {verify.verify_message}")
            if verify is not None:
                return InvalidURLError("cacert", self.tls.cacert if self.tls else None,
                                       f"the TLS certificate of {where} did not verify: "
                                       f"{verify.verify_message or verify}")
            if "Invalid Database" in text:
                return InvalidURLError("db", self.db, f"{where} has no such database")
            if "No connection available" in text:
                return BackendTimeout(f"all max_connections={self.max_connections} connections to {where} stayed "
                                      f"busy for operation_timeout={self.operation_timeout}s", key)
            return BackendConnectionError(f"cannot reach {where}: {text}", key)
        if isinstance(exc, errors.ReadOnlyError):
            return BackendConnectionError(f"{where} cannot serve writes now (a replica?): {text}", key)
        if isinstance(exc, errors.ResponseError) and "DB index is out of range" in text:
            return InvalidURLError("db", self.db, f"{where} has no such database")
        if isinstance(exc, errors.ResponseError) and text.startswith("CORRUPT "):
            return self.corrupt(_SCRIPT_SUFFIX.sub("", text))
        if isinstance(exc, errors.ResponseError) and "WRONGTYPE" in text:
            # Only where no check of ours ran first: some key of the namespace holds another type.
            return CorruptEntry(f"{where}: a Redis key of namespace {self.prefix!r} holds another type than "
                                f"this backend wrote there ({text}); see the module docs, 'Corrupt storage'", None)
        if isinstance(exc, errors.RedisError):
            return KVError(f"{where} answered with an error: {text}", key)
        return None

    def corrupt(self, text: str) -> CorruptEntry:
        """The :class:`CorruptEntry` for a script's ``CORRUPT KEY|BOOK|MEMBER ...`` error; for the
        bookkeeping, the message ends with the ``redis-cli`` command that removes the bad data."""
        kind, _, rest = text[len("CORRUPT "):].partition(" ")
        name, _, why = rest.partition(" ")
        where = f"redis at {self.host}:{self.port}"
        if kind == "KEY":
            redis_key = self.prefix + "k/" + name
            return CorruptEntry(f"{where}: key {name!r} (Redis key {redis_key!r}) {why}: not written by rdzv; "
                                f"delete the key (KVBackend.delete, or `rdzv reset`)", name)
        cli = f"redis-cli -h {self.host} -p {self.port} -n {self.db}"
        if kind == "MEMBER":
            hex_member, _, why = why.partition(" ")
            member = bytes.fromhex(hex_member) if hex_member != "-" else b""
            printable = member.isascii() and member.decode().isprintable()
            fix = (f"ZREM {shlex.quote(name)} {shlex.quote(member.decode())}" if printable
                   else f"DEL {shlex.quote(name)}")
            return CorruptEntry(f"{where}: this backend's bookkeeping key {name!r} holds the member {member!r}, "
                                f"which {why}: not written by rdzv; remove it: {cli} {fix}", None)
        if name[len(self.prefix):] == "#keys":  # the index cannot be rebuilt: clear the whole namespace
            pattern = shlex.quote(self.prefix.replace("*", "\\*") + "*")
            return CorruptEntry(f"{where}: this backend's bookkeeping key {name!r} {why}: not written by rdzv; "
                                f"it indexes every key of the namespace and cannot be rebuilt, so delete the whole "
                                f"namespace (every run in it): {cli} --scan --pattern {pattern} | xargs {cli} DEL",
                                None)
        cost = _AFTER_DELETE.get(name[len(self.prefix):], "")
        return CorruptEntry(f"{where}: this backend's bookkeeping key {name!r} {why}: not written by rdzv; "
                            f"{cost}; delete it: {cli} DEL {shlex.quote(name)}", None)



# -- the backend -------------------------------------------------------------------------------
class RedisBackend(KVBackend):
    """The KV protocol on one Redis server; see the module docstring for the layout and algorithms.

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

    Raises:
        BackendConnectionError: the server refused or dropped the connection (``open`` pings).
        BackendTimeout: the server did not answer within ``operation_timeout``.
        InvalidURLError: the server rejected the password (``password``) or the database
            number (``db``), or its TLS certificate did not verify (``cacert``) or was issued
            for another name (``host``).
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
    ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors = redis.exceptions
        self._errmap = _ErrorMap(host, port, db, tls, operation_timeout, max_connections, namespace_prefix(namespace),
                                 username, password is not None)
        self.host, self.port, self.db = host, port, db
        self.username = username
        self.namespace = namespace
        self.operation_timeout = operation_timeout
        self.tls = tls
        self.max_connections = max_connections
        ns = namespace_prefix(namespace)
        self.prefix = ns
        self._data = ns + "k/"
        self._index_keys = [ns + "#rev", ns + "#log", ns + "#keys", ns + "#ttl", ns + "#epoch", ns + "#last"]
        self._scratch = ns + "#add"
        #: How every connection is made: this backend's pool and its listener's (class, kwargs).
        connection_class = redis.SSLConnection if tls is not None else redis.Connection
        self._connection_args: tuple[type[Any], dict[str, Any]] = (connection_class, dict(
            host=host,
            port=port,
            db=db,
            username=username,
            # AUTH needs a password with a user; any works for a ``nopass`` user.
            password="" if password is None and username is not None else password,
            socket_timeout=operation_timeout,
            socket_connect_timeout=operation_timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            # RESP2: pub/sub messages arrive as plain replies, and redis-py 8's RESP3 default would
            # add "maintenance notifications" that relax socket timeouts (operation_timeout is ours).
            protocol=2,
            # No CLIENT SETINFO: two round trips per new connection, and redis-py reads its own
            # package metadata for it (about 1 ms of CPU each) — the listener is a new connection.
            driver_info=None,
            **(tls.connection_kwargs() if tls is not None else {}),
        ))
        self._pool = _Pool(lambda: connection_class(**self._connection_args[1]), max_connections, operation_timeout)
        self._scripts = {name: _Script(_PRELUDE + body) for name, body in _SCRIPTS.items()}
        self._notifier = _Notifier.of(self)
        try:
            with self._translate(None):
                self._call("PING")
        except BaseException:
            self._notifier.release(self)
            self._pool.close()
            raise
        log.debug("opened %r", self)

    def __repr__(self) -> str:
        scheme = "rediss" if self.tls is not None else "redis"
        user = f"{self.username}@" if self.username else ""
        return f"RedisBackend('{scheme}://{user}{self.host}:{self.port}', db={self.db}, prefix={self.prefix!r})"

    # -- plumbing ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _translate(self, key: str | None) -> Iterator[None]:
        """Map redis-py errors onto :mod:`rdzv_core.errors`; anything raised by a call that
        :meth:`close` cut short becomes :class:`~rdzv_core.errors.BackendClosed`."""
        try:
            yield
        except Exception as exc:
            if self._closed:
                raise BackendClosed(f"{type(self).__name__} was closed during the call", key) from exc
            mapped = self._errmap.map(exc, key)
            if mapped is None:
                raise
            raise mapped from (None if isinstance(mapped, (InvalidURLError, CorruptEntry)) else exc)

    def _call(self, *command: Any) -> Any:
        """Send one command on a pooled connection and return the server's raw (RESP2) reply.

        redis-py's errors propagate (callers translate them); a connection that failed other
        than by an error reply is disconnected (it reconnects when next used)."""
        budget = call_budget(self.operation_timeout)
        conn = self._pool.acquire(budget)
        short = budget < self.operation_timeout  # the caller's deadline (rdzv_core.kv.deadline) is sooner
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
            reply = conn.read_response()
            if short and conn._sock is not None:
                conn._sock.settimeout(self.operation_timeout)
            return reply
        except self._errors.ResponseError:
            if short and conn._sock is not None:
                conn._sock.settimeout(self.operation_timeout)
            raise  # an error reply: the connection is in step
        except BaseException:
            conn.disconnect()
            raise
        finally:
            self._pool.release(conn)

    def _run(self, name: str, key: str | None, *args: Any, extra_key: str | None = None) -> Any:
        keys = self._index_keys + ([extra_key] if extra_key is not None else [])
        script = self._scripts[name]
        with self._translate(key):
            try:
                return self._call("EVALSHA", script.sha, len(keys), *keys, self.prefix, HISTORY_LIMIT, *args)
            except self._errors.NoScriptError:  # a new or restarted server: load it, once per server
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
            raise KeyNotFound(f"key {key!r} not found (expired or deleted)", key)
        return None if ms < 0 else ms / 1000.0

    def _do_get(self, key: str) -> Entry | None:
        with self._translate(key):
            try:
                flat = cast("list[bytes]", self._call("HGETALL", self._data + key))
            except self._errors.ResponseError as exc:
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
            raise KeyExists(f"key {key!r} exists (revision {rev})", key)
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
            raise KeyNotFound(f"key {key!r} not found (expired or deleted)", key)

    def _do_add(self, key: str, delta: int) -> int:
        if not _INT64[0] <= delta <= _INT64[1]:
            raise KVError(f"add({key!r}, {delta}): Redis counters are 64-bit signed integers", key)
        result = self._run("add", key, key, delta, extra_key=self._scratch)
        if result[0] == 0:
            raise CorruptEntry(f"value at {key!r} is not a decimal integer (add stores ASCII decimal); "
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
        try:
            if timeout > 0:
                waiter, start = self._notifier.begin(self, prefix, after)
                covered = waiter is not None
            while not self._closed:
                if start is not None:
                    if waiter is not None:
                        waiter.wake.clear()  # from here on, a wake-up means: poll again
                        hint, heard = self._notifier.take_hint(waiter)
                        if woken and covered and hint and heard and not any(
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
                    # history still reaches `after` (HistoryCompacted if the server lost its data).
                    result = self._run("poll", prefix, after_revision, prefix, 1, after)
                    if result[0] == -1:
                        raise _history_lost(prefix, after_revision, result[1].decode(), int(result[2]))
                    return [_event(item) for item in result[3]]
                start, woken = after, True
            return []
        except BackendClosed:
            return []  # close() ended the watch
        finally:
            if waiter is not None:
                self._notifier.remove(waiter)

    def _do_close(self) -> None:
        self._notifier.release(self)
        self._pool.close()


# -- connections -------------------------------------------------------------------------------
class _Script:
    """A Lua script's text and SHA-1 (what ``EVALSHA`` names it by)."""

    __slots__ = ("text", "sha")

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


# -- helpers -----------------------------------------------------------------------------------
def _ttl_ms(ttl: float | None) -> str:
    """A TTL in whole milliseconds (at least 1) as the scripts take it; ``""`` for none."""
    return "" if ttl is None else str(max(1, round(ttl * 1000)))


def _check_compare(key: str, expected: int, result: Sequence[Any]) -> None:
    if result[0] == 0:
        raise KeyNotFound(f"key {key!r} not found", key)
    if result[0] == 1:
        actual = int(result[1])
        raise CompareFailed(f"key {key!r} is at revision {actual}, not {expected}", key, expected, actual)


def _event(item: Sequence[Any]) -> Event:
    rev, kind, key = int(item[0]), item[1], item[2].decode()
    if kind == b"p":
        return Event(EventType.PUT, key, rev, item[3])
    return Event(EventType.DELETE, key, rev)


def _history_lost(prefix: str, after: int, why: str, revision: int) -> HistoryCompacted:
    if why == "trimmed":
        detail = f"the log was trimmed (next kept: {revision})"
    elif why == "ahead":
        detail = f"the server's revision is {revision}, behind it: it lost data (restart without persistence?)"
    else:
        detail = f"this history began at revision {revision}: the server lost the one before"
    return HistoryCompacted(f"events after revision {after} are gone: {detail}; re-read", prefix)


def _find_cause(exc: BaseException, kind: type[BaseException]) -> Any:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, kind):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


# -- plugin ------------------------------------------------------------------------------------
_TLS_KEYS = ("cacert", "cert", "key")


def _open(url: RendezvousURL) -> RedisBackend:
    """Open a :class:`RedisBackend` for a parsed ``redis://`` / ``rediss://`` URL.

    Raises:
        InvalidURLError: more than one host; TLS options without ``rediss``; a TLS file problem.
        UnknownBackendError: redis-py is not installed.
        BackendUnavailable: see :class:`RedisBackend`.
    """
    if len(url.hosts) != 1:
        raise InvalidURLError(
            "host", ",".join(f"{h}:{p}" for h, p in url.hosts),
            "Redis takes one host: one server endpoint (Sentinel and Cluster are not supported; for a replicated "
            "backend use etcd: README, 'High availability')",
        )
    try:
        import redis  # noqa: F401  (the client, imported only when a redis URL is opened)
    except ImportError:
        raise UnknownBackendError(
            "scheme", url.scheme, "needs the redis-py client, which is not installed: pip install 'rdzv[redis]'"
        ) from None
    host, port = url.hosts[0]
    params = url.params
    tls = None
    if url.scheme == "rediss":
        tls = TLSFiles(params.get("cacert"), params.get("cert"), params.get("key"))
    else:
        for name in _TLS_KEYS:
            if name in params:
                raise InvalidURLError(name, params[name], "TLS options need the rediss:// scheme")
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
    )


QUERY_KEYS = {
    "db": lambda f, v: to_int(f, v, 0),
    "max_connections": lambda f, v: to_int(f, v, 1),
    "namespace": to_str,
    "cacert": to_str,
    "cert": to_str,
    "key": to_str,
}


#: Registers ``redis://`` and ``rediss://`` through the ``rdzv`` entry point.
plugin = backend_plugin(
    BackendSpec(
        schemes=("redis", "rediss"),
        open=_open,
        capabilities=CAPABILITIES,
        default_port=DEFAULT_PORT,
        query_keys=QUERY_KEYS,
        requires_host=True,
        description="agents on many hosts, one Redis server endpoint (Lua scripts, stream log, server-side TTLs; "
                    "rediss:// for TLS)",
    )
)
