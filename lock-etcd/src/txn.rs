//! The etcd transactions behind acquire, extend and release.
//!
//! Each is one `Txn` request, so the comparison and the write happen
//! atomically on the server:
//!
//! - acquire: `if create_revision(key) == 0 then put(key, value, lease)
//!   else (if value(key) == ours then put(key, value, lease); get(key) else get(key))`
//!   (a renewing one also only while its fence is down, see [`crate::fence`]);
//!   the put's revision (the transaction's header revision) is the key's
//!   `create_revision` and becomes the fencing token. The nested branch
//!   adopts a lock an earlier attempt of the same acquisition took: its TTL
//!   starts again on this attempt's lease, its fencing token is unchanged.
//! - extend: `if value(key) == ours and create_revision(key) == fencing then
//!   put(key, value, new_lease)`; a missing key fails the comparison, so an
//!   expired lock is never recreated.
//! - confirm (renewing a lock on a session lease): `if value(key) == ours
//!   and create_revision(key) == fencing and lease(key) == session` with no
//!   operations; the session's keep-alive does the renewing.
//! - release: `if value(key) == ours and create_revision(key) == fencing then delete(key)`.

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse};
use std::time::Duration;

use distlock_core::{AcquireReply, FencingToken, LockError, LockKey, OwnerToken};

use crate::fence::Fence;
use crate::keys::decode_value;

/// The acquire transaction. A `fence`d one writes nothing once its fence
/// is up; either branch puts the fences in `raise` up (earlier requests of
/// the same acquisition whose outcome is unknown; see [`crate::fence`]).
pub(crate) fn acquire(
    key: &[u8],
    value: &[u8],
    lease_id: i64,
    fence: Option<&Fence>,
    raise: &[Fence],
) -> Txn {
    let put = || TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease_id)));
    let mut when = vec![Compare::create_revision(key, CompareOp::Equal, 0)];
    when.extend(fence.map(Fence::down));
    let mut then = vec![put()];
    // Adoption: a key that holds this acquisition's value was taken by an
    // earlier attempt whose reply was lost. Putting it again on this
    // attempt's lease resets its TTL from now (a put keeps the key's
    // create revision, so the fencing token stays), and the earlier
    // attempt's lease, revoked once its outcome was unknown, no longer
    // bounds it.
    let mut adopt_when = vec![Compare::value(key, CompareOp::Equal, value)];
    adopt_when.extend(fence.map(Fence::down));
    let adopt = Txn::new()
        .when(adopt_when)
        .and_then([put(), TxnOp::get(key, None)])
        .or_else([TxnOp::get(key, None)]);
    let mut otherwise = vec![TxnOp::txn(adopt)];
    then.extend(raise.iter().map(Fence::raise));
    otherwise.extend(raise.iter().map(Fence::raise));
    Txn::new().when(when).and_then(then).or_else(otherwise)
}

/// The comparisons that prove the lock is still this acquisition's.
fn ours(key: &[u8], value: &[u8], fencing: FencingToken) -> Vec<Compare> {
    vec![
        Compare::value(key, CompareOp::Equal, value),
        Compare::create_revision(
            key,
            CompareOp::Equal,
            i64::try_from(fencing.get()).unwrap_or(i64::MAX),
        ),
    ]
}

/// The extend transaction: moves the key to `new_lease_id`.
pub(crate) fn extend(key: &[u8], value: &[u8], fencing: FencingToken, new_lease_id: i64) -> Txn {
    Txn::new()
        .when(ours(key, value, fencing))
        .and_then([TxnOp::put(
            key,
            value,
            Some(PutOptions::new().with_lease(new_lease_id)),
        )])
}

/// The confirm transaction for a lock on a session lease: succeeds, without
/// writing anything, if the key is still this acquisition's and still
/// attached to `session_lease_id`.
pub(crate) fn confirm(
    key: &[u8],
    value: &[u8],
    fencing: FencingToken,
    session_lease_id: i64,
) -> Txn {
    let mut when = ours(key, value, fencing);
    when.push(Compare::lease(key, CompareOp::Equal, session_lease_id));
    Txn::new().when(when)
}

/// The release transaction.
pub(crate) fn release(key: &[u8], value: &[u8], fencing: FencingToken) -> Txn {
    Txn::new()
        .when(ours(key, value, fencing))
        .and_then([TxnOp::delete(key, None)])
}

/// What the acquire transaction found.
#[derive(Debug)]
pub(crate) enum AcquireOutcome {
    /// We created the key; its create revision.
    Created(FencingToken),
    /// Someone else holds it (or, impossible in one transaction but
    /// answered as "try again at once", the key vanished between compare
    /// and get).
    Refused(AcquireReply),
}

/// Reads the acquire transaction's reply. A value we did not write, or a
/// lock without a lease (it would never expire), is `Corrupted`. A lock
/// that holds `owner`'s token is this acquisition's: an earlier send of
/// the same transaction took it (its reply was lost), so it was created.
pub(crate) fn acquire_outcome(
    key: &LockKey,
    owner: OwnerToken,
    reply: &TxnResponse,
) -> Result<AcquireOutcome, LockError> {
    if reply.succeeded() {
        let revision = reply.header().map(|h| h.revision()).unwrap_or(0);
        return u64::try_from(revision)
            .ok()
            .filter(|r| *r > 0)
            .map(|r| AcquireOutcome::Created(FencingToken::new(r)))
            .ok_or_else(|| {
                LockError::unavailable(format!(
                    "etcd acquired lock {:?} but returned no revision (header {revision})",
                    key.as_str()
                ))
            });
    }
    let gone = AcquireOutcome::Refused(AcquireReply::Held {
        expires_in: Some(Duration::ZERO),
    });
    let Some(nested) = reply.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Txn(nested) => Some(nested),
        _ => None,
    }) else {
        return Err(LockError::unavailable(format!(
            "etcd answered the acquire of lock {:?} without the adoption step's reply",
            key.as_str()
        )));
    };
    for op in nested.op_responses() {
        if let TxnOpResponse::Get(get) = op {
            let Some(kv) = get.kvs().first() else {
                return Ok(gone);
            };
            if check_found(key, kv.value(), kv.lease())? == owner {
                if !nested.succeeded() {
                    // Ours by its value, yet the adoption's comparison
                    // failed: only its fence (a later undo) can do that.
                    return Ok(gone);
                }
                tracing::debug!(key = %key, "etcd acquire adopted the lock an earlier attempt took");
                return u64::try_from(kv.create_revision())
                    .ok()
                    .filter(|r| *r > 0)
                    .map(|r| AcquireOutcome::Created(FencingToken::new(r)))
                    .ok_or_else(|| {
                        LockError::unavailable(format!(
                            "etcd returned lock {:?} without a create revision",
                            key.as_str()
                        ))
                    });
            }
            tracing::trace!(key = %key, holder_lease = kv.lease(), "etcd lock held by another owner");
            // The holder's lease may be a session lease, renewed for as
            // long as its holder wants: no expiry to predict.
            return Ok(AcquireOutcome::Refused(AcquireReply::Held {
                expires_in: None,
            }));
        }
    }
    Ok(gone)
}

/// Refuses a value distlock did not write at a lock key.
pub(crate) fn check_found(
    key: &LockKey,
    value: &[u8],
    lease_id: i64,
) -> Result<OwnerToken, LockError> {
    let Some(owner) = decode_value(value) else {
        return Err(LockError::corrupted(format!(
            "the etcd key for lock {:?} holds a value distlock did not write ({} bytes); it was left untouched — remove it or use another namespace",
            key.as_str(),
            value.len()
        )));
    };
    if lease_id == 0 {
        return Err(LockError::corrupted(format!(
            "the etcd key for lock {:?} has no lease, so it would never expire; distlock never writes that — it was left untouched, delete it by hand",
            key.as_str()
        )));
    }
    Ok(owner)
}
