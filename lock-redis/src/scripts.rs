//! The Lua scripts: acquire, extend and release, one round trip each, the
//! operator calls inspect and force-release, and the connect-time ACL probe;
//! how each is invoked and what its reply means.
//!
//! The value at a lock key is `dl1:<32 hex owner>:<fencing token>`, with a
//! PX expiry. Anything else there (another type, another format, no expiry)
//! is answered with a `DISTLOCK_CORRUPT lock|fence <detail>` error reply and
//! nothing is written.

use std::sync::LazyLock;
use std::time::Duration;

use distlock_core::{
    AcquireReply, ExtendReply, FencingToken, Grant, LockError, LockKey, LockState, ReleaseReply,
};
use redis::aio::ConnectionLike;
use redis::{ErrorKind, RedisResult, Script, ServerErrorKind, Value};

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
-- After a DEL: wake the waiters (`publish` is PUBLISH, or SPUBLISH in a
-- cluster). A script is not rolled back, so a refused publish (no ACL
-- channel permission) must not fail it: the lock is released either way;
-- the error text goes back for the client to log.
local function released(publish, channel)
  local r = redis.pcall(publish, channel, 'released')
  if type(r) == 'table' and r['err'] then return {1, r['err']} end
  return 1
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

/// KEYS: lock. ARGV: expected value, channel, publish command.
/// Returns 1 when released and published, `{1, error}` when released but
/// the publish was refused, 0 when not held.
const RELEASE: &str = r#"
local lt = kind(KEYS[1])
if lt == 'none' then return 0 end
if lt ~= 'string' then return corrupt('lock', 'holds a ' .. lt .. ', not a distlock lock') end
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return released(ARGV[3], ARGV[2])
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

/// KEYS: lock. ARGV: channel, publish command. Deletes the lock whoever
/// holds it.
/// Returns as [`RELEASE`] (0 when free).
const FORCE_RELEASE: &str = r#"
local lt = kind(KEYS[1])
if lt == 'none' then return 0 end
if lt ~= 'string' then return corrupt('lock', 'holds a ' .. lt .. ', not a distlock lock') end
if not ours(redis.call('GET', KEYS[1])) then
  return corrupt('lock', 'holds a value in a format distlock does not write')
end
redis.call('DEL', KEYS[1])
return released(ARGV[2], ARGV[1])
"#;

/// KEYS: a lock key and a fence key, ARGV: a channel in the namespace and
/// the publish, subscribe and unsubscribe commands (sharded in a cluster).
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
  for _, k in ipairs(KEYS) do
    check('keys', 'TYPE', k)
    check('keys', 'GET', k)
    check('keys', 'SET', k, 'v', 'PX', '1')
    check('keys', 'PTTL', k)
    check('keys', 'PEXPIRE', k, '1')
  end
  check('keys', 'DEL', KEYS[1])
  check('', 'TIME')
  check('channels', ARGV[2], ARGV[1], 'released')
  check('channels', ARGV[3], ARGV[1])
  check('channels', ARGV[4], ARGV[1])
  check('', 'PING')
end
return denied
"#;

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
            "if redis.replicate_commands then redis.replicate_commands() end\n{PRELUDE}{body}"
        );
        let sha = Script::new(&body).get_hash().to_owned();
        Self { body, sha }
    }

    /// Puts the script in the server's cache (`SCRIPT LOAD`).
    pub(crate) async fn load(&self, conn: &mut impl ConnectionLike) -> RedisResult<()> {
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(&self.body)
            .query_async::<String>(conn)
            .await
            .map(drop)
    }

    /// Runs the script as [`invoke`](Self::invoke), then `WAIT replicas
    /// timeout` on the same connection (one pipeline): the script's reply
    /// and how many replicas acknowledged its writes.
    pub(crate) async fn invoke_and_wait(
        &self,
        conn: &mut impl ConnectionLike,
        keys: &[&str],
        args: &[String],
        replicas: u32,
        timeout: Duration,
    ) -> RedisResult<(Value, i64)> {
        let pipeline = |eval: bool| {
            let mut pipe = redis::pipe();
            pipe.cmd(if eval { "EVAL" } else { "EVALSHA" })
                .arg(if eval { &self.body } else { &self.sha })
                .arg(keys.len())
                .arg(keys)
                .arg(args);
            pipe.cmd("WAIT").arg(replicas).arg(
                u64::try_from(timeout.as_millis())
                    .unwrap_or(u64::MAX)
                    .max(1),
            );
            pipe
        };
        match pipeline(false).query_async(conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                pipeline(true).query_async(conn).await
            }
            other => other,
        }
    }

    /// Runs the script: `EVALSHA`, and `EVAL` with its text when the server
    /// does not have it (after a restart, a failover or `SCRIPT FLUSH`, or
    /// never loaded because the ACL user may not `SCRIPT LOAD`). `EVAL`
    /// caches the script, so the next call is one `EVALSHA` again.
    pub(crate) async fn invoke(
        &self,
        conn: &mut impl ConnectionLike,
        keys: &[&str],
        args: &[String],
    ) -> RedisResult<Value> {
        let result = redis::cmd("EVALSHA")
            .arg(&self.sha)
            .arg(keys.len())
            .arg(keys)
            .arg(args)
            .query_async(conn)
            .await;
        match result {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                redis::cmd("EVAL")
                    .arg(&self.body)
                    .arg(keys.len())
                    .arg(keys)
                    .arg(args)
                    .query_async(conn)
                    .await
            }
            other => other,
        }
    }
}

/// The acquire script.
pub(crate) static ACQUIRE_SCRIPT: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(ACQUIRE));
/// The extend script.
pub(crate) static EXTEND_SCRIPT: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(EXTEND));
/// The release script.
pub(crate) static RELEASE_SCRIPT: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(RELEASE));
/// The ACL probe, run at connect.
pub(crate) static PROBE_SCRIPT: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(PROBE));

/// The inspect script (operators only; not preloaded).
pub(crate) static INSPECT_SCRIPT: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(INSPECT));
/// The force-release script (operators only; not preloaded).
pub(crate) static FORCE_RELEASE_SCRIPT: LazyLock<LuaScript> =
    LazyLock::new(|| LuaScript::new(FORCE_RELEASE));

/// The SHA1 of the acquire script (tests count its EVALSHA calls).
pub fn acquire_script_sha() -> &'static str {
    &ACQUIRE_SCRIPT.sha
}

/// The value stored at a lock key for `owner_hex` and `fencing`.
pub(crate) fn lock_value(owner_hex: &str, fencing: u64) -> String {
    format!("dl1:{owner_hex}:{fencing}")
}

/// The scripts every client runs, for preloading.
pub(crate) fn all() -> [&'static LuaScript; 4] {
    [
        &PROBE_SCRIPT,
        &ACQUIRE_SCRIPT,
        &EXTEND_SCRIPT,
        &RELEASE_SCRIPT,
    ]
}

/// Reads the acquire script's reply for a request of `ttl`.
pub(crate) fn acquire_reply(
    key: &LockKey,
    ttl: Duration,
    reply: &Value,
) -> Result<AcquireReply, LockError> {
    let bad = || unexpected("acquire", key, reply);
    let Value::Array(items) = reply else {
        return Err(bad());
    };
    match (items.first().and_then(as_int), items.get(1)) {
        (Some(1), Some(token)) => {
            let token = as_token(token).ok_or_else(bad)?;
            Ok(AcquireReply::Granted(Grant::new(token, ttl)))
        }
        (Some(0), Some(pttl)) => {
            let pttl = as_int(pttl).ok_or_else(bad)?;
            Ok(AcquireReply::Held {
                expires_in: millis_left(pttl),
            })
        }
        _ => Err(bad()),
    }
}

/// Reads the extend script's reply for a lock of `fencing` extended by `ttl`.
pub(crate) fn extend_reply(
    key: &LockKey,
    fencing: FencingToken,
    ttl: Duration,
    reply: &Value,
) -> Result<ExtendReply, LockError> {
    match as_int(reply) {
        Some(1) => Ok(ExtendReply::Extended(Grant::new(fencing, ttl))),
        Some(0) => Ok(ExtendReply::NotHeld),
        _ => Err(unexpected("extend", key, reply)),
    }
}

/// Reads the release script's reply.
pub(crate) fn release_reply(key: &LockKey, reply: &Value) -> Result<ReleaseReply, LockError> {
    match deleted(key, reply) {
        Some(true) => Ok(ReleaseReply::Released),
        Some(false) => Ok(ReleaseReply::NotHeld),
        None => Err(unexpected("release", key, reply)),
    }
}

/// Reads the force-release script's reply: whether a lock was held.
pub(crate) fn force_release_reply(key: &LockKey, reply: &Value) -> Result<bool, LockError> {
    deleted(key, reply).ok_or_else(|| unexpected("force release", key, reply))
}

/// Reads the inspect script's reply.
pub(crate) fn inspect_reply(key: &LockKey, reply: &Value) -> Result<LockState, LockError> {
    let bad = || unexpected("inspect", key, reply);
    let Value::Array(items) = reply else {
        return Err(bad());
    };
    match items.as_slice() {
        [state] if as_int(state) == Some(0) => Ok(LockState::Free),
        [state, pttl, token] if as_int(state) == Some(1) => Ok(LockState::Held {
            expires_in: millis_left(as_int(pttl).ok_or_else(bad)?),
            fencing_token: as_token(token).ok_or_else(bad)?,
        }),
        _ => Err(bad()),
    }
}

fn unexpected(what: &str, key: &LockKey, reply: &Value) -> LockError {
    LockError::corrupted(format!(
        "{what} on lock {key:?}: unexpected reply from the redis server: {reply:?}"
    ))
}

/// Reads a release or force-release reply: whether a lock was deleted.
/// Logs a deletion whose notification the server refused (`{1, error}`):
/// the lock is free, but waiters of other clients are not woken and find
/// out at the holder's expiry, when their timers fire.
fn deleted(key: &LockKey, reply: &Value) -> Option<bool> {
    match reply {
        Value::Array(items) => match items.as_slice() {
            [flag, error] if as_int(flag) == Some(1) => {
                let error = redis::from_redis_value_ref::<String>(error).unwrap_or_default();
                tracing::warn!(
                    key = %key,
                    error = %error,
                    "redis lock released, but the server refused the release notification \
                     (ACL channel permission?); other clients' waiters wake at the holder's expiry"
                );
                Some(true)
            }
            _ => None,
        },
        other => match as_int(other) {
            Some(1) => Some(true),
            Some(0) => Some(false),
            _ => None,
        },
    }
}

/// A `PTTL` as time left (`None` for the negative "no key"/"no expiry").
fn millis_left(pttl: i64) -> Option<Duration> {
    u64::try_from(pttl).ok().map(Duration::from_millis)
}

fn as_token(value: &Value) -> Option<FencingToken> {
    as_int(value)
        .and_then(|t| u64::try_from(t).ok())
        .map(FencingToken::new)
}

fn as_int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}
