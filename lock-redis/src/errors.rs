//! Redis driver errors -> [`LockError`].

use lock_core::{LockError, LockKey};
use redis::{ErrorKind as RedisKind, RedisError};

use crate::keys::RedisKeys;

/// The error code our scripts reply with when they find data distlock did
/// not write.
pub(crate) const CORRUPT_CODE: &str = "DISTLOCK_CORRUPT";

/// Maps a driver error from `what` (a short description of the request).
pub(crate) fn map(err: RedisError, what: &str) -> LockError {
    let code = err.code().unwrap_or("");
    let kind = err.kind();
    if kind == RedisKind::AuthenticationFailed || matches!(code, "WRONGPASS" | "NOAUTH") {
        return LockError::config(format!(
            "{what}: redis authentication failed; check the user and password in the URL \
             (redis://user:password@host:port, or redis://:password@host:port without ACL users)"
        ))
        .with_source(err);
    }
    if code == "NOPERM" {
        return LockError::config(format!(
            "{what}: the redis ACL user may not run this command or touch these keys/channels; \
             it needs EVAL/EVALSHA/SCRIPT LOAD, SUBSCRIBE and the distlock namespace"
        ))
        .with_source(err);
    }
    if kind == RedisKind::InvalidClientConfig {
        return LockError::config(format!("{what}: invalid redis configuration: {err}"))
            .with_source(err);
    }
    if err.is_timeout() {
        return LockError::timeout(format!("{what}: the redis server did not answer in time"))
            .with_source(err);
    }
    if err.is_io_error() || err.is_connection_refusal() || err.is_connection_dropped() {
        return LockError::unavailable(format!(
            "{what}: cannot reach the redis server ({err}); it may be down, it will be retried"
        ))
        .with_source(err);
    }
    LockError::unavailable(format!(
        "{what}: the redis server refused the request: {err}"
    ))
    .with_source(err)
}

/// Maps an error from one of our scripts on `key`: a `DISTLOCK_CORRUPT`
/// reply becomes [`ErrorKind::Corrupted`](lock_core::ErrorKind) naming the
/// Redis key, anything else goes through [`map`].
pub(crate) fn map_script(
    err: RedisError,
    what: &str,
    key: &LockKey,
    keys: &RedisKeys,
) -> LockError {
    if err.code() != Some(CORRUPT_CODE) {
        return map(err, what);
    }
    let detail = err.detail().unwrap_or("holds data distlock did not write");
    let (which, rest) = detail.split_once(' ').unwrap_or((detail, ""));
    let redis_key = match which {
        "fence" => &keys.fence,
        _ => &keys.lock,
    };
    corrupted(key, redis_key, rest)
}

/// A [`ErrorKind::Corrupted`](lock_core::ErrorKind) error for `redis_key`.
pub(crate) fn corrupted(key: &LockKey, redis_key: &str, detail: &str) -> LockError {
    LockError::corrupted(format!(
        "lock {key:?}: redis key {redis_key:?} {detail}; distlock did not write it and left it \
         untouched. Delete it if it is stale, or use another namespace"
    ))
}
