//! Session leases: one etcd lease per client and TTL, shared by the locks
//! whose guards renew them, kept alive by one keep-alive stream (as etcd's
//! Go `concurrency.Session`).
//!
//! A renewing acquire attaches its key to the session lease, so it costs
//! one transaction instead of grant + transaction. Renewing such a lock does
//! not move the key: one request confirms the key is still ours and still on
//! the session lease, and the lease's validity is counted from the last
//! keep-alive the server confirmed.
//!
//! The session lease alone would keep a lock alive as long as the *client*
//! lives, not as long as its *holder* renews it. So the session's task also
//! tracks each attached lock's last renewal and deletes (compare owner,
//! create revision and lease, then delete) any lock not renewed for the
//! session TTL: a holder that stops renewing loses the lock after its TTL
//! while the session lives on for the other locks. A crashed client stops
//! the keep-alives and etcd expires the session lease, and its keys with it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, KvClient, LeaseClient, LeaseKeepAliveStream, LeaseKeeper};
use etcd_client::{Txn, TxnOp};
use lock_core::{ClientOptions, FencingToken};
use tokio::sync::watch;

use crate::errors;

/// Set in [`Lease::handle`](lock_core::Lease::handle) for a lock attached to
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

/// Shortest pause before reopening a failed keep-alive stream.
const REOPEN_PAUSE: Duration = Duration::from_millis(100);

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
    options: ClientOptions,
}

impl Sessions {
    pub(crate) fn new(kv: KvClient, leases: LeaseClient, options: ClientOptions) -> Self {
        let (tx, rx) = watch::channel(());
        Self {
            by_ttl: Mutex::new(HashMap::new()),
            creating: tokio::sync::Mutex::new(()),
            _shutdown: tx,
            shutdown: rx,
            kv,
            leases,
            options,
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
            }),
        });
        let task = Task {
            session: session.clone(),
            kv: self.kv.clone(),
            leases: self.leases.clone(),
            options: self.options.clone(),
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
}

#[derive(Clone)]
struct Tracked {
    key: Vec<u8>,
    fencing: Option<FencingToken>,
    renewed_at: Instant,
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

    /// Detaches a lock (released, moved to its own lease, or gone).
    pub(crate) fn untrack(&self, value: &[u8]) {
        self.state().locks.remove(value);
    }

    /// How many locks are attached.
    #[cfg(test)]
    fn attached(&self) -> usize {
        self.state().locks.len()
    }

    /// Removes and returns the locks not renewed for the TTL, and the
    /// earliest deadline of the others.
    fn take_expired(&self, now: Instant) -> (Vec<(Vec<u8>, Tracked)>, Option<Instant>) {
        let mut state = self.state();
        let ttl = self.ttl;
        let expired: Vec<Vec<u8>> = state
            .locks
            .iter()
            .filter(|(_, t)| t.renewed_at + ttl <= now)
            .map(|(v, _)| v.clone())
            .collect();
        let taken = expired
            .into_iter()
            .filter_map(|v| state.locks.remove(&v).map(|t| (v, t)))
            .collect();
        let next = state.locks.values().map(|t| t.renewed_at + ttl).min();
        (taken, next)
    }

    /// Puts back a lock whose deletion failed, to be retried.
    fn put_back(&self, value: Vec<u8>, tracked: Tracked) {
        let mut state = self.state();
        if state.alive {
            state.locks.entry(value).or_insert(tracked);
        }
    }

    fn confirm(&self, sent_at: Instant) {
        let mut state = self.state();
        state.confirmed_sent_at = state.confirmed_sent_at.max(sent_at);
    }

    /// Marks the session dead; its locks are gone (or going) on the server.
    fn kill(&self) {
        let mut state = self.state();
        state.alive = false;
        state.locks.clear();
    }
}

/// The keep-alive and expiry task of one session.
struct Task {
    session: Arc<Session>,
    kv: KvClient,
    leases: LeaseClient,
    options: ClientOptions,
    shutdown: watch::Receiver<()>,
}

enum Opened {
    Stream((LeaseKeeper, LeaseKeepAliveStream)),
    Shutdown,
    LeaseGone,
    Failed(lock_core::LockError),
}

enum Stop {
    /// The client was dropped.
    Shutdown,
    /// The lease is gone, or must be assumed gone.
    Lost(&'static str),
}

impl Task {
    async fn run(mut self) {
        let stop = self.keep_alive().await;
        let lease_id = self.session.lease_id;
        self.session.kill();
        match stop {
            Stop::Shutdown => {
                tracing::debug!(lease_id, "etcd session stopped with its client");
            }
            Stop::Lost(why) => {
                tracing::warn!(
                    lease_id,
                    reason = why,
                    "etcd session lease lost; its locks are gone"
                );
                // Make the server agree at once if it still has the lease.
                let mut leases = self.leases.clone();
                let _ = self
                    .options
                    .timed("etcd lease revoke", async {
                        leases
                            .revoke(lease_id)
                            .await
                            .map(|_| ())
                            .map_err(errors::mapper("etcd lease revoke"))
                    })
                    .await;
            }
        }
    }

    async fn keep_alive(&mut self) -> Stop {
        let ttl = self.session.ttl;
        let period = (ttl / 3).max(Duration::from_millis(100));
        let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
        // Send times of the keep-alives not answered yet, oldest first
        // (etcd answers in order on one stream).
        let mut in_flight: VecDeque<Instant> = VecDeque::new();
        // The first keep-alive goes out at once: it opens the stream.
        let mut next_send = Instant::now();
        loop {
            let now = Instant::now();
            let confirmed = match self.session.confirmed_sent_at() {
                Some(at) => at,
                None => return Stop::Lost("session marked dead"),
            };
            let lease_end = confirmed + ttl;
            if now >= lease_end {
                return Stop::Lost("no keep-alive confirmed within the lease TTL");
            }
            let next_expiry = self.sweep(now);
            if now >= next_send {
                if let Some((keeper, _)) = stream.as_mut() {
                    in_flight.push_back(Instant::now());
                    if let Err(e) = keeper.keep_alive().await {
                        tracing::debug!(lease_id = self.session.lease_id, error = %e, "etcd keep-alive send failed; reopening the stream");
                        stream = None;
                        in_flight.clear();
                    }
                }
                if stream.is_none() {
                    // Opening the stream sends the first keep-alive and
                    // waits for its answer.
                    let sent_at = Instant::now();
                    match self.open().await {
                        Opened::Stream(opened) => {
                            stream = Some(opened);
                            in_flight.clear();
                            self.session.confirm(sent_at);
                        }
                        Opened::Shutdown => return Stop::Shutdown,
                        Opened::LeaseGone => {
                            return Stop::Lost("etcd reports the session lease expired")
                        }
                        Opened::Failed(e) => {
                            tracing::debug!(lease_id = self.session.lease_id, error = %e, "could not open the etcd keep-alive stream; retrying");
                        }
                    }
                }
                next_send = if stream.is_some() {
                    Instant::now() + period
                } else {
                    Instant::now() + REOPEN_PAUSE.min(period)
                };
            }
            let wake = [Some(next_send), Some(lease_end), next_expiry]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(next_send);
            let message = async {
                match stream.as_mut() {
                    Some((_, responses)) => responses.message().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = self.shutdown.changed() => return Stop::Shutdown,
                _ = tokio::time::sleep_until(wake.into()) => {}
                message = message => match message {
                    Ok(Some(reply)) => {
                        let sent_at = in_flight.pop_front();
                        if reply.ttl() <= 0 {
                            return Stop::Lost("etcd reports the session lease expired");
                        }
                        if let Some(sent_at) = sent_at {
                            self.session.confirm(sent_at);
                        }
                    }
                    Ok(None) | Err(_) => {
                        tracing::debug!(lease_id = self.session.lease_id, "etcd keep-alive stream ended; reopening");
                        stream = None;
                        in_flight.clear();
                        next_send = next_send.min(Instant::now() + REOPEN_PAUSE.min(period));
                    }
                }
            }
        }
    }

    /// Opens the keep-alive stream (which sends one keep-alive and reads
    /// its answer), under the operation timeout.
    async fn open(&mut self) -> Opened {
        let mut leases = self.leases.clone();
        let lease_id = self.session.lease_id;
        let open = self.options.timed("etcd lease keep-alive", async {
            Ok(leases.keep_alive(lease_id).await)
        });
        tokio::select! {
            _ = self.shutdown.changed() => Opened::Shutdown,
            opened = open => match opened {
                Ok(Ok(opened)) => Opened::Stream(opened),
                // etcd-client's way of saying the answer had TTL 0.
                Ok(Err(etcd_client::Error::LeaseKeepAliveError(message)))
                    if message.contains("not found") =>
                {
                    Opened::LeaseGone
                }
                Ok(Err(e)) => Opened::Failed(errors::map("etcd lease keep-alive", e)),
                Err(e) => Opened::Failed(e),
            },
        }
    }

    /// Deletes, in the background, the attached locks not renewed for the
    /// TTL; returns the next such deadline.
    fn sweep(&self, now: Instant) -> Option<Instant> {
        let (expired, next) = self.session.take_expired(now);
        for (value, tracked) in expired {
            let session = self.session.clone();
            let mut kv = self.kv.clone();
            let options = self.options.clone();
            tokio::spawn(async move {
                let mut when = vec![
                    Compare::value(tracked.key.clone(), CompareOp::Equal, value.clone()),
                    Compare::lease(tracked.key.clone(), CompareOp::Equal, session.lease_id),
                ];
                if let Some(fencing) = tracked.fencing {
                    when.push(Compare::create_revision(
                        tracked.key.clone(),
                        CompareOp::Equal,
                        i64::try_from(fencing.get()).unwrap_or(i64::MAX),
                    ));
                }
                let txn = Txn::new()
                    .when(when)
                    .and_then([TxnOp::delete(tracked.key.clone(), None)]);
                let result = options
                    .timed("etcd expire session lock", async {
                        kv.txn(txn)
                            .await
                            .map_err(errors::mapper("etcd expire session lock"))
                    })
                    .await;
                match result {
                    Ok(reply) => {
                        tracing::debug!(
                            fencing = ?tracked.fencing,
                            deleted = reply.succeeded(),
                            "etcd session lock not renewed within its TTL; expired"
                        );
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "could not expire an unrenewed etcd session lock; retrying");
                        session.put_back(value, tracked);
                    }
                }
            });
        }
        next
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
            }),
        };
        session.track(b"k1", b"v1", Some(FencingToken::new(3)), start);
        session.track(b"k2", b"v2", None, start);
        assert!(session.renew(b"v2", start + Duration::from_secs(1)));
        let (expired, next) = session.take_expired(start + Duration::from_secs(2));
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].0, b"v1".to_vec());
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
