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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use distlock_core::{
    AcquireReply, AcquireRequest, ExtendReply, FencingToken, Grant, HeldLock, LockError,
};
use etcd_client::{KvClient, LeaseClient};
use tokio::sync::watch;

use crate::backend::EtcdLock;
use crate::errors::{Repeat, Requests};
use crate::fence::Fence;
use crate::keepalive::Task;
use crate::keys::encode_value;
use crate::txn::{self, AcquireOutcome};

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

impl EtcdLock {
    /// The live session lease for `ttl`, granted (one round trip, ending by
    /// `deadline`: the operation's) if there is none yet.
    pub(crate) async fn session(
        &self,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<Arc<Session>, LockError> {
        let sessions = &self.inner.sessions;
        let secs = ttl.as_secs();
        if let Some(session) = sessions.live(secs) {
            return Ok(session);
        }
        let _creating = sessions.creating().await;
        if let Some(session) = sessions.live(secs) {
            return Ok(session);
        }
        // The server starts the lease's clock after this: the session's
        // first confirmed instant.
        let sent_at = Instant::now();
        let (lease_id, granted) = self.grant(ttl, deadline).await?;
        Ok(sessions.start(secs, lease_id, granted, sent_at))
    }

    /// A renewing acquire: one transaction creates the key on the session
    /// lease of the request's TTL.
    pub(crate) async fn acquire_on_session(
        &self,
        request: AcquireRequest<'_>,
    ) -> Result<AcquireReply, LockError> {
        let key = request.key;
        // A first acquire grants the session lease: both share one
        // operation timeout.
        let deadline = self.inner.requests.deadline();
        let session = self.session(request.ttl, deadline).await?;
        let etcd_key = self.inner.layout.lock_key(key);
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
            .run_txn_until(
                deadline,
                "etcd acquire",
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
            return Err(LockError::unavailable(format!(
                "lock {:?} was taken on an etcd session lease that was lost while the request was in flight (no keep-alive answered within its TTL), so it is gone again; try again",
                key.as_str()
            )));
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
    pub(crate) async fn confirm_session_lock(
        &self,
        lock: HeldLock<'_>,
        session: &Session,
    ) -> Result<ExtendReply, LockError> {
        let etcd_key = self.inner.layout.lock_key(lock.key);
        let value = encode_value(lock.owner);
        // After the client's send time, as in `acquire_on_session`.
        let renewed_at = Instant::now();
        let reply = self
            .run_txn(
                "etcd extend",
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
            if let Some(session) = self.inner.sessions.by_lease(id) {
                session.untrack(&encode_value(lock.owner));
            }
        }
    }
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
    kv: KvClient,
    leases: LeaseClient,
    requests: Requests,
}

impl Sessions {
    pub(crate) fn new(kv: KvClient, leases: LeaseClient, requests: Requests) -> Self {
        let (tx, rx) = watch::channel(());
        Self {
            by_ttl: Mutex::new(HashMap::new()),
            creating: tokio::sync::Mutex::new(()),
            _shutdown: tx,
            shutdown: rx,
            kv,
            leases,
            requests,
        }
    }

    fn map(&self) -> MutexGuard<'_, HashMap<u64, Arc<Session>>> {
        self.by_ttl.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The live session for `ttl_secs`, if any.
    pub(crate) fn live(&self, ttl_secs: u64) -> Option<Arc<Session>> {
        self.map().get(&ttl_secs).filter(|s| s.is_alive()).cloned()
    }

    /// The session (live or dead but not yet replaced) with this lease id.
    pub(crate) fn by_lease(&self, lease_id: i64) -> Option<Arc<Session>> {
        self.map()
            .values()
            .find(|s| s.lease_id == lease_id)
            .cloned()
    }

    /// Held while granting a session lease.
    pub(crate) async fn creating(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.creating.lock().await
    }

    /// Starts a session on the freshly granted lease `lease_id` (granted
    /// `ttl`, request sent at `sent_at`) and its keep-alive task.
    pub(crate) fn start(
        &self,
        ttl_secs: u64,
        lease_id: i64,
        ttl: Duration,
        sent_at: Instant,
    ) -> Arc<Session> {
        let session = Arc::new(Session {
            lease_id,
            ttl,
            state: Mutex::new(State {
                alive: true,
                confirmed_sent_at: sent_at,
                locks: HashMap::new(),
                pending: HashMap::new(),
            }),
        });
        let task = Task {
            session: session.clone(),
            kv: self.kv.clone(),
            leases: self.leases.clone(),
            requests: self.requests.clone(),
            shutdown: self.shutdown.clone(),
        };
        tokio::spawn(task.run());
        tracing::debug!(lease_id, ttl = ?ttl, "etcd session lease started");
        self.map().insert(ttl_secs, session.clone());
        session
    }

    pub(crate) fn len(&self) -> usize {
        self.map().len()
    }
}

/// One session lease.
pub(crate) struct Session {
    lease_id: i64,
    ttl: Duration,
    state: Mutex<State>,
}

struct State {
    alive: bool,
    /// When the last keep-alive (or the grant) the server answered
    /// positively was sent: the server keeps the lease at least `ttl`
    /// from then.
    confirmed_sent_at: Instant,
    /// Attached locks by owner value (unique per acquisition).
    locks: HashMap<Vec<u8>, Tracked>,
    /// By owner value: the fences of requests (acquires, undos) whose
    /// outcome is unknown; the next request for that owner puts them up.
    pending: HashMap<Vec<u8>, Vec<Fence>>,
}

/// A lock the session undoes (its holder stopped renewing it, or its
/// acquire's outcome is unknown): the undo is fenced by `fence` and puts
/// up `raise`, the fences of the owner's earlier unknown requests.
pub(crate) struct Undo {
    pub(crate) value: Vec<u8>,
    pub(crate) tracked: Tracked,
    pub(crate) fence: Fence,
    pub(crate) raise: Vec<Fence>,
}

#[derive(Clone)]
pub(crate) struct Tracked {
    pub(crate) key: Vec<u8>,
    pub(crate) fencing: Option<FencingToken>,
    pub(crate) renewed_at: Instant,
}

impl Session {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn lease_id(&self) -> i64 {
        self.lease_id
    }

    /// The TTL the server granted the session lease.
    pub(crate) fn ttl(&self) -> Duration {
        self.ttl
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.state().alive
    }

    /// The send time of the last positively answered keep-alive, if the
    /// session is alive.
    pub(crate) fn confirmed_sent_at(&self) -> Option<Instant> {
        let state = self.state();
        state.alive.then_some(state.confirmed_sent_at)
    }

    /// Attaches a lock (renewed at `renewed_at`); `fencing` is `None` when
    /// the acquire's outcome is unknown.
    pub(crate) fn track(
        &self,
        key: &[u8],
        value: &[u8],
        fencing: Option<FencingToken>,
        renewed_at: Instant,
    ) {
        let mut state = self.state();
        if state.alive {
            state.locks.insert(
                value.to_vec(),
                Tracked {
                    key: key.to_vec(),
                    fencing,
                    renewed_at,
                },
            );
        }
    }

    /// Records a renewal at `at`; false if the lock is no longer attached
    /// (expired and being deleted, or the session died).
    pub(crate) fn renew(&self, value: &[u8], at: Instant) -> bool {
        let mut state = self.state();
        if !state.alive {
            return false;
        }
        match state.locks.get_mut(value) {
            Some(tracked) => {
                tracked.renewed_at = tracked.renewed_at.max(at);
                true
            }
            None => false,
        }
    }

    /// Starts an acquire request of owner `value` fenced by `fence`, sent
    /// at `at`: tracks it as attached (outcome unknown) and returns the
    /// fences it must put up.
    pub(crate) fn begin(&self, key: &[u8], value: &[u8], fence: &Fence, at: Instant) -> Vec<Fence> {
        let mut state = self.state();
        if !state.alive {
            return Vec::new();
        }
        state.locks.insert(
            value.to_vec(),
            Tracked {
                key: key.to_vec(),
                fencing: None,
                renewed_at: at,
            },
        );
        let pending = state.pending.entry(value.to_vec()).or_default();
        let raise = pending.clone();
        pending.push(fence.clone());
        raise
    }

    /// A request fenced by `fence` that put up `raised` was answered: the
    /// outcome of both is known.
    pub(crate) fn settled(&self, value: &[u8], raised: &[Fence], fence: &Fence) {
        let mut state = self.state();
        if let Some(pending) = state.pending.get_mut(value) {
            pending.retain(|f| f != fence && !raised.contains(f));
            if pending.is_empty() {
                state.pending.remove(value);
            }
        }
    }

    /// Detaches a lock (released, moved to its own lease, or gone). If a
    /// request of its owner has an unknown outcome, it stays due for an
    /// undo, which puts that request's fence up.
    pub(crate) fn untrack(&self, value: &[u8]) {
        let mut state = self.state();
        let removed = state.locks.remove(value);
        if let Some(tracked) = removed {
            if state.pending.contains_key(value) {
                let due = tracked
                    .renewed_at
                    .checked_sub(self.ttl)
                    .unwrap_or(tracked.renewed_at);
                state.locks.insert(
                    value.to_vec(),
                    Tracked {
                        fencing: None,
                        renewed_at: due,
                        ..tracked
                    },
                );
            }
        }
    }

    /// How many locks are attached.
    #[cfg(test)]
    fn attached(&self) -> usize {
        self.state().locks.len()
    }

    /// Removes and returns the locks not renewed for the TTL, each with the
    /// fence of its undo (counted as pending until the undo is answered),
    /// and the earliest deadline of the others.
    pub(crate) fn take_expired(&self, now: Instant) -> (Vec<Undo>, Option<Instant>) {
        let mut state = self.state();
        let ttl = self.ttl;
        let expired: Vec<Vec<u8>> = state
            .locks
            .iter()
            .filter(|(_, t)| t.renewed_at + ttl <= now)
            .map(|(v, _)| v.clone())
            .collect();
        let mut taken = Vec::with_capacity(expired.len());
        for value in expired {
            let Some(tracked) = state.locks.remove(&value) else {
                continue;
            };
            let fence = Fence::new(&tracked.key, self.lease_id);
            let pending = state.pending.entry(value.clone()).or_default();
            let raise = pending.clone();
            pending.push(fence.clone());
            taken.push(Undo {
                value,
                tracked,
                fence,
                raise,
            });
        }
        let next = state.locks.values().map(|t| t.renewed_at + ttl).min();
        (taken, next)
    }

    /// Puts back a lock whose undo failed, to be undone again (unless a
    /// new request of its owner tracks it already).
    pub(crate) fn put_back(&self, value: Vec<u8>, tracked: Tracked) {
        let mut state = self.state();
        if state.alive {
            state.locks.entry(value).or_insert(tracked);
        }
    }

    pub(crate) fn confirm(&self, sent_at: Instant) {
        let mut state = self.state();
        state.confirmed_sent_at = state.confirmed_sent_at.max(sent_at);
    }

    /// Marks the session dead; its locks are gone (or going) on the server.
    pub(crate) fn kill(&self) {
        let mut state = self.state();
        state.alive = false;
        state.locks.clear();
        state.pending.clear();
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

    #[test]
    fn tracking_expires_only_unrenewed_locks() {
        let start = Instant::now();
        let session = Session {
            lease_id: 7,
            ttl: Duration::from_secs(2),
            state: Mutex::new(State {
                alive: true,
                confirmed_sent_at: start,
                locks: HashMap::new(),
                pending: HashMap::new(),
            }),
        };
        session.track(b"k1", b"v1", Some(FencingToken::new(3)), start);
        session.track(b"k2", b"v2", None, start);
        assert!(session.renew(b"v2", start + Duration::from_secs(1)));
        let (expired, next) = session.take_expired(start + Duration::from_secs(2));
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].value, b"v1".to_vec());
        assert_eq!(next, Some(start + Duration::from_secs(3)));
        assert!(!session.renew(b"v1", start + Duration::from_secs(2)));
        session.untrack(b"v2");
        assert_eq!(session.attached(), 0);
        session.track(b"k3", b"v3", None, start);
        session.kill();
        assert_eq!(session.attached(), 0);
        assert_eq!(session.confirmed_sent_at(), None);
        assert!(!session.renew(b"v3", start));
    }
}
