//! Reading the scripts' replies: what each answer means, and a reply no
//! script gives reported as corrupted.

use std::time::Duration;

use distlock_core::{
    AcquireReply, ExtendReply, FencingToken, Grant, HolderId, LockError, LockKey, LockState,
    PermitReply, PermitState, ReleaseReply,
};
use redis::Value;

use crate::errors::{self, CORRUPT_CODE};
use crate::keys::RedisKeys;

/// Reads the acquire script's reply for a request of `ttl` on `key` (at
/// `keys`).
pub(crate) fn acquire_reply(
    key: &LockKey,
    keys: &RedisKeys,
    ttl: Duration,
    reply: &Value,
) -> Result<AcquireReply, LockError> {
    let bad = || unexpected(reply);
    let Value::Array(items) = reply else {
        return Err(bad());
    };
    match (items.first().and_then(as_int), items.get(1)) {
        (Some(1), Some(token)) => {
            let token = as_token(token).ok_or_else(bad)?;
            if items.get(2).is_some() {
                // The lock is ours; only its label, for people, is missing.
                tracing::warn!(
                    key = %key,
                    redis_key = %keys.holder,
                    "holder label not stored: the key holds data distlock did not write (left alone)"
                );
            }
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

/// Reads the permit acquire script's reply for a request of `ttl` on the
/// semaphore `key` (at `keys`).
pub(crate) fn acquire_permit_reply(
    key: &LockKey,
    keys: &RedisKeys,
    ttl: Duration,
    reply: &Value,
) -> Result<PermitReply, LockError> {
    let bad = || unexpected(reply);
    let Value::Array(items) = reply else {
        return Err(bad());
    };
    match items.as_slice() {
        [flag, token, foreign @ ..] if as_int(flag) == Some(1) && foreign.len() <= 1 => {
            let token = as_token(token).ok_or_else(bad)?;
            if !foreign.is_empty() {
                // The permit is ours; only its label, for people, is missing.
                tracing::warn!(
                    key = %key,
                    redis_key = %keys.holder,
                    "permit holder label not stored: the key holds data distlock did not write (left alone), or the ACL user may not run HSET there"
                );
            }
            Ok(PermitReply::Granted(Grant::new(token, ttl)))
        }
        [flag, ms] if as_int(flag) == Some(0) => Ok(PermitReply::Full {
            expires_in: millis_left(as_int(ms).ok_or_else(bad)?),
        }),
        [flag, stored] if as_int(flag) == Some(2) => {
            let stored = as_int(stored)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(bad)?;
            Ok(PermitReply::LimitMismatch { stored })
        }
        _ => Err(bad()),
    }
}

/// Reads the extend script's reply for a lock of `fencing` extended by `ttl`
/// (the permit extend script answers the same way).
pub(crate) fn extend_reply(
    fencing: FencingToken,
    ttl: Duration,
    reply: &Value,
) -> Result<ExtendReply, LockError> {
    match as_int(reply) {
        Some(1) => Ok(ExtendReply::Extended(Grant::new(fencing, ttl))),
        Some(0) => Ok(ExtendReply::NotHeld),
        _ => Err(unexpected(reply)),
    }
}

/// Reads the many-lock extend script's reply: one answer per lock of
/// `held` (with its Redis names), each as [`extend_reply`] reads it, or
/// the corruption found at that lock's keys.
pub(crate) fn extend_many_reply(
    held: &[(FencingToken, &RedisKeys)],
    ttl: Duration,
    reply: &Value,
) -> Result<Vec<Result<ExtendReply, LockError>>, LockError> {
    let Value::Array(items) = reply else {
        return Err(unexpected(reply));
    };
    if items.len() != held.len() {
        return Err(unexpected(reply));
    }
    let corrupt = format!("{CORRUPT_CODE} ");
    Ok(held
        .iter()
        .zip(items)
        .map(|((fencing, keys), item)| match item {
            Value::BulkString(b) => match std::str::from_utf8(b)
                .ok()
                .and_then(|text| text.strip_prefix(&corrupt))
            {
                Some(detail) => Err(errors::corrupt_detail(detail, keys)),
                None => Err(unexpected(item)),
            },
            answer => extend_reply(*fencing, ttl, answer),
        })
        .collect())
}

/// Reads the release script's reply (the permit release script answers the
/// same way).
pub(crate) fn release_reply(key: &LockKey, reply: &Value) -> Result<ReleaseReply, LockError> {
    match deleted(key, reply) {
        Some(true) => Ok(ReleaseReply::Released),
        Some(false) => Ok(ReleaseReply::NotHeld),
        None => Err(unexpected(reply)),
    }
}

/// Reads the force-release script's reply: whether a lock was held.
pub(crate) fn force_release_reply(key: &LockKey, reply: &Value) -> Result<bool, LockError> {
    deleted(key, reply).ok_or_else(|| unexpected(reply))
}

/// Reads the inspect script's reply.
pub(crate) fn inspect_reply(reply: &Value) -> Result<LockState, LockError> {
    let bad = || unexpected(reply);
    let Value::Array(items) = reply else {
        return Err(bad());
    };
    match items.as_slice() {
        [state] if as_int(state) == Some(0) => Ok(LockState::Free),
        [state, pttl, token, label @ ..] if as_int(state) == Some(1) && label.len() <= 1 => {
            Ok(LockState::Held {
                expires_in: millis_left(as_int(pttl).ok_or_else(bad)?),
                fencing_token: as_token(token).ok_or_else(bad)?,
                holder: label.first().and_then(holder_label),
            })
        }
        _ => Err(bad()),
    }
}

/// Reads the permit inspect script's reply: the live permits, oldest
/// first.
pub(crate) fn inspect_permits_reply(reply: &Value) -> Result<Vec<PermitState>, LockError> {
    let bad = || unexpected(reply);
    let Value::Array(items) = reply else {
        return Err(bad());
    };
    let mut permits = items
        .iter()
        .map(|item| match item {
            Value::Array(fields) => match fields.as_slice() {
                [token, pttl, limit, label] => Some(PermitState {
                    fencing_token: as_token(token)?,
                    expires_in: millis_left(as_int(pttl)?),
                    limit: as_int(limit).and_then(|n| u32::try_from(n).ok())?,
                    holder: holder_label(label),
                }),
                _ => None,
            },
            _ => None,
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(bad)?;
    permits.sort_by_key(|p| p.fencing_token);
    Ok(permits)
}

/// A holder label a script showed. The scripts show only labels in
/// distlock's format; one [`HolderId`] would refuse (or none, empty) is
/// shown as none, never a panic.
fn holder_label(value: &Value) -> Option<HolderId> {
    match value {
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| HolderId::new(s).ok()),
        _ => None,
    }
}

/// A reply no script of this version gives (the lock call's context names
/// the operation and key).
fn unexpected(reply: &Value) -> LockError {
    LockError::corrupted(format!("unexpected reply from the redis server: {reply:?}"))
}

/// Reads a release or force-release reply: whether a lock was deleted.
/// Logs a deletion whose notification the server refused (`{1, error}`):
/// the lock is free, but waiters of other clients are not woken and find
/// out at the holder's expiry, when their timers fire.
pub(crate) fn deleted(key: &LockKey, reply: &Value) -> Option<bool> {
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
