//! [`EtcdLock`]: the [`DistributedLock`] implementation on etcd v3.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use etcd_client::{Client, ConnectOptions, KvClient, LeaseClient};
use lock_core::{
    AcquireAttempt, Capabilities, ClientOptions, DistributedLock, FencingToken, Lease, LeaseIssuer,
    LockError, LockKey, LockState, OwnerToken, ReleaseWatch,
};

use crate::config::EtcdConfig;
use crate::errors;
use crate::keys::{encode_value, KeyLayout};
use crate::queue;
use crate::session::{self, Session, Sessions};
use crate::txn::{self, AcquireOutcome};
use crate::waiters::Watcher;

/// The smallest lease etcd grants with its default settings is 2 s
/// (1.5 × the 1 s election timeout, rounded up); a server tuned for short
/// election timeouts grants 1 s. We ask for what the caller wants, rounded up
/// to whole seconds, and use the TTL the server reports.
pub(crate) const MIN_TTL: Duration = Duration::from_secs(1);

/// etcd's largest lease TTL (`MaxLeaseTTL`, 9 000 000 000 s); we cap lower,
/// at lock-core's default of a year.
const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// HTTP/2 keep-alive ping interval, so a watch stream to a vanished server
/// is noticed. etcd's enforcement policy rejects pings more often than every
/// 5 s, and pings on a connection without open streams at all (so they are
/// only sent while a stream is open).
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// A distributed lock on etcd v3.
///
/// A lock is the key `NS/lock/<escaped key>` attached to an etcd lease
/// whose TTL is the lock's TTL, so etcd itself deletes it when the holder
/// stops renewing, by the server's clock. The fencing token is the key's
/// `create_revision`: etcd's global revision counter, strictly increasing
/// across releases, expiries and server restarts, unchanged by renewals.
///
/// Locks whose holder renews them ([`try_acquire_renewing`], which
/// [`Locker`](lock_core::Locker) uses for guards with renewal on) share a
/// *session* lease instead: one etcd lease per client and TTL, granted on
/// first use and kept alive by one keep-alive stream, as etcd's Go
/// `concurrency.Session`. The session also deletes any of its locks whose
/// holder has not renewed it for its TTL, so a holder that stops renewing
/// still loses the lock after the TTL while the client lives on; if the
/// client dies, etcd expires the session lease and its locks with it.
/// Locks without renewal keep a lease of their own, so their TTL is exact.
///
/// Costs, in round trips to the server:
/// - `try_acquire_renewing`: 1 transaction that creates the key on the
///   session lease (plus 1 lease grant the first time a client uses a TTL).
/// - `extend` of a session lock with its TTL (a guard's renewal, every
///   third of the TTL by default): 1 transaction that only confirms the key
///   is still ours and on the session lease.
/// - session keep-alive: 1 message on the keep-alive stream per third of
///   the TTL, per client and TTL in use, whatever the number of locks.
/// - `try_acquire`: 2 (grant a lease, then one transaction that creates the
///   key only if absent); on refusal the unused lease is revoked in the
///   background (not waited for).
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
/// `NS/lock/<escaped key>/waiters/<id>` on a short session lease of its
/// client, and watches only the entry just before it; the first in line
/// watches the lock key, whose deletion (release, or the holder's lease
/// expiring) wakes exactly that waiter. A handoff costs the same few
/// requests however many wait (release, acquire, the leaving waiter's
/// queue-entry delete, one look-up by its successor); all watches share one
/// watch stream per client. Acquiring without waiting (`try_acquire`)
/// never queues, so it may overtake waiters.
///
/// A renewing acquire whose session is lost while the request is in flight
/// (no keep-alive answered within the TTL) is refused with an
/// [`Unavailable`](lock_core::ErrorKind::Unavailable) error: the lock it
/// created goes with the session lease, so no lease is dated from it.
///
/// Cancel safety: each future may be dropped at any await point (under a
/// timeout, say). A dropped `watch`, and so a dropped waiting `acquire`,
/// leaves no queue entry behind. A dropped renewing acquire leaves at most
/// a lock that the session deletes a TTL after the request was sent. A
/// dropped `try_acquire` or `extend` leaves at most a lock, or an unused
/// lease, that etcd expires after the requested TTL (a dropped `extend`
/// may have moved the lock to a lease of that TTL, so after dropping one
/// with a shorter TTL assume the shorter one). A dropped `release` leaves
/// the lock to expire as if it had not been released.
///
/// [`try_acquire_renewing`]: DistributedLock::try_acquire_renewing
///
/// TTLs are whole seconds (at least 1 s, or the server's minimum lease TTL
/// if larger); shorter or fractional TTLs are rounded up.
///
/// A client belongs to the tokio runtime it was created in: the gRPC
/// channel runs its connection tasks there, so create it inside the runtime
/// that uses it and do not use it after that runtime shut down.
///
/// ```no_run
/// use std::time::Duration;
/// use lock_core::{DistributedLock, LockKey};
/// use lock_etcd::EtcdLock;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_core::LockError> {
/// let lock = EtcdLock::connect("etcd://127.0.0.1:2379?namespace=jobs").await?;
/// let key = LockKey::new("nightly-report")?;
/// if let Some(lease) = lock.try_acquire(&key, Duration::from_secs(30)).await?.lease() {
///     println!("fencing token {}", lease.fencing_token());
///     lock.release(&lease).await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct EtcdLock {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) kv: KvClient,
    leases: LeaseClient,
    pub(crate) layout: KeyLayout,
    pub(crate) options: ClientOptions,
    issuer: LeaseIssuer,
    pub(crate) watcher: Watcher,
    sessions: Sessions,
}

impl EtcdLock {
    /// Connects to the cluster named by an `etcd://` URL (see
    /// [`EtcdConfig::from_url`]).
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::with_config(EtcdConfig::from_url(url)?).await
    }

    /// Connects with `config`: authenticates if it has a user, and checks
    /// the cluster answers, within the connect timeout. A wrong password is an
    /// [`ErrorKind::Config`](lock_core::ErrorKind) error.
    pub async fn with_config(config: EtcdConfig) -> Result<Self, LockError> {
        config.validate()?;
        let options = config.options().clone();
        let mut connect = ConnectOptions::new()
            .with_connect_timeout(options.connect_timeout)
            .with_timeout(options.operation_timeout)
            .with_keep_alive(KEEP_ALIVE_INTERVAL, options.operation_timeout)
            .with_keep_alive_while_idle(false)
            .with_auto_token_refresh(true);
        if let Some((name, password)) = config.credentials() {
            connect = connect.with_user(name.clone(), password.clone());
        }
        let endpoints = config.endpoints().to_vec();
        let what = format!("connecting to etcd at {}", endpoints.join(","));
        let client = lock_core::with_timeout(options.connect_timeout, &what, async {
            Client::connect(&endpoints, Some(connect))
                .await
                .map_err(|e| errors::map(&what, e))
        })
        .await
        .map_err(unreachable_on_timeout)?;
        let lock = Self::from_client(client, options)?;
        lock.probe(&what).await?;
        tracing::debug!(endpoints = ?config.endpoints(), namespace = %lock.inner.options.namespace, "connected to etcd");
        Ok(lock)
    }

    /// Uses an existing client (its endpoints, credentials and TLS), with
    /// `options` for namespace and timeouts. Does not contact the server.
    pub fn from_client(client: Client, options: ClientOptions) -> Result<Self, LockError> {
        options.validate()?;
        let layout = KeyLayout::new(&options.namespace);
        let watcher = Watcher::new(client.watch_client(), options.clone());
        let sessions = Sessions::new(client.kv_client(), client.lease_client(), options.clone());
        Ok(Self {
            inner: Arc::new(Inner {
                kv: client.kv_client(),
                leases: client.lease_client(),
                layout,
                options,
                issuer: LeaseIssuer::random(),
                watcher,
                sessions,
            }),
        })
    }

    /// The namespace and timeouts in use.
    pub fn options(&self) -> &ClientOptions {
        &self.inner.options
    }

    /// The prefix of every etcd key this client touches (`NS/lock/`, locks
    /// and their waiter queues): a restricted etcd user needs a role with
    /// readwrite permission on it.
    pub fn key_prefix(&self) -> &str {
        self.inner.layout.prefix()
    }

    /// One read inside the namespace, to fail fast on an unreachable cluster
    /// or a user without permission.
    async fn probe(&self, what: &str) -> Result<(), LockError> {
        let mut kv = self.inner.kv.clone();
        let key = self.inner.layout.prefix().as_bytes().to_vec();
        lock_core::with_timeout(self.inner.options.connect_timeout, what, async {
            kv.get(key, None)
                .await
                .map(|_| ())
                .map_err(|e| errors::map(what, e))
        })
        .await
        .map_err(unreachable_on_timeout)
    }

    /// Grants an etcd lease of `ttl` (whole seconds); returns its id and
    /// the TTL the server granted.
    async fn grant(&self, ttl: Duration) -> Result<(i64, Duration), LockError> {
        let seconds = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX).max(1);
        let mut leases = self.inner.leases.clone();
        let reply = self
            .inner
            .options
            .timed("etcd lease grant", async {
                leases
                    .grant(seconds, None)
                    .await
                    .map_err(errors::mapper("etcd lease grant"))
            })
            .await?;
        if !reply.error().is_empty() {
            return Err(LockError::unavailable(format!(
                "etcd refused to grant a lease: {}",
                reply.error()
            )));
        }
        let granted = u64::try_from(reply.ttl()).unwrap_or(0);
        if granted == 0 || reply.id() <= 0 {
            return Err(LockError::unavailable(format!(
                "etcd granted an unusable lease (id {}, ttl {})",
                reply.id(),
                reply.ttl()
            )));
        }
        Ok((reply.id(), Duration::from_secs(granted)))
    }

    /// Revokes a lease in the background, bounded by the operation timeout.
    /// Failing only means the lease lives until its TTL runs out.
    fn revoke_later(&self, lease_id: i64) {
        let mut leases = self.inner.leases.clone();
        let options = self.inner.options.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            let result = options
                .timed("etcd lease revoke", async {
                    leases
                        .revoke(lease_id)
                        .await
                        .map(|_| ())
                        .map_err(errors::mapper("etcd lease revoke"))
                })
                .await;
            if let Err(e) = result {
                tracing::debug!(lease_id, error = %e, "could not revoke an etcd lease; it expires by its TTL");
            }
        });
    }

    async fn run_txn(
        &self,
        what: &'static str,
        txn: etcd_client::Txn,
    ) -> Result<etcd_client::TxnResponse, LockError> {
        let mut kv = self.inner.kv.clone();
        self.inner
            .options
            .timed(what, async {
                kv.txn(txn).await.map_err(errors::mapper(what))
            })
            .await
    }

    /// Reads the lock key: `None` if absent, else the key-value after
    /// checking it is ours.
    async fn read_lock(&self, key: &LockKey) -> Result<Option<etcd_client::KeyValue>, LockError> {
        let etcd_key = self.inner.layout.lock_key(key);
        let mut kv = self.inner.kv.clone();
        let reply = self
            .inner
            .options
            .timed("etcd get", async {
                kv.get(etcd_key, None)
                    .await
                    .map_err(errors::mapper("etcd get"))
            })
            .await?;
        let Some(found) = reply.kvs().first() else {
            return Ok(None);
        };
        txn::check_found(key, found.value(), found.lease())?;
        Ok(Some(found.clone()))
    }

    /// The live session lease for `ttl`, granted (one round trip) if there
    /// is none yet.
    pub(crate) async fn session(&self, ttl: Duration) -> Result<Arc<Session>, LockError> {
        let secs = ttl.as_secs();
        if let Some(session) = self.inner.sessions.live(secs) {
            return Ok(session);
        }
        let _creating = self.inner.sessions.creating().await;
        if let Some(session) = self.inner.sessions.live(secs) {
            return Ok(session);
        }
        let sent_at = Instant::now();
        let (lease_id, granted) = self.grant(ttl).await?;
        Ok(self.inner.sessions.start(secs, lease_id, granted, sent_at))
    }

    /// Renews a lock attached to the live `session` with the session's TTL:
    /// one transaction confirms the key is still ours and on the session
    /// lease; the session's keep-alives renew it.
    async fn confirm_session_lock(
        &self,
        lease: &Lease,
        session: &Session,
    ) -> Result<Lease, LockError> {
        let etcd_key = self.inner.layout.lock_key(lease.key());
        let value = encode_value(lease.owner());
        let sent_at = Instant::now();
        let reply = self
            .run_txn(
                "etcd extend",
                txn::confirm(&etcd_key, &value, lease.fencing_token(), session.lease_id()),
            )
            .await?;
        if !reply.succeeded() {
            session.untrack(&value);
            tracing::debug!(key = %lease.key(), fencing = %lease.fencing_token(), "etcd session lock not held on extend");
            return Err(Self::not_held(lease));
        }
        let confirmed = match session.confirmed_sent_at() {
            Some(confirmed) if session.renew(&value, sent_at) => confirmed,
            _ => {
                tracing::debug!(key = %lease.key(), fencing = %lease.fencing_token(), "etcd session lock expired or its session was lost");
                return Err(Self::not_held(lease));
            }
        };
        tracing::trace!(key = %lease.key(), fencing = %lease.fencing_token(), "etcd session lock confirmed");
        Ok(lease.renewed(sent_at.min(confirmed), session.ttl()))
    }

    /// Detaches a lock from its session's expiry tracking, if it had one.
    fn untrack(&self, lease: &Lease) {
        if let Some(id) = session::session_lease_of(lease.handle()) {
            if let Some(session) = self.inner.sessions.by_lease(id) {
                session.untrack(&encode_value(lease.owner()));
            }
        }
    }

    fn not_held(lease: &Lease) -> LockError {
        LockError::not_held(format!(
            "lock {:?} is no longer held by this lease (released, expired or taken over)",
            lease.key().as_str()
        ))
    }
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLock")
            .field("namespace", &self.options.namespace)
            .field("issuer", &self.issuer)
            .field("watcher", &self.watcher)
            .field("sessions", &self.sessions.len())
            .finish_non_exhaustive()
    }
}

/// A timeout while connecting means the cluster is unreachable.
fn unreachable_on_timeout(error: LockError) -> LockError {
    if error.kind() == lock_core::ErrorKind::Timeout {
        LockError::unavailable(error.message().to_owned()).with_source(error)
    } else {
        error
    }
}

#[async_trait]
impl DistributedLock for EtcdLock {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            min_ttl: MIN_TTL,
            ttl_granularity: Duration::from_secs(1),
            max_ttl: MAX_TTL,
            native_wait: true,
            durable: true,
            admin: true,
            ..Capabilities::default()
        }
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<AcquireAttempt, LockError> {
        let ttl = self.capabilities().effective_ttl(ttl)?;
        let etcd_key = self.inner.layout.lock_key(key);
        let owner = OwnerToken::random();
        let value = encode_value(owner);
        let sent_at = Instant::now();
        let (lease_id, granted) = self.grant(ttl).await?;
        let reply = match self
            .run_txn("etcd acquire", txn::acquire(&etcd_key, &value, lease_id))
            .await
        {
            Ok(reply) => reply,
            Err(e) => {
                // Unknown outcome: the lease bounds the lock's life either
                // way; revoking it frees a lock we may have taken.
                self.revoke_later(lease_id);
                return Err(e);
            }
        };
        match txn::acquire_outcome(key, &reply) {
            Ok(AcquireOutcome::Created(fencing)) => {
                tracing::debug!(key = %key, fencing = %fencing, ttl = ?granted, "etcd lock acquired");
                Ok(AcquireAttempt::Acquired(
                    Lease::new(
                        key.clone(),
                        owner,
                        fencing,
                        sent_at,
                        granted,
                        self.inner.issuer,
                    )
                    .with_handle(u64::try_from(lease_id).unwrap_or(0)),
                ))
            }
            Ok(AcquireOutcome::Held { lease_id: holder }) => {
                self.revoke_later(lease_id);
                tracing::trace!(key = %key, holder_lease = holder, "etcd lock held by another owner");
                Ok(AcquireAttempt::Held { expires_in: None })
            }
            Ok(AcquireOutcome::Gone) => {
                self.revoke_later(lease_id);
                Ok(AcquireAttempt::Held {
                    expires_in: Some(Duration::ZERO),
                })
            }
            Err(e) => {
                self.revoke_later(lease_id);
                tracing::debug!(key = %key, error = %e, "foreign value at an etcd lock key");
                Err(e)
            }
        }
    }

    async fn try_acquire_renewing(
        &self,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<AcquireAttempt, LockError> {
        let ttl = self.capabilities().effective_ttl(ttl)?;
        let session = self.session(ttl).await?;
        let etcd_key = self.inner.layout.lock_key(key);
        let owner = OwnerToken::random();
        let value = encode_value(owner);
        let sent_at = Instant::now();
        // Tracked before it is sent: if this future is dropped before the
        // reply, the session still deletes the lock a TTL after `sent_at`,
        // as any lock its holder stopped renewing (the session lease itself
        // lives as long as the client).
        session.track(&etcd_key, &value, None, sent_at);
        let reply = match self
            .run_txn(
                "etcd acquire",
                txn::acquire(&etcd_key, &value, session.lease_id()),
            )
            .await
        {
            Ok(reply) => reply,
            Err(e) => {
                // Unknown outcome, and the session lease cannot be revoked
                // for one lock: make it due now, so the session deletes it
                // (if it was created) at its next tick.
                let due = sent_at.checked_sub(session.ttl()).unwrap_or(sent_at);
                session.track(&etcd_key, &value, None, due);
                return Err(e);
            }
        };
        match txn::acquire_outcome(key, &reply) {
            Ok(AcquireOutcome::Created(fencing)) => {
                session.track(&etcd_key, &value, Some(fencing), sent_at);
                // The server keeps the session lease at least a TTL after
                // the last confirmed keep-alive was sent. A session that
                // died while the request was in flight is being revoked
                // (or expires on the server), taking the new key with it:
                // no lease can be dated from it.
                let Some(confirmed) = session.confirmed_sent_at() else {
                    tracing::debug!(key = %key, fencing = %fencing, "etcd session lost while acquiring; the lock goes with it");
                    return Err(LockError::unavailable(format!(
                        "lock {:?} was taken on an etcd session lease that was lost while the request was in flight (no keep-alive answered within its TTL), so it is gone again; try again",
                        key.as_str()
                    )));
                };
                let valid_from = confirmed.min(sent_at);
                tracing::debug!(key = %key, fencing = %fencing, ttl = ?session.ttl(), "etcd lock acquired on the session lease");
                Ok(AcquireAttempt::Acquired(
                    Lease::new(
                        key.clone(),
                        owner,
                        fencing,
                        valid_from,
                        session.ttl(),
                        self.inner.issuer,
                    )
                    .with_handle(session::session_handle(session.lease_id())),
                ))
            }
            Ok(AcquireOutcome::Held { lease_id: holder }) => {
                session.untrack(&value);
                tracing::trace!(key = %key, holder_lease = holder, "etcd lock held by another owner");
                Ok(AcquireAttempt::Held { expires_in: None })
            }
            Ok(AcquireOutcome::Gone) => {
                session.untrack(&value);
                Ok(AcquireAttempt::Held {
                    expires_in: Some(Duration::ZERO),
                })
            }
            Err(e) => {
                session.untrack(&value);
                tracing::debug!(key = %key, error = %e, "foreign value at an etcd lock key");
                Err(e)
            }
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease, LockError> {
        lease.check_issuer(self.inner.issuer)?;
        let ttl = self.capabilities().effective_ttl(ttl)?;
        if let Some(session) = session::session_lease_of(lease.handle())
            .and_then(|id| self.inner.sessions.by_lease(id))
            .filter(|session| session.is_alive() && session.ttl() == ttl)
        {
            return self.confirm_session_lock(lease, &session).await;
        }
        // Any other TTL (max hold, hold-at-least), or a lost session: move
        // the key to a lease of its own with exactly that TTL.
        let etcd_key = self.inner.layout.lock_key(lease.key());
        let value = encode_value(lease.owner());
        let sent_at = Instant::now();
        let (new_lease, granted) = self.grant(ttl).await?;
        let reply = match self
            .run_txn(
                "etcd extend",
                txn::extend(&etcd_key, &value, lease.fencing_token(), new_lease),
            )
            .await
        {
            Ok(reply) => reply,
            Err(e) => {
                // Unknown outcome. If the move happened, the key now lives on
                // `new_lease`, so it is not revoked (that would delete a lock
                // we still hold); it expires by its TTL, and a retried extend
                // moves the key on again.
                return Err(e);
            }
        };
        // Off the session lease either way: its expiry tracking stops.
        self.untrack(lease);
        if !reply.succeeded() {
            self.revoke_later(new_lease);
            tracing::debug!(key = %lease.key(), fencing = %lease.fencing_token(), "etcd lock not held on extend");
            return Err(Self::not_held(lease));
        }
        // A session lease is shared: never revoked for one lock.
        if session::session_lease_of(lease.handle()).is_none() {
            let old = i64::try_from(lease.handle()).unwrap_or(0);
            if old > 0 && old != new_lease {
                self.revoke_later(old);
            }
        }
        tracing::debug!(key = %lease.key(), fencing = %lease.fencing_token(), ttl = ?granted, "etcd lock extended");
        Ok(lease
            .renewed(sent_at, granted)
            .with_handle(u64::try_from(new_lease).unwrap_or(0)))
    }

    async fn release(&self, lease: &Lease) -> Result<(), LockError> {
        lease.check_issuer(self.inner.issuer)?;
        let etcd_key = self.inner.layout.lock_key(lease.key());
        let value = encode_value(lease.owner());
        let reply = self
            .run_txn(
                "etcd release",
                txn::release(&etcd_key, &value, lease.fencing_token()),
            )
            .await?;
        self.untrack(lease);
        if !reply.succeeded() {
            tracing::debug!(key = %lease.key(), fencing = %lease.fencing_token(), "etcd lock not held on release");
            return Err(Self::not_held(lease));
        }
        // A session lease (top bit set, so not a valid i64 id) is shared
        // and never revoked for one lock.
        if session::session_lease_of(lease.handle()).is_none() {
            if let Ok(id) = i64::try_from(lease.handle()) {
                if id > 0 {
                    self.revoke_later(id);
                }
            }
        }
        tracing::debug!(key = %lease.key(), fencing = %lease.fencing_token(), "etcd lock released");
        Ok(())
    }

    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        let Some(found) = self.read_lock(key).await? else {
            return Ok(LockState::Free);
        };
        let mut leases = self.inner.leases.clone();
        let lease_id = found.lease();
        let ttl = self
            .inner
            .options
            .timed("etcd lease time-to-live", async {
                leases
                    .time_to_live(lease_id, None)
                    .await
                    .map_err(errors::mapper("etcd lease time-to-live"))
            })
            .await?;
        Ok(LockState::Held {
            // -1 once the lease expired (the key goes with it).
            expires_in: u64::try_from(ttl.ttl()).ok().map(Duration::from_secs),
            fencing_token: FencingToken::new(u64::try_from(found.create_revision()).unwrap_or(0)),
        })
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let Some(found) = self.read_lock(key).await? else {
            return Ok(false);
        };
        // Delete exactly the lock that was read (and checked to be ours), so
        // a value written in between is never removed unseen.
        let etcd_key = self.inner.layout.lock_key(key);
        let delete = etcd_client::Txn::new()
            .when([etcd_client::Compare::mod_revision(
                etcd_key.clone(),
                etcd_client::CompareOp::Equal,
                found.mod_revision(),
            )])
            .and_then([etcd_client::TxnOp::delete(etcd_key, None)]);
        let reply = self.run_txn("etcd force release", delete).await?;
        if !reply.succeeded() {
            return Err(LockError::unavailable(format!(
                "lock {:?} changed while it was being force-released; try again",
                key.as_str()
            )));
        }
        // The key's lease is not revoked: it may be a session lease that
        // other locks of the holder's client share. Without keys, it just
        // runs out.
        tracing::info!(key = %key, "etcd lock force-released");
        Ok(true)
    }

    async fn watch(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        queue::enqueue(self, key).await.map(Some)
    }
}
