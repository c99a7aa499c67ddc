//! Counting semaphores: at most `limit` permits of a key, each an etcd key
//! on a lease of its own.
//!
//! The permits of semaphore `k` are the keys below
//! `NS/lock/%sem/<escaped k>/permits/`, one per holder, named by its owner
//! token (see [`crate::keys`]) and valued `dl1:<owner>/<limit>`. etcd
//! deletes a permit when its lease runs out, by its own clock, so the keys
//! present are exactly the live permits; their create revisions order them
//! and are their fencing tokens (etcd's global revision: strictly greater
//! than every earlier permit's, across releases, expiries, the semaphore's
//! keys all vanishing, and restarts).
//!
//! Permits are entries in a line ordered by create revision, and the
//! holders are the first `limit` of them (as Curator's semaphore and etcd's
//! own recipes order waiters): an attempt grants a lease of the TTL, then
//! one transaction puts its permit on it and reads every permit, oldest
//! first. Its place in that read decides: fewer than `limit` before it, it
//! holds a permit; else (`Full`), or an older permit carries another limit
//! (`LimitMismatch`), it revokes its lease, which deletes the entry again.
//! A permit's place only moves forward as older ones go, so every holder
//! is always among the first `limit` entries and never more than `limit`
//! are held; attempts running at once do not conflict (each finds its own
//! place), so up to `limit` of them get in at once. An entry on its way
//! out only delays others (it counts until its revoke lands), and its
//! deletion wakes them. An attempt first reads the permits without
//! writing, and when that read shows every permit taken (or another
//! limit) it is refused with no write at all: a full semaphore costs its
//! waiters one read per wake-up, and no churn.
//!
//! The limit is stored in every permit's value: every holder was granted
//! only when all older permits carried its limit, so all holders carry
//! the same one, and a request with another is refused while any lives.
//! With none left the next request's limit applies; nothing of the
//! semaphore outlives its last permit.
//!
//! Adoption: an attempt whose owner's permit exists puts it again on the
//! attempt's fresh lease (value and create revision kept), so an earlier
//! attempt applied unseen is handed back with its fencing token and its
//! TTL reset from now. An attempt whose outcome is unknown revokes its
//! lease in the background: the undo of a put on that lease that no late
//! put outlives (a put on a revoked lease fails whole). Renewing permits
//! too get a lease of their own with their TTL, so a holder that dies
//! before its first renewal frees its permit within that TTL; extending
//! moves a permit to a new lease of the TTL asked for.
//!
//! Waiters queue FIFO as a lock's do ([`crate::queue`], on the
//! semaphore's own queue), the first in line watching deletions below
//! the permits prefix: a release or an expiry wakes exactly it.

use std::time::{Duration, Instant};

use async_trait::async_trait;
use distlock_core::{
    ExtendReply, FencingToken, Grant, HeldLock, LockError, LockKey, OwnerToken, PermitReply,
    PermitRequest, ReleaseReply, ReleaseWatch, SemaphoreBackend, IN_LOCK_CALL,
};
use etcd_client::{GetOptions, KeyValue, SortOrder, SortTarget};

use crate::backend::EtcdLock;
use crate::keys::{decode_permit, encode_permit};
use crate::queue::Line;
use crate::requests::Repeat;
use crate::txn;

/// A live permit, as read.
#[derive(Debug)]
struct Permit {
    owner: OwnerToken,
    limit: u32,
    /// Its fencing token.
    created: i64,
    lease: i64,
}

/// Reads what a get of the permits prefix found, oldest first; anything
/// distlock did not write is `Corrupted`, never obeyed.
fn parse(lock: &EtcdLock, key: &LockKey, kvs: &[KeyValue]) -> Result<Vec<Permit>, LockError> {
    let prefix = lock.etcd().layout.permits_prefix(key);
    kvs.iter()
        .map(|kv| {
            let name = kv.key().strip_prefix(prefix.as_slice()).unwrap_or_default();
            match decode_permit(kv.value()) {
                Some((owner, limit)) if kv.lease() != 0 && name == owner.to_hex().as_bytes() => {
                    Ok(Permit {
                        owner,
                        limit,
                        created: kv.create_revision(),
                        lease: kv.lease(),
                    })
                }
                _ => Err(LockError::corrupted(format!(
                    "the semaphore's etcd permits hold a key distlock did not write ({:?}); it was left untouched — remove it or use another namespace",
                    String::from_utf8_lossy(kv.key())
                ))),
            }
        })
        .collect()
}

fn token(revision: i64) -> FencingToken {
    FencingToken::new(u64::try_from(revision).unwrap_or(0))
}

fn handle(lease: i64) -> u64 {
    u64::try_from(lease).unwrap_or(0)
}

impl EtcdLock {
    /// Reads every permit of `key`, ending by `deadline`.
    async fn read_permits(
        &self,
        key: &LockKey,
        deadline: Instant,
    ) -> Result<Vec<Permit>, LockError> {
        let prefix = self.etcd().layout.permits_prefix(key);
        let kv = &self.etcd().kv;
        let reply = self
            .etcd()
            .requests
            .send_until(deadline, "reading the permits", Repeat::Safe, || {
                let mut kv = kv.clone();
                let prefix = prefix.clone();
                let oldest_first = GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Create, SortOrder::Ascend);
                async move { kv.get(prefix, Some(oldest_first)).await }
            })
            .await?;
        parse(self, key, reply.kvs())
    }
}

/// What a permit attempt is answered, from its place among the permits
/// (`held`, oldest first): granted if fewer than `limit` come before it and
/// none of those carries another limit. `place` is `held.len()` for an
/// attempt not yet in the line.
fn decide(held: &[Permit], place: usize, limit: u32) -> Option<PermitReply> {
    let ahead = held.get(..place).unwrap_or(held);
    if let Some(other) = ahead.iter().find(|p| p.limit != limit) {
        return Some(PermitReply::LimitMismatch {
            stored: other.limit,
        });
    }
    // A permit's lease may be renewed for as long as its holder wants: no
    // expiry to predict (a waiter's watch sees it go).
    (ahead.len() >= usize::try_from(limit).unwrap_or(usize::MAX))
        .then_some(PermitReply::Full { expires_in: None })
}

#[async_trait]
impl SemaphoreBackend for EtcdLock {
    async fn acquire_permit(&self, request: PermitRequest<'_>) -> Result<PermitReply, LockError> {
        let layout = &self.etcd().layout;
        let key = request.key;
        let prefix = layout.permits_prefix(key);
        let permit = layout.permit_key(key, request.owner);
        let value = encode_permit(request.owner, request.limit);
        // The read, the grant and the transaction share one operation
        // timeout.
        let deadline = self.etcd().requests.deadline();
        let before = self.read_permits(key, deadline).await?;
        let earlier = before.iter().find(|p| p.owner == request.owner);
        if earlier.is_none() {
            if let Some(refusal) = decide(&before, before.len(), request.limit) {
                return Ok(refusal);
            }
        }
        let (lease_id, granted) = self.etcd().grant(request.ttl, deadline).await?;
        let reply = match self
            .etcd()
            .run_txn_until(
                deadline,
                IN_LOCK_CALL,
                Repeat::Safe,
                txn::join_permits(&permit, &value, lease_id, &prefix),
            )
            .await
        {
            Ok(reply) => reply,
            Err(e) => {
                // Unknown outcome: the permit, if it was put, lives on
                // this lease; revoking it is an undo no late put outlives.
                // A retry (same owner) joins or adopts anew.
                self.etcd().revoke_later(lease_id);
                return Err(e);
            }
        };
        let (put, kvs) = txn::joined_permits(&reply);
        let now = match parse(self, key, &kvs) {
            Ok(now) => now,
            Err(e) => {
                self.etcd().revoke_later(lease_id);
                return Err(e);
            }
        };
        let place = now.iter().position(|p| p.owner == request.owner);
        let (Some(place), true) = (place, put) else {
            self.etcd().revoke_later(lease_id);
            return Err(LockError::corrupted(
                "the semaphore's etcd permit for this owner holds a value distlock did not write; it was left untouched — remove it or use another namespace",
            ));
        };
        // An adopted permit's earlier lease has no key left.
        if let Some(earlier) = earlier.filter(|p| p.lease != lease_id) {
            self.etcd().revoke_later(earlier.lease);
        }
        if let Some(refusal) = decide(&now, place, request.limit) {
            // Out of the line again: the revoke deletes the entry.
            self.etcd().revoke_later(lease_id);
            return Ok(refusal);
        }
        let fencing = now[place].created;
        Ok(PermitReply::Granted(
            Grant::new(token(fencing), granted).with_handle(handle(lease_id)),
        ))
    }

    async fn extend_permit(
        &self,
        permit: HeldLock<'_>,
        ttl: Duration,
    ) -> Result<ExtendReply, LockError> {
        let etcd_key = self.etcd().layout.permit_key(permit.key, permit.owner);
        let fencing = i64::try_from(permit.fencing.get()).unwrap_or(i64::MAX);
        self.move_to_new_lease(
            permit.fencing,
            permit.handle,
            ttl,
            IN_LOCK_CALL,
            |new_lease| txn::move_permit(&etcd_key, fencing, new_lease),
        )
        .await
    }

    async fn release_permit(&self, permit: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let etcd_key = self.etcd().layout.permit_key(permit.key, permit.owner);
        let fencing = i64::try_from(permit.fencing.get()).unwrap_or(i64::MAX);
        // The deletion wakes the first waiters (their watch).
        self.release_with(
            IN_LOCK_CALL,
            permit.handle,
            txn::release_permit(&etcd_key, fencing),
        )
        .await
    }

    async fn watch_permits(
        &self,
        key: &LockKey,
        limit: u32,
        _waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        self.inner
            .queues
            .enqueue(Line::Permits(key.clone(), limit))
            .await
            .map(Some)
    }
}

#[cfg(test)]
mod tests {
    //! The permit transaction against a real etcd, and the decision on a
    //! place in the line.

    use std::sync::Arc;

    use distlock_conformance::server::{Etcd, ServerProcess};
    use etcd_client::Client;

    use super::*;

    fn permit(limit: u32) -> Permit {
        Permit {
            owner: OwnerToken::random(),
            limit,
            created: 1,
            lease: 1,
        }
    }

    #[test]
    fn the_first_limit_permits_hold() {
        let line = [permit(2), permit(2), permit(2)];
        assert_eq!(decide(&line, 0, 2), None);
        assert_eq!(decide(&line, 1, 2), None);
        assert_eq!(
            decide(&line, 2, 2),
            Some(PermitReply::Full { expires_in: None })
        );
        // Not yet in the line: its place is after every permit.
        assert_eq!(
            decide(&line[..2], 2, 2),
            Some(PermitReply::Full { expires_in: None })
        );
        assert_eq!(decide(&line[..1], 1, 2), None);
        assert_eq!(decide(&[], 0, 1), None);
    }

    #[test]
    fn another_limit_before_it_refuses() {
        let line = [permit(3), permit(5)];
        assert_eq!(
            decide(&line, 1, 5),
            Some(PermitReply::LimitMismatch { stored: 3 })
        );
        assert_eq!(
            decide(&line, 2, 3),
            Some(PermitReply::LimitMismatch { stored: 5 })
        );
        // A permit after it under another limit is not its business.
        assert_eq!(decide(&line, 0, 3), None);
    }

    async fn etcd() -> (ServerProcess, Client) {
        let server = ServerProcess::start(Arc::new(Etcd)).expect("an etcd server must start");
        let client = Client::connect([server.addr().to_string()], None)
            .await
            .expect("connect");
        (server, client)
    }

    /// The permits prefix of semaphore `name`, and `owner`'s permit key.
    fn permit_of(name: &str, owner: OwnerToken) -> (Vec<u8>, Vec<u8>) {
        let layout = crate::keys::KeyLayout::new("ns");
        let key = LockKey::new(name).expect("a valid key");
        (layout.permits_prefix(&key), layout.permit_key(&key, owner))
    }

    /// A permit attempt whose outcome was unknown is undone by revoking its
    /// lease: the attempt, applied by the server only after the revoke (a
    /// request that sat in a socket buffer), writes nothing. The control
    /// shows the same attempt on a live lease takes the permit.
    #[tokio::test]
    async fn a_permit_attempt_applied_after_its_undo_takes_nothing() {
        let (_server, mut client) = etcd().await;
        let owner = OwnerToken::random();
        let (permits, key) = permit_of("late", owner);
        let value = encode_permit(owner, 1);
        let lease = client.lease_grant(60, None).await.expect("lease").id();
        let late = txn::join_permits(&key, &value, lease, &permits);
        client.lease_revoke(lease).await.expect("the undo");
        let applied = client.txn(late).await;
        assert!(
            applied.is_err(),
            "a permit put on a revoked lease was applied: {applied:?}"
        );
        let left = client.get(key.clone(), None).await.expect("get");
        assert!(left.kvs().is_empty(), "a permit was left");
        let live = client.lease_grant(60, None).await.expect("lease").id();
        let control = client
            .txn(txn::join_permits(&key, &value, live, &permits))
            .await
            .expect("control");
        let (put, found) = txn::joined_permits(&control);
        assert!(
            put && found.len() == 1,
            "control: the attempt takes the permit"
        );
    }

    /// Joining again with the owner's value (a retry whose first attempt
    /// was applied unseen) keeps the permit's place and fencing token and
    /// moves it to the new lease; another value at the key is only read.
    #[tokio::test]
    async fn joining_again_adopts_the_permit() {
        let (_server, mut client) = etcd().await;
        let owner = OwnerToken::random();
        let (permits, key) = permit_of("adopt", owner);
        let value = encode_permit(owner, 2);
        let first = client.lease_grant(60, None).await.expect("lease").id();
        let second = client.lease_grant(60, None).await.expect("lease").id();
        let reply = client
            .txn(txn::join_permits(&key, &value, first, &permits))
            .await
            .expect("first attempt");
        let created = reply.header().expect("header").revision();
        let reply = client
            .txn(txn::join_permits(&key, &value, second, &permits))
            .await
            .expect("second attempt");
        let (put, found) = txn::joined_permits(&reply);
        assert!(put, "the owner's second attempt did not adopt its permit");
        assert_eq!(found.len(), 1, "a second permit was taken");
        assert_eq!(found[0].create_revision(), created, "the place moved");
        assert_eq!(found[0].lease(), second, "the TTL did not start again");
        let other = encode_permit(owner, 3);
        let reply = client
            .txn(txn::join_permits(&key, &other, first, &permits))
            .await
            .expect("foreign value");
        let (put, found) = txn::joined_permits(&reply);
        assert!(!put, "a value that is not the attempt's was overwritten");
        assert_eq!(found[0].value(), value.as_slice());
    }
}
