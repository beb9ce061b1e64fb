"""The Lua scripts of :mod:`rdzv_backends.redis`: their text, names and arguments.

Every operation of :class:`~rdzv_backends.redis.backend.RedisBackend` that writes (and ``list``
and the watch poll) is one of these scripts, run atomically by the server. Each script is
:data:`_PRELUDE` (argument names, the sweep of due expiries, the helpers that log and publish
events, type checks) followed by its body from :data:`_SCRIPTS`; the backend sends each
``_PRELUDE + body`` by its SHA-1 (``EVALSHA``, then ``SCRIPT LOAD`` if the server lacks it). :data:`_SWEEP`
is run by the pub/sub listener (:mod:`rdzv_backends.redis._listener`) only. The algorithms (layout,
revisions, expiry, corrupt storage) are described in docs/backends/redis.md.
This module holds text only: it imports nothing, so it loads without redis-py.
"""

#: Events kept in the log stream (``XADD ... MAXLEN ~``; Redis may keep a few more): every script's
#: ARGV 2 (re-exported by :mod:`rdzv_backends.redis`).
HISTORY_LIMIT = 10_000
#: The range of Redis integers (``INCRBY``, hence ``add``): 64-bit signed.
_INT64 = (-(2**63), 2**63 - 1)

# KEYS: 1 #rev, 2 #log, 3 #keys, 4 #ttl, 5 #epoch, 6 #last, [7 data hash of the key | #add]
# ARGV: 1 namespace ("rdzv:" / "rdzv:NAME:"), 2 log cap, 3.. per script.
_PRELUDE = r"""
local REV, LOG, IDX, TTL, EPOCH, LAST = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local NS, MAXLEN = ARGV[1], ARGV[2]
local LAST_LIMIT = 1024  -- members of #last beyond which each write prunes those the log no longer holds
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

-- Wake the watchers of every prefix of `key` ('' included): channel NS#w:PREFIX, message the
-- event with the first revision of this history ('REV EPOCH d KEY', 'REV EPOCH p KEY VALUE'), or
-- only 'REV' (a value over INLINE bytes, an #epoch that is not ours); and record REV as the
-- prefix's latest event in #last (member PREFIX, score REV).
local INLINE = 4096
local function notify(key, rev, kind, value)
  local epoch = redis.pcall('GET', EPOCH)
  local msg = rev
  if type(epoch) ~= 'string' or not string.match(epoch, '^%d+$') then
    msg = rev
  elseif kind == 'd' then
    msg = rev .. ' ' .. epoch .. ' d ' .. key
  elseif #value <= INLINE then
    msg = rev .. ' ' .. epoch .. ' p ' .. key .. ' ' .. value
  end
  redis.call('PUBLISH', WATCH, msg)
  redis.call('ZADD', LAST, rev, '')
  local i = string.find(key, '/', 1, true)
  while i do
    local prefix = string.sub(key, 1, i)
    redis.call('PUBLISH', WATCH .. prefix, msg)
    redis.call('ZADD', LAST, rev, prefix)
    i = string.find(key, '/', i + 1, true)
  end
end

-- #last holds, for every prefix with an event after the score of its member '#' (no prefix holds
-- a '#'), the revision of its latest event: a watch learns without reading the log whether its
-- prefix changed. A #last without '#' starts now (covering the events after `prev`).
local function last_begins(prev)
  local from = redis.pcall('ZSCORE', LAST, '#')
  if type(from) == 'table' then broken(LAST, 'is not a sorted set') end
  if not from then redis.call('ZADD', LAST, string.format('%d', prev), '#') end
end

-- Forget the prefixes whose latest event the log no longer holds (the '#' moves up past them),
-- once there are more than LAST_LIMIT: watches from before the log's start scan it anyway.
local function last_prune()
  if redis.call('ZCARD', LAST) <= LAST_LIMIT then return end
  local first = redis.call('XRANGE', LOG, '-', '+', 'COUNT', 1)[1]
  local floor = first and string.match(tostring(first[2][6]), '^%d+$')
  if not floor then return end
  redis.call('ZREMRANGEBYSCORE', LAST, '-inf', floor)
  redis.call('ZADD', LAST, 'GT', floor, '#')
end

-- The next revision: one more than the last, and never behind the server's clock (us).
-- The event goes to the log under it (stream ID REV-0) with p = the revision before it.
local function emit(kind, key, value)
  local prev = last_revision()
  last_begins(prev)
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
  notify(key, rev, kind, value)
  last_prune()
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

# KEYS 7 scratch. ARGV 3 key, 4 delta. -> {0} not an integer | {1, err} out of range | {2, sum}
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
local scratch = KEYS[7]
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
-- `after` must belong to this history: issued by it, or one below a revision it issued (a watch
-- may begin just before an event). Else the caller saw revisions this server never issued: it
-- lost writes (a failover to a replica that missed them, a restore of an older snapshot) and its
-- history went on from an earlier point. (One lookup of the log's entry at or below `after + 1`.)
if after > 0 then
  local below = redis.pcall('XREVRANGE', LOG, string.format('%d-0', after + 1), '-', 'COUNT', 1)
  if below.err then broken(LOG, 'is not a stream') end
  local id = below[1] and tonumber(string.match(below[1][1], '^(%d+)%-'))
  if id and id < after then return {-1, 'diverged', string.format('%d', id)} end
end
local prefix = ARGV[4]
-- #last knows the prefix's latest event after its '#': none after `start` needs no scan,
-- and a scan can stop at the latest.
local known = redis.pcall('ZMSCORE', LAST, prefix, '#')
if known.err then broken(LAST, 'is not a sorted set') end
local latest, from = tonumber(known[1]), tonumber(known[2])
local upto = '+'
if from and start >= from then
  if not latest or latest <= start then return {string.format('%d', last_rev), 0, next_deadline(), {}} end
  upto = string.format('%d-0', latest)
end
local entries = redis.pcall('XRANGE', LOG, string.format('%d-0', start + 1), upto, 'COUNT', tonumber(ARGV[5]))
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
-- Read up to the prefix's latest event: nothing under it follows, up to the last revision.
if upto ~= '+' and tonumber(last) >= latest then last = string.format('%d', last_rev) end
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
