//! [`EtcdLock`]: the [`LockBackend`] on etcd v3 — the plain (own lease)
//! paths, and the dispatch to the session paths ([`crate::session`]) and
//! the waiter queue ([`crate::queue`]); connecting is [`crate::connect`],
//! the operator calls [`crate::admin`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use distlock_core::{
    AcquireReply, AcquireRequest, Capabilities, ExtendReply, FencingToken, Grant, HeldLock,
    LockAdmin, LockBackend, LockError, LockKey, OwnerToken, ReleaseReply, ReleaseWatch,
    SemaphoreBackend, IN_LOCK_CALL,
};

use crate::config::{EtcdConfig, MAX_TTL, MIN_TTL};
use crate::connection::Etcd;
use crate::errors;
use crate::keys::encode_value;
use crate::marker;
use crate::permit_names::PermitNames;
use crate::queue::{Line, Queues};
use crate::requests::Repeat;
use crate::session::{self, Attached, Session, Sessions};
use crate::txn::{self, AcquireOutcome};

/// A distributed lock server on etcd v3, for
/// [`LockClient`](distlock_core::LockClient) and [`Locker`](distlock_core::Locker).
///
/// A lock is the key `NS/lock/<escaped key>` attached to an etcd lease
/// whose TTL is the lock's TTL, so etcd itself deletes it when the holder
/// stops renewing, by the server's clock. The fencing token is the key's
/// `create_revision`: etcd's global revision counter, strictly increasing
/// across releases, expiries and server restarts, unchanged by renewals.
///
/// Locks whose holder renews them (a renewing [`AcquireRequest`], which
/// [`Locker`](distlock_core::Locker) makes for guards with renewal on) share a
/// *session* lease instead: one etcd lease per client and TTL, granted on
/// first use and kept alive by one keep-alive stream, as etcd's Go
/// `concurrency.Session`. The session also deletes any of its locks whose
/// holder has not renewed it for its TTL, so a holder that stops renewing
/// still loses the lock after the TTL while the client lives on; if the
/// client dies, etcd expires the session lease and its locks with it.
/// Locks without renewal keep a lease of their own, so their TTL is exact.
/// Renewed semaphore permits share the session lease the same way (see
/// the crate docs, [Semaphores](crate#semaphores)).
/// A session lock's grant (and each renewal) is dated from the send time
/// of the last keep-alive the server confirmed, if that is earlier than
/// the request ([`Grant::clock_started`]).
///
/// Costs, in round trips to the server:
/// - renewing acquire: 1 transaction that creates the key on the session
///   lease (plus 1 lease grant the first time a client uses a TTL).
/// - `extend` of a session lock with its TTL (a guard's renewal, every
///   third of the TTL by default): 1 transaction that only confirms the key
///   is still ours and on the session lease.
/// - session keep-alive: 1 message on the keep-alive stream per third of
///   the TTL, per client and TTL in use, whatever the number of locks.
/// - plain acquire: 2 (grant a lease, then one transaction that creates the
///   key only if absent and nobody is ahead in line); on refusal the unused
///   lease is revoked in the background (not waited for). A waiter that
///   expects a refusal (someone ahead of it, or the lock held, by its queue
///   task's last look) sends a read-only transaction first: 1 if refused,
///   3 if not. An attempt not in line while one of the client's own
///   waiters is in the key's line is refused without a request.
/// - `extend` of a lock on its own lease, or with another TTL (max hold,
///   hold-at-least): 2 (grant a lease with the new TTL, then one
///   transaction that moves the key to it only if the value and create
///   revision are still ours); the old lease is revoked in the background
///   unless it is a session lease (those are never revoked for one lock).
/// - `release`: 1 transaction that compares owner and revision, then
///   deletes; a lock's own lease is revoked in the background.
///
/// Waiting is FIFO and woken by the server, as etcd's Go
/// `concurrency.Mutex`: each waiting call puts a queue entry
/// `NS/lock/<escaped key>/waiters/<id>` on a session lease of 5 s of its
/// client, and watches only the entry just before it; the first in line
/// watches the lock key, whose deletion (release, or the holder's lease
/// expiring) wakes exactly that waiter. A handoff costs the same few
/// requests however many wait (release, acquire, the leaving waiter's
/// queue-entry delete, one look-up by its successor); all watches share one
/// watch stream per client. Nobody overtakes the line: a free lock is
/// granted only to the first waiter, or to anyone while none waits; a
/// `try_lock` does not queue, and is refused while anyone waits (see the
/// crate docs, [Waiting](crate#waiting)). A waiter that takes the lock
/// leaves its line in the acquire transaction, so a handoff costs the
/// release, the next waiter's acquire and its successor's look-up.
///
/// A renewing acquire whose session is lost while the request is in flight
/// (no keep-alive answered within the TTL) is refused with an
/// [`Unavailable`](distlock_core::ErrorKind::Unavailable) error: the lock it
/// created goes with the session lease, so no lease is dated from it.
///
/// Cancel safety: each future may be dropped at any await point; what a
/// dropped one leaves is in the crate docs, [Cancellation](crate#cancellation).
///
/// TTLs are whole seconds (at least 1 s, or the server's minimum lease TTL
/// if larger); the client rounds shorter or fractional TTLs up.
///
/// Against a cluster, requests that hit a dead, cut-off or leaderless
/// member are sent again as the crate docs describe
/// ([Unknown outcomes](crate#unknown-outcomes), [Topologies](crate#topologies)).
///
/// A client belongs to the tokio runtime it was created in: the gRPC
/// channel runs its connection tasks there, so create it inside the runtime
/// that uses it and do not use it after that runtime shut down.
///
/// ```no_run
/// use std::time::Duration;
/// use distlock_core::{LockClient, LockKey};
/// use distlock_etcd::EtcdLock;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock_core::LockError> {
/// let client = LockClient::new(EtcdLock::connect("etcd://127.0.0.1:2379?namespace=jobs").await?);
/// let key = LockKey::new("nightly-report")?;
/// if let Some(lease) = client.try_acquire(&key, Duration::from_secs(30)).await?.lease() {
///     println!("fencing token {}", lease.fencing_token());
///     client.release(&lease).await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct EtcdLock {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    /// The kv and lease clients, key layout and request executor.
    pub(crate) etcd: Etcd,
    pub(crate) config: EtcdConfig,
    /// The session leases of renewing locks (and of queue entries).
    pub(crate) sessions: Arc<Sessions>,
    /// The waiter queues, woken through the watch stream.
    pub(crate) queues: Arc<Queues>,
    /// The names of this client's permits, reused.
    pub(crate) permit_names: PermitNames,
    /// The most reads a batched confirm puts in one transaction: etcd's
    /// default `--max-txn-ops`, lowered if the server refuses that many.
    pub(crate) txn_ops: AtomicUsize,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLock")
            .field("config", &self.config)
            .field("listener", &self.queues.listener)
            .field("waiting", &self.queues.waiting.channels().len())
            .field("sessions", &self.sessions.len())
            .finish_non_exhaustive()
    }
}

impl EtcdLock {
    /// The configuration in use.
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.config
    }

    /// The prefix of every etcd key this client touches (`NS/lock/`: locks,
    /// semaphores' permits, their waiter queues, and the namespace's format
    /// marker `NS/lock/%format`): a restricted etcd
    /// user needs a role with readwrite permission on it.
    pub fn key_prefix(&self) -> &str {
        self.etcd().layout.prefix()
    }

    /// The client's kv and lease clients, key layout and request executor.
    pub(crate) fn etcd(&self) -> &Etcd {
        &self.inner.etcd
    }

    /// A plain acquire: grants a lease of exactly the TTL, then creates the
    /// key on it if absent and nobody is ahead in line (`turn`), both by
    /// `deadline`.
    async fn acquire_on_own_lease(
        &self,
        request: AcquireRequest<'_>,
        mut turn: txn::Turn,
        deadline: Instant,
    ) -> Result<AcquireReply, LockError> {
        let key = request.key;
        let etcd_key = self.etcd().layout.lock_key(key);
        let value = encode_value(request.owner);
        let label = txn::Label::of(&self.etcd().layout, &request);
        let (lease_id, granted) = self.etcd().grant(request.ttl, deadline).await?;
        let outcome = loop {
            let reply = match self
                .etcd()
                .run_txn_until(
                    deadline,
                    IN_LOCK_CALL,
                    Repeat::Safe,
                    txn::acquire(&etcd_key, &value, &label, lease_id, &turn, None, &[]),
                )
                .await
            {
                Ok(reply) => reply,
                Err(e) => {
                    // Unknown outcome: the lease bounds the lock's life
                    // either way; revoking it frees a lock we may have taken.
                    self.etcd().revoke_later(lease_id);
                    return Err(e);
                }
            };
            match txn::acquire_outcome(key, request.owner, &turn, &reply) {
                // Our entry is gone and the line empty: once more, as an
                // attempt not in line.
                Ok(AcquireOutcome::OutOfLine) if turn.place.is_some() => turn.place = None,
                outcome => break outcome,
            }
        };
        if !matches!(outcome, Ok(AcquireOutcome::Created(_))) {
            // Not ours: the unused lease goes.
            self.etcd().revoke_later(lease_id);
        }
        Ok(match outcome? {
            AcquireOutcome::Created(fencing) => AcquireReply::Granted(
                Grant::new(fencing, granted).with_handle(u64::try_from(lease_id).unwrap_or(0)),
            ),
            AcquireOutcome::Refused(refused) => refused,
            AcquireOutcome::OutOfLine => try_again(),
        })
    }

    /// Renews `held`, the lock or permit `attached`: on a live session
    /// lease with this TTL, one transaction confirms it (the session's
    /// keep-alives renew it); else (its own lease, another TTL such as max
    /// hold or hold-at-least, or a lost session) it moves to a new lease of
    /// exactly `ttl` by `moving(new lease)`, a transaction that moves the
    /// key only if it is still ours.
    pub(crate) async fn renew(
        &self,
        attached: &Attached,
        held: HeldLock<'_>,
        ttl: Duration,
        moving: impl FnOnce(i64) -> etcd_client::Txn,
    ) -> Result<ExtendReply, LockError> {
        let sessions = &self.inner.sessions;
        if let Some(session) = sessions.renewable(held.handle, ttl) {
            return sessions.confirm(attached, held.fencing, &session).await;
        }
        let moved = self
            .move_to_new_lease(held.fencing, held.handle, ttl, moving)
            .await?;
        // Off the session lease either way: its expiry tracking stops.
        sessions.untrack(held.handle, attached);
        Ok(moved)
    }

    /// Grants a lease of exactly `ttl` and runs `moving(new lease)`, a
    /// transaction that moves a key (lock or permit of `fencing`) to it
    /// only if the key is still ours; then revokes whichever lease is left
    /// without it: the old one (`old_handle`, if the key's own) once it
    /// moved, else the new one. Grant and transaction share one operation
    /// timeout.
    async fn move_to_new_lease(
        &self,
        fencing: FencingToken,
        old_handle: u64,
        ttl: Duration,
        moving: impl FnOnce(i64) -> etcd_client::Txn,
    ) -> Result<ExtendReply, LockError> {
        let deadline = self.etcd().requests.deadline();
        let (new_lease, granted) = self.etcd().grant(ttl, deadline).await?;
        // Unknown outcome on error: if the move happened, the key now lives
        // on `new_lease`, so it is not revoked (that would delete a key we
        // still hold); it expires by its TTL, and a retried extend moves the
        // key on again.
        let reply = self
            .etcd()
            .run_txn_until(deadline, IN_LOCK_CALL, Repeat::Safe, moving(new_lease))
            .await?;
        if !reply.succeeded() {
            self.etcd().revoke_later(new_lease);
            return Ok(ExtendReply::NotHeld);
        }
        if let Some(old) = own_lease_of(old_handle).filter(|old| *old != new_lease) {
            self.etcd().revoke_later(old);
        }
        Ok(ExtendReply::Extended(
            Grant::new(fencing, granted).with_handle(u64::try_from(new_lease).unwrap_or(0)),
        ))
    }

    /// Runs `release`, a transaction that deletes `attached` (a lock or
    /// permit on `handle`) only if it is still ours; once it did, revokes
    /// the key's own lease (if not a session's) in the background. Either
    /// way, the key leaves its session's expiry tracking.
    pub(crate) async fn release_with(
        &self,
        attached: &Attached,
        handle: u64,
        release: etcd_client::Txn,
    ) -> Result<ReleaseReply, LockError> {
        // Sent again after a lost reply: a second send that finds the key
        // gone may follow a first that released it, which the reply says
        // (the client decides by the lease's clock), instead of leaving it
        // to its TTL while everyone waits.
        let (reply, resent) = self
            .etcd()
            .run_txn_resent(IN_LOCK_CALL, Repeat::Safe, release)
            .await?;
        self.inner.sessions.untrack(handle, attached);
        if !reply.succeeded() {
            return Ok(if resent {
                ReleaseReply::NotHeldAfterResend
            } else {
                ReleaseReply::NotHeld
            });
        }
        if let Some(own) = own_lease_of(handle) {
            self.etcd().revoke_later(own);
        }
        Ok(ReleaseReply::Released)
    }
}

impl EtcdLock {
    /// A renewal found `lock` gone (deleted by a request that knows no
    /// markers: a force release of an older client, a hand): its marker,
    /// if it has one, goes in the background, or its successor would wait
    /// for it as long as the marker's lease lives (a session's: as long as
    /// this client).
    fn drop_marker(&self, lock: &HeldLock<'_>) {
        let queues = self.inner.queues.clone();
        let Some(entry) = queues.markers.of(lock.key, lock.owner) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let etcd = self.etcd().clone();
        let (key, owner) = (lock.key.clone(), lock.owner);
        runtime.spawn(async move {
            let delete = etcd_client::Txn::new().and_then([marker::delete_unless_held(
                &etcd.layout.lock_key(&key),
                &encode_value(owner),
                &entry,
            )]);
            let sent_again = etcd.requests.sent_again();
            let deleted = etcd
                .run_txn("etcd marker of a lost lock", Repeat::Safe, delete)
                .await;
            if let Err(e) = &deleted {
                tracing::debug!(key = %key, error = %e, "could not delete the marker of a lost etcd lock; it goes with its lease");
            }
            // As for a release: the name is reused only if no earlier try
            // can still be applied.
            let known = deleted.is_ok() && etcd.requests.sent_again() == sent_again;
            queues.markers.ended(&key, owner, known);
        });
    }
}

/// An attempt refused for a reason gone by now: try again at once.
pub(crate) fn try_again() -> AcquireReply {
    AcquireReply::Held {
        expires_in: Some(Duration::ZERO),
    }
}

/// The lock's own etcd lease in a handle; `None` for a session lease (shared,
/// never revoked for one lock) or no lease.
pub(crate) fn own_lease_of(handle: u64) -> Option<i64> {
    if session::session_lease_of(handle).is_some() {
        return None;
    }
    i64::try_from(handle).ok().filter(|id| *id > 0)
}

/// The TTL a granted or extended lock or permit expires by if nobody
/// releases it: its lease's, when the lease is its own; `None` on a
/// session lease (it ends with its holder or its session). One rule for
/// grants and extends, read from the grant's handle, for the client's
/// records of it to go once past (see [`crate::by_owner`]).
pub(crate) fn own_lease_ttl(grant: &Grant) -> Option<Duration> {
    own_lease_of(grant.handle).map(|_| grant.ttl)
}

#[async_trait]
impl LockBackend for EtcdLock {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            min_ttl: MIN_TTL,
            ttl_granularity: Duration::from_secs(1),
            max_ttl: MAX_TTL,
            native_wait: true,
            wakes_one_waiter: true,
            fair_handoff: true,
            durable: true,
            // Renewing guards' locks share the session lease: one
            // transaction of reads confirms many.
            extend_batch: txn::MAX_CONFIRM_BATCH,
            holder_ids: true,
            // Beside each permit, on its lease (see `keys`).
            permit_holder_ids: true,
            holder_watch: true,
            // A watch writes a queue entry through Raft (and its delete
            // after): a free key needs neither.
            attempt_before_watch: true,
            ..Capabilities::default()
        }
    }

    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<AcquireReply, LockError> {
        // The line the attempt must not cut into, and its place in it if it
        // waits (see `crate::queue`).
        let (turn, mut seat) = self.inner.queues.turn(request.key, request.owner);
        // A waiter whose seat expects a refusal reads first: a refusal then
        // costs one read, not a write through Raft (an etcd transaction
        // that could write is logged and committed even when its compare
        // fails) nor a lease.
        // The probe and the acquire share one operation timeout.
        // So does a settling attempt not in line while one of this
        // client's waiters is (the entry read is that waiter's; any other
        // attempt is refused without a request then: a crowd of one
        // process, where the holder that released asks again), and an
        // attempt on a key this client found taken lately (a crowd of
        // many: the line's first key is read).
        let queues = &self.inner.queues;
        // The attempt right after the waiter joined, whose entry's own
        // transaction found someone ahead or another owner's lock: refused
        // without a request (see `Seat::refused_at_join`).
        if let Some(seat) = seat.as_deref().filter(|_| !request.settling) {
            if seat.refused_at_join() {
                queues.taken(request.key);
                return Ok(AcquireReply::Held { expires_in: None });
            }
        }
        let deadline = self.etcd().requests.deadline();
        let probe_ahead = match seat.as_deref() {
            Some(seat) => seat
                .expects_refusal()
                .then(|| seat.ahead().map_or(txn::Ahead::Nobody, txn::Ahead::Entry)),
            None => match queues.entry_in_line(request.key) {
                // One of this client's waiters is in the key's line (its
                // entry is put, and not deleted while its seat is
                // registered), so an attempt not in line is refused, as a
                // read of that entry would say: no request. Not a settling
                // attempt, which must find a lock an earlier attempt may
                // have taken, to give it back.
                Some(_) if !request.settling => {
                    queues.taken(request.key);
                    return Ok(AcquireReply::Held { expires_in: None });
                }
                Some(entry) => Some(txn::Ahead::Entry(entry)),
                None => queues
                    .contended(request.key)
                    .then(|| txn::Ahead::AnyOf(turn.line.clone())),
            },
        };
        if let Some(ahead) = probe_ahead {
            let probe = txn::probe(&self.etcd().layout.lock_key(request.key), &ahead);
            let reply = self
                .etcd()
                .run_txn_until(deadline, IN_LOCK_CALL, Repeat::Safe, probe)
                .await?;
            if let Some(refused) = txn::probed(request.key, request.owner, &turn, &reply)? {
                queues.taken(request.key);
                return Ok(refused);
            }
        }
        if let Some(seat) = &mut seat {
            seat.sending();
        }
        let sent_again = self.etcd().requests.sent_again();
        let turn_place = turn.place.clone();
        let reply = if request.renewing {
            self.inner.sessions.acquire(request, turn, deadline).await
        } else {
            self.acquire_on_own_lease(request, turn, deadline).await
        };
        if let Some(seat) = &mut seat {
            // A try of it that went unanswered (this client sent some
            // request again meanwhile) may still be applied after it.
            seat.answered(reply.is_ok() && self.etcd().requests.sent_again() == sent_again);
        }
        if let (Ok(AcquireReply::Granted(grant)), Some(seat)) = (&reply, &seat) {
            // Its entry is the holder's marker now (or was gone already).
            seat.took();
            if let Some((entry, _)) = &turn_place {
                let ttl = own_lease_ttl(grant);
                queues
                    .markers
                    .granted(request.key, request.owner, entry, ttl);
            }
        }
        if let Ok(AcquireReply::Held { .. }) = &reply {
            queues.taken(request.key);
            if let Some(seat) = &seat {
                // A first waiter woken for the end of the marker ahead
                // of it, refused: it looks its place up again.
                seat.refused();
            }
        }
        reply
    }

    async fn extend(&self, lock: HeldLock<'_>, ttl: Duration) -> Result<ExtendReply, LockError> {
        let attached = Attached::lock(&self.etcd().layout, lock.key, lock.owner);
        let value = encode_value(lock.owner);
        let label_key = self.etcd().layout.holder_key(lock.key);
        let reply = self
            .renew(&attached, lock, ttl, |new_lease| {
                // Looked up only for a move: a confirm writes nothing.
                let marker = self.inner.queues.markers.of(lock.key, lock.owner);
                txn::extend(
                    attached.key(),
                    &value,
                    &label_key,
                    lock.fencing,
                    new_lease,
                    marker.as_deref(),
                )
            })
            .await;
        match &reply {
            Ok(ExtendReply::NotHeld) => self.drop_marker(&lock),
            Ok(ExtendReply::Extended(grant)) => {
                let markers = &self.inner.queues.markers;
                markers.extended(lock.key, lock.owner, own_lease_ttl(grant));
            }
            Err(_) => {}
        }
        reply
    }

    /// Locks on a live session lease of this TTL (renewing guards') are
    /// confirmed together: one transaction of range reads over their sorted
    /// keys, at most 1,024 locks and 128 ranges a request (etcd's default
    /// `--max-txn-ops`, halved while the server refuses that many), each
    /// lock checked on its own (a range cut short by others' keys is read
    /// again key by key). The others move to a new lease one by one, as
    /// `extend` does. A failed transaction fails the call (reads: nothing
    /// was written).
    async fn extend_many(
        &self,
        locks: &[HeldLock<'_>],
        ttl: Duration,
    ) -> Result<Vec<Result<ExtendReply, LockError>>, LockError> {
        let layout = &self.etcd().layout;
        let sessions = &self.inner.sessions;
        // (index in `locks`, its answer), put in order at the end.
        let mut replies: Vec<(usize, Result<ExtendReply, LockError>)> =
            Vec::with_capacity(locks.len());
        // Grouped by session lease (one, unless a session was replaced).
        let mut groups: Vec<(Arc<Session>, Vec<usize>)> = Vec::new();
        for (at, lock) in locks.iter().enumerate() {
            match sessions.renewable(lock.handle, ttl) {
                Some(session) => {
                    match groups
                        .iter_mut()
                        .find(|(s, _)| s.lease_id() == session.lease_id())
                    {
                        Some((_, members)) => members.push(at),
                        None => groups.push((session, vec![at])),
                    }
                }
                None => replies.push((at, self.extend(*lock, ttl).await)),
            }
        }
        for (session, members) in groups {
            let mut rest = members.as_slice();
            while !rest.is_empty() {
                let ranges = self.inner.txn_ops.load(Ordering::Relaxed);
                let (chunk, after) = rest.split_at(txn::MAX_CONFIRM_BATCH.min(rest.len()));
                let attached: Vec<Attached> = chunk
                    .iter()
                    .map(|&at| Attached::lock(layout, locks[at].key, locks[at].owner))
                    .collect();
                let items: Vec<(&Attached, FencingToken)> = attached
                    .iter()
                    .zip(chunk)
                    .map(|(attached, &at)| (attached, locks[at].fencing))
                    .collect();
                match sessions.confirm_many(&items, &session, ranges).await {
                    Ok(answers) => {
                        for (&at, answer) in chunk.iter().zip(&answers) {
                            if let ExtendReply::NotHeld = answer {
                                self.drop_marker(&locks[at]);
                            }
                        }
                        replies.extend(chunk.iter().zip(answers).map(|(&at, a)| (at, Ok(a))));
                        rest = after;
                    }
                    // A server run with a lower --max-txn-ops: smaller
                    // transactions from now on (a refused one read nothing).
                    Err(e) if txn::range_reads(chunk.len(), ranges) > 1 && too_many_ops(&e) => {
                        let sent = txn::range_reads(chunk.len(), ranges);
                        let fewer = sent / 2;
                        self.inner.txn_ops.store(fewer, Ordering::Relaxed);
                        tracing::warn!(
                            refused = sent,
                            now = fewer,
                            "etcd refused a transaction of {sent} reads (its --max-txn-ops is lower): renewals now send at most {fewer} reads a request"
                        );
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        replies.sort_by_key(|(at, _)| *at);
        Ok(replies.into_iter().map(|(_, reply)| reply).collect())
    }

    async fn release(&self, lock: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let attached = Attached::lock(&self.etcd().layout, lock.key, lock.owner);
        let value = encode_value(lock.owner);
        let label_key = self.etcd().layout.holder_key(lock.key);
        let markers = &self.inner.queues.markers;
        let marker = markers.of(lock.key, lock.owner);
        let release = txn::release(
            attached.key(),
            &value,
            &label_key,
            lock.fencing,
            marker.as_deref(),
        );
        let sent_again = self.etcd().requests.sent_again();
        let reply = self.release_with(&attached, lock.handle, release).await;
        if reply.is_ok() {
            // The marker went with the lock, or after it. Its name is
            // reused only if no earlier try of the release can still be
            // applied (one applied later deletes a marker of that name).
            let known = self.etcd().requests.sent_again() == sent_again;
            markers.ended(lock.key, lock.owner, known);
        }
        reply
    }

    async fn watch(
        &self,
        key: &LockKey,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        self.inner
            .queues
            .enqueue(Line::Lock(key.clone()), Some(waiter))
            .await
            .map(Some)
    }

    fn admin(&self) -> Option<&dyn LockAdmin> {
        Some(self)
    }

    fn semaphore(&self) -> Option<&dyn SemaphoreBackend> {
        Some(self)
    }
}

/// Whether `error` is etcd refusing a transaction of more operations
/// than its `--max-txn-ops` (see `errors::map`).
fn too_many_ops(error: &LockError) -> bool {
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<etcd_client::Error>())
        .is_some_and(errors::is_too_many_ops)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_own_leases_are_revoked() {
        assert_eq!(own_lease_of(42), Some(42));
        assert_eq!(own_lease_of(session::session_handle(42)), None);
        assert_eq!(own_lease_of(0), None);
    }

    /// A fresh etcd server (stopped when dropped), a client of it, and a
    /// raw driver client.
    async fn etcd_with_clients() -> (
        distlock_conformance::server::ServerProcess,
        EtcdLock,
        etcd_client::Client,
    ) {
        use distlock_conformance::server::{Etcd as EtcdServer, ServerProcess};
        let server = ServerProcess::start(Arc::new(EtcdServer)).expect("an etcd server must start");
        let lock = EtcdLock::connect(&server.url()).await.expect("connect");
        let raw = etcd_client::Client::connect([server.addr().to_string()], None)
            .await
            .expect("raw client");
        (server, lock, raw)
    }

    /// A waiter's entry name is reused by the client's next wait only once
    /// no attempt that claimed its place can still be applied (one that
    /// takes the lock deletes the entry by its name): not while an attempt
    /// that sent its transaction is unanswered when the wait ends.
    #[tokio::test]
    async fn an_entry_name_is_not_reused_while_an_attempt_on_it_is_unanswered() {
        let (_server, lock, raw) = etcd_with_clients().await;
        let key = LockKey::new("named").expect("key");
        let line = lock.etcd().layout.queue_prefix(&key);
        let bound = Duration::from_secs(10);
        // Waits on `key` and returns its entry's name, with its watch.
        let wait = |owner| {
            let (lock, key, line, mut raw) = (lock.clone(), key.clone(), line.clone(), raw.clone());
            async move {
                let watch = lock
                    .watch(&key, owner)
                    .await
                    .expect("watch")
                    .expect("queued");
                let entries = raw
                    .get(
                        line.clone(),
                        Some(etcd_client::GetOptions::new().with_prefix()),
                    )
                    .await
                    .expect("read the line");
                let names: Vec<_> = entries
                    .kvs()
                    .iter()
                    .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
                    .collect();
                assert_eq!(names.len(), 1, "one entry");
                (names[0].clone(), watch)
            }
        };
        // What an attempt of `owner` claims as it starts.
        let claim_seat = |owner| {
            lock.inner
                .queues
                .turn(&key, owner)
                .1
                .expect("the waiter's seat")
        };
        // Answered: the next wait takes the name again.
        let owner = OwnerToken::random();
        let (first, watch) = wait(owner).await;
        let mut claim = claim_seat(owner);
        claim.sending();
        claim.answered(true);
        drop(claim);
        watch.close(bound).await;
        let (again, watch) = wait(OwnerToken::random()).await;
        assert_eq!(again, first, "an entry name was not reused");
        watch.close(bound).await;
        // Unanswered when its wait ends: the name is retired.
        let owner = OwnerToken::random();
        let (named, watch) = wait(owner).await;
        assert_eq!(named, first);
        let mut claim = claim_seat(owner);
        claim.sending();
        watch.close(bound).await;
        let (next, watch) = wait(OwnerToken::random()).await;
        assert_ne!(next, first, "the name of an unanswered attempt was reused");
        watch.close(bound).await;
        drop(claim);
        let (last, watch) = wait(OwnerToken::random()).await;
        assert_ne!(last, first, "a retired name came back");
        watch.close(bound).await;
    }

    /// A waiter that takes the lock leaves its entry as the lock's marker
    /// (see `crate::marker`): the entry's name is not reused by the
    /// client's next wait while the marker may exist (its put would be
    /// refused: the name is in use), and is reused once the release
    /// deleted it.
    #[tokio::test]
    async fn a_markers_name_is_reused_only_once_its_lock_is_released() {
        let (_server, lock, mut raw) = etcd_with_clients().await;
        let key = LockKey::new("marked").expect("key");
        let line = lock.etcd().layout.queue_prefix(&key);
        let bound = Duration::from_secs(10);
        let names = |raw: &mut etcd_client::Client| {
            let (mut raw, line) = (raw.clone(), line.clone());
            async move {
                let entries = raw
                    .get(line, Some(etcd_client::GetOptions::new().with_prefix()))
                    .await
                    .expect("read the line");
                entries
                    .kvs()
                    .iter()
                    .map(|kv| (String::from_utf8_lossy(kv.key()).into_owned(), kv.version()))
                    .collect::<Vec<_>>()
            }
        };
        let request = |owner| AcquireRequest {
            key: &key,
            owner,
            ttl: Duration::from_secs(30),
            renewing: false,
            settling: false,
            holder: None,
        };
        // A waiter, first in line, takes the free lock.
        let owner = OwnerToken::random();
        let watch = lock
            .watch(&key, owner)
            .await
            .expect("watch")
            .expect("queued");
        let AcquireReply::Granted(grant) = lock.acquire(request(owner)).await.expect("acquire")
        else {
            panic!("the first in line was refused a free lock");
        };
        watch.close(bound).await;
        let marked = names(&mut raw).await;
        assert_eq!(marked.len(), 1, "{marked:?}");
        assert!(
            marked[0].1 > 1,
            "the taker's entry is not its marker: {marked:?}"
        );
        // The client's next wait takes another name.
        let next = lock
            .watch(&key, OwnerToken::random())
            .await
            .expect("watch while the marker lives")
            .expect("queued");
        let both = names(&mut raw).await;
        assert_eq!(both.len(), 2, "{both:?}");
        next.close(bound).await;
        let released = HeldLock {
            key: &key,
            owner,
            fencing: grant.fencing,
            handle: grant.handle,
        };
        assert!(matches!(
            lock.release(released).await.expect("release"),
            ReleaseReply::Released
        ));
        assert!(
            names(&mut raw).await.is_empty(),
            "the marker outlived its release"
        );
        // Now the marker's name is free again (the lowest).
        let again = lock
            .watch(&key, OwnerToken::random())
            .await
            .expect("watch")
            .expect("queued");
        let reused = names(&mut raw).await;
        assert_eq!(reused.len(), 1, "{reused:?}");
        assert_eq!(
            reused[0].0, marked[0].0,
            "the marker's name was not given back"
        );
        again.close(bound).await;
    }

    /// Another client holds `key`; a waiter of `lock`'s client is in
    /// line, and an acquire attempt of it has claimed its place and been
    /// sent (unanswered while the claim lives).
    async fn first_waiter_sending(
        lock: &EtcdLock,
        raw: &mut etcd_client::Client,
        key: &LockKey,
    ) -> (ReleaseWatch, crate::queue::Claim) {
        raw.put(
            lock.etcd().layout.lock_key(key),
            encode_value(OwnerToken::random()),
            None,
        )
        .await
        .expect("hold the key");
        let first = OwnerToken::random();
        let watch = lock
            .watch(key, first)
            .await
            .expect("watch")
            .expect("queued");
        let mut claim = lock
            .inner
            .queues
            .turn(key, first)
            .1
            .expect("the first waiter's seat");
        claim.sending();
        (watch, claim)
    }

    /// How many entries `key`'s line has.
    async fn line_entries(lock: &EtcdLock, mut raw: etcd_client::Client, key: &LockKey) -> usize {
        let line = lock.etcd().layout.queue_prefix(key);
        raw.get(line, Some(etcd_client::GetOptions::new().with_prefix()))
            .await
            .expect("read the line")
            .kvs()
            .len()
    }

    /// A waiting call joins a key's line only once no acquire attempt of
    /// another waiter of its client on that key is in flight: the two
    /// writes sent together go into separate Raft rounds, the grant often
    /// behind the join's put (a holder that releases and asks again while
    /// the next waiter, in its own process, takes the lock).
    #[tokio::test]
    async fn a_join_waits_for_its_clients_attempt_in_flight_on_the_key() {
        let (_server, lock, mut raw) = etcd_with_clients().await;
        let key = LockKey::new("joined-behind").expect("key");
        let (first_watch, claim) = first_waiter_sending(&lock, &mut raw, &key).await;
        let join = tokio::spawn({
            let lock = lock.clone();
            let key = key.clone();
            async move { lock.watch(&key, OwnerToken::random()).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !join.is_finished(),
            "a waiting call joined while its client's attempt on the key was in flight"
        );
        assert_eq!(
            line_entries(&lock, raw.clone(), &key).await,
            1,
            "only the first waiter is in line"
        );
        drop(claim);
        let second_watch = join
            .await
            .expect("the join")
            .expect("watch")
            .expect("queued");
        assert_eq!(
            line_entries(&lock, raw.clone(), &key).await,
            2,
            "the second waiter joined"
        );
        let bound = Duration::from_secs(10);
        first_watch.close(bound).await;
        second_watch.close(bound).await;
    }

    /// The join's wait for its client's attempt in flight is capped at an
    /// operation timeout: an attempt that never ends (a stalled member
    /// holding its request, a claim leaked by a bug) must not keep every
    /// later waiter of the client out of the line.
    #[tokio::test]
    async fn a_join_goes_on_after_an_operation_timeout_of_an_attempt_in_flight() {
        let (server, _, mut raw) = etcd_with_clients().await;
        let config = EtcdConfig::from_url(&server.url())
            .expect("config")
            .with_client(
                distlock_core::ClientOptions::default()
                    .with_operation_timeout(Duration::from_secs(3)),
            );
        let lock = EtcdLock::with_config(config).await.expect("connect");
        let key = LockKey::new("joined-after-cap").expect("key");
        // Sent and never answered: the claim lives until the test ends.
        let (first_watch, claim) = first_waiter_sending(&lock, &mut raw, &key).await;
        // Without the cap this join waits as long as the claim lives; the
        // bound only keeps a broken build from hanging the suite.
        let second_watch = tokio::time::timeout(
            Duration::from_secs(60),
            lock.watch(&key, OwnerToken::random()),
        )
        .await
        .expect(
            "a join behind an attempt in flight stayed out of the line past an operation timeout",
        )
        .expect("watch")
        .expect("queued");
        assert_eq!(
            line_entries(&lock, raw.clone(), &key).await,
            2,
            "the second waiter joined"
        );
        let bound = Duration::from_secs(10);
        second_watch.close(bound).await;
        drop(claim);
        first_watch.close(bound).await;
    }

    /// A renewing acquire answered only after the client sent some request
    /// again (a try of it that went unanswered may still be applied) keeps
    /// its fence due: once the lock is released, the session's undo puts
    /// the fence up, and a copy of the acquire that the server applies only
    /// then writes nothing. Were the fence settled by the answer, that copy
    /// would put the lock back on the session lease: held by nobody, kept
    /// alive by the client's keep-alives, taken by nobody while it lives.
    #[tokio::test]
    async fn an_acquire_sent_again_is_fenced_once_released() {
        use etcd_client::{Compare, CompareOp, PutOptions, TxnOp};
        let (_server, lock, mut raw) = etcd_with_clients().await;
        let key = LockKey::new("sent-again").expect("key");
        let owner = OwnerToken::random();
        let attached = Attached::lock(&lock.etcd().layout, &key, owner);
        let value = encode_value(owner);
        let sessions = &lock.inner.sessions;
        let deadline = lock.etcd().requests.deadline();
        let session = sessions
            .session(Duration::from_secs(3), deadline)
            .await
            .expect("a session");
        let lease = session.lease_id();
        let mut late = None;
        let mut fence_key = Vec::new();
        let (reply, tracked_from) = sessions
            .attach(&session, &attached, deadline, |fence, raise| {
                assert!(raise.is_empty(), "no earlier request to fence");
                fence_key = fence.key().to_vec();
                // The acquire's write, fenced, on the session lease.
                let put = etcd_client::Txn::new()
                    .when([
                        fence.down(),
                        Compare::create_revision(attached.key(), CompareOp::Equal, 0),
                    ])
                    .and_then([TxnOp::put(
                        attached.key(),
                        value.clone(),
                        Some(PutOptions::new().with_lease(lease)),
                    )]);
                late = Some(put.clone());
                // Its first try went unanswered: sent again.
                lock.etcd().requests.count_sent_again();
                put
            })
            .await
            .expect("the acquire");
        assert!(reply.succeeded(), "the acquire took the free lock");
        let created = reply.header().expect("a header").revision();
        let fencing = FencingToken::new(u64::try_from(created).expect("a revision"));
        let grant = Sessions::granted(&session, &attached, fencing, tracked_from).expect("granted");
        let released = lock
            .release(HeldLock {
                key: &key,
                owner,
                fencing,
                handle: grant.handle,
            })
            .await
            .expect("release");
        assert_eq!(released, ReleaseReply::Released);
        // The undo runs in the session's task (within a keep-alive period).
        let until = Instant::now() + Duration::from_secs(20);
        while Instant::now() < until {
            let fence = raw
                .get(fence_key.clone(), None)
                .await
                .expect("read the fence");
            if !fence.kvs().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        raw.txn(late.expect("the acquire was sent"))
            .await
            .expect("the late copy");
        let left = raw.get(attached.key(), None).await.expect("read the lock");
        assert!(
            left.kvs().is_empty(),
            "a late copy of a released acquire put the lock back on the session lease"
        );
    }
}
