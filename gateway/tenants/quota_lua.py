"""The quota check-and-take in Lua: one Redis round trip per request, atomic, on the server's clock.

The same algorithm as quota_counters.MemoryQuota (read its docstring); the contract tests run
both. Every key of a tenant carries the hash tag `{gwq:<tenant>}`, so they share one Redis
Cluster slot. Per scope, five keys: r (requests per second bucket), t (tokens per bucket), c
(leases: a sorted set scored by expiry, ms), d (tokens per UTC day) and m (micro-USD per day).
"""

from __future__ import annotations

__all__ = ["PEEK", "TAKE", "SETTLE", "UNDO", "USAGE", "scope_keys", "take_key"]

KEYS_PER_SCOPE = 5


def scope_keys(prefix: str, tenant: str, scope: str) -> list[str]:
    """The five keys of one scope, in the order the scripts read them."""
    base = f"{prefix}{{gwq:{tenant}}}:{scope}:"
    return [base + k for k in ("r", "t", "c", "d", "m")]


def take_key(prefix: str, tenant: str, lease: str) -> str:
    """The record of one take (its bucket, day and tokens) while its request runs, in the tenant's
    slot: what UNDO reverses when the caller never learnt the take's answer (a timeout)."""
    return f"{prefix}{{gwq:{tenant}}}:u:{lease}"


_COMMON = r"""
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
-- sum of a window hash (second -> n) over the last 61 buckets; older fields are removed
local function window(key, b)
  local raw = redis.call('HGETALL', key)
  local pairs_, sum, old = {}, 0, {}
  for i = 1, #raw, 2 do
    local sec, n = tonumber(raw[i]), tonumber(raw[i + 1])
    if sec < b - 60 then
      old[#old + 1] = raw[i]
    else
      sum = sum + n
      pairs_[#pairs_ + 1] = {sec, n}
    end
  end
  if #old > 0 then redis.call('HDEL', key, unpack(old)) end
  return sum, pairs_
end
-- seconds until `need` more fits under `limit` as old buckets leave the window
local function free_after(pairs_, used, need, limit, now)
  table.sort(pairs_, function(a, b) return a[1] < b[1] end)
  for _, p in ipairs(pairs_) do
    used = used - p[2]
    if used + need <= limit then
      local w = p[1] + 61 - now
      if w < 0 then w = 0 end
      return w
    end
  end
  return 61
end
"""

_DECIDE = r"""
-- TAKE's decision (and PEEK's): whether every limit of every scope lets the ask in, the tenant
-- scope's figures for the headers as they are before it takes anything, and the tokens it takes
-- on each scope (capped at the smallest tpm and the same on every scope, so one settle delta
-- corrects them all). `win`: window (drops old buckets) or window_ro; `prune`: drop expired leases
-- (TAKE) or leave them, uncounted (PEEK).
local function decide(n, b, now, day, ask, cost, win, prune)
  local ok, limit, scope_name, retry = 1, '', '', 0
  local lreq, rreq, reset_req, ltok, rtok, reset_tok = -1, -1, 0, -1, -1, 0
  local tokens = ask
  for i = 0, n - 1 do
    local tpm = tonumber(ARGV[7 + i * 6])
    if tpm > 0 and tokens > tpm then tokens = tpm end
  end
  local expired = math.floor(now * 1000)
  for i = 0, n - 1 do
    local a = 5 + i * 6
    local name = ARGV[a]
    local rpm, tpm, conc = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    local tpd, spend = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
    local k = i * 5
    local reqs, rpairs = win(KEYS[k + 1], b)
    local used, tpairs = win(KEYS[k + 2], b)
    if prune then redis.call('ZREMRANGEBYSCORE', KEYS[k + 3], '-inf', expired) end
    if name == '' then
      if rpm > 0 then
        lreq, rreq = rpm, math.max(0, rpm - reqs)
        if reqs > 0 then reset_req = free_after(rpairs, reqs, 1, rpm, now) end
      end
      if tpm > 0 then
        ltok, rtok = tpm, math.max(0, tpm - used)
        if used > 0 then reset_tok = free_after(tpairs, used, tokens, tpm, now) end
      end
    end
    if ok == 1 then
      local why, wait = nil, 0
      if rpm > 0 and reqs + 1 > rpm then
        why, wait = 'rpm', free_after(rpairs, reqs, 1, rpm, now)
      elseif tpm > 0 and used + tokens > tpm then
        why, wait = 'tpm', free_after(tpairs, used, tokens, tpm, now)
      elseif conc > 0 and redis.call('ZCOUNT', KEYS[k + 3], '(' .. expired, '+inf') >= conc then
        why, wait = 'concurrency', 1
      elseif tpd > 0 and tonumber(redis.call('HGET', KEYS[k + 4], day) or '0') + tokens > tpd then
        why, wait = 'tokens_per_day', (day + 1) * 86400 - now
      elseif spend > 0 then
        local spent = tonumber(redis.call('HGET', KEYS[k + 5], day) or '0')
        if spent >= spend then
          why, wait = 'spend_per_day_usd', (day + 1) * 86400 - now
        elseif cost > 0 and spent + cost > spend then
          why, wait = 'spend_per_day_usd', 1  -- held by requests in flight: free as they settle
        end
      end
      if why then ok, limit, scope_name, retry = 0, why, name, wait end
    end
  end
  return ok, limit, scope_name, retry, lreq, rreq, reset_req, ltok, rtok, reset_tok, tokens
end
"""

# KEYS: 5 per scope, then the take's record (take_key). ARGV: tokens, lease, lease_ttl_ms,
# spend_micro (the answer's estimated cost, reserved), then per scope: name, rpm, tpm,
# concurrency, tokens_per_day, spend_per_day_micro (0: no limit).
TAKE = _COMMON + _DECIDE + r"""
local now = now_s()
local b = math.floor(now)
local day = math.floor(now / 86400)
local ask, lease, ttl, cost = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local n = (#ARGV - 4) / 6
local rec = KEYS[n * 5 + 1]
local prev = redis.call('GET', rec)
if prev == 'undone' then
  -- UNDO ran first (the caller gave up waiting for this answer): it takes nothing
  return {0, 'undone', '', '0', b, day, -1, -1, '0', -1, -1, '0'}
end
local pb, pday = string.match(prev or '', '^(%d+) (%d+) ')
if pb then
  -- This take ran already: its reply was lost with its connection and the client sent it again
  -- (a failover's reconnects). Taken once, with the bucket and day it was taken in (the settle's);
  -- no figures for the headers this time.
  return {1, '', '', '0', tonumber(pb), tonumber(pday), -1, -1, '0', -1, -1, '0'}
end
local ok, limit, scope_name, retry, lreq, rreq, reset_req, ltok, rtok, reset_tok, tokens = decide(n, b, now, day, ask, cost, window, true)
if ok == 1 then
  for i = 0, n - 1 do
    local a = 5 + i * 6
    local k = i * 5
    redis.call('HINCRBY', KEYS[k + 1], b, 1)
    redis.call('PEXPIRE', KEYS[k + 1], 62000)
    redis.call('HINCRBY', KEYS[k + 2], b, tokens)
    redis.call('PEXPIRE', KEYS[k + 2], 62000)
    redis.call('HINCRBY', KEYS[k + 4], day, tokens)
    redis.call('PEXPIRE', KEYS[k + 4], 2 * 86400 * 1000)
    if cost > 0 then
      redis.call('HINCRBY', KEYS[k + 5], day, cost)
      redis.call('PEXPIRE', KEYS[k + 5], 2 * 86400 * 1000)
    end
    if tonumber(ARGV[a + 3]) > 0 then
      redis.call('ZADD', KEYS[k + 3], math.floor(now * 1000) + ttl, lease)
      -- never shortened: a request with a short deadline set it to its own TTL, and the set
      -- expired with the long requests' leases in it (their concurrency freed while they ran)
      local left = redis.call('PTTL', KEYS[k + 3])
      if left < ttl + 1000 then redis.call('PEXPIRE', KEYS[k + 3], ttl + 1000) end
    end
    if ARGV[a] == '' then
      if rreq > 0 then rreq = rreq - 1 end
      if rtok >= 0 then rtok = math.max(0, rtok - tokens) end
    end
  end
  redis.call('SET', rec, b .. ' ' .. day .. ' ' .. tokens .. ' ' .. cost, 'PX', ttl + 1000)
end
return {ok, limit, scope_name, tostring(retry), b, day, lreq, rreq, tostring(reset_req), ltok, rtok, tostring(reset_tok)}
"""

# TAKE's decision, writing nothing (/v1/route/explain): the buckets older than the window and the
# expired leases, which TAKE deletes, are left out of the counts instead; no take record is read
# (a peek has no lease of its own). KEYS: 5 per scope. ARGV: as TAKE's. Answers as TAKE does.
PEEK = _COMMON + r"""
local function window_ro(key, b)
  local raw = redis.call('HGETALL', key)
  local pairs_, sum = {}, 0
  for i = 1, #raw, 2 do
    local sec, n = tonumber(raw[i]), tonumber(raw[i + 1])
    if sec >= b - 60 then
      sum = sum + n
      pairs_[#pairs_ + 1] = {sec, n}
    end
  end
  return sum, pairs_
end
""" + _DECIDE + r"""
local now = now_s()
local b = math.floor(now)
local day = math.floor(now / 86400)
local n = (#ARGV - 4) / 6
local ok, limit, scope_name, retry, lreq, rreq, reset_req, ltok, rtok, reset_tok, tokens = decide(n, b, now, day, tonumber(ARGV[1]), tonumber(ARGV[4]), window_ro, false)
if ok == 1 then  -- the figures TAKE answers with once it took
  for i = 0, n - 1 do
    if ARGV[5 + i * 6] == '' then
      if rreq > 0 then rreq = rreq - 1 end
      if rtok >= 0 then rtok = math.max(0, rtok - tokens) end
    end
  end
end
return {ok, limit, scope_name, tostring(retry), b, day, lreq, rreq, tostring(reset_req), ltok, rtok, tostring(reset_tok)}
"""

# KEYS: 5 per scope, then the take's record. ARGV: bucket, day, token_delta, spend_delta (micro-USD:
# actual - reserved), lease. One delta for every scope: TAKE reserved the same on each. A positive
# delta goes to the current second's bucket, a negative one to the take's (while in the window);
# bucket -1 (a replay of what a replica counted on its own while Redis failed): the day's only.
# The record is left saying `settled` for 20 s (past the ~8 s a settle is retried over, and a resend's
# round trip): the same settle sent again (its reply was lost with its connection, and the client
# resends; a retry after a timeout it had run through) changes nothing a second time.
SETTLE = _COMMON + r"""
local b, day, delta, spend, lease = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local sec = math.floor(now_s())
if redis.call('GET', KEYS[#KEYS]) == 'settled' then return 1 end
redis.call('SET', KEYS[#KEYS], 'settled', 'PX', 20000)
-- the leases first: a script that fails later (an error leaves what ran before it) still gives them back
for k = 0, #KEYS - 2, 5 do
  redis.call('ZREM', KEYS[k + 3], lease)
end
for k = 0, #KEYS - 2, 5 do
  if delta ~= 0 then
    if b == '-1' then
      -- a replay: its seconds are gone, its day is not
    elseif delta > 0 then
      -- what it used past its reservation counts now (in the take's bucket it would leave the window with it)
      redis.call('HINCRBY', KEYS[k + 2], sec, delta)
      redis.call('PEXPIRE', KEYS[k + 2], 62000)
    elseif redis.call('HEXISTS', KEYS[k + 2], b) == 1 then
      local v = redis.call('HINCRBY', KEYS[k + 2], b, delta)
      if v < 0 then redis.call('HSET', KEYS[k + 2], b, 0) end
    end
    local d = redis.call('HINCRBY', KEYS[k + 4], day, delta)
    if d < 0 then redis.call('HSET', KEYS[k + 4], day, 0) end
    redis.call('PEXPIRE', KEYS[k + 4], 2 * 86400 * 1000)
  end
  if spend ~= 0 then
    local m = redis.call('HINCRBY', KEYS[k + 5], day, spend)
    if m < 0 then redis.call('HSET', KEYS[k + 5], day, 0) end
    redis.call('PEXPIRE', KEYS[k + 5], 2 * 86400 * 1000)
  end
end
return 1
"""

# KEYS: 5 per scope, then the take's record. ARGV: lease, ttl_ms. Reverses a take whose caller
# never learnt its answer (the round trip timed out, and it answered from its own counters): its
# request, tokens and lease come off every scope, as if it had not run. A take not run yet (still
# on its way) finds the record this leaves and takes nothing. Returns 1 when a take was reversed.
UNDO = r"""
local rec, lease, ttl = KEYS[#KEYS], ARGV[1], tonumber(ARGV[2])
local held = redis.call('GET', rec)
redis.call('SET', rec, 'undone', 'PX', ttl)
if not held or not string.match(held, '^%d+ %d+ ') then return 0 end  -- none, undone, or settled
local b, day, tokens, cost = string.match(held, '(%S+) (%S+) (%S+) (%S+)')
tokens, cost = tonumber(tokens), tonumber(cost)
for k = 0, #KEYS - 2, 5 do
  if redis.call('HEXISTS', KEYS[k + 1], b) == 1 then
    local r = redis.call('HINCRBY', KEYS[k + 1], b, -1)
    if r < 0 then redis.call('HSET', KEYS[k + 1], b, 0) end
  end
  if redis.call('HEXISTS', KEYS[k + 2], b) == 1 then
    local v = redis.call('HINCRBY', KEYS[k + 2], b, -tokens)
    if v < 0 then redis.call('HSET', KEYS[k + 2], b, 0) end
  end
  if redis.call('HEXISTS', KEYS[k + 4], day) == 1 then
    local d = redis.call('HINCRBY', KEYS[k + 4], day, -tokens)
    if d < 0 then redis.call('HSET', KEYS[k + 4], day, 0) end
  end
  if cost > 0 and redis.call('HEXISTS', KEYS[k + 5], day) == 1 then
    local m = redis.call('HINCRBY', KEYS[k + 5], day, -cost)
    if m < 0 then redis.call('HSET', KEYS[k + 5], day, 0) end
  end
  redis.call('ZREM', KEYS[k + 3], lease)
end
return 1
"""

# KEYS: the 5 keys of one scope. Returns window requests, window tokens, in flight, day tokens, day spend.
USAGE = _COMMON + r"""
local now = now_s()
local b = math.floor(now)
local day = math.floor(now / 86400)
local reqs = window(KEYS[1], b)
local toks = window(KEYS[2], b)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', math.floor(now * 1000))
return {reqs, toks, redis.call('ZCARD', KEYS[3]), tonumber(redis.call('HGET', KEYS[4], day) or '0'),
        tonumber(redis.call('HGET', KEYS[5], day) or '0')}
"""
