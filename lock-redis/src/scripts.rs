//! The Lua scripts: acquire, extend and release, one round trip each, and
//! the operator calls inspect and force-release.
//!
//! The value at a lock key is `dl1:<32 hex owner>:<fencing token>`, with a
//! PX expiry. Anything else there (another type, another format, no expiry)
//! is answered with a `DISTLOCK_CORRUPT lock|fence <detail>` error reply and
//! nothing is written.

use std::sync::LazyLock;

use redis::Script;

/// Shared helpers, prepended to every script.
const PRELUDE: &str = r#"
local function kind(key)
  local t = redis.call('TYPE', key)
  if type(t) == 'table' then t = t['ok'] end
  return t
end
local function ours(v)
  local owner, fence = string.match(v, '^dl1:(%x+):(%d+)$')
  return owner ~= nil and #owner == 32 and #fence <= 20
end
local function corrupt(which, detail)
  return redis.error_reply('DISTLOCK_CORRUPT ' .. which .. ' ' .. detail)
end
"#;

/// KEYS: lock, fence. ARGV: owner hex, ttl ms, fence retention ms.
/// Returns `{1, token}` when acquired, `{0, pttl}` when held.
const ACQUIRE: &str = r#"
local lt = kind(KEYS[1])
if lt ~= 'none' then
  if lt ~= 'string' then return corrupt('lock', 'holds a ' .. lt .. ', not a distlock lock') end
  if not ours(redis.call('GET', KEYS[1])) then
    return corrupt('lock', 'holds a value in a format distlock does not write')
  end
  local pttl = redis.call('PTTL', KEYS[1])
  if pttl < 0 then return corrupt('lock', 'has no expiry, which distlock never leaves') end
  return {0, pttl}
end
local counter = 0
local ft = kind(KEYS[2])
if ft ~= 'none' then
  if ft ~= 'string' then return corrupt('fence', 'holds a ' .. ft .. ', not a fencing counter') end
  local c = redis.call('GET', KEYS[2])
  if string.match(c, '^%d+$') == nil or #c > 16 or tonumber(c) >= 9007199254740000 then
    return corrupt('fence', 'holds a value that is not a distlock fencing counter')
  end
  counter = tonumber(c)
end
local now = redis.call('TIME')
local token = tonumber(now[1]) * 1000000 + tonumber(now[2])
if counter + 1 > token then token = counter + 1 end
local text = string.format('%.0f', token)
redis.call('SET', KEYS[1], 'dl1:' .. ARGV[1] .. ':' .. text, 'PX', ARGV[2])
redis.call('SET', KEYS[2], text, 'PX', ARGV[3])
return {1, text}
"#;

/// KEYS: lock, fence. ARGV: expected value, ttl ms, fence retention ms.
/// Returns 1 when extended, 0 when not held. Never recreates the lock.
const EXTEND: &str = r#"
local lt = kind(KEYS[1])
if lt == 'none' then return 0 end
if lt ~= 'string' then return corrupt('lock', 'holds a ' .. lt .. ', not a distlock lock') end
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  local fp = redis.call('PTTL', KEYS[2])
  if fp >= 0 and fp < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
  return 1
end
if not ours(v) then return corrupt('lock', 'holds a value in a format distlock does not write') end
return 0
"#;

/// KEYS: lock. ARGV: expected value, channel.
/// Returns 1 when released (and published), 0 when not held.
const RELEASE: &str = r#"
local lt = kind(KEYS[1])
if lt == 'none' then return 0 end
if lt ~= 'string' then return corrupt('lock', 'holds a ' .. lt .. ', not a distlock lock') end
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], 'released')
  return 1
end
if not ours(v) then return corrupt('lock', 'holds a value in a format distlock does not write') end
return 0
"#;

/// KEYS: lock. Returns `{0}` when free, `{1, pttl, token}` when held.
const INSPECT: &str = r#"
local lt = kind(KEYS[1])
if lt == 'none' then return {0} end
if lt ~= 'string' then return corrupt('lock', 'holds a ' .. lt .. ', not a distlock lock') end
local v = redis.call('GET', KEYS[1])
if not ours(v) then return corrupt('lock', 'holds a value in a format distlock does not write') end
local _, fence = string.match(v, '^dl1:(%x+):(%d+)$')
return {1, redis.call('PTTL', KEYS[1]), fence}
"#;

/// KEYS: lock. ARGV: channel. Deletes the lock whoever holds it.
/// Returns 1 when a lock was deleted (and published), 0 when free.
const FORCE_RELEASE: &str = r#"
local lt = kind(KEYS[1])
if lt == 'none' then return 0 end
if lt ~= 'string' then return corrupt('lock', 'holds a ' .. lt .. ', not a distlock lock') end
if not ours(redis.call('GET', KEYS[1])) then
  return corrupt('lock', 'holds a value in a format distlock does not write')
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[1], 'released')
return 1
"#;

fn script(body: &str) -> Script {
    // Redis < 5 needs effects replication for TIME before writes; newer
    // servers replicate effects anyway.
    Script::new(&format!(
        "if redis.replicate_commands then redis.replicate_commands() end\n{PRELUDE}{body}"
    ))
}

/// The acquire script.
pub(crate) static ACQUIRE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(ACQUIRE));
/// The extend script.
pub(crate) static EXTEND_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(EXTEND));
/// The release script.
pub(crate) static RELEASE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(RELEASE));

/// The inspect script (operators only; not preloaded).
pub(crate) static INSPECT_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(INSPECT));
/// The force-release script (operators only; not preloaded).
pub(crate) static FORCE_RELEASE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(FORCE_RELEASE));

/// The SHA1 of the acquire script (tests count its EVALSHA calls).
pub fn acquire_script_sha() -> &'static str {
    ACQUIRE_SCRIPT.get_hash()
}

/// The value stored at a lock key for `owner_hex` and `fencing`.
pub(crate) fn lock_value(owner_hex: &str, fencing: u64) -> String {
    format!("dl1:{owner_hex}:{fencing}")
}

/// All scripts, for preloading.
pub(crate) fn all() -> [&'static Script; 3] {
    [&ACQUIRE_SCRIPT, &EXTEND_SCRIPT, &RELEASE_SCRIPT]
}
