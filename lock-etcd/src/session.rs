//! Session leases: one etcd lease per client and TTL, shared by the locks
//! whose guards renew them, kept alive by one keep-alive stream (as etcd's
//! Go `concurrency.Session`).
//!
//! A renewing acquire attaches its key to the session lease, so it costs
//! one transaction instead of grant + transaction. Renewing such a lock does
//! not move the key: one request confirms the key is still ours and still on
//! the session lease, and the lease's validity is counted from the last
//! keep-alive the server confirmed: a grant or renewal says so with
//! [`Grant::clock_started`], so the client dates the lease from it.
//!
//! The session lease alone would keep a lock alive as long as the *client*
//! lives, not as long as its *holder* renews it. So the session's task also
//! tracks each attached lock's last renewal and deletes (compare owner,
//! create revision and lease, then delete) any lock not renewed for the
//! session TTL: a holder that stops renewing loses the lock after its TTL
//! while the session lives on for the other locks. A crashed client stops
//! the keep-alives and etcd expires the session lease, and its keys with it.
//!
//! One session's state (liveness, confirmed keep-alives, attached locks)
//! is [`state`]; its keep-alive and expiry task is [`keepalive`].

mod keepalive;
mod state;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use distlock_core::{
    AcquireReply, AcquireRequest, ExtendReply, Grant, HeldLock, LockError, IN_LOCK_CALL,
};
use tokio::sync::watch;

use crate::connection::Etcd;
use crate::fence::Fence;
use crate::keys::encode_value;
use crate::requests::Repeat;
use crate::txn::{self, AcquireOutcome};
use keepalive::Task;
pub(crate) use state::Session;

/// Set in [`Grant::handle`] for a lock attached to
/// a session lease (etcd lease ids are positive `i64`s, so the top bit is
/// free): such a lease is never revoked on behalf of one lock.
pub(crate) const SESSION_BIT: u64 = 1 << 63;

/// The lease handle of a lock attached to session lease `lease_id`.
pub(crate) fn session_handle(lease_id: i64) -> u64 {
    u64::try_from(lease_id).unwrap_or(0) | SESSION_BIT
}

/// The session lease id in a handle, if the handle is a session's.
pub(crate) fn session_lease_of(handle: u64) -> Option<i64> {
    (handle & SESSION_BIT != 0)
        .then(|| i64::try_from(handle & !SESSION_BIT).ok())
        .flatten()
}

/// The sessions of one client, by requested TTL in whole seconds.
pub(crate) struct Sessions {
    by_ttl: Mutex<HashMap<u64, Arc<Session>>>,
    /// Serializes session creation, so concurrent first acquires with one
    /// TTL grant one lease.
    creating: tokio::sync::Mutex<()>,
    /// Dropped with the client: closes the channel, which stops every
    /// session task (the leases then expire on the server).
    _shutdown: watch::Sender<()>,
    shutdown: watch::Receiver<()>,
    etcd: Etcd,
}

impl Sessions {
    pub(crate) fn new(etcd: Etcd) -> Self {
        let (tx, rx) = watch::channel(());
        Self {
            by_ttl: Mutex::new(HashMap::new()),
            creating: tokio::sync::Mutex::new(()),
            _shutdown: tx,
            shutdown: rx,
            etcd,
        }
    }

    fn map(&self) -> MutexGuard<'_, HashMap<u64, Arc<Session>>> {
        self.by_ttl.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The live session for `ttl_secs`, if any.
    fn live(&self, ttl_secs: u64) -> Option<Arc<Session>> {
        self.map().get(&ttl_secs).filter(|s| s.is_alive()).cloned()
    }

    /// The session (live or dead but not yet replaced) with this lease id.
    pub(crate) fn by_lease(&self, lease_id: i64) -> Option<Arc<Session>> {
        self.map()
            .values()
            .find(|s| s.lease_id() == lease_id)
            .cloned()
    }

    /// Held while granting a session lease.
    async fn creating(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.creating.lock().await
    }

    /// Starts a session on the freshly granted lease `lease_id` (granted
    /// `ttl`, request sent at `sent_at`) and its keep-alive task.
    fn start(&self, ttl_secs: u64, lease_id: i64, ttl: Duration, sent_at: Instant) -> Arc<Session> {
        let session = Arc::new(Session::new(lease_id, ttl, sent_at));
        let task = Task {
            session: session.clone(),
            etcd: self.etcd.clone(),
            shutdown: self.shutdown.clone(),
        };
        tokio::spawn(task.run());
        tracing::debug!(lease_id, ttl = ?ttl, "etcd session lease started");
        self.map().insert(ttl_secs, session.clone());
        session
    }

    /// The live session lease for `ttl`, granted (one round trip, ending by
    /// `deadline`: the operation's) if there is none yet.
    pub(crate) async fn session(
        &self,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<Arc<Session>, LockError> {
        let secs = ttl.as_secs();
        if let Some(session) = self.live(secs) {
            return Ok(session);
        }
        let _creating = self.creating().await;
        if let Some(session) = self.live(secs) {
            return Ok(session);
        }
        // The server starts the lease's clock after this: the session's
        // first confirmed instant.
        let sent_at = Instant::now();
        let (lease_id, granted) = self.etcd.grant(ttl, deadline).await?;
        Ok(self.start(secs, lease_id, granted, sent_at))
    }

    /// A renewing acquire: one transaction creates the key on the session
    /// lease of the request's TTL.
    pub(crate) async fn acquire(
        &self,
        request: AcquireRequest<'_>,
    ) -> Result<AcquireReply, LockError> {
        let key = request.key;
        // A first acquire grants the session lease: both share one
        // operation timeout.
        let deadline = self.etcd.requests.deadline();
        let session = self.session(request.ttl, deadline).await?;
        let etcd_key = self.etcd.layout.lock_key(key);
        let value = encode_value(request.owner);
        let fence = Fence::new(&etcd_key, session.lease_id());
        // Tracked before it is sent: if this future is dropped before the
        // reply, the session still undoes the lock a TTL after now, as
        // any lock its holder stopped renewing (the session lease itself
        // lives as long as the client). Now is after the client took its
        // send time, so the client's lease ends before that undo. The
        // transaction puts up the fences of this acquisition's earlier
        // requests whose outcome is unknown.
        let tracked_from = Instant::now();
        let raise = session.begin(&etcd_key, &value, &fence, tracked_from);
        let reply = match self
            .etcd
            .run_txn_until(
                deadline,
                IN_LOCK_CALL,
                Repeat::Safe,
                txn::acquire(&etcd_key, &value, session.lease_id(), Some(&fence), &raise),
            )
            .await
        {
            Ok(reply) => {
                session.settled(&value, &raise, &fence);
                reply
            }
            Err(e) => {
                // Unknown outcome, and the session lease cannot be revoked
                // for one lock: make it due now, so the session undoes it
                // at its next tick, fence first (see `crate::fence`): the
                // request, applied after that, writes nothing.
                let due = tracked_from
                    .checked_sub(session.ttl())
                    .unwrap_or(tracked_from);
                session.track(&etcd_key, &value, None, due);
                return Err(e);
            }
        };
        let fencing = match txn::acquire_outcome(key, request.owner, &reply) {
            Ok(AcquireOutcome::Created(fencing)) => fencing,
            Ok(AcquireOutcome::Refused(refused)) => {
                session.untrack(&value);
                return Ok(refused);
            }
            Err(e) => {
                session.untrack(&value);
                return Err(e);
            }
        };
        session.track(&etcd_key, &value, Some(fencing), tracked_from);
        // The server keeps the session lease at least a TTL after the last
        // confirmed keep-alive was sent. A session that died while the
        // request was in flight is being revoked (or expires on the
        // server), taking the new key with it: no lease can be dated from it.
        let Some(confirmed) = session.confirmed_sent_at() else {
            tracing::debug!(key = %key, fencing = %fencing, "etcd session lost while acquiring; the lock goes with it");
            return Err(LockError::unavailable(
                "the lock was taken on an etcd session lease that was lost while the request was in flight (no keep-alive answered within its TTL), so it is gone again; try again",
            ));
        };
        Ok(AcquireReply::Granted(
            Grant::new(fencing, session.ttl())
                .with_handle(session_handle(session.lease_id()))
                .clock_started(confirmed),
        ))
    }

    /// Renews a lock attached to the live `session` with the session's TTL:
    /// one transaction confirms the key is still ours and on the session
    /// lease; the session's keep-alives renew it.
    pub(crate) async fn confirm_lock(
        &self,
        lock: HeldLock<'_>,
        session: &Session,
    ) -> Result<ExtendReply, LockError> {
        let etcd_key = self.etcd.layout.lock_key(lock.key);
        let value = encode_value(lock.owner);
        // After the client's send time, as in `acquire`.
        let renewed_at = Instant::now();
        let reply = self
            .etcd
            .run_txn(
                IN_LOCK_CALL,
                Repeat::Safe,
                txn::confirm(&etcd_key, &value, lock.fencing, session.lease_id()),
            )
            .await?;
        if !reply.succeeded() {
            session.untrack(&value);
            return Ok(ExtendReply::NotHeld);
        }
        match session.confirmed_sent_at() {
            Some(confirmed) if session.renew(&value, renewed_at) => Ok(ExtendReply::Extended(
                Grant::new(lock.fencing, session.ttl())
                    .with_handle(session_handle(session.lease_id()))
                    .clock_started(confirmed),
            )),
            _ => {
                tracing::debug!(key = %lock.key, fencing = %lock.fencing, "etcd session lock expired or its session was lost");
                Ok(ExtendReply::NotHeld)
            }
        }
    }

    /// Detaches a lock from its session's expiry tracking, if it had one.
    pub(crate) fn untrack(&self, lock: &HeldLock<'_>) {
        if let Some(id) = session_lease_of(lock.handle) {
            if let Some(session) = self.by_lease(id) {
                session.untrack(&encode_value(lock.owner));
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.map().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip() {
        assert_eq!(session_lease_of(session_handle(42)), Some(42));
        assert_eq!(session_lease_of(42), None);
        assert_eq!(session_lease_of(0), None);
        assert_eq!(session_lease_of(session_handle(i64::MAX)), Some(i64::MAX));
    }
}
