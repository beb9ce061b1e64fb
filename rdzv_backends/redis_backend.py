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
for a free connection (redis-py's ``BlockingConnectionPool``) rather than fail.

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
    NSk/KEY         hash     v=VALUE, r=REVISION; PEXPIREAT when it has a TTL
    NS#w:PREFIX     channel  each event's revision, published for every prefix of its key ("" too)
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
for its prefix's channel. The backend objects of one process that share
server, database, user, TLS files, namespace and ``operation_timeout`` share
one *listener*: a thread with one connection of its own, subscribed to
``NS#w:PREFIX`` for the prefixes being watched (channels unused for 30 s are
dropped; the thread ends 30 s after its last watch, and with the last of those
backends). A message wakes only the waiting watches of its prefix whose
revision it passes, and each polls again. So an event costs one wake-up per
watch that wants it — not one per waiting watch, as a shared ``XREAD BLOCK`` on
the log would — and waiting watches hold no connection.

No event is missed between a poll and the wait: a watch asks for its channel
before its first poll and registers after it, and polls once more if the
subscription took effect after that poll began, or if a message for it came
meanwhile. Nor is the log rescanned: once a poll that began after the
subscription read the log to its end at revision R (or the listener's own
sweep did, right after subscribing), every event under the prefix after R is
announced. A watch from at least R then polls only from just before the first
revision announced after its own, or not at all when none was (it waits; if it
times out, a one-entry poll still checks that its revision belongs to the
server's history, so lost data still gives ``HistoryCompacted``). Without this,
every waiting agent's poll would read every join and keep-alive of the round:
O(N^2) work for the server per round.

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
        +hmget +hset +persist +pexpireat +zadd +zrem +zscore +zrange +zrangebylex +zrangebyscore +zcount
        +xadd +xrange +xrevrange +publish +subscribe +unsubscribe
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import selectors
import shlex
import socket
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
    CorruptEntry,
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
    "DEFAULT_MAX_CONNECTIONS",
    "namespace_prefix",
    "plugin",
]

log = logging.getLogger(__name__)

DEFAULT_PORT = 6379
#: Seconds a call may take when the URL sets no ``operation_timeout``.
DEFAULT_OPERATION_TIMEOUT = 10.0
#: Events kept in the log stream (``XADD ... MAXLEN ~``; Redis may keep a few more).
HISTORY_LIMIT = 10_000
#: Pooled connections per backend object when the URL sets no ``max_connections``. A call holds
#: one only for its round trip and waiting watches hold none, so a process needs one per thread
#: that is in a call at the same moment: 1,024 covers every thread count a Python process runs
#: usefully (a smaller cap made 512 agent threads of one process queue for connections, each
#: queued thread waiting behind the others' GIL-bound round trips, and time out). Beyond it,
#: calls wait (up to ``operation_timeout``) for a free connection instead of failing.
DEFAULT_MAX_CONNECTIONS = 1024
#: Log entries one poll script scans at most.
_WATCH_BATCH = 256
#: Seconds the listener thread lives on without waiters (and a channel stays subscribed without).
_LISTENER_IDLE = 30.0
#: Revisions a channel remembers having announced (so a new watch need not scan the log for them).
_HEARD = 64
#: What Redis 7 appends to an error raised by a script.
_SCRIPT_SUFFIX = re.compile(r"\s*script: \w+, on @user_script:\d+\.?\s*$")
#: What deleting a corrupt bookkeeping key costs (for the error message).
_AFTER_DELETE = {
    "#rev": "nothing is lost without it (revisions go on after the log's last)",
    "#epoch": "nothing is lost without it",
    "#log": "without it, the event history is lost: watchers get HistoryCompacted and re-read",
    "#keys": "without it, list() and `rdzv reset` miss the keys written before until they are written again",
    "#ttl": "without it, keys with a TTL expire in Redis alone, each recorded when a client next touches it",
}
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
# ARGV: 1 namespace ("rdzv:" / "rdzv:NAME:"), 2 log cap, 3.. per script.
_PRELUDE = r"""
local REV, LOG, IDX, TTL, EPOCH = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local NS, MAXLEN = ARGV[1], ARGV[2]
local DATA, WATCH, DUE = NS .. 'k/', NS .. '#w:', NS .. '#t'
local clock = redis.call('TIME')
local NOW_US = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local now = math.floor(NOW_US / 1000)

-- Data this backend did not write stops the script before the operation writes anything
-- (Lua does not roll back): 'CORRUPT KEY key why' for a store key's data hash,
-- 'CORRUPT BOOK rediskey why' / 'CORRUPT MEMBER rediskey hex why' for the bookkeeping.
local function corrupt(key, why) error({err = 'CORRUPT KEY ' .. key .. ' ' .. why}) end
local function broken(rkey, why) error({err = 'CORRUPT BOOK ' .. rkey .. ' ' .. why}) end
local function stray(rkey, member, why)
  local hex = string.gsub(string.sub(member, 1, 200), '.', function(c) return string.format('%02x', string.byte(c)) end)
  error({err = 'CORRUPT MEMBER ' .. rkey .. ' ' .. (hex == '' and '-' or hex) .. ' ' .. why})
end
local function is_key(s)
  return #s > 0 and #s <= 1024 and not string.find(s, '[^%w_%-%.=%%%+:@~/]') and string.sub(s, 1, 1) ~= '/'
    and string.sub(s, -1) ~= '/' and not string.find(s, '//', 1, true)
end

-- #rev / #epoch: a decimal revision, 0 when absent.
local function counter(rkey)
  local raw = redis.pcall('GET', rkey)
  if type(raw) == 'table' then broken(rkey, 'is not a string') end
  if not raw then return 0 end
  local n = string.match(raw, '^%d+$') and tonumber(raw)
  if not n or n > 9007199254740991 then broken(rkey, 'is not a decimal revision') end
  return n
end

-- The last revision issued: #rev, else (someone deleted it) the log's last entry, else 0.
local function last_revision()
  local n = counter(REV)
  if n > 0 then return n end
  local top = redis.pcall('XREVRANGE', LOG, '+', '-', 'COUNT', 1)
  if top.err then broken(LOG, 'is not a stream') end
  return top[1] and tonumber(string.match(top[1][1], '^(%d+)%-')) or 0
end

-- Every key a script touches through the prelude's helpers: the index of live keys must be a
-- sorted set before anything is written (the log and #ttl are checked where first used).
local itype = redis.call('TYPE', IDX)['ok']
if itype ~= 'zset' and itype ~= 'none' then broken(IDX, 'is a ' .. itype .. ', not a sorted set') end

-- Wake the watchers of every prefix of `key` ('' included): channel NS#w:PREFIX, message REV.
local function notify(key, rev)
  redis.call('PUBLISH', WATCH, rev)
  local i = string.find(key, '/', 1, true)
  while i do
    redis.call('PUBLISH', WATCH .. string.sub(key, 1, i), rev)
    i = string.find(key, '/', i + 1, true)
  end
end

-- The next revision: one more than the last, and never behind the server's clock (us).
-- The event goes to the log under it (stream ID REV-0) with p = the revision before it.
local function emit(kind, key, value)
  local prev = last_revision()
  local rev = string.format('%d', math.max(prev + 1, NOW_US))
  local id, p = rev .. '-0', string.format('%d', prev)
  local added
  if value then
    added = redis.pcall('XADD', LOG, 'MAXLEN', '~', MAXLEN, id, 't', kind, 'k', key, 'p', p, 'v', value)
  else
    added = redis.pcall('XADD', LOG, 'MAXLEN', '~', MAXLEN, id, 't', kind, 'k', key, 'p', p)
  end
  if type(added) == 'table' then broken(LOG, 'does not take the next event: ' .. tostring(added.err)) end
  redis.call('SET', REV, rev)
  if prev == 0 then redis.call('SET', EPOCH, rev) end
  notify(key, rev)
  return rev
end

-- Delete a key and record it, once: it leaves both indexes in the same script.
local function drop(key)
  local rev = emit('d', key)
  redis.call('DEL', DATA .. key)
  redis.call('ZREM', IDX, key)
  redis.call('ZREM', TTL, key)
  return rev
end

-- Every key whose deadline (server clock, ms) has passed expires now, in deadline order.
local function sweep()
  local due = redis.pcall('ZRANGEBYSCORE', TTL, '-inf', string.format('%d', now), 'LIMIT', 0, 1000)
  if due.err then broken(TTL, 'is not a sorted set') end
  for _, key in ipairs(due) do
    if not is_key(key) then stray(TTL, key, 'is not a key') end
    drop(key)
  end
end

-- The entry at `key` as value, revision; nothing when absent (recording, once, the DELETE of
-- an indexed key whose data Redis expired or evicted). Anything else stored there is corrupt.
local function load(key)
  local dk = DATA .. key
  local vr = redis.pcall('HMGET', dk, 'v', 'r')
  if vr.err then corrupt(key, 'is a Redis ' .. redis.call('TYPE', dk)['ok'] .. ', not a hash') end
  local v, r = vr[1], vr[2]
  if v and r then
    if string.match(r, '^%d+$') then return v, r end
    corrupt(key, 'has a revision field r that is not a decimal number')
  end
  if v or r or redis.call('EXISTS', dk) == 1 then corrupt(key, 'is a hash without the fields v and r') end
  if redis.call('ZSCORE', IDX, key) then drop(key) end
end

-- Tell the listeners when `key`'s deadline became the earliest one (they sleep until it).
local function signal_due(key)
  if redis.call('ZRANGE', TTL, 0, 0)[1] == key then redis.call('PUBLISH', DUE, '') end
end

-- ms from now to the earliest TTL deadline (server clock); -1 when no key has one.
local function next_deadline()
  local nxt = redis.call('ZRANGE', TTL, 0, 0, 'WITHSCORES')
  if nxt[1] then return math.max(tonumber(nxt[2]) - now, 0) end
  return -1
end

local function expire_at(key, ttl_ms)
  local at = string.format('%d', now + tonumber(ttl_ms))
  redis.call('PEXPIREAT', DATA .. key, at)
  redis.call('ZADD', TTL, at, key)
  signal_due(key)
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
    expire_at(key, ttl_ms)
  end
  return rev
end

sweep()
"""

# ARGV 3 key, 4 value, 5 ttl ms or ''. -> {0, rev} exists | {1, rev} written
_CREATE = r"""
local key = ARGV[3]
local _, cur = load(key)
if cur then return {0, cur} end
return {1, write(key, ARGV[4], ARGV[5])}
"""

# ARGV 3 key, 4 value, 5 ttl ms or ''. -> rev
_PUT = r"""
local key = ARGV[3]
load(key)
return write(key, ARGV[4], ARGV[5])
"""

# ARGV 3 key, 4 value, 5 ttl ms or '', 6 expected rev. -> {0} absent | {1, rev} differs | {2, rev} written
_CAS = r"""
local key = ARGV[3]
local _, cur = load(key)
if not cur then return {0} end
if cur ~= ARGV[6] then return {1, cur} end
return {2, write(key, ARGV[4], ARGV[5])}
"""

# ARGV 3 key, 4 expected rev. -> {0} absent | {1, rev} differs | {2, rev} deleted
_CAD = r"""
local key = ARGV[3]
local _, cur = load(key)
if not cur then return {0} end
if cur ~= ARGV[4] then return {1, cur} end
return {2, drop(key)}
"""

# ARGV 3 key. -> 0 absent | 1 deleted. Whatever the Redis key holds: this is how corrupt data goes.
_DELETE = r"""
local key = ARGV[3]
if redis.call('EXISTS', DATA .. key) == 0 then
  if redis.call('ZSCORE', IDX, key) then drop(key) end
  return 0
end
drop(key)
return 1
"""

# ARGV 3 key, 4 ttl ms. -> 0 absent | 1 refreshed (value, revision unchanged, no event)
_REFRESH = r"""
local key = ARGV[3]
if not load(key) then return 0 end
expire_at(key, ARGV[4])
return 1
"""

# KEYS 6 scratch. ARGV 3 key, 4 delta. -> {0} not an integer | {1, err} out of range | {2, sum}
# The stored value must be ASCII decimal, -?[0-9]{1,30} (rdzv_core.kv.parse_counter); the sum is
# computed by INCRBY, so it is exact and must stay within 64 bits.
_ADD = r"""
local key = ARGV[3]
local raw = load(key)
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
redis.call('HSET', DATA .. key, 'v', sum, 'r', rev)
redis.call('ZADD', IDX, 0, key)
return {2, sum}
"""

# ARGV 3 prefix ('' for all). -> {revision, {key, value, rev, key, value, rev, ...}}
_LIST = r"""
local prefix = ARGV[3]
local off = redis.call('ZCOUNT', IDX, '-inf', '(0') + redis.call('ZCOUNT', IDX, '(0', '+inf')
if off > 0 then broken(IDX, 'has ' .. off .. ' member(s) with a score other than 0') end
local keys
if prefix == '' then
  keys = redis.call('ZRANGE', IDX, 0, -1)
else
  keys = redis.call('ZRANGEBYLEX', IDX, '[' .. prefix, '(' .. prefix .. '\255')
end
local out = {}
for _, key in ipairs(keys) do
  if not is_key(key) then stray(IDX, key, 'is not a key') end
  local v, r = load(key)
  if v then out[#out + 1] = key; out[#out + 1] = v; out[#out + 1] = r end
end
return {string.format('%d', last_revision()), out}
"""

# ARGV 3 after (the caller's revision), 4 prefix, 5 batch, 6 start (>= after: nothing under the prefix
# lies between). -> {-1, why, revision} history gone
# | {last scanned rev, number scanned, ms to the next TTL deadline or -1, {{rev, t, key[, value]}, ...}}
_POLL = r"""
local after, start = tonumber(ARGV[3]), tonumber(ARGV[6])
local last_rev = last_revision()
local epoch = counter(EPOCH)
if after > last_rev then return {-1, 'ahead', string.format('%d', last_rev)} end
if after > 0 and after < epoch - 1 then return {-1, 'before', string.format('%d', epoch)} end
local entries = redis.pcall('XRANGE', LOG, string.format('%d-0', start + 1), '+', 'COUNT', tonumber(ARGV[5]))
if entries.err then broken(LOG, 'is not a stream') end
-- Only entries emit() wrote: ID REV-0, fields t p|d, k KEY, p REV[, v VALUE] (the key is checked
-- where it is returned; a watch scans thousands of entries, so the rest is kept cheap).
local function check(e)
  local f, id = e[2], e[1]
  if f[1] == 't' and f[3] == 'k' and f[5] == 'p' and (f[2] == 'p' and f[7] == 'v' or f[2] == 'd' and not f[7])
      and string.sub(id, -2) == '-0' and tonumber(f[6]) then
    return string.sub(id, 1, -3), f
  end
  broken(LOG, 'holds the entry ' .. id .. ', which this backend did not write')
end
if entries[1] then
  local rev, f = check(entries[1])
  -- Its predecessor is later than `start`: the events between were trimmed (or lost).
  if tonumber(f[6]) > start then return {-1, 'trimmed', rev} end
elseif last_rev > start then
  return {-1, 'trimmed', string.format('%d', last_rev)}
end
local prefix = ARGV[4]
local out = {}
local last = string.format('%d', start)
for _, e in ipairs(entries) do
  local rev, f = check(e)
  last = rev
  if string.sub(f[4], 1, #prefix) == prefix then
    if not is_key(f[4]) then broken(LOG, 'holds the entry ' .. e[1] .. ', which this backend did not write') end
    out[#out + 1] = {rev, f[2], f[4], f[8]}
  end
end
return {last, #entries, next_deadline(), out}
"""

# -> {ms until the next TTL deadline (server clock) or -1 when no key has one, the last revision}.
# The prelude swept.
_SWEEP = r"""
return {next_deadline(), string.format('%d', last_revision())}
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
}  # and _SWEEP, run by the listener (_Notifier)


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
                 max_connections: int, prefix: str) -> None:
        import redis

        self.errors = redis.exceptions
        self.host, self.port, self.db, self.tls = host, port, db, tls
        self.operation_timeout, self.max_connections, self.prefix = operation_timeout, max_connections, prefix

    def map(self, exc: Exception, key: str | None) -> RdzvError | None:
        """The error of :mod:`rdzv_core.errors` for a redis-py one (``None``: not redis-py's)."""
        errors = self.errors
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
        self._errmap = _ErrorMap(host, port, db, tls, operation_timeout, max_connections, namespace_prefix(namespace))
        self.host, self.port, self.db = host, port, db
        self.username = username
        self.namespace = namespace
        self.operation_timeout = operation_timeout
        self.tls = tls
        self.max_connections = max_connections
        ns = namespace_prefix(namespace)
        self.prefix = ns
        self._data = ns + "k/"
        self._index_keys = [ns + "#rev", ns + "#log", ns + "#keys", ns + "#ttl", ns + "#epoch"]
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
        self._pool = redis.BlockingConnectionPool(max_connections=max_connections, timeout=operation_timeout,
                                                  connection_class=self._connection_args[0],
                                                  **self._connection_args[1])
        self._client: redis.Redis = redis.Redis(connection_pool=self._pool)
        self._scripts = {name: self._client.register_script(_PRELUDE + body) for name, body in _SCRIPTS.items()}
        self._notifier = _Notifier.of(self)
        try:
            with self._translate(None):
                self._client.ping()
        except BaseException:
            self._notifier.release(self)
            self._pool.disconnect()
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

    def _run(self, name: str, key: str | None, *args: Any, extra_key: str | None = None) -> Any:
        keys = self._index_keys + ([extra_key] if extra_key is not None else [])
        with self._translate(key):
            return self._scripts[name](keys=keys, args=[self.prefix, HISTORY_LIMIT, *args])

    def _run_key(self, name: str, key: str, *args: Any) -> Any:
        return self._run(name, key, key, *args, extra_key=self._data + key)

    # -- the protocol --------------------------------------------------------------------------
    def _do_get(self, key: str) -> Entry | None:
        with self._translate(key):
            try:
                fields = cast("dict[bytes, bytes]", self._client.hgetall(self._data + key))
            except self._errors.ResponseError as exc:
                if "WRONGTYPE" not in str(exc):
                    raise
                raise self._errmap.corrupt(f"CORRUPT KEY {key} is not a hash") from None
        if not fields:
            return None
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
                        hint = self._notifier.take_hint(waiter)
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
        self._pool.disconnect(inuse_connections=True)


# -- the listener --------------------------------------------------------------------------------
class _Waiter:
    """One watch call of ``owner``, waiting for an event under a prefix after ``after`` (set by the listener)."""

    __slots__ = ("owner", "channel", "after", "hint", "wake", "error")

    def __init__(self, owner: RedisBackend, channel: _Channel, after: int) -> None:
        self.owner = owner
        self.channel = channel
        self.after = after
        self.hint: int | None = None  # the least revision > after heard since the watch last took it (0: unknown)
        self.wake = threading.Event()
        self.error: RdzvError | None = None


class _Channel:
    """One subscribed prefix: its waiters, when the subscription took effect, the last revision heard."""

    __slots__ = ("name", "waiters", "confirmed_at", "last_rev", "heard", "covered_from", "idle_since")

    def __init__(self, name: bytes) -> None:
        self.name = name
        self.waiters: set[_Waiter] = set()
        self.confirmed_at: float | None = None  # time.monotonic() when the SUBSCRIBE reply was read
        self.last_rev = 0
        self.heard: collections.deque[int] = collections.deque(maxlen=_HEARD)  # the last revisions announced
        # Every event under the prefix after this revision has been announced (a poll that began after
        # the subscription took effect read the log to its end there); None: not known yet.
        self.covered_from: int | None = None
        self.idle_since = time.monotonic()


class _Notifier:
    """The pub/sub listener of the :class:`RedisBackend` objects of one process that share a
    server, database, user, TLS files, namespace and ``operation_timeout`` (:meth:`of`): a thread
    that wakes matching waiters. Reference-counted by its backends; the last :meth:`release` ends it.

    The thread owns a connection of its own (not from a pool) subscribed to ``NS#t`` and to
    ``NS#w:PREFIX`` for every prefix being watched; the write scripts publish each event's
    revision to every prefix of its key. A message wakes the waiters of its channel whose
    ``after`` is below the revision; nothing else wakes them. While any waiter exists, the
    thread also sweeps at the next TTL deadline (the ``sweep`` script returns it; ``NS#t`` says
    when a write made an earlier one), so expiries are recorded, published and seen. Sweeps run
    on a client of its own (two pooled connections), since any backend may be closed first.

    A watch asks for its channel (:meth:`begin`) before its first poll and registers a waiter
    (:meth:`add`) after it: if the subscription took effect before that poll began, every later
    event reaches the waiter (and one heard meanwhile is detected by ``last_rev``); otherwise
    the watch polls once more after the subscription. A channel's ``covered_from`` (set by
    :meth:`covers` after such a poll, or by the thread's sweep after subscribing) lets
    :meth:`begin` register a watch at once and say where (whether) it must poll; a waiter's
    ``hint`` (:meth:`take_hint`) says where to poll after a wake-up.
    The thread pings the server when it heard nothing for ``operation_timeout / 2`` and fails
    every waiter with the mapped error when the connection breaks or stays silent for
    ``operation_timeout``; it exits after :data:`_LISTENER_IDLE` seconds without waiters (a
    later watch starts it again). Channels without waiters for as long are unsubscribed.
    """

    _shared: dict[tuple[Any, ...], _Notifier] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def of(cls, backend: RedisBackend) -> _Notifier:
        """The notifier ``backend`` shares with the other open backends of this process that use
        the same connection settings and namespace (a new one if there is none); counts it as a user."""
        key = (os.getpid(), backend.host, backend.port, backend.db, backend.username,
               backend._connection_args[1]["password"],
               None if backend.tls is None else (backend.tls.cacert, backend.tls.cert, backend.tls.key),
               backend.prefix, backend.operation_timeout)
        with cls._shared_lock:
            notifier = cls._shared.get(key)
            if notifier is None:
                notifier = cls._shared[key] = cls(backend, key)
            notifier._users += 1
            return notifier

    def __init__(self, backend: RedisBackend, key: tuple[Any, ...]) -> None:
        import redis

        self._key = key
        self._users = 0  # backends that hold it (under _shared_lock)
        # What every user has in common (no reference to a backend: a forgotten one must stay collectable).
        self._errmap = backend._errmap
        self._index_keys, self._prefix = backend._index_keys, backend.prefix
        self._name = repr(backend)
        connection_class, connection_kwargs = backend._connection_args
        self._client = redis.Redis(connection_pool=redis.BlockingConnectionPool(
            max_connections=2, timeout=backend.operation_timeout, connection_class=connection_class,
            **connection_kwargs))
        self._sweep_script = self._client.register_script(_PRELUDE + _SWEEP)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a subscription took effect, or the thread failed
        self._channels: dict[bytes, _Channel] = {}
        self._outbox: list[bytes] = []  # channels to SUBSCRIBE
        self._waiters = 0
        self._idle_since = time.monotonic()  # when the last waiter left
        self._need_sweep: float | None = None  # when NS#t said: a write set an earlier TTL deadline
        self._need_cover = False  # a channel's subscription took effect: sweep to learn its covered_from
        self._due_since: float | None = None  # when the NS#t subscription took effect
        self._sleep_until = 0.0  # when the thread wakes at the latest (time.monotonic())
        # (when it was learnt, the next TTL deadline or None for none) by a sweep after _due_since
        self._deadline: tuple[float, float | None] | None = None
        self._thread: threading.Thread | None = None
        self._wake_pair: tuple[socket.socket, socket.socket] | None = None
        self._closed = False
        self._watch = (backend.prefix + "#w:").encode()
        self._due = (backend.prefix + "#t").encode()

    def release(self, backend: RedisBackend) -> None:
        """``backend`` is closed: its waits end now (they return ``[]``); the last user closes this."""
        with self._lock:
            for channel in self._channels.values():
                for waiter in channel.waiters:
                    if waiter.owner is backend:
                        waiter.wake.set()
            self._changed.notify_all()
        with self._shared_lock:
            self._users -= 1
            last = self._users == 0
            if last and self._shared.get(self._key) is self:
                del self._shared[self._key]
        if last:
            self.close()

    # -- called by watches ---------------------------------------------------------------------
    def add(self, owner: RedisBackend, prefix: str, after: int, polled_at: float, patience: float,
            next_deadline: float | None) -> _Waiter:
        """Register a waiter of ``owner`` for ``prefix``; its ``wake`` is already set when the watch
        must poll again.

        ``after`` and ``next_deadline`` (``time.monotonic()`` value, or ``None``: no TTLs) are
        what the poll sent at ``polled_at`` returned. Waits (at most ``operation_timeout``, or
        ``patience`` seconds, then asks for one more poll) for a new channel's subscription to
        take effect.

        Raises:
            BackendClosed: ``owner`` was closed.
            BackendTimeout: the subscription did not take effect within ``operation_timeout``.
            BackendUnavailable, KVError: the listener failed (mapped as every call's errors are).
        """
        with self._lock:
            channel = self._channel_locked(prefix)
            waiter = self._register_locked(owner, channel, after)
            if self._due_since is not None and self._due_since < polled_at and (
                    self._deadline is None or self._deadline[0] < polled_at):
                self._deadline = (polled_at, next_deadline)  # the poll swept: the listener need not
                if self._need_sweep is not None and self._need_sweep < polled_at:
                    self._need_sweep = None
            if self._deadline is not None and self._deadline[1] is not None and self._deadline[1] < self._sleep_until:
                self._start_locked()  # the thread sleeps too long now: a sweep is due sooner
            if channel.confirmed_at is None:
                limit = min(self._errmap.operation_timeout, patience)
                if not self._changed.wait_for(
                    lambda: channel.confirmed_at is not None or waiter.error is not None or owner._closed, limit
                ) and limit < patience:
                    self._remove_locked(waiter)
                    raise BackendTimeout(f"redis at {self._errmap.host}:{self._errmap.port} did not confirm a "
                                         f"subscription within operation_timeout={limit}s", prefix)
            if channel.confirmed_at is None or channel.confirmed_at >= polled_at or channel.last_rev > after:
                waiter.wake.set()  # it may have missed an event: poll again
        if waiter.error is not None or owner._closed:
            self.remove(waiter)
            if owner._closed:
                raise BackendClosed("RedisBackend is closed", prefix)
            raise _copy_error(cast(RdzvError, waiter.error), prefix) from waiter.error
        return waiter

    def begin(self, owner: RedisBackend, prefix: str, after: int) -> tuple[_Waiter | None, int | None]:
        """A watch of ``owner`` starts: subscribe to ``prefix``'s channel now (so that it may be in
        effect before the poll is sent, and :meth:`add` need not ask for a second one).

        Returns ``(None, after)`` (poll from ``after``, then :meth:`add`), or, when the channel has
        announced every event under the prefix after ``after``, a waiter registered at once and
        where to poll from: ``None`` if nothing was announced (no poll needed: wait), else just
        before the first revision announced.

        Raises:
            BackendClosed: ``owner`` was closed.
        """
        with self._lock:
            channel = self._channel_locked(prefix)
            if owner._closed:
                raise BackendClosed("RedisBackend is closed", prefix)
            covered_from = channel.covered_from
            # (From 0, an empty history: `after` may come from one the server lost; a poll tells.)
            if channel.confirmed_at is None or covered_from is None or after < covered_from or (
                    covered_from == 0 < after):
                return None, after
            heard = channel.heard
            first = next((rev for rev in heard if rev > after), None)
            if first is not None and len(heard) == heard.maxlen and heard[0] > after:
                first = after + 1  # older announcements were forgotten: scan from after
            waiter = self._register_locked(owner, channel, after)
        return waiter, None if first is None else first - 1

    def covers(self, waiter: _Waiter, polled_at: float, last: int) -> bool:
        """A poll that began at ``polled_at`` read the log to its end at ``last``: if the waiter's
        subscription took effect before, record that every event after ``last`` is announced; whether so."""
        channel = waiter.channel
        with self._lock:
            if not _before(channel.confirmed_at, polled_at):
                return False
            if channel.covered_from is None or last < channel.covered_from:
                channel.covered_from = last
            return True

    def _channel_locked(self, prefix: str) -> _Channel:
        if self._closed:
            raise BackendClosed("RedisBackend is closed", prefix)
        name = self._watch + prefix.encode()
        channel = self._channels.get(name)
        if channel is None:
            channel = self._channels[name] = _Channel(name)
            self._outbox.append(name)
            self._start_locked()
        elif self._thread is None:
            self._start_locked()
        return channel

    def _register_locked(self, owner: RedisBackend, channel: _Channel, after: int) -> _Waiter:
        waiter = _Waiter(owner, channel, after)
        channel.waiters.add(waiter)
        self._waiters += 1
        if self._waiters == 1:
            self._start_locked()  # the thread sweeps while someone waits
        return waiter

    def take_hint(self, waiter: _Waiter) -> int | None:
        """The least revision above ``waiter.after`` heard on its channel since the last call, if any."""
        with self._lock:
            hint, waiter.hint = waiter.hint, None
        return hint

    def remove(self, waiter: _Waiter) -> None:
        """Unregister ``waiter`` (idempotent)."""
        with self._lock:
            self._remove_locked(waiter)

    def _remove_locked(self, waiter: _Waiter) -> None:
        channel = waiter.channel
        if waiter in channel.waiters:
            channel.waiters.discard(waiter)
            self._waiters -= 1
            now = time.monotonic()
            if not channel.waiters:
                channel.idle_since = now
            if not self._waiters:
                self._idle_since = now

    def close(self) -> None:
        """End every wait now; the thread exits at once (it closes its own connection)."""
        with self._lock:
            self._closed = True
            for channel in self._channels.values():
                for waiter in channel.waiters:
                    waiter.wake.set()
            self._changed.notify_all()
            if self._thread is None and self._wake_pair is not None:
                for sock in self._wake_pair:
                    sock.close()
                self._wake_pair = None
        self._poke()
        self._client.connection_pool.disconnect(inuse_connections=True)  # ends a sweep in flight

    def _start_locked(self) -> None:
        """Start the thread, or poke it: it has something to send (or a sooner time to wake)."""
        if self._thread is not None:
            self._poke()
            return
        if self._wake_pair is None:
            self._wake_pair = socket.socketpair()
            for sock in self._wake_pair:
                sock.setblocking(False)
        self._idle_since = time.monotonic()  # a new thread lives _LISTENER_IDLE at least
        self._thread = threading.Thread(target=self._main, name=f"rdzv-redis-listener-{id(self):x}", daemon=True)
        self._thread.start()

    def _poke(self) -> None:
        pair = self._wake_pair
        if pair is not None:
            with contextlib.suppress(OSError):  # full (already poked) or closed
                pair[1].send(b"x")

    # -- the thread ----------------------------------------------------------------------------
    def _main(self) -> None:
        conn = None
        try:
            pool = self._client.connection_pool
            conn = pool.connection_class(**pool.connection_kwargs)
            conn.connect()
            self._serve(conn)
        except Exception as exc:
            if not self._closed:
                mapped = exc if isinstance(exc, RdzvError) else self._errmap.map(exc, None)
                if mapped is None:  # a bug of ours or of redis-py: fail the waiters rather than hang them
                    log.warning("redis listener of %s failed", self._name, exc_info=True)
                    mapped = BackendConnectionError(f"the watch listener of {self._name} failed: {exc!r}")
                self._fail(mapped)
        finally:
            if conn is not None:
                conn.disconnect()
            self._client.connection_pool.disconnect()  # reconnects on demand; none held while idle
            with self._lock:
                if self._closed and self._wake_pair is not None:
                    for sock in self._wake_pair:
                        sock.close()
                    self._wake_pair = None

    def _sweep(self, started: float) -> float | None:
        """Record every due expiry (a sweep sent at ``started``); return when the next TTL deadline is
        due (``time.monotonic()`` value, ``None``: no key has a TTL). The revision it read covers every
        channel subscribed before: each later event under its prefix is announced."""
        ms, revision = self._sweep_script(keys=self._index_keys, args=[self._prefix, HISTORY_LIMIT])
        with self._lock:
            for channel in self._channels.values():
                if channel.covered_from is None and _before(channel.confirmed_at, started):
                    channel.covered_from = int(revision)
        return None if ms < 0 else time.monotonic() + ms / 1000

    def _serve(self, conn: Any) -> None:
        with selectors.DefaultSelector() as selector:  # epoll: select() fails for descriptors >= 1024
            pair = self._wake_pair
            if pair is None or conn._sock is None:  # redis-py keeps the socket in _sock
                raise self._errmap.errors.ConnectionError("the listener's connection was closed")
            selector.register(conn._sock, selectors.EVENT_READ)
            selector.register(pair[0], selectors.EVENT_READ)
            self._loop(conn, selector, pair[0])

    def _loop(self, conn: Any, selector: selectors.BaseSelector, poked: socket.socket) -> None:
        timeout = self._errmap.operation_timeout
        heard = time.monotonic()  # when the server last said anything
        pinged: float | None = None
        conn.send_command("SUBSCRIBE", self._due)
        while True:
            now = time.monotonic()
            with self._lock:
                if self._closed:
                    return
                if self._waiters == 0 and now - self._idle_since > _LISTENER_IDLE:
                    self._thread = None
                    self._forget_locked()
                    return
                subscribe, self._outbox = self._outbox, []
                unsubscribe = [c.name for c in self._channels.values()
                               if not c.waiters and c.confirmed_at is not None and now - c.idle_since > _LISTENER_IDLE]
                for name in unsubscribe:
                    del self._channels[name]
                waiting = self._waiters > 0
                deadline = self._deadline
                next_sweep = deadline[1] if deadline is not None else None
                # Sweeps wait for the NS#t subscription, so that no earlier deadline goes unheard.
                sweep = self._need_cover or waiting and self._due_since is not None and (
                    deadline is None or self._need_sweep is not None or (next_sweep is not None and now >= next_sweep))
                if sweep:
                    self._need_cover = False
                    if waiting and self._due_since is not None:
                        self._need_sweep = None
            if unsubscribe:
                conn.send_command("UNSUBSCRIBE", *unsubscribe)
            if subscribe:
                conn.send_command("SUBSCRIBE", *subscribe)
            if sweep:
                next_sweep = self._sweep(now)
                with self._lock:
                    if _before(self._due_since, now) and (self._deadline is None or self._deadline[0] < now):
                        self._deadline = (now, next_sweep)
            if pinged is not None and now - pinged > timeout:
                raise self._errmap.errors.TimeoutError(f"no answer to PING within {timeout}s")
            if pinged is None and waiting and now - heard > timeout / 2:
                conn.send_command("PING")
                pinged = now
            limits = [timeout / 2, _LISTENER_IDLE]
            if next_sweep is not None and waiting:
                limits.append(max(next_sweep - time.monotonic(), 0.001))
            with self._lock:
                # A waiter that comes while this thread sleeps pokes it if it must wake sooner.
                waiting = self._waiters > 0
                if waiting and self._deadline is not None and self._deadline[1] is not None:
                    limits.append(max(self._deadline[1] - time.monotonic(), 0.001))
                self._sleep_until = time.monotonic() + min(limits) if waiting else 0.0
            if self._readable(conn, selector, poked, max(0.0, min(limits))):
                while True:
                    self._handle(conn.read_response())
                    heard, pinged = time.monotonic(), None
                    if not conn.can_read(0):
                        break

    @staticmethod
    def _readable(conn: Any, selector: selectors.BaseSelector, poked: socket.socket, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the connection (or a poke); whether a message can be read."""
        if conn.can_read(0):  # buffered by the parser or TLS
            return True
        ready = {key.fileobj for key, _ in selector.select(timeout)}
        if poked in ready:
            with contextlib.suppress(OSError):
                while poked.recv(4096):
                    pass
        return len(ready - {poked}) > 0

    def _handle(self, message: Any) -> None:
        """Act on one pub/sub message."""
        kind, name = message[0], message[1]
        if kind == b"message" and name == self._due:
            with self._lock:
                self._need_sweep = time.monotonic()
        elif kind == b"message":
            try:
                rev = hint = int(message[2])
            except ValueError:  # not ours: wake everyone (with no hint); they poll and find what is real
                rev, hint = _INT64[1], 0
            with self._lock:
                channel = self._channels.get(name)
                if channel is not None:
                    channel.last_rev = max(channel.last_rev, rev)
                    if hint:
                        channel.heard.append(rev)
                    for waiter in channel.waiters:
                        if rev > waiter.after:
                            waiter.hint = hint if waiter.hint is None else min(waiter.hint, hint)
                            waiter.wake.set()
        elif kind == b"subscribe":
            with self._lock:
                channel = self._channels.get(name)
                if name == self._due:
                    self._due_since = time.monotonic()
                elif channel is not None and channel.confirmed_at is None:
                    channel.confirmed_at = time.monotonic()
                    self._need_cover = True  # a sweep now tells from which revision it announces all
                    self._changed.notify_all()

    def _forget_locked(self) -> None:
        self._channels.clear()
        self._outbox.clear()
        self._due_since = self._deadline = None
        self._changed.notify_all()

    def _fail(self, error: RdzvError) -> None:
        """The thread ends: every registered waiter gets ``error``; later watches start a new thread."""
        with self._lock:
            for channel in self._channels.values():
                for waiter in channel.waiters:
                    waiter.error = error
                    waiter.wake.set()
            self._thread = None
            self._forget_locked()


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


def _before(moment: float | None, then: float) -> bool:
    """``moment`` (``time.monotonic()``, or ``None``: not yet) came before ``then``."""
    return moment is not None and moment < then


def _copy_error(error: RdzvError, key: str) -> RdzvError:
    """A copy of ``error`` (met by the listener thread) for one watch to raise, about ``key`` (its prefix)."""
    copy = type(error).__new__(type(error))
    copy.__dict__.update(error.__dict__)
    copy.args = error.args
    if isinstance(copy, KVError) and not isinstance(copy, CorruptEntry):  # CorruptEntry names its own key
        copy.key = key
    return copy


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
        description="one Redis server (Lua scripts, stream log, server-side TTLs; rediss:// for TLS)",
    )
)
