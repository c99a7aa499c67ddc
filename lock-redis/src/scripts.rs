//! The Lua scripts: acquire, extend and release, one round trip each, for
//! locks and for semaphore permits, the operator calls inspect and
//! force-release, and the connect-time ACL probe and format check: their
//! text and what each expects and answers. Running one is [`run`]'s
//! business; reading its reply, [`crate::replies`]'.
//!
//! The value at a lock key is `dl1:<32 hex owner>:<fencing token>`, with a
//! PX expiry (a format older clients parse too, so it never changes); the
//! holder label beside it, stored only by an acquisition that gave one, is
//! `<32 hex owner>:<label>` with the lock's PX expiry, shown by inspect
//! only while that owner holds the lock; the released-by marker holds such a value and a release id,
//! `dl1:<owner>:<token>/<hex id>`, with a PX expiry. A semaphore's permit
//! set is a sorted set of `dl1:<owner>:<token>:<limit>` scored by the
//! permit's expiry (server time in milliseconds), its released-by markers
//! a sorted set of `<owner>:<token>/<hex id>` scored the same way; both with
//! a PX expiry no earlier than their last member's; the permits' holder
//! labels a hash of `<owner>:<token>` to label (written only for a permit
//! whose holder gave one, deleted with the permit, with a PX expiry no
//! earlier than the permit set's), shown only for the live permit of that
//! owner and token. Anything else
//! at a key a script reads (another type, another format, no expiry) is
//! answered with a `DISTLOCK_CORRUPT lock|fence|gone <detail>` error reply
//! (`lock` is a semaphore's permit set) and nothing is written; an argument
//! out of range with `DISTLOCK_ARGS <detail>`, before anything is written.
//! The holder label is for people, so anything else at its key (a lock's
//! or the permits') does not stop a lock or permit operation: no script
//! writes, deletes or shows it (acquire then tells the client its label
//! was not stored).

mod run;

use std::sync::LazyLock;

use redis::Script;

/// Shared helpers, prepended to every script.
///
/// A script is not rolled back when it fails half-way, so every script
/// checks its arguments and everything it reads before its first write:
/// a value distlock did not write, at any key the script would write, is
/// reported and nothing is written.
const PRELUDE: &str = r#"
local function kind(key)
  local t = redis.call('TYPE', key)
  if type(t) == 'table' then t = t['ok'] end
  return t
end
-- The owner hex and fencing token of a lock value, or nil.
local function parse(v)
  local owner, fence = string.match(v, '^dl1:(%x+):(%d+)$')
  if owner ~= nil and #owner == 32 and #fence <= 20 then return owner, fence end
  return nil
end
local function ours(v)
  return parse(v) ~= nil
end
local function corrupt(which, detail)
  return redis.error_reply('DISTLOCK_CORRUPT ' .. which .. ' ' .. detail)
end
-- A string key of `which` whose value passes `valid`, with an expiry:
-- {value, pttl}; {} if there is none; an error reply (a table with
-- `err`) for anything else.
local function string_at(which, key, noun, valid)
  -- GET answers another type with an error: one command, not TYPE first.
  local v = redis.pcall('GET', key)
  if v == false then return {} end
  if type(v) ~= 'string' then return corrupt(which, 'holds a ' .. kind(key) .. ', not ' .. noun) end
  if not valid(v) then return corrupt(which, 'holds a value in a format distlock does not write') end
  local pttl = redis.call('PTTL', key)
  if pttl < 0 then return corrupt(which, 'has no expiry, which distlock never leaves') end
  return {value = v, pttl = pttl}
end
local function lock_at(key)
  return string_at('lock', key, 'a distlock lock', ours)
end
-- A holder label as a client sends it (a HolderId): 1 to 128 bytes, no
-- control character.
local function label_ok(s)
  return type(s) == 'string' and #s >= 1 and #s <= 128 and string.find(s, '%c') == nil
end
-- The holder label key: {owner = hex, label = text} if it holds what
-- distlock writes there (`<owner hex>:<label>`, with an expiry); {} if
-- there is none; nil for anything else, which no script writes, deletes or
-- shows. Read with pcall: another type there must not fail the script.
local function holder_at(key)
  local v = redis.pcall('GET', key)
  if v == false then return {} end
  if type(v) ~= 'string' then return nil end
  local owner, label = string.match(v, '^(%x+):(.*)$')
  if owner == nil or #owner ~= 32 or not label_ok(label) then return nil end
  if redis.call('PTTL', key) < 0 then return nil end
  return {owner = owner, label = label}
end
-- Pushes the expiry of `owner`'s label (if it has one there) to `ms`, as
-- its lock's.
local function holder_keep(key, owner, ms)
  local h = holder_at(key)
  if h ~= nil and h.owner == owner then redis.call('PEXPIRE', key, ms) end
end
-- After the lock was deleted: its label (any distlock label there is
-- stale once the lock is free) goes too. Whether there was one.
local function holder_drop(key)
  local h = holder_at(key)
  if h ~= nil and h.owner ~= nil then
    redis.call('DEL', key)
    return true
  end
  return false
end
-- Tells the key's observers that its labelled holder changed, on
-- `<channel>:observers` (no client id is `observers`: they are hex). Only
-- changes of a labelled holder are told (elections label every leader),
-- so an unlabelled lock pays nothing. A refused publish must not fail a
-- script that already wrote: observers fall back to reading.
local function observed(publish, channel)
  redis.pcall(publish, channel .. ':observers', '')
end
-- The released-by marker: a lock value and the id of the release that
-- deleted it, `dl1:<owner>:<token>/<release id>`.
local function marker(v)
  local lock, id = string.match(v, '^(.+)/(%x+)$')
  return lock ~= nil and #id <= 32 and ours(lock)
end
local function gone_at(key)
  return string_at('gone', key, 'a distlock released-by marker', marker)
end
-- The fencing counter: {counter, pttl} (0 and -2 if there is none), or an
-- error reply.
local function fence_at(key)
  local c = redis.pcall('GET', key)
  if c == false then return {counter = 0, pttl = -2} end
  if type(c) ~= 'string' then return corrupt('fence', 'holds a ' .. kind(key) .. ', not a fencing counter') end
  if string.match(c, '^%d+$') == nil or #c > 16 or tonumber(c) >= 9007199254740000 then
    return corrupt('fence', 'holds a value that is not a distlock fencing counter')
  end
  local pttl = redis.call('PTTL', key)
  if pttl < 0 then return corrupt('fence', 'has no expiry, which distlock never leaves') end
  return {counter = tonumber(c), pttl = pttl}
end
-- Keeps an existing fencing counter at least `keep` ms more (never less).
local function retain(key, fence, keep)
  if fence.pttl >= 0 and fence.pttl < tonumber(keep) then redis.call('PEXPIRE', key, keep) end
end
-- Durations in milliseconds: whole, positive, at most 15 digits, which
-- every expiry command accepts.
local function millis_ok(...)
  for _, a in ipairs({...}) do
    if type(a) ~= 'string' or string.match(a, '^[1-9]%d*$') == nil or #a > 15 then return false end
  end
  return true
end
local function bad_args(detail)
  return redis.error_reply('DISTLOCK_ARGS ' .. detail)
end
-- The server's clock, in milliseconds and in microseconds.
local function clock()
  local t = redis.call('TIME')
  local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  return math.floor(us / 1000), us
end
-- Integers as arguments: never in exponent form.
local function int(n)
  return string.format('%.0f', n)
end
-- Keeps `key` at least `ms` more (never less), so it outlives its members.
local function keep_for(key, ms)
  if redis.call('PTTL', key) < tonumber(ms) then redis.call('PEXPIRE', key, ms) end
end
-- The waiter line: a sorted set of `<client hex>:<owner hex>` scored by
-- arrival (server microseconds). Checked before a script's first write.
local function line_ok(key)
  local t = kind(key)
  if t == 'none' or t == 'zset' then return nil end
  return corrupt('waiters', 'holds a ' .. t .. ', not a distlock waiter line')
end
-- A failed attempt of a waiter (`member`, if the client sent one) joins
-- the line, keeping its place if it has one; the line outlives the wait
-- by at least `ms` (it is re-joined at every failed attempt).
local function join(key, member, ms)
  if member == nil or member == '' then return end
  local _, us = clock()
  redis.call('ZADD', key, 'NX', int(us), member)
  keep_for(key, int(ms))
end
-- A granted attempt leaves the line.
local function leave(key, member)
  if member ~= nil and member ~= '' then redis.call('ZREM', key, member) end
end
-- A lock's line is served in order (fair handoff): the free key goes to
-- the line's head. A head that was woken has a turn, the string
-- `<member>/<deadline>` (server milliseconds) at the turn key, with a PX
-- expiry of two turns: it stays first until it takes the key, leaves the
-- line, or its turn is over. {member, at} of the turn; {} if there is
-- none; an error reply for anything else.
local function turn_ok(v)
  local client, owner, at = string.match(v, '^(%x+):(%x+)/(%d+)$')
  return client ~= nil and #client <= 32 and #owner == 32 and #at <= 15
end
local function turn_at(key)
  local t = string_at('turn', key, 'a distlock waiter turn', turn_ok)
  if t.value then
    local member, at = string.match(t.value, '^(.+)/(%d+)$')
    t.member, t.at = member, tonumber(at)
  end
  return t
end
-- Serves the line `line` of a free lock for `requester` (a member, or ''
-- for none): {} if the requester may take the key (the line is empty, or
-- it is the head; `turn` then holds what `turn_at` read at `tkey` for the
-- head, for the grant to delete); else {wait = ms}, what the head's turn
-- has left. The turn is read only when the line has a head: a turn left
-- with no line behind it (its line ran out) is stale, and a new turn
-- replaces it. `fresh`: the head's turn is over (a release just freed
-- the lock), so it is woken again with a new one. A head whose turn is
-- over leaves the line; a head never woken (the key came free by expiry,
-- or its turn was dropped) is woken by publishing its owner on its
-- client's channel (`<channel>:<client>`; `publish` is PUBLISH, or
-- SPUBLISH in a cluster) and given a turn of `turn_ms`; one nobody
-- receives for (its client gone) leaves the line and the next is tried,
-- a few at most (then {wait = 1}: the next attempt goes on). A refused
-- publish (no ACL channel permission) still gives the turn, and its error
-- text comes back as `note`. A member distlock does not write at the head,
-- or a turn it does not write: an error reply (the heads dropped before it
-- are dropped either way). `now`: the server's clock in ms, or nil (read
-- here if needed).
local function serve(publish, channel, line, tkey, now, turn_ms, requester, fresh)
  local turn = nil
  for _ = 1, 8 do
    local first = redis.pcall('ZRANGE', line, 0, 0)
    if first['err'] then return corrupt('waiters', 'holds a ' .. kind(line) .. ', not a distlock waiter line') end
    local head = first[1]
    if head == nil then return {} end
    if turn == nil then
      turn = turn_at(tkey)
      if turn.err then return turn end
      if fresh and turn.value then
        redis.call('DEL', tkey)
        turn = {}
      end
    end
    if head == requester then return {turn = turn} end
    local client, owner = string.match(head, '^(%x+):(%x+)$')
    if client == nil or #client > 32 or #owner ~= 32 then
      return corrupt('waiters', 'holds a member in a format distlock does not write')
    end
    if now == nil then now = clock() end
    if turn.member == head then
      if turn.at > now then return {wait = turn.at - now} end
      -- Woken, and it never came: its turn is over.
      redis.call('DEL', tkey)
      turn = {}
    else
      local r = redis.pcall(publish, channel .. ':' .. client, owner)
      local refused = type(r) == 'table' and r['err']
      if refused or r > 0 then
        local ms = tonumber(turn_ms)
        redis.call('SET', tkey, head .. '/' .. int(now + ms), 'PX', int(2 * ms))
        return {wait = ms, note = refused or nil}
      end
    end
    redis.call('ZREM', line, head)
  end
  return {wait = 1}
end
-- After the lock was deleted (release, force-release) or a waiter left a
-- free lock's line: the head is woken with a fresh turn (`fresh`), or
-- served as `serve` does (one on its way keeps its turn). Returns 1, or
-- `{1, error}` when the wake-up failed (a line or turn distlock did not
-- write, a refused publish): the lock is released either way.
local function hand_on(publish, channel, line, tkey, turn_ms, fresh)
  local served = serve(publish, channel, line, tkey, nil, turn_ms, '', fresh)
  if served.err then return {1, served.err} end
  if served.note then return {1, served.note} end
  return 1
end
-- A semaphore's line (permits keep this): after a permit came free, wake
-- the first waiter of the line alone, by publishing its owner on its
-- client's channel. It leaves the line as it is woken (if its attempt
-- fails it joins again). A waiter nobody receives for (its client gone) is
-- dropped and the next one tried, a few at most; a frozen client's waiter
-- takes the wake-up with it, and the others fall back to their timers. A
-- refused publish (no ACL channel permission) must not fail the script
-- after its write: the permit is released either way; the error text goes
-- back for the client to log.
local function released(publish, channel, line)
  for _ = 1, 8 do
    -- Read, not checked before the DEL: a line that is not a sorted set
    -- fails the wake-up, not the release.
    local first = redis.pcall('ZRANGE', line, 0, 0)
    if first['err'] then
      return {1, 'DISTLOCK_CORRUPT waiters holds something other than a distlock waiter line'}
    end
    local head = first[1]
    if head == nil then return 1 end
    local client, owner = string.match(head, '^(%x+):(%x+)$')
    if client == nil or #client > 32 or #owner ~= 32 then
      return {1, 'DISTLOCK_CORRUPT waiters holds a member in a format distlock does not write'}
    end
    redis.call('ZREM', line, head)
    local r = redis.pcall(publish, channel .. ':' .. client, owner)
    if type(r) == 'table' and r['err'] then return {1, r['err']} end
    if r > 0 then return 1 end
  end
  return 1
end
"#;

/// KEYS: lock, fence, waiter line, holder label, turn. ARGV: owner hex,
/// ttl ms, fence retention ms, waiter member (empty for an attempt that
/// does not wait), holder label (empty for none), the key's channel and
/// publish command (a waiter is woken there; with a label its observers
/// are told), turn ms. Returns `{1, token}` when acquired (`{1, token,
/// 'foreign'}` if the label was not stored: data distlock did not write is
/// at its key), `{0, ms}` when held (`ms`: the holder's PTTL) or when the
/// free key is another waiter's turn (`ms`: what that turn has left); a
/// waiter then joins the line.
///
/// The lock held by this same owner is *adopted*: an earlier attempt of
/// the same acquisition took it but its reply was lost (a timeout, a
/// dropped connection, a driver resending the request). Its TTL is reset
/// to `ttl` from now and its own fencing token returned; its label is set
/// again, or the one it stored kept as long. Without a label a fresh
/// acquisition never touches the label key: a label left there by another
/// owner is never shown. Adoption comes first, whatever the line holds.
///
/// A free lock goes to the head of its line (`serve` in [`PRELUDE`]): to the
/// requester if the line is empty or it is the head; anyone else (an
/// attempt that does not wait too) is refused, and a waiter joins the
/// line's end (keeping its place if it has one).
const ACQUIRE: &str = r#"
if not millis_ok(ARGV[2], ARGV[3], ARGV[8]) then
  return bad_args('ttl ' .. tostring(ARGV[2]) .. ' ms, fence retention ' .. tostring(ARGV[3])
    .. ' ms, turn ' .. tostring(ARGV[8]) .. ' ms')
end
if ARGV[5] ~= '' and not label_ok(ARGV[5]) then
  return bad_args('holder label of ' .. #tostring(ARGV[5]) .. ' bytes or with a control character')
end
if ARGV[7] ~= 'PUBLISH' and ARGV[7] ~= 'SPUBLISH' then
  return bad_args('publish command ' .. tostring(ARGV[7]))
end
-- After a grant: stores the label (or keeps an adopted one as long as the
-- lock); 'foreign' if data distlock did not write is at its key.
local function label(adopted)
  if ARGV[5] == '' and not adopted then return nil end
  local h = holder_at(KEYS[4])
  if h == nil then
    if ARGV[5] ~= '' then return 'foreign' end
    return nil
  end
  if ARGV[5] ~= '' then
    redis.call('SET', KEYS[4], ARGV[1] .. ':' .. ARGV[5], 'PX', ARGV[2])
    observed(ARGV[7], ARGV[6])
  elseif h.owner == ARGV[1] then
    redis.call('PEXPIRE', KEYS[4], ARGV[2])
  end
  return nil
end
local lock = lock_at(KEYS[1])
if lock.err then return lock end
local fence = fence_at(KEYS[2])
if fence.err then return fence end
if lock.value then
  -- Read by a waiter (it joins or leaves the line); not by an attempt
  -- that does not wait. On a free key `serve` reads it.
  if ARGV[4] ~= '' then
    local bad_line = line_ok(KEYS[3])
    if bad_line then return bad_line end
  end
  local owner, token = parse(lock.value)
  if owner ~= ARGV[1] then
    join(KEYS[3], ARGV[4], lock.pttl + tonumber(ARGV[2]))
    return {0, lock.pttl}
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  retain(KEYS[2], fence, ARGV[3])
  leave(KEYS[3], ARGV[4])
  return {1, token, label(true)}
end
local now, us = clock()
local served = serve(ARGV[7], ARGV[6], KEYS[3], KEYS[5], now, ARGV[8], ARGV[4], false)
if served.err then return served end
if served.wait then
  join(KEYS[3], ARGV[4], served.wait + tonumber(ARGV[2]))
  return {0, served.wait}
end
local token = us
if fence.counter + 1 > token then token = fence.counter + 1 end
local text = int(token)
redis.call('SET', KEYS[1], 'dl1:' .. ARGV[1] .. ':' .. text, 'PX', ARGV[2])
redis.call('SET', KEYS[2], text, 'PX', ARGV[3])
leave(KEYS[3], ARGV[4])
if served.turn and served.turn.value then redis.call('DEL', KEYS[5]) end
return {1, text, label(false)}
"#;

/// KEYS: lock, fence, holder label. ARGV: expected value, ttl ms, fence
/// retention ms, `1` if the lock was taken without a label (its label key
/// is not read). Returns 1 when extended (the owner's label with it), 0
/// when not held. Never recreates the lock.
const EXTEND: &str = r#"
if not millis_ok(ARGV[2], ARGV[3]) then
  return bad_args('ttl ' .. tostring(ARGV[2]) .. ' ms, fence retention ' .. tostring(ARGV[3]) .. ' ms')
end
local lock = lock_at(KEYS[1])
if lock.err then return lock end
if lock.value ~= ARGV[1] then return 0 end
local fence = fence_at(KEYS[2])
if fence.err then return fence end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
retain(KEYS[2], fence, ARGV[3])
if ARGV[4] ~= '1' then holder_keep(KEYS[3], (parse(ARGV[1])), ARGV[2]) end
return 1
"#;

/// The extend script for many locks of one client (not in a cluster: the
/// keys span slots). KEYS: lock, fence and holder label of each lock, in
/// threes. ARGV:
/// ttl ms, fence retention ms, then each lock's expected value. Returns
/// one answer per lock: 1 when extended, 0 when not held, or the
/// `DISTLOCK_CORRUPT` message for data distlock did not write at its keys
/// (each lock checked before it is written, as EXTEND does).
const EXTEND_MANY: &str = r#"
if not millis_ok(ARGV[1], ARGV[2]) then
  return bad_args('ttl ' .. tostring(ARGV[1]) .. ' ms, fence retention ' .. tostring(ARGV[2]) .. ' ms')
end
if #KEYS ~= 3 * (#ARGV - 2) then
  return bad_args(#KEYS .. ' keys for ' .. (#ARGV - 2) .. ' locks')
end
local answers = {}
for i = 1, #ARGV - 2 do
  local lock = lock_at(KEYS[3 * i - 2])
  local fence = {}
  if not lock.err and lock.value == ARGV[i + 2] then fence = fence_at(KEYS[3 * i - 1]) end
  if lock.err then answers[i] = lock.err
  elseif lock.value ~= ARGV[i + 2] then answers[i] = 0
  elseif fence.err then answers[i] = fence.err
  else
    redis.call('PEXPIRE', KEYS[3 * i - 2], ARGV[1])
    retain(KEYS[3 * i - 1], fence, ARGV[2])
    holder_keep(KEYS[3 * i], (parse(lock.value)), ARGV[1])
    answers[i] = 1
  end
end
return answers
"#;

/// KEYS: lock, released-by marker, waiter line, holder label (deleted with
/// the lock), turn. ARGV: expected value,
/// channel, publish command, marker life ms, release id (fresh hex per
/// release call), turn ms, `1` if the lock was taken without a label (its
/// label key is not read: any label there is another owner's, stale, never
/// shown, and expires with that owner's lock). Returns 1 when released (and the line's head
/// woken, keeping its place with a fresh turn), `{1, error}` when released
/// but the wake-up failed, 0 when not held.
///
/// A release leaves its value and id in the marker for the marker life (at
/// most the lock's remaining TTL): the same request sent again (a driver
/// resending it after a dropped connection) answers 1, as the first did;
/// another release of the same lock (another id) answers 0.
const RELEASE: &str = r#"
if not millis_ok(ARGV[4], ARGV[6]) then
  return bad_args('released-marker life ' .. tostring(ARGV[4]) .. ' ms, turn ' .. tostring(ARGV[6]) .. ' ms')
end
if type(ARGV[5]) ~= 'string' or string.match(ARGV[5], '^%x+$') == nil or #ARGV[5] > 32 then
  return bad_args('release id ' .. tostring(ARGV[5]))
end
local lock = lock_at(KEYS[1])
if lock.err then return lock end
local gone = gone_at(KEYS[2])
if gone.err then return gone end
local mark = ARGV[1] .. '/' .. ARGV[5]
if lock.value ~= ARGV[1] then
  if gone.value == mark then return 1 end
  return 0
end
redis.call('DEL', KEYS[1])
local labelled = ARGV[7] ~= '1' and holder_drop(KEYS[4])
local keep = math.min(lock.pttl, tonumber(ARGV[4]))
if keep < 1 then keep = 1 end
redis.call('SET', KEYS[2], mark, 'PX', string.format('%.0f', keep))
local woke = hand_on(ARGV[3], ARGV[2], KEYS[3], KEYS[5], ARGV[6], true)
if labelled then observed(ARGV[3], ARGV[2]) end
return woke
"#;

/// Helpers of the permit scripts, after [`PRELUDE`].
///
/// A permit lives while its score (its expiry, server milliseconds) is
/// later than the server's clock; expired members are swept by the next
/// script that writes the set. Every member and score is checked before
/// the first write, as every lock value is.
const PERMIT_PRELUDE: &str = r#"
-- A permit limit: 1 to 2^32 - 1, as the client sends it.
local function limit_ok(s)
  return type(s) == 'string' and string.match(s, '^[1-9]%d*$') ~= nil and #s <= 10
    and tonumber(s) <= 4294967295
end
-- A permit, `dl1:<owner>:<token>:<limit>`: its parts, or nil.
local function permit(m)
  local owner, token, limit = string.match(m, '^dl1:(%x+):(%d+):(%d+)$')
  if owner == nil or #owner ~= 32 or #token > 20 or not limit_ok(limit) then return nil end
  return {owner = owner, token = token, limit = tonumber(limit)}
end
-- A permit's released-by marker, `<owner>:<token>/<release id>`.
local function permit_mark(m)
  local owner, token, id = string.match(m, '^(%x+):(%d+)/(%x+)$')
  if owner == nil or #owner ~= 32 or #token > 20 or #id > 32 then return nil end
  return {}
end
-- A sorted set of `which` whose members pass `parse` and whose scores are
-- expiry times (whole milliseconds below 2^53), with an expiry:
-- {entries = {...}}, each the parsed member plus `member` and `at` (its
-- score), none if there is no key; an error reply for anything else.
local function entries_at(which, key, noun, parse)
  local t = kind(key)
  if t == 'none' then return {entries = {}} end
  if t ~= 'zset' then return corrupt(which, 'holds a ' .. t .. ', not ' .. noun) end
  local flat = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  local entries = {}
  for i = 1, #flat, 2 do
    local e = parse(flat[i])
    local at = tonumber(flat[i + 1])
    if e == nil or at == nil or at ~= math.floor(at) or at < 0 or at >= 9007199254740992 then
      return corrupt(which, 'holds a member in a format distlock does not write')
    end
    e.member = flat[i]
    e.at = at
    table.insert(entries, e)
  end
  if redis.call('PTTL', key) < 0 then
    return corrupt(which, 'has no expiry, which distlock never leaves')
  end
  return {entries = entries}
end
local function permits_at(key)
  return entries_at('lock', key, 'a distlock permit set', permit)
end
local function marks_at(key)
  return entries_at('gone', key, 'a set of distlock released-by markers', permit_mark)
end
-- The live permit of `owner` (with fencing token `token`, unless nil).
local function live_permit(entries, owner, token, now)
  for _, p in ipairs(entries) do
    if p.at > now and p.owner == owner and (token == nil or p.token == token) then return p end
  end
  return nil
end
-- Removes the members that expired by `now`.
local function sweep(key, now)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
end
-- The permits' holder labels: a hash of `<owner hex>:<token>` (one
-- permit) to its label, with an expiry no earlier than the permit set's.
-- true if the key is such a hash, 'none' if there is no key, false for
-- anything else, which no script writes, deletes or shows: labels are for
-- people, so nothing there may stop a permit operation (read with pcall:
-- an ACL refusal counts as anything else).
local function labels_ok(key)
  local t = redis.pcall('TYPE', key)
  if type(t) == 'table' then t = t['ok'] end
  if t == 'none' then return 'none' end
  if t ~= 'hash' then return false end
  local pttl = redis.pcall('PTTL', key)
  return type(pttl) == 'number' and pttl >= 0
end
local function label_field(p)
  return p.owner .. ':' .. p.token
end
-- The label stored for permit `p` (its own owner and token), or nil.
local function label_of(key, p)
  local v = redis.pcall('HGET', key, label_field(p))
  if type(v) == 'string' and label_ok(v) then return v end
  return nil
end
-- Keeps the labels at least as long as the permit set `set` (after its
-- expiry was pushed). `ok`: what `labels_ok` said of `key` earlier in this
-- script (read once: a deletion since leaves nothing to keep).
local function labels_keep(key, set, ok)
  if ok ~= true then return end
  local want = redis.call('PTTL', set)
  if want > 0 and redis.call('PTTL', key) < want then redis.pcall('PEXPIRE', key, want) end
end
-- The labels of the permits among `entries` that ran out by `now`, and of
-- `released`: deleted with them (a label never outlives its permit's
-- member). `ok`: what `labels_ok` said of `key`.
local function labels_drop(key, entries, now, released, ok)
  if ok ~= true then return end
  for _, p in ipairs(entries) do
    if p.at <= now or p == released then redis.pcall('HDEL', key, label_field(p)) end
  end
end
-- The live permits: how many, under which limit, and when the first
-- runs out; or an error reply (two limits).
local function live_permits(entries, now)
  local live, stored, first = 0, nil, nil
  for _, p in ipairs(entries) do
    if p.at > now then
      if stored ~= nil and stored ~= p.limit then
        return corrupt('lock', 'holds live permits under two limits, which distlock never writes')
      end
      stored = p.limit
      live = live + 1
      if first == nil or p.at < first then first = p.at end
    end
  end
  return {live = live, limit = stored, first = first}
end
"#;

/// KEYS: permit set, fence, waiter line, holder labels. ARGV: owner hex,
/// ttl ms, fence retention ms, limit, waiter member (empty for an attempt
/// that does not wait), holder label (empty for none). Returns `{1,
/// token}` when granted (`{1, token, 'foreign'}` if the label was not
/// stored: data distlock did not write is at its key), `{0, ms}` when full
/// (until the first live permit runs out; a waiter then joins the line),
/// `{2, stored limit}` when live permits are held under another limit.
///
/// The label is stored under the permit's owner and fencing token, so it
/// is only ever shown for that permit; without one, nothing is written
/// there. Labels of the permits the sweep removes go with them.
///
/// The limit is stored in every permit; with no live permit the request's
/// applies. The live permit of this same owner is adopted, as the lock is
/// ([`ACQUIRE`]): its TTL reset to `ttl` from now, its own fencing token.
/// Fencing tokens come from the semaphore's own counter, as the lock's.
const ACQUIRE_PERMIT: &str = r#"
if not millis_ok(ARGV[2], ARGV[3]) then
  return bad_args('ttl ' .. tostring(ARGV[2]) .. ' ms, fence retention ' .. tostring(ARGV[3]) .. ' ms')
end
if not limit_ok(ARGV[4]) then return bad_args('permit limit ' .. tostring(ARGV[4])) end
if ARGV[6] ~= '' and not label_ok(ARGV[6]) then
  return bad_args('holder label of ' .. #tostring(ARGV[6]) .. ' bytes or with a control character')
end
-- After the grant of the permit `field` names: its label, kept as long
-- as the permit set; 'foreign' if it could not be stored. `ok`: what
-- `labels_ok` said of the labels before the grant (the sweep's deletions
-- since may have removed the hash: HSET then creates it).
local function label(field, ok)
  if ARGV[6] == '' then
    labels_keep(KEYS[4], KEYS[1], ok)
    return nil
  end
  if ok == false then return 'foreign' end
  local r = redis.pcall('HSET', KEYS[4], field, ARGV[6])
  if type(r) == 'table' and r['err'] then return 'foreign' end
  -- A hash it created has no expiry yet.
  local want = redis.call('PTTL', KEYS[1])
  if redis.call('PTTL', KEYS[4]) < want then redis.pcall('PEXPIRE', KEYS[4], want) end
  return nil
end
local set = permits_at(KEYS[1])
if set.err then return set end
local fence = fence_at(KEYS[2])
if fence.err then return fence end
if ARGV[5] ~= '' then
  local bad_line = line_ok(KEYS[3])
  if bad_line then return bad_line end
end
local now, us = clock()
local held = live_permits(set.entries, now)
if held.err then return held end
local limit = tonumber(ARGV[4])
if held.limit ~= nil and held.limit ~= limit then return {2, held.limit} end
local own = live_permit(set.entries, ARGV[1], nil, now)
if own == nil and held.live >= limit then
  join(KEYS[3], ARGV[5], held.first - now + tonumber(ARGV[2]))
  return {0, held.first - now}
end
local expires = int(now + tonumber(ARGV[2]))
sweep(KEYS[1], now)
local labels = labels_ok(KEYS[4])
labels_drop(KEYS[4], set.entries, now, nil, labels)
leave(KEYS[3], ARGV[5])
if own ~= nil then
  redis.call('ZADD', KEYS[1], expires, own.member)
  keep_for(KEYS[1], ARGV[2])
  retain(KEYS[2], fence, ARGV[3])
  return {1, own.token, label(label_field(own), labels)}
end
local token = us
if fence.counter + 1 > token then token = fence.counter + 1 end
local text = int(token)
redis.call('ZADD', KEYS[1], expires, 'dl1:' .. ARGV[1] .. ':' .. text .. ':' .. ARGV[4])
keep_for(KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], text, 'PX', ARGV[3])
return {1, text, label(ARGV[1] .. ':' .. text, labels)}
"#;

/// KEYS: permit set, fence, holder labels. ARGV: owner hex, fencing
/// token, ttl ms, fence retention ms. Returns 1 when extended (the labels
/// kept as long as the permits), 0 when this owner and token hold no live
/// permit. Never recreates a permit.
const EXTEND_PERMIT: &str = r#"
if not millis_ok(ARGV[3], ARGV[4]) then
  return bad_args('ttl ' .. tostring(ARGV[3]) .. ' ms, fence retention ' .. tostring(ARGV[4]) .. ' ms')
end
local set = permits_at(KEYS[1])
if set.err then return set end
local fence = fence_at(KEYS[2])
if fence.err then return fence end
local now = clock()
local mine = live_permit(set.entries, ARGV[1], ARGV[2], now)
if mine == nil then return 0 end
sweep(KEYS[1], now)
local labels = labels_ok(KEYS[3])
labels_drop(KEYS[3], set.entries, now, nil, labels)
redis.call('ZADD', KEYS[1], 'XX', int(now + tonumber(ARGV[3])), mine.member)
keep_for(KEYS[1], ARGV[3])
labels_keep(KEYS[3], KEYS[1], labels)
retain(KEYS[2], fence, ARGV[4])
return 1
"#;

/// KEYS: permit set, released-by markers, waiter line, holder labels (the
/// permit's goes with it). ARGV: owner hex,
/// fencing token, channel, publish command, marker life ms, release id.
/// Returns as
/// [`RELEASE`], whose resend rule it follows: a marker per released permit
/// (several permits may be released within one marker life), swept once
/// expired.
const RELEASE_PERMIT: &str = r#"
if not millis_ok(ARGV[5]) then
  return bad_args('released-marker life ' .. tostring(ARGV[5]) .. ' ms')
end
if type(ARGV[6]) ~= 'string' or string.match(ARGV[6], '^%x+$') == nil or #ARGV[6] > 32 then
  return bad_args('release id ' .. tostring(ARGV[6]))
end
local set = permits_at(KEYS[1])
if set.err then return set end
local marks = marks_at(KEYS[2])
if marks.err then return marks end
local now = clock()
local mark = ARGV[1] .. ':' .. ARGV[2] .. '/' .. ARGV[6]
local mine = live_permit(set.entries, ARGV[1], ARGV[2], now)
if mine == nil then
  for _, m in ipairs(marks.entries) do
    if m.member == mark and m.at > now then return 1 end
  end
  return 0
end
sweep(KEYS[1], now)
redis.call('ZREM', KEYS[1], mine.member)
labels_drop(KEYS[4], set.entries, now, mine, labels_ok(KEYS[4]))
local keep = math.min(mine.at - now, tonumber(ARGV[5]))
if keep < 1 then keep = 1 end
sweep(KEYS[2], now)
redis.call('ZADD', KEYS[2], int(now + keep), mark)
keep_for(KEYS[2], int(keep))
return released(ARGV[4], ARGV[3], KEYS[3])
"#;

/// KEYS: permit set, waiter line. ARGV: waiter member, channel, publish
/// command. [`LEAVE`] for a semaphore: the next waiter is woken if a
/// permit is free.
const LEAVE_PERMIT: &str = r#"
local set = permits_at(KEYS[1])
if set.err then return set end
local bad_line = line_ok(KEYS[2])
if bad_line then return bad_line end
local held = live_permits(set.entries, clock())
if held.err then return held end
redis.call('ZREM', KEYS[2], ARGV[1])
if held.limit ~= nil and held.live >= held.limit then return 1 end
return released(ARGV[3], ARGV[2], KEYS[2])
"#;

/// KEYS: permit set, holder labels. Returns the live permits, each
/// `{token, pttl, limit, label}` (`label` empty if none is stored for that
/// permit's owner and token). Writes nothing.
const INSPECT_PERMITS: &str = r#"
local set = permits_at(KEYS[1])
if set.err then return set end
local now = clock()
local labelled = labels_ok(KEYS[2]) == true
local live = {}
for _, p in ipairs(set.entries) do
  if p.at > now then
    local label = nil
    if labelled then label = label_of(KEYS[2], p) end
    table.insert(live, {p.token, p.at - now, p.limit, label or ''})
  end
end
return live
"#;

/// KEYS: lock, holder label. Returns `{0}` when free, `{1, pttl, token}`
/// when held, `{1, pttl, token, label}` when held by the owner that stored
/// the label (a label of another owner is stale: never shown).
const INSPECT: &str = r#"
local lt = kind(KEYS[1])
if lt == 'none' then return {0} end
if lt ~= 'string' then return corrupt('lock', 'holds a ' .. lt .. ', not a distlock lock') end
local v = redis.call('GET', KEYS[1])
if not ours(v) then return corrupt('lock', 'holds a value in a format distlock does not write') end
local owner, fence = parse(v)
local h = holder_at(KEYS[2])
local label = nil
if h ~= nil and h.owner == owner then label = h.label end
return {1, redis.call('PTTL', KEYS[1]), fence, label}
"#;

/// KEYS: lock, waiter line, holder label, turn. ARGV: channel, publish
/// command, turn ms. Deletes the lock whoever holds it, and its label
/// (telling observers); wakes the line's head as [`RELEASE`] does.
/// Returns as [`RELEASE`] (0 when free).
const FORCE_RELEASE: &str = r#"
if not millis_ok(ARGV[3]) then return bad_args('turn ' .. tostring(ARGV[3]) .. ' ms') end
local lt = kind(KEYS[1])
if lt == 'none' then return 0 end
if lt ~= 'string' then return corrupt('lock', 'holds a ' .. lt .. ', not a distlock lock') end
if not ours(redis.call('GET', KEYS[1])) then
  return corrupt('lock', 'holds a value in a format distlock does not write')
end
redis.call('DEL', KEYS[1])
local labelled = holder_drop(KEYS[3])
local woke = hand_on(ARGV[2], ARGV[1], KEYS[2], KEYS[4], ARGV[3], true)
if labelled then observed(ARGV[2], ARGV[1]) end
return woke
"#;

/// KEYS: lock, waiter line, turn. ARGV: waiter member, channel, publish
/// command, turn ms. A waiter whose wait ended without the lock leaves the
/// line (and its turn, if it was woken); if the lock is free, the line's
/// head is served as an attempt would serve it: the next waiter is woken
/// with a turn unless the head already has one. Leaving twice (or a member
/// not in the line) changes nothing. Returns as [`RELEASE`].
const LEAVE: &str = r#"
if not millis_ok(ARGV[4]) then return bad_args('turn ' .. tostring(ARGV[4]) .. ' ms') end
local bad_line = line_ok(KEYS[2])
if bad_line then return bad_line end
local turn = turn_at(KEYS[3])
if turn.err then return turn end
redis.call('ZREM', KEYS[2], ARGV[1])
if turn.member == ARGV[1] then redis.call('DEL', KEYS[3]) end
if kind(KEYS[1]) ~= 'none' then return 1 end
return hand_on(ARGV[3], ARGV[2], KEYS[2], KEYS[3], ARGV[4], false)
"#;

/// KEYS: a lock's lock, fence and released-by marker keys, then a
/// semaphore's permit set, fence and released-by markers, then the lock's
/// and the semaphore's waiter lines, then the lock's holder label and
/// turn. ARGV: a lock's
/// channel, the publish, subscribe and unsubscribe commands (sharded in a
/// cluster), a semaphore's channel, the format marker (an argument, not a
/// key: it lies in another cluster slot, and the probe touches no key);
/// all in the namespace.
/// Runs nothing: returns what the ACL user may not do there, as a flat list
/// of `command, 'keys'|'channels'|''` pairs. Empty on servers before 7.0
/// (no `redis.acl_check_cmd`); they report missing permissions at first use.
const PROBE: &str = r#"
local denied = {}
if redis.acl_check_cmd then
  local function check(scope, ...)
    if not redis.acl_check_cmd(...) then
      table.insert(denied, (...))
      table.insert(denied, scope)
    end
  end
  for i, k in ipairs(KEYS) do
    check('keys', 'TYPE', k)
    check('keys', 'PTTL', k)
    check('keys', 'PEXPIRE', k, '1')
    if i == 4 or (i >= 6 and i <= 8) then
      check('keys', 'ZRANGE', k, '0', '-1', 'WITHSCORES')
      check('keys', 'ZADD', k, '1', 'm')
      check('keys', 'ZREM', k, 'm')
      check('keys', 'ZREMRANGEBYSCORE', k, '-inf', '1')
    else
      check('keys', 'GET', k)
      check('keys', 'SET', k, 'v', 'PX', '1')
    end
  end
  check('keys', 'TYPE', ARGV[6])
  check('keys', 'GET', ARGV[6])
  check('keys', 'SET', ARGV[6], '1')
  check('keys', 'DEL', KEYS[1])
  check('keys', 'DEL', KEYS[9])
  check('keys', 'DEL', KEYS[10])
  check('', 'TIME')
  for _, channel in ipairs({ARGV[1], ARGV[5]}) do
    check('channels', ARGV[2], channel, 'released')
    check('channels', ARGV[3], channel)
    check('channels', ARGV[4], channel)
  end
  check('', 'PING')
end
return denied
"#;

/// KEYS: the namespace's format marker. ARGV: this client's format number.
/// Stores the number if there is no marker (no expiry), then returns the
/// marker's text; anything but a string there is a `DISTLOCK_CORRUPT
/// format a <type>` error reply (the wording of the refusal is the core's,
/// [`distlock_core::foreign_storage_format`]), and nothing is written.
const FORMAT: &str = r#"
local t = kind(KEYS[1])
if t == 'none' then
  redis.call('SET', KEYS[1], ARGV[1])
  return ARGV[1]
end
if t ~= 'string' then return corrupt('format', 'a ' .. t) end
return redis.call('GET', KEYS[1])
"#;

/// The largest duration argument the scripts accept, in milliseconds (15
/// digits: exact in Lua, and far from overflowing the server's clock).
pub(crate) const MAX_ARG_MILLIS: u64 = 999_999_999_999_999;

/// A Lua script: its text, for EVAL, and its SHA1, for EVALSHA.
pub(crate) struct LuaScript {
    body: String,
    sha: String,
}

impl LuaScript {
    fn new(body: &str) -> Self {
        // Redis < 5 needs effects replication for TIME before writes; newer
        // servers replicate effects anyway.
        let body = format!(
            "if redis.replicate_commands then redis.replicate_commands() end\n{}{body}",
            helpers_used(&format!("{PRELUDE}{PERMIT_PRELUDE}"), body)
        );
        let sha = Script::new(&body).get_hash().to_owned();
        Self { body, sha }
    }
}

/// The helpers of `prelude` that `body` names, directly or through
/// another helper, in the prelude's order (a helper is defined before the
/// helpers that call it). Redis runs a script's whole text at every call,
/// defining each helper anew, so a script carries only the helpers it
/// uses. A helper is a top-level `local function NAME` with the comment
/// lines above it; it is used where NAME appears as a word (a call, or the
/// function passed as a value). Any other top-level statement is kept.
fn helpers_used(prelude: &str, body: &str) -> String {
    struct Helper<'a> {
        name: Option<&'a str>,
        text: String,
    }
    let mut helpers: Vec<Helper<'_>> = Vec::new();
    let mut comments = String::new();
    for line in prelude.lines() {
        if line.starts_with("--") {
            comments.push_str(line);
            comments.push('\n');
            continue;
        }
        let starts = line.starts_with("local ") || helpers.is_empty();
        if starts {
            let name = line
                .strip_prefix("local function ")
                .and_then(|rest| rest.split('(').next());
            helpers.push(Helper {
                name,
                text: std::mem::take(&mut comments),
            });
        }
        if let Some(current) = helpers.last_mut() {
            current.text.push_str(&std::mem::take(&mut comments));
            current.text.push_str(line);
            current.text.push('\n');
        }
    }
    let names = |text: &str, name: &str| {
        text.match_indices(name).any(|(at, _)| {
            let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
            !text[..at].ends_with(word) && !text[at + name.len()..].starts_with(word)
        })
    };
    let mut used = vec![false; helpers.len()];
    let mut texts = vec![body];
    while let Some(text) = texts.pop() {
        for (i, helper) in helpers.iter().enumerate() {
            let needed = helper.name.is_none_or(|name| names(text, name));
            if needed && !used[i] {
                used[i] = true;
                texts.push(&helper.text);
            }
        }
    }
    helpers
        .iter()
        .zip(used)
        .filter(|(_, used)| *used)
        .map(|(helper, _)| helper.text.as_str())
        .collect()
}

/// The acquire script.
pub(crate) static ACQUIRE_SCRIPT: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(ACQUIRE));
/// The extend script.
pub(crate) static EXTEND_SCRIPT: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(EXTEND));
/// The extend script for many locks.
pub(crate) static EXTEND_MANY_SCRIPT: LazyLock<LuaScript> =
    LazyLock::new(|| LuaScript::new(EXTEND_MANY));
/// The release script.
pub(crate) static RELEASE_SCRIPT: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(RELEASE));
/// The permit acquire script.
pub(crate) static ACQUIRE_PERMIT_SCRIPT: LazyLock<LuaScript> =
    LazyLock::new(|| LuaScript::new(ACQUIRE_PERMIT));
/// The permit extend script.
pub(crate) static EXTEND_PERMIT_SCRIPT: LazyLock<LuaScript> =
    LazyLock::new(|| LuaScript::new(EXTEND_PERMIT));
/// The permit release script.
pub(crate) static RELEASE_PERMIT_SCRIPT: LazyLock<LuaScript> =
    LazyLock::new(|| LuaScript::new(RELEASE_PERMIT));
/// The leave script (a wait ended without the lock).
pub(crate) static LEAVE_SCRIPT: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(LEAVE));
/// The permit leave script.
pub(crate) static LEAVE_PERMIT_SCRIPT: LazyLock<LuaScript> =
    LazyLock::new(|| LuaScript::new(LEAVE_PERMIT));
/// The ACL probe, run at connect.
pub(crate) static PROBE_SCRIPT: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(PROBE));
/// The format marker check, run at connect.
pub(crate) static FORMAT_SCRIPT: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(FORMAT));

/// The inspect script (operators only; not preloaded).
pub(crate) static INSPECT_SCRIPT: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(INSPECT));
/// The permit inspect script (operators only; not preloaded).
pub(crate) static INSPECT_PERMITS_SCRIPT: LazyLock<LuaScript> =
    LazyLock::new(|| LuaScript::new(INSPECT_PERMITS));
/// The force-release script (operators only; not preloaded).
pub(crate) static FORCE_RELEASE_SCRIPT: LazyLock<LuaScript> =
    LazyLock::new(|| LuaScript::new(FORCE_RELEASE));
/// The SHA1 of the acquire script, for this crate's integration tests
/// (they count its EVALSHA calls); not a stable API.
#[doc(hidden)]
pub fn acquire_script_sha() -> &'static str {
    &ACQUIRE_SCRIPT.sha
}

/// The value stored at a lock key for `owner_hex` and `fencing`.
pub(crate) fn lock_value(owner_hex: &str, fencing: u64) -> String {
    format!("dl1:{owner_hex}:{fencing}")
}

/// The scripts every client runs, for preloading.
pub(crate) fn all() -> [&'static LuaScript; 9] {
    [
        &PROBE_SCRIPT,
        &ACQUIRE_SCRIPT,
        &EXTEND_SCRIPT,
        &RELEASE_SCRIPT,
        &ACQUIRE_PERMIT_SCRIPT,
        &EXTEND_PERMIT_SCRIPT,
        &RELEASE_PERMIT_SCRIPT,
        &LEAVE_SCRIPT,
        &LEAVE_PERMIT_SCRIPT,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_script_carries_the_helpers_it_uses_and_theirs_in_order() {
        let prelude = "
-- One.
local function one(x)
  return x
end
-- Two, which calls one.
local function two(x)
  return one(x) + 1
end
local function unused()
  return 0
end
local function passed(v)
  return v
end
";
        let text = helpers_used(prelude, "return two(1) + call(passed)");
        assert_eq!(
            text,
            "\n-- One.\nlocal function one(x)\n  return x\nend\n-- Two, which calls one.\nlocal function two(x)\n  return one(x) + 1\nend\nlocal function passed(v)\n  return v\nend\n"
        );
        // A name inside another word is no use of it.
        assert!(!helpers_used(prelude, "return someone(1)").contains("function one"));
    }

    #[test]
    fn every_helper_a_script_names_is_defined_in_it() {
        let prelude = format!("{PRELUDE}{PERMIT_PRELUDE}");
        let helper_names: Vec<&str> = prelude
            .lines()
            .filter_map(|l| l.strip_prefix("local function "))
            .filter_map(|rest| rest.split('(').next())
            .collect();
        for script in all().into_iter().chain([
            &*INSPECT_SCRIPT,
            &*FORCE_RELEASE_SCRIPT,
            &*INSPECT_PERMITS_SCRIPT,
        ]) {
            for name in &helper_names {
                let call = format!("{name}(");
                let calls = script.body.match_indices(&call).any(|(at, _)| {
                    !script.body[..at]
                        .ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.')
                });
                if calls {
                    assert!(
                        script.body.contains(&format!("local function {name}(")),
                        "a script calls {name} without defining it"
                    );
                }
            }
        }
    }
}
