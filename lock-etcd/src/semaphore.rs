//! Counting semaphores: at most `limit` permits of a key, each an etcd key
//! on a lease of its own, or on its client's session lease if its holder
//! renews it.
//!
//! The permits of semaphore `k` are the keys below
//! `NS/lock/%sem/<escaped k>/permits/`, one per holder, named by its client
//! with a name the client reuses (see [`crate::permit_names`] and
//! [`crate::keys`]) and valued `dl1:<owner>/<limit>`. etcd
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
//! (`LimitMismatch`), it gives the entry back (revoking its lease, which
//! deletes it).
//! A permit's place only moves forward as older ones go, so every holder
//! is always among the first `limit` entries and never more than `limit`
//! are held; attempts running at once do not conflict (each finds its own
//! place), so up to `limit` of them get in at once. An entry on its way
//! out only delays others (it counts until its deletion lands), and its
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
//! put outlives (a put on a revoked lease fails whole). Extending moves a
//! permit to a new lease of the TTL asked for.
//!
//! Renewing permits (a renewing [`PermitRequest`], what a permit guard
//! takes) go on the client's session lease of their TTL instead, as
//! renewing locks do ([`crate::session`]): no lease is granted, moved or
//! revoked per permit. Extending one with that TTL is one transaction that
//! confirms the permit is still there with its create revision and on the
//! session lease (the session's keep-alives renew it); with another TTL,
//! or once the session was lost, it moves to a new lease as above. The
//! session deletes a permit whose holder stopped renewing it for its TTL,
//! and etcd expires the session lease (and its permits) a TTL after the
//! client dies, so a holder that dies before its first renewal still frees
//! its permit within that TTL. The session lease is never revoked for one
//! permit: an entry given back, or an attempt whose outcome is unknown, is
//! deleted by the session's undo, whose fence the attempt's transaction
//! carries (see [`crate::fence`]; fences go below the semaphore's base,
//! outside its permits).
//!
//! Waiters queue FIFO as a lock's do ([`crate::queue`], on the
//! semaphore's own queue), the first in line watching deletions below
//! the permits prefix: a release or an expiry wakes exactly it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use distlock_core::{
    ExtendReply, FencingToken, Grant, HeldLock, LockError, LockKey, OwnerToken, PermitReply,
    PermitRequest, PermitState, ReleaseReply, ReleaseWatch, SemaphoreBackend, IN_LOCK_CALL,
};
use etcd_client::{GetOptions, KeyValue, SortOrder, SortTarget, TxnResponse};

use crate::backend::{own_lease_ttl, EtcdLock};
use crate::keys::{decode_holder, decode_permit};
use crate::queue::Line;
use crate::requests::Repeat;
use crate::session::{Attached, Session, Sessions};
use crate::slots::is_slot_name;
use crate::txn;

/// A live permit, as read.
#[derive(Debug)]
struct Permit {
    /// Its key below the permits prefix.
    name: Vec<u8>,
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
                // Named by a client (or, before 0.1.0, by its owner).
                Some((owner, limit))
                    if kv.lease() != 0
                        && (is_slot_name(name) || name == owner.to_hex().as_bytes()) =>
                {
                    Ok(Permit {
                        name: name.to_vec(),
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

impl EtcdLock {
    /// What `permit` is attached as: its name from this client's
    /// [`crate::permit_names`], or, if the client has none for it (lost
    /// track after an extend found it gone), from a read of the permits;
    /// `None` if no permit of its owner and fencing token is there.
    async fn held_permit(&self, permit: &HeldLock<'_>) -> Result<Option<Attached>, LockError> {
        let layout = &self.etcd().layout;
        let named = match self.inner.permit_names.of(permit.owner, permit.fencing) {
            Some(named) => Some(named),
            None => {
                let deadline = self.etcd().requests.deadline();
                self.read_permits(permit.key, deadline)
                    .await?
                    .into_iter()
                    .find(|p| p.owner == permit.owner && token(p.created) == permit.fencing)
                    .map(|p| (p.name, p.limit))
            }
        };
        Ok(named
            .map(|(name, limit)| Attached::permit(layout, permit.key, permit.owner, &name, limit)))
    }
}

impl EtcdLock {
    /// The live permits of `key`, oldest first, each with its own label:
    /// the permits and the labels read in one transaction, then each
    /// distinct lease's time to live. A label key whose value does not
    /// name its permit's owner (bad data) shows no label.
    pub(crate) async fn list_permits(&self, key: &LockKey) -> Result<Vec<PermitState>, LockError> {
        let layout = &self.etcd().layout;
        let read = etcd_client::Txn::new().and_then([
            txn::read_permits(&layout.permits_prefix(key)),
            etcd_client::TxnOp::get(
                layout.permit_holders_prefix(key),
                Some(GetOptions::new().with_prefix()),
            ),
        ]);
        let reply = self
            .etcd()
            .run_txn(IN_LOCK_CALL, Repeat::Safe, read)
            .await?;
        let mut found = reply.op_responses().into_iter().map(|op| match op {
            etcd_client::TxnOpResponse::Get(get) => get.kvs().to_vec(),
            _ => Vec::new(),
        });
        let (permits, labels) = (
            found.next().unwrap_or_default(),
            found.next().unwrap_or_default(),
        );
        let mut listed = Vec::new();
        let mut time_left = std::collections::HashMap::new();
        for permit in parse(self, key, &permits)? {
            let holder = labels
                .iter()
                .filter(|kv| kv.key() == layout.permit_holder_key(key, permit.owner).as_slice())
                .find_map(|kv| decode_holder(kv.value()))
                .filter(|(owner, _)| *owner == permit.owner)
                .map(|(_, holder)| holder);
            let expires_in = match time_left.get(&permit.lease) {
                Some(left) => *left,
                None => {
                    let left = self.time_left(permit.lease).await?;
                    time_left.insert(permit.lease, left);
                    left
                }
            };
            listed.push(PermitState {
                fencing_token: token(permit.created),
                expires_in,
                limit: permit.limit,
                holder,
            });
        }
        Ok(listed)
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

/// The lease a permit attempt put its permit on.
enum OnLease {
    /// A lease of its own, granted this TTL: revoking it gives the permit
    /// back.
    Own(i64, Duration),
    /// The session lease of a renewing attempt, the permit tracked from
    /// that instant: the session's fenced undo gives it back.
    Session(Arc<Session>, Instant),
}

impl EtcdLock {
    /// Sends the permit attempt's transaction, putting `attached` (with
    /// its value) on a lease of the request's TTL: the session lease for a
    /// renewing attempt (as a renewing lock's), else a lease of its own.
    /// On an error (unknown outcome) that lease is given back.
    async fn join(
        &self,
        request: &PermitRequest<'_>,
        attached: &Attached,
        deadline: Instant,
    ) -> Result<(TxnResponse, OnLease), LockError> {
        let prefix = self.etcd().layout.permits_prefix(request.key);
        let label = txn::Label::of_permit(&self.etcd().layout, request);
        if request.renewing {
            let sessions = &self.inner.sessions;
            let session = sessions.session(request.ttl, deadline).await?;
            let lease_id = session.lease_id();
            let joining = sessions.attach(&session, attached, deadline, |fence, raise| {
                let fence = Some(fence);
                txn::join_permits(
                    attached.key(),
                    attached.value(),
                    &label,
                    lease_id,
                    &prefix,
                    fence,
                    raise,
                )
            });
            return match joining.await {
                Ok((reply, tracked_from)) => Ok((reply, OnLease::Session(session, tracked_from))),
                Err(e) => {
                    // Unknown outcome: the session's undo, fence first, is
                    // one no late put outlives (see `crate::fence`).
                    drop(sessions.undo_now(&session, attached, None));
                    Err(e)
                }
            };
        }
        let (lease_id, granted) = self.etcd().grant(request.ttl, deadline).await?;
        let join = txn::join_permits(
            attached.key(),
            attached.value(),
            &label,
            lease_id,
            &prefix,
            None,
            &[],
        );
        match self
            .etcd()
            .run_txn_until(deadline, IN_LOCK_CALL, Repeat::Safe, join)
            .await
        {
            Ok(reply) => Ok((reply, OnLease::Own(lease_id, granted))),
            Err(e) => {
                // Unknown outcome: the permit, if it was put, lives on
                // this lease; revoking it is an undo no late put outlives.
                // A retry (same owner) joins or adopts anew.
                self.etcd().revoke_later(lease_id);
                Err(e)
            }
        }
    }

    /// Gives back the permit `attached` (created at `fencing`, if known)
    /// that an attempt put on `on`. One on the session lease is deleted by
    /// the session's undo, which this waits for (it runs on if this is
    /// dropped): a retry of the same owner sent while it is in flight
    /// would have to put its fence up, a key that stays for as long as the
    /// session lives.
    async fn give_back(&self, on: &OnLease, attached: &Attached, fencing: Option<FencingToken>) {
        match on {
            OnLease::Own(lease_id, _) => self.etcd().revoke_later(*lease_id),
            OnLease::Session(session, _) => {
                if let Some(undone) = self.inner.sessions.undo_now(session, attached, fencing) {
                    let _ = undone.await;
                }
            }
        }
    }

    /// Forgets the lease of an attempt that put nothing on it.
    fn unused(&self, on: &OnLease, attached: &Attached) {
        match on {
            OnLease::Own(lease_id, _) => self.etcd().revoke_later(*lease_id),
            OnLease::Session(session, _) => session.untrack(attached.id()),
        }
    }
}

#[async_trait]
impl SemaphoreBackend for EtcdLock {
    async fn acquire_permit(&self, request: PermitRequest<'_>) -> Result<PermitReply, LockError> {
        let key = request.key;
        let names = &self.inner.permit_names;
        // The read, the grant (of a lease, or of the session's first) and
        // the transaction share one operation timeout.
        let deadline = self.etcd().requests.deadline();
        let before = self.read_permits(key, deadline).await?;
        let earlier = before.iter().find(|p| p.owner == request.owner);
        if earlier.is_none() {
            if let Some(refusal) = decide(&before, before.len(), request.limit) {
                names.done(request.owner);
                return Ok(refusal);
            }
        }
        let name = names.for_attempt(
            request.owner,
            request.limit,
            earlier.map(|p| p.name.as_slice()),
        );
        let attached = Attached::permit(
            &self.etcd().layout,
            key,
            request.owner,
            &name,
            request.limit,
        );
        let (reply, on) = match self.join(&request, &attached, deadline).await {
            Ok(joined) => joined,
            Err(e) => {
                // Undone by `join`; a late copy can touch no other
                // acquisition's permit under the name (see
                // `crate::permit_names`).
                names.done(request.owner);
                return Err(e);
            }
        };
        let (put, kvs) = txn::joined_permits(&reply);
        let now = match parse(self, key, &kvs) {
            Ok(now) => now,
            Err(e) => {
                self.give_back(&on, &attached, None).await;
                names.done(request.owner);
                return Err(e);
            }
        };
        let mine = now
            .iter()
            .position(|p| p.owner == request.owner && p.name == name);
        let place = match (mine, put) {
            (Some(place), true) => place,
            (None, false) => {
                // Nothing put: the name holds another acquisition's permit
                // (one put late, before its undo), or this attempt's fence
                // is up (the session's undo of it ran a TTL late). Try again
                // at once, under another name.
                self.unused(&on, &attached);
                names.taken(request.owner);
                return Ok(PermitReply::Full {
                    expires_in: Some(Duration::ZERO),
                });
            }
            _ => {
                self.unused(&on, &attached);
                names.done(request.owner);
                return Err(LockError::corrupted(
                    "the semaphore's etcd permit for this owner holds a value distlock did not write; it was left untouched — remove it or use another namespace",
                ));
            }
        };
        let lease_id = match &on {
            OnLease::Own(lease_id, _) => *lease_id,
            OnLease::Session(session, _) => session.lease_id(),
        };
        // An adopted permit's earlier lease has no key left (a session
        // lease is never revoked for one permit).
        if let Some(earlier) = earlier
            .filter(|p| p.lease != lease_id && self.inner.sessions.by_lease(p.lease).is_none())
        {
            self.etcd().revoke_later(earlier.lease);
        }
        let fencing = token(now[place].created);
        if let Some(refusal) = decide(&now, place, request.limit) {
            // Out of the line again: giving it back deletes the entry.
            self.give_back(&on, &attached, Some(fencing)).await;
            names.done(request.owner);
            return Ok(refusal);
        }
        let grant = match on {
            OnLease::Own(lease_id, granted) => {
                Grant::new(fencing, granted).with_handle(handle(lease_id))
            }
            OnLease::Session(session, tracked_from) => {
                match Sessions::granted(&session, &attached, fencing, tracked_from) {
                    Ok(grant) => grant,
                    Err(e) => {
                        names.done(request.owner);
                        return Err(e);
                    }
                }
            }
        };
        names.granted(request.owner, fencing, own_lease_ttl(&grant));
        Ok(PermitReply::Granted(grant))
    }

    async fn extend_permit(
        &self,
        permit: HeldLock<'_>,
        ttl: Duration,
    ) -> Result<ExtendReply, LockError> {
        let Some(attached) = self.held_permit(&permit).await? else {
            return Ok(ExtendReply::NotHeld);
        };
        let label = self
            .etcd()
            .layout
            .permit_holder_key(permit.key, permit.owner);
        let fencing = i64::try_from(permit.fencing.get()).unwrap_or(i64::MAX);
        let reply = self
            .renew(&attached, permit, ttl, |new_lease| {
                txn::move_permit(attached.key(), &label, fencing, new_lease)
            })
            .await;
        let names = &self.inner.permit_names;
        match &reply {
            // Lost: its acquisition is over.
            Ok(ExtendReply::NotHeld) => names.ended(permit.owner, permit.fencing),
            Ok(ExtendReply::Extended(grant)) => {
                names.extended(permit.owner, permit.fencing, own_lease_ttl(grant));
            }
            Err(_) => {}
        }
        reply
    }

    async fn release_permit(&self, permit: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let Some(attached) = self.held_permit(&permit).await? else {
            return Ok(ReleaseReply::NotHeld);
        };
        let label = self
            .etcd()
            .layout
            .permit_holder_key(permit.key, permit.owner);
        let fencing = i64::try_from(permit.fencing.get()).unwrap_or(i64::MAX);
        // The deletion wakes the first waiters (their watch).
        let release = txn::release_permit(attached.key(), &label, fencing);
        let reply = self.release_with(&attached, permit.handle, release).await;
        // Whatever the answer, a copy of the release applied later deletes
        // only the permit created at `fencing`: the name may be reused.
        self.inner.permit_names.ended(permit.owner, permit.fencing);
        reply
    }

    async fn watch_permits(
        &self,
        key: &LockKey,
        limit: u32,
        _waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        self.inner
            .queues
            .enqueue(Line::Permits(key.clone(), limit), None)
            .await
            .map(Some)
    }
}

#[cfg(test)]
mod tests {
    //! The permit transaction against a real etcd, and the decision on a
    //! place in the line.

    use distlock_conformance::server::{Etcd, ServerProcess};
    use etcd_client::Client;

    use super::*;
    use crate::keys::encode_permit;

    fn permit(limit: u32) -> Permit {
        Permit {
            name: b"0123456789abcdef-0".to_vec(),
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

    /// No label, for a permit at `permit`: these tests are about the
    /// permit key.
    fn unlabelled(permit: &[u8]) -> txn::Label {
        let mut key = permit.to_vec();
        key.extend_from_slice(b"-label");
        txn::Label { key, value: None }
    }

    /// The permits prefix of semaphore `name`, and a permit key in it.
    fn permit_of(name: &str) -> (Vec<u8>, Vec<u8>) {
        let layout = crate::keys::KeyLayout::new("ns");
        let key = LockKey::new(name).expect("a valid key");
        (
            layout.permits_prefix(&key),
            layout.permit_key(&key, b"0123456789abcdef-0"),
        )
    }

    /// A permit attempt whose outcome was unknown is undone by revoking its
    /// lease: the attempt, applied by the server only after the revoke (a
    /// request that sat in a socket buffer), writes nothing. The control
    /// shows the same attempt on a live lease takes the permit.
    #[tokio::test]
    async fn a_permit_attempt_applied_after_its_undo_takes_nothing() {
        let (_server, mut client) = etcd().await;
        let owner = OwnerToken::random();
        let (permits, key) = permit_of("late");
        let value = encode_permit(owner, 1);
        let lease = client.lease_grant(60, None).await.expect("lease").id();
        let late = txn::join_permits(&key, &value, &unlabelled(&key), lease, &permits, None, &[]);
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
            .txn(txn::join_permits(
                &key,
                &value,
                &unlabelled(&key),
                live,
                &permits,
                None,
                &[],
            ))
            .await
            .expect("control");
        let (put, found) = txn::joined_permits(&control);
        assert!(
            put && found.len() == 1,
            "control: the attempt takes the permit"
        );
    }

    /// A renewing permit attempt (on a session lease, fenced) whose
    /// outcome was unknown is undone by the session: the undo deletes the
    /// permit if the attempt was applied and puts its fence up, so the
    /// attempt, applied only after that, writes nothing. The control shows
    /// the same attempt unfenced takes the permit.
    #[tokio::test]
    async fn a_renewing_permit_attempt_applied_after_its_undo_takes_nothing() {
        let (_server, mut client) = etcd().await;
        let layout = crate::keys::KeyLayout::new("ns");
        let key = LockKey::new("late-session").expect("a valid key");
        let owner = OwnerToken::random();
        let attached = Attached::permit(&layout, &key, owner, b"0123456789abcdef-0", 1);
        let permits = layout.permits_prefix(&key);
        let value = encode_permit(owner, 1);
        let session = client.lease_grant(60, None).await.expect("lease").id();
        let fence = attached.fence(session);
        let join = |fence: Option<&crate::fence::Fence>| {
            txn::join_permits(
                attached.key(),
                &value,
                &unlabelled(attached.key()),
                session,
                &permits,
                fence,
                &[],
            )
        };
        let late = join(Some(&fence));
        let undo = txn::undo_session_lock(
            attached.key(),
            attached.value(),
            None,
            session,
            None,
            &attached.fence(session),
            std::slice::from_ref(&fence),
            None,
        );
        client.txn(undo).await.expect("undo");
        let reply = client.txn(late).await.expect("late attempt");
        let (put, found) = txn::joined_permits(&reply);
        assert!(!put, "the late attempt put its permit");
        assert!(found.is_empty(), "a permit was left: {found:?}");
        let control = client.txn(join(None)).await.expect("control");
        let (put, found) = txn::joined_permits(&control);
        assert!(
            put && found.len() == 1,
            "control: the attempt without its fence takes the permit"
        );
    }

    /// Joining again with the owner's value (a retry whose first attempt
    /// was applied unseen) keeps the permit's place and fencing token and
    /// moves it to the new lease; another value at the key is only read.
    #[tokio::test]
    async fn joining_again_adopts_the_permit() {
        let (_server, mut client) = etcd().await;
        let owner = OwnerToken::random();
        let (permits, key) = permit_of("adopt");
        let value = encode_permit(owner, 2);
        let first = client.lease_grant(60, None).await.expect("lease").id();
        let second = client.lease_grant(60, None).await.expect("lease").id();
        let reply = client
            .txn(txn::join_permits(
                &key,
                &value,
                &unlabelled(&key),
                first,
                &permits,
                None,
                &[],
            ))
            .await
            .expect("first attempt");
        let created = reply.header().expect("header").revision();
        let reply = client
            .txn(txn::join_permits(
                &key,
                &value,
                &unlabelled(&key),
                second,
                &permits,
                None,
                &[],
            ))
            .await
            .expect("second attempt");
        let (put, found) = txn::joined_permits(&reply);
        assert!(put, "the owner's second attempt did not adopt its permit");
        assert_eq!(found.len(), 1, "a second permit was taken");
        assert_eq!(found[0].create_revision(), created, "the place moved");
        assert_eq!(found[0].lease(), second, "the TTL did not start again");
        let other = encode_permit(owner, 3);
        let reply = client
            .txn(txn::join_permits(
                &key,
                &other,
                &unlabelled(&key),
                first,
                &permits,
                None,
                &[],
            ))
            .await
            .expect("foreign value");
        let (put, found) = txn::joined_permits(&reply);
        assert!(!put, "a value that is not the attempt's was overwritten");
        assert_eq!(found[0].value(), value.as_slice());
    }

    /// A permit's name is reused by a later acquisition of its client, and
    /// requests of the earlier one may still be applied after: the
    /// session's undo of the earlier permit (its outcome unknown, so no
    /// fencing token to compare) leaves the newer permit under the name
    /// alone, and so does a late copy of the earlier attempt. The control:
    /// the same undo deletes the earlier permit itself.
    #[tokio::test]
    async fn a_late_request_of_an_earlier_permit_leaves_its_names_next_permit_alone() {
        let (_server, mut client) = etcd().await;
        let layout = crate::keys::KeyLayout::new("ns");
        let key = LockKey::new("reused").expect("a valid key");
        let name = b"0123456789abcdef-0";
        let permits = layout.permits_prefix(&key);
        let session = client.lease_grant(60, None).await.expect("lease").id();
        let (earlier, later) = (OwnerToken::random(), OwnerToken::random());
        let earlier = Attached::permit(&layout, &key, earlier, name, 2);
        let later = Attached::permit(&layout, &key, later, name, 2);
        let join = |attached: &Attached| {
            let fence = attached.fence(session);
            txn::join_permits(
                attached.key(),
                attached.value(),
                &unlabelled(attached.key()),
                session,
                &permits,
                Some(&fence),
                &[],
            )
        };
        let undo = |attached: &Attached| {
            txn::undo_session_lock(
                attached.key(),
                attached.value(),
                None,
                session,
                None,
                &attached.fence(session),
                &[],
                None,
            )
        };
        let late = join(&earlier);
        client.txn(join(&later)).await.expect("the later permit");
        client.txn(undo(&earlier)).await.expect("the earlier undo");
        let reply = client.txn(late).await.expect("the earlier attempt");
        let (put, _) = txn::joined_permits(&reply);
        assert!(!put, "a late attempt wrote over the name's next permit");
        let left = client.get(later.key(), None).await.expect("read");
        assert_eq!(
            left.kvs().first().map(KeyValue::value),
            Some(later.value()),
            "the name's next permit is gone"
        );
        client.txn(undo(&later)).await.expect("control undo");
        let left = client.get(later.key(), None).await.expect("read");
        assert!(
            left.kvs().is_empty(),
            "control: the undo deletes its own permit"
        );
    }
}
