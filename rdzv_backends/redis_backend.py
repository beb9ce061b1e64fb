"""``redis://`` and ``rediss://`` — the KV protocol on one Redis server (redis-py).

URL::

    redis://[USER[:PASSWORD]@]HOST[:PORT]/RUN_ID?db=N&namespace=NAME&operation_timeout=S
    rediss://[USER[:PASSWORD]@]HOST[:PORT]/RUN_ID?cacert=CA.pem&cert=CLIENT.pem&key=CLIENT.key

The port defaults to 6379. ``rediss`` speaks TLS and verifies the server's
certificate and host name (against ``cacert``, else the system's CAs); ``cert``
and ``key`` (both or neither) present a client certificate. TLS options on a
``redis://`` URL are an error, never a silent plain-text connection. One host
only: Sentinel and Cluster are not supported. ``operation_timeout`` (seconds,
default 10) bounds every call: it is the socket connect and read timeout, and
redis-py's own retries are turned off, so nothing multiplies it.

Layout. Every key of one backend lives under the *namespace* ``rdzv:``, or
``rdzv:NAME:`` with ``NAME`` percent-escaped (``urllib.parse.quote(NAME, safe="")``,
so it holds no ``:``, ``/`` or ``#`` and no namespace can reach another's keys;
store keys only ever follow the ``k/`` marker)::

    NS#rev          string   the last revision issued
    NS#epoch        string   the first revision of this history (set when #rev was missing)
    NS#log          stream   one entry per revision, ID ``REV-0``: t=p|d, k=KEY, p=PREVIOUS REV[, v=VALUE]
    NS#keys         zset     every live (or not yet recorded as expired) key, score 0 (lex order)
    NS#ttl          zset     key -> its deadline, server clock in ms (the key's PEXPIREAT)
    NS#add          string   scratch for exact 64-bit arithmetic in ``add``
    NSk/KEY         hash     v=VALUE, r=REVISION; PEXPIREAT when it has a TTL

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
once, whoever notices it first. ``get`` is a plain ``HMGET`` (Redis never
returns an expired key), ``list`` sweeps, so the revision it returns already
counts every expiry it hides.

Watch. ``watch`` runs a *poll* script (sweep, check history, return the
matching events after the caller's revision) and, when nothing matches, blocks
in ``XREAD BLOCK`` on the log — which any new event wakes at once — but no
longer than the next deadline in ``#ttl`` (the script returns it relative to
the server's clock), so a watcher is awake when a key is due and its sweep
records the expiry. Redis resolves a blocking command's own timeout only on
its cron tick (up to 100 ms late at the default ``hz 10``), so the block ends
:data:`_BLOCK_SLACK` (0.12 s) early and the last stretch before a deadline is
waited in 20 ms client-side steps, each followed by a poll. Measured on
loopback: a change wakes a watcher in about 1 ms, an expiry is seen 2-15 ms
after its TTL. No keyspace notifications, pub/sub or ``CONFIG`` rights are
needed, and no client clock decides an expiry (the client only measures the
server-given interval). An expiry is recorded when the first client (watcher
or writer) runs a script after the deadline; until one does, the key is
already invisible to ``get``/``list``.

Counters. ``add`` accepts a stored value of ``-?[0-9]{1,30}`` (as
:func:`~rdzv_core.kv.parse_counter`) and adds with ``INCRBY``: exact, and a
:class:`~rdzv_core.errors.KVError` if the sum leaves the 64-bit range (c10d's
counters are 64-bit too). Values up to :data:`MAX_VALUE_BYTES` (64 MiB) are
accepted; each is held twice while its event is in the log.

Closing. :meth:`RedisBackend.close` shuts the connection of every watch blocked
in ``XREAD``, so those watches return ``[]`` at once.

Server requirements: Redis >= 6.2 (7.0 tested). Use AOF persistence
(``appendonly yes``) so a restart keeps the keyspace and its history; without
it a restart loses both, and watchers from the old history get
``HistoryCompacted``. Use a ``maxmemory-policy`` of ``noeviction`` (an evicted
key is reported as deleted). An ACL user needs its keys and these commands::

    ACL SETUSER agent on >PASSWORD resetkeys ~rdzv:* resetchannels
        -@all +ping +evalsha +script|load +hmget +xread
        +time +get +set +incr +incrby +del +exists +hget +hset +persist +pexpireat
        +zadd +zrem +zscore +zrange +zrangebylex +zrangebyscore +xadd +xrange
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import ssl
import threading
import time
import urllib.parse
from typing import TYPE_CHECKING, Any, Iterator, Sequence, cast

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
    RdzvError,
    UnknownBackendError,
)
from rdzv_core.kv import Capabilities, Entry, Event, EventType, KVBackend
from rdzv_core.plugins import BackendSpec, backend_plugin
from rdzv_core.url import RendezvousURL, to_int, to_str

if TYPE_CHECKING:
    import redis

__all__ = [
    "RedisBackend",
    "TLSFiles",
    "CAPABILITIES",
    "HISTORY_LIMIT",
    "MAX_VALUE_BYTES",
    "DEFAULT_PORT",
    "DEFAULT_OPERATION_TIMEOUT",
    "namespace_prefix",
    "plugin",
]

log = logging.getLogger(__name__)

DEFAULT_PORT = 6379
#: Seconds a call may take when the URL sets no ``operation_timeout``.
DEFAULT_OPERATION_TIMEOUT = 10.0
#: Events kept in the log stream (``XADD ... MAXLEN ~``; Redis may keep a few more).
HISTORY_LIMIT = 10_000
#: Log entries one poll script scans at most.
_WATCH_BATCH = 256
#: Redis resolves a blocking command's timeout on its cron tick (1/hz: 100 ms at the default
#: hz 10), so an ``XREAD BLOCK`` is made to end this many seconds before a watch's deadline or
#: the next TTL deadline, and the rest is waited in :data:`_SLICE` steps, each followed by a poll.
_BLOCK_SLACK = 0.12
_SLICE = 0.02
#: Largest value accepted (bytes). The value is held twice (data + log), so 64 MiB, not Redis' 512 MiB.
MAX_VALUE_BYTES = 64 * 1024 * 1024
_INT64 = (-(2**63), 2**63 - 1)
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

# -- Lua ---------------------------------------------------------------------------------------
# KEYS: 1 #rev, 2 #log, 3 #keys, 4 #ttl, 5 #epoch, [6 data hash of the key | #add]
# ARGV: 1 data-key prefix ("NSk/"), 2 log cap, 3.. per script.
_PRELUDE = r"""
local REV, LOG, IDX, TTL, EPOCH = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local DATA, MAXLEN = ARGV[1], ARGV[2]
local clock = redis.call('TIME')
local NOW_US = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local now = math.floor(NOW_US / 1000)

-- The next revision: one more than the last, and never behind the server's clock (us).
-- The event goes to the log under it (stream ID REV-0) with p = the revision before it.
local function emit(kind, key, value)
  local prev = tonumber(redis.call('GET', REV) or '0')
  local rev = string.format('%d', math.max(prev + 1, NOW_US))
  redis.call('SET', REV, rev)
  if prev == 0 then redis.call('SET', EPOCH, rev) end
  local id, p = rev .. '-0', string.format('%d', prev)
  if value then
    redis.call('XADD', LOG, 'MAXLEN', '~', MAXLEN, id, 't', kind, 'k', key, 'p', p, 'v', value)
  else
    redis.call('XADD', LOG, 'MAXLEN', '~', MAXLEN, id, 't', kind, 'k', key, 'p', p)
  end
  return rev
end

-- Delete a key and record it, once: it leaves both indexes in the same script.
local function drop(key)
  redis.call('DEL', DATA .. key)
  redis.call('ZREM', IDX, key)
  redis.call('ZREM', TTL, key)
  return emit('d', key)
end

-- Every key whose deadline (server clock, ms) has passed expires now, in deadline order.
local function sweep()
  local due = redis.call('ZRANGEBYSCORE', TTL, '-inf', string.format('%d', now), 'LIMIT', 0, 1000)
  for _, key in ipairs(due) do drop(key) end
end

-- Indexed but without data: Redis itself expired or evicted it; record that once.
local function reap(key)
  if redis.call('EXISTS', DATA .. key) == 0 and redis.call('ZSCORE', IDX, key) then drop(key) end
end

local function write(key, value, ttl_ms)
  local rev = emit('p', key, value)
  local dk = DATA .. key
  redis.call('HSET', dk, 'v', value, 'r', rev)
  redis.call('ZADD', IDX, 0, key)
  if ttl_ms == '' then
    redis.call('PERSIST', dk)
    redis.call('ZREM', TTL, key)
  else
    local at = string.format('%d', now + tonumber(ttl_ms))
    redis.call('PEXPIREAT', dk, at)
    redis.call('ZADD', TTL, at, key)
  end
  return rev
end

sweep()
"""

# ARGV 3 key, 4 value, 5 ttl ms or ''. -> {0, rev} exists | {1, rev} written
_CREATE = r"""
local key = ARGV[3]
reap(key)
local cur = redis.call('HGET', DATA .. key, 'r')
if cur then return {0, cur} end
return {1, write(key, ARGV[4], ARGV[5])}
"""

# ARGV 3 key, 4 value, 5 ttl ms or ''. -> rev
_PUT = r"""
local key = ARGV[3]
reap(key)
return write(key, ARGV[4], ARGV[5])
"""

# ARGV 3 key, 4 value, 5 ttl ms or '', 6 expected rev. -> {0} absent | {1, rev} differs | {2, rev} written
_CAS = r"""
local key = ARGV[3]
reap(key)
local cur = redis.call('HGET', DATA .. key, 'r')
if not cur then return {0} end
if cur ~= ARGV[6] then return {1, cur} end
return {2, write(key, ARGV[4], ARGV[5])}
"""

# ARGV 3 key, 4 expected rev. -> {0} absent | {1, rev} differs | {2, rev} deleted
_CAD = r"""
local key = ARGV[3]
reap(key)
local cur = redis.call('HGET', DATA .. key, 'r')
if not cur then return {0} end
if cur ~= ARGV[4] then return {1, cur} end
return {2, drop(key)}
"""

# ARGV 3 key. -> 0 absent | 1 deleted
_DELETE = r"""
local key = ARGV[3]
reap(key)
if redis.call('EXISTS', DATA .. key) == 0 then return 0 end
drop(key)
return 1
"""

# ARGV 3 key, 4 ttl ms. -> 0 absent | 1 refreshed (value, revision unchanged, no event)
_REFRESH = r"""
local key = ARGV[3]
reap(key)
local dk = DATA .. key
if redis.call('EXISTS', dk) == 0 then return 0 end
local at = string.format('%d', now + tonumber(ARGV[4]))
redis.call('PEXPIREAT', dk, at)
redis.call('ZADD', TTL, at, key)
return 1
"""

# KEYS 6 scratch. ARGV 3 key, 4 delta. -> {0} not an integer | {1, err} out of range | {2, sum}
# The stored value must be ASCII decimal, -?[0-9]{1,30} (rdzv_core.kv.parse_counter); the sum is
# computed by INCRBY, so it is exact and must stay within 64 bits.
_ADD = r"""
local key = ARGV[3]
reap(key)
local dk = DATA .. key
local raw = redis.call('HGET', dk, 'v')
local base = '0'
if raw then
  local sign, digits = string.match(raw, '^(%-?)(%d+)$')
  if not digits or #digits > 30 then return {0} end
  digits = string.gsub(digits, '^0+', '')
  if digits == '' then base = '0' else base = sign .. digits end
end
local scratch = KEYS[6]
redis.call('SET', scratch, base)
local res = redis.pcall('INCRBY', scratch, ARGV[4])
local sum = redis.call('GET', scratch)
redis.call('DEL', scratch)
if type(res) == 'table' and res.err then return {1, res.err} end
local rev = emit('p', key, sum)
redis.call('HSET', dk, 'v', sum, 'r', rev)
redis.call('ZADD', IDX, 0, key)
return {2, sum}
"""

# ARGV 3 prefix ('' for all). -> {revision, {key, value, rev, key, value, rev, ...}}
_LIST = r"""
local prefix = ARGV[3]
local keys
if prefix == '' then
  keys = redis.call('ZRANGE', IDX, 0, -1)
else
  keys = redis.call('ZRANGEBYLEX', IDX, '[' .. prefix, '(' .. prefix .. '\255')
end
local out = {}
for _, key in ipairs(keys) do
  local vr = redis.call('HMGET', DATA .. key, 'v', 'r')
  if vr[1] then
    out[#out + 1] = key; out[#out + 1] = vr[1]; out[#out + 1] = vr[2]
  else
    reap(key)
  end
end
return {redis.call('GET', REV) or '0', out}
"""

# ARGV 3 after (revision), 4 prefix, 5 batch. -> {-1, why, revision} history gone
# | {last scanned rev, number scanned, ms to the next TTL deadline or -1, {{rev, t, key[, value]}, ...}}
_POLL = r"""
local after = tonumber(ARGV[3])
local counter = tonumber(redis.call('GET', REV) or '0')
local epoch = tonumber(redis.call('GET', EPOCH) or '0')
if after > counter then return {-1, 'ahead', string.format('%d', counter)} end
if after > 0 and after < epoch - 1 then return {-1, 'before', string.format('%d', epoch)} end
local entries = redis.call('XRANGE', LOG, string.format('%d-0', after + 1), '+', 'COUNT', tonumber(ARGV[5]))
if entries[1] then
  -- Its predecessor is later than `after`: the events between were trimmed (or lost).
  if tonumber(entries[1][2][6]) > after then return {-1, 'trimmed', string.match(entries[1][1], '^(%d+)')} end
elseif counter > after then
  return {-1, 'trimmed', string.format('%d', counter)}
end
local prefix = ARGV[4]
local out = {}
local last = string.format('%d', after)
for _, e in ipairs(entries) do
  last = string.match(e[1], '^(%d+)')
  local f = e[2]
  if string.sub(f[4], 1, #prefix) == prefix then out[#out + 1] = {last, f[2], f[4], f[8]} end
end
local wake = -1
local nxt = redis.call('ZRANGE', TTL, 0, 0, 'WITHSCORES')
if nxt[1] then wake = math.max(tonumber(nxt[2]) - now, 0) end
return {last, #entries, wake, out}
"""

_SCRIPTS = {
    "create": _CREATE,
    "put": _PUT,
    "cas": _CAS,
    "cad": _CAD,
    "delete": _DELETE,
    "refresh": _REFRESH,
    "add": _ADD,
    "list": _LIST,
    "poll": _POLL,
}


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
        return {
            "ssl": True,
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
        operation_timeout: seconds any call may take (connect, and each reply).
        tls: :class:`TLSFiles` to speak TLS, or ``None`` for plain TCP.

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
    ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors = redis.exceptions
        self.host, self.port, self.db = host, port, db
        self.username = username
        self.namespace = namespace
        self.operation_timeout = operation_timeout
        self.tls = tls
        ns = namespace_prefix(namespace)
        self.prefix = ns
        self._data = ns + "k/"
        self._index_keys = [ns + "#rev", ns + "#log", ns + "#keys", ns + "#ttl", ns + "#epoch"]
        self._scratch = ns + "#add"
        # XREAD BLOCK must return before the socket timeout fires.
        self._block_cap = operation_timeout / 2
        self._lock = threading.Lock()
        self._blocked: set[Any] = set()  # connections in XREAD BLOCK, shut by close()
        self._client: redis.Redis = redis.Redis(
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
            **(tls.client_kwargs() if tls is not None else {}),
        )
        self._scripts = {name: self._client.register_script(_PRELUDE + body) for name, body in _SCRIPTS.items()}
        try:
            with self._translate(None):
                self._client.ping()
        except BaseException:
            self._client.close()
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
            mapped = self._map_error(exc, key)
            if mapped is None:
                raise
            raise mapped from (None if isinstance(mapped, InvalidURLError) else exc)

    def _map_error(self, exc: Exception, key: str | None) -> RdzvError | None:
        errors = self._errors
        where = f"redis at {self.host}:{self.port}"
        text = str(exc)
        if isinstance(exc, errors.AuthenticationError):
            return InvalidURLError("password", "***", f"{where} rejected the user/password: {text}")
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
            return BackendConnectionError(f"cannot reach {where}: {text}", key)
        if isinstance(exc, errors.ReadOnlyError):
            return BackendConnectionError(f"{where} cannot serve writes now (a replica?): {text}", key)
        if isinstance(exc, errors.ResponseError) and "DB index is out of range" in text:
            return InvalidURLError("db", self.db, f"{where} has no such database")
        if isinstance(exc, errors.RedisError):
            return KVError(f"{where} answered with an error: {text}", key)
        return None

    def _run(self, name: str, key: str | None, *args: Any, extra_key: str | None = None) -> Any:
        keys = self._index_keys + ([extra_key] if extra_key is not None else [])
        with self._translate(key):
            return self._scripts[name](keys=keys, args=[self._data, HISTORY_LIMIT, *args])

    def _run_key(self, name: str, key: str, *args: Any) -> Any:
        return self._run(name, key, key, *args, extra_key=self._data + key)

    # -- the protocol --------------------------------------------------------------------------
    def _do_get(self, key: str) -> Entry | None:
        with self._translate(key):
            value, rev = self._client.hmget(self._data + key, "v", "r")
        if value is None:
            return None
        return Entry(key, cast(bytes, value), int(cast(bytes, rev)))

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
            raise KVError(f"value at {key!r} is not a decimal integer", key)
        if result[0] == 1:
            raise KVError(f"add({key!r}, {delta}) leaves the 64-bit range: {result[1]}", key)
        return int(result[1])

    def _do_watch(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        deadline = time.monotonic() + timeout
        after = after_revision
        try:
            while True:
                result = self._run("poll", prefix, after, prefix, _WATCH_BATCH)
                if result[0] == -1:
                    raise _history_lost(prefix, after, result[1].decode(), int(result[2]))
                last, scanned, wake_ms, matched = result
                if matched:
                    return [_event(item) for item in matched]
                after = int(last)
                if scanned >= _WATCH_BATCH and not self._closed:
                    continue  # more history to scan (at most HISTORY_LIMIT entries), even at timeout 0
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return []
                until = remaining if wake_ms < 0 else min(remaining, wake_ms / 1000)
                if until > _BLOCK_SLACK:
                    # XREAD returns at once on a new event; its own timeout may fire up to 1/hz late,
                    # so it ends _BLOCK_SLACK early and the rest is waited in short slices.
                    block_ms = max(1, math.floor(min(until - _BLOCK_SLACK, self._block_cap) * 1000))
                    with self._translate(prefix):
                        self._wait_for_log(after, block_ms)
                else:
                    time.sleep(min(until, _SLICE))
        except BackendClosed:
            return []  # close() ended the watch

    def _wait_for_log(self, after: int, block_ms: int) -> None:
        """``XREAD BLOCK`` until the log has an entry after ``after`` or ``block_ms`` pass.

        The command is sent under ``_lock`` and its connection registered there, so
        :meth:`close` either comes first (nothing is sent) or finds the connection and
        shuts it, which ends the blocked read at once.
        """
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            with self._lock:
                if self._closed:
                    raise BackendClosed(f"{type(self).__name__} is closed")
                self._blocked.add(conn)
                conn.send_command("XREAD", "COUNT", 1, "BLOCK", block_ms, "STREAMS", self._index_keys[1],
                                  f"{after}-0")
            conn.read_response()
        except BaseException:
            conn.disconnect()  # a reply may still be on its way: never reuse this connection
            raise
        finally:
            with self._lock:
                self._blocked.discard(conn)
            pool.release(conn)

    def _do_close(self) -> None:
        with self._lock:
            for conn in self._blocked:
                conn.disconnect()
        self._client.close()
        self._client.connection_pool.disconnect(inuse_connections=True)


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
            "Redis takes one host (Sentinel and Cluster are not supported)",
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
    )


QUERY_KEYS = {
    "db": lambda f, v: to_int(f, v, 0),
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
        description="one Redis server (Lua scripts, stream log, server-side TTLs; rediss:// for TLS)",
    )
)
