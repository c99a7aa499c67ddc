//! Redis driver errors -> [`LockError`].

use distlock_core::{request_message, LockError, IN_LOCK_CALL};
use redis::{ErrorKind as RedisKind, RedisError};

use crate::keys::RedisKeys;

/// The error code our scripts reply with when they find data distlock did
/// not write.
pub(crate) const CORRUPT_CODE: &str = "DISTLOCK_CORRUPT";

/// The error code our scripts reply with when an argument is out of range
/// (checked before anything is written).
pub(crate) const ARGS_CODE: &str = "DISTLOCK_ARGS";

/// Maps a driver error from `what` (a short description of the request;
/// empty inside a lock call, see [`request_message`]).
pub(crate) fn map(error: RedisError, what: &str) -> LockError {
    let err = match crate::tls::failure(error, what) {
        Ok(tls) => return tls,
        Err(err) => err,
    };
    let code = err.code().unwrap_or("");
    let kind = err.kind();
    let (error, message): (fn(String) -> LockError, String) =
        if kind == RedisKind::AuthenticationFailed || matches!(code, "WRONGPASS" | "NOAUTH") {
            (
                LockError::config,
                "redis authentication failed; check the user and password in the URL \
             (redis://user:password@host:port, or redis://:password@host:port without ACL users)"
                    .to_owned(),
            )
        } else if code == "NOPERM" {
            (
                LockError::config,
                format!(
                    "the redis ACL user is not allowed to do this ({}); distlock needs the \
                 permissions listed in the distlock-redis docs (\"ACL users\") on its namespace's \
                 keys and channels",
                    err.detail().unwrap_or("NOPERM")
                ),
            )
        } else if code == "READONLY" {
            (
                LockError::unavailable,
                format!(
                    "the redis server is a read-only replica now ({err}); a failover is under way \
                 (or the URL names a replica): nothing was written, and the next call looks for \
                 the primary again"
                ),
            )
        } else if matches!(code, "CLUSTERDOWN" | "MASTERDOWN" | "TRYAGAIN" | "LOADING") {
            (
                LockError::unavailable,
                format!("the redis server cannot serve the request now ({err})"),
            )
        } else if kind == RedisKind::InvalidClientConfig {
            (
                LockError::config,
                format!("invalid redis configuration: {err}"),
            )
        } else if err.is_timeout() {
            (
                LockError::timeout,
                "the redis server did not answer in time".to_owned(),
            )
        } else if err.is_io_error() || err.is_connection_refusal() || err.is_connection_dropped() {
            (
                LockError::unavailable,
                format!("cannot reach the redis server ({err}); it may be down"),
            )
        } else {
            (
                LockError::unavailable,
                format!("the redis server refused the request: {err}"),
            )
        };
    error(request_message(what, message)).with_source(err)
}

/// Whether the connection `err` came from should be replaced: it failed or
/// timed out (a connection whose replies stall stays open, and the
/// driver's reconnection waits for it to close), or the server became a
/// replica (the Sentinel primary moved).
pub(crate) fn connection_suspect(err: &RedisError) -> bool {
    err.is_io_error()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_timeout()
        || err.is_unrecoverable_error()
        || matches!(err.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"))
}

/// Whether the server refused `err` for lack of an ACL permission.
pub(crate) fn is_noperm(err: &RedisError) -> bool {
    err.code() == Some("NOPERM")
}

/// The server refused to run a script for `namespace` at all (`detail` is
/// its NOPERM text): the command, or the keys it declares.
pub(crate) fn acl_refused(what: &str, namespace: &str, detail: &str) -> LockError {
    let grant = if detail.contains("key") {
        format!("read and write access to the keys `~{namespace}:*`")
    } else {
        "the commands EVALSHA and EVAL (`+evalsha +eval`)".to_owned()
    };
    LockError::config(format!(
        "{what}: the redis ACL user may not run distlock's scripts ({detail}); grant it {grant}. \
         The permissions distlock needs are listed in the distlock-redis docs (\"ACL users\")"
    ))
}

/// The ACL probe found commands the user may not run in `namespace`, as
/// (command, scope) pairs with scope `keys`, `channels` or empty.
pub(crate) fn acl_denied(what: &str, namespace: &str, denied: &[(&str, &str)]) -> LockError {
    let mut parts = Vec::new();
    for (scope, grant) in [
        ("keys", format!(" on the keys `~{namespace}:*`")),
        ("channels", format!(" on the channels `&{namespace}:*`")),
        ("", String::new()),
    ] {
        let mut commands: Vec<&str> = Vec::new();
        // The probe checks the lock and the fence key: name each command once.
        for (command, _) in denied.iter().filter(|(_, s)| *s == scope) {
            if !commands.contains(command) {
                commands.push(command);
            }
        }
        if !commands.is_empty() {
            parts.push(format!("{}{grant}", commands.join(", ")));
        }
    }
    LockError::config(format!(
        "{what}: the redis ACL user may not run {}; grant it those. The permissions distlock \
         needs are listed in the distlock-redis docs (\"ACL users\")",
        parts.join("; ")
    ))
}

/// Maps an error from one of our scripts on the lock at `keys`, inside a
/// lock call (the client names the operation and key): a `DISTLOCK_CORRUPT`
/// reply becomes [`ErrorKind::Corrupted`](distlock_core::ErrorKind) naming the
/// Redis key, `DISTLOCK_ARGS` [`ErrorKind::InvalidInput`](distlock_core::ErrorKind),
/// anything else goes through [`map`].
pub(crate) fn map_script(err: RedisError, keys: &RedisKeys) -> LockError {
    match err.code() {
        Some(CORRUPT_CODE) => corrupt_detail(
            err.detail().unwrap_or("holds data distlock did not write"),
            keys,
        ),
        Some(ARGS_CODE) => LockError::invalid_input(format!(
            "the script refused its arguments ({}) before writing anything",
            err.detail().unwrap_or("out of range")
        )),
        _ => map(err, IN_LOCK_CALL),
    }
}

/// A [`ErrorKind::Corrupted`](distlock_core::ErrorKind) error for `redis_key`.
/// A `DISTLOCK_CORRUPT` detail (`<which> <what>`, after the code) about
/// `keys`, naming the Redis key it is about.
pub(crate) fn corrupt_detail(detail: &str, keys: &RedisKeys) -> LockError {
    let (which, rest) = detail.split_once(' ').unwrap_or((detail, ""));
    let redis_key = match which {
        "fence" => &keys.fence,
        "gone" => &keys.gone,
        "waiters" => &keys.waiters,
        "turn" => &keys.turn,
        _ => &keys.lock,
    };
    corrupted(redis_key, rest)
}

pub(crate) fn corrupted(redis_key: &str, detail: &str) -> LockError {
    LockError::corrupted(format!(
        "redis key {redis_key:?} {detail}; distlock did not write it and left it \
         untouched. Delete it if it is stale, or use another namespace"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inside a lock call the message is the failure alone (the client
    /// names the call); elsewhere it starts with the request.
    #[test]
    fn only_requests_outside_lock_calls_are_named() {
        let refused = || RedisError::from((RedisKind::Parse, "no"));
        let in_call = map(refused(), IN_LOCK_CALL);
        assert_eq!(in_call.kind(), distlock_core::ErrorKind::Unavailable);
        assert!(
            in_call
                .message()
                .starts_with("the redis server refused the request"),
            "{in_call}"
        );
        let other = map(refused(), "connecting to redis at h:1");
        assert!(
            other
                .message()
                .starts_with("connecting to redis at h:1: the redis server refused the request"),
            "{other}"
        );
    }

    #[test]
    fn acl_denied_names_each_command_once_with_its_pattern() {
        let err = acl_denied(
            "connecting",
            "jobs",
            &[
                ("SET", "keys"),
                ("PUBLISH", "channels"),
                ("SET", "keys"),
                ("TIME", ""),
            ],
        );
        assert_eq!(err.kind(), distlock_core::ErrorKind::Config);
        let message = err.message();
        assert!(message.contains("SET on the keys `~jobs:*`"), "{message}");
        assert!(
            message.contains("PUBLISH on the channels `&jobs:*`"),
            "{message}"
        );
        assert!(message.contains("; TIME;"), "{message}");
        assert_eq!(message.matches("SET").count(), 1, "{message}");
    }
}
