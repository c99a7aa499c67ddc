//! [`EtcdLock`]: the [`LockBackend`] on etcd v3 — its constructors, the
//! plain (own lease) paths, and the dispatch to the session paths
//! ([`crate::session`]), the waiter queue ([`crate::queue`]) and the
//! operator calls ([`crate::admin`]).

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use distlock_core::check_storage_format;
use distlock_core::{
    AcquireReply, AcquireRequest, Capabilities, ExtendReply, FencingToken, Grant, HeldLock,
    Listener, LockAdmin, LockBackend, LockError, LockKey, ReleaseNotifier, ReleaseReply,
    ReleaseWatch, SemaphoreBackend, STORAGE_FORMAT,
};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, KvClient, LeaseClient, Txn, TxnOp, TxnOpResponse,
};

use crate::config::EtcdConfig;
use crate::errors::{self, Repeat, Requests};
use crate::health::Health;
use crate::keys::{encode_value, KeyLayout};
use crate::listener::EtcdWatches;
use crate::queue;
use crate::session::{self, Sessions};
use crate::txn::{self, AcquireOutcome};

/// The smallest lease etcd grants with its default settings is 2 s
/// (1.5 × the 1 s election timeout, rounded up); a server tuned for short
/// election timeouts grants 1 s. We ask for what the caller wants, rounded up
/// to whole seconds, and use the TTL the server reports.
pub(crate) const MIN_TTL: Duration = Duration::from_secs(1);

/// etcd's largest lease TTL (`MaxLeaseTTL`, 9 000 000 000 s); we cap lower,
/// at distlock-core's default of a year.
const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// HTTP/2 keep-alive ping interval, so a watch stream to a vanished server
/// is noticed. etcd's enforcement policy rejects pings more often than every
/// 5 s, and pings on a connection without open streams at all (so they are
/// only sent while a stream is open).
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// How often the watch listener cancels watches whose waiters left.
const WATCH_SWEEP: Duration = Duration::from_secs(1);

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
/// watch stream per client. Acquiring without
/// waiting never queues, so it may overtake waiters.
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
    pub(crate) kv: KvClient,
    pub(crate) leases: LeaseClient,
    pub(crate) layout: KeyLayout,
    pub(crate) config: EtcdConfig,
    /// The watch stream that carries deletions to the waiter queue.
    pub(crate) listener: Listener<EtcdWatches>,
    /// The channels of waiting calls, woken by their queue tasks (not by
    /// the listener, whose resets they never see: see [`crate::queue`]).
    pub(crate) waiting: ReleaseNotifier,
    /// Numbers this client's waiting calls.
    pub(crate) next_waiter: AtomicU64,
    pub(crate) sessions: Sessions,
    /// Timeouts, and sending again what reached no server.
    pub(crate) requests: Requests,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLock")
            .field("config", &self.config)
            .field("listener", &self.listener)
            .field("waiting", &self.waiting.channels().len())
            .field("sessions", &self.sessions.len())
            .finish_non_exhaustive()
    }
}

impl EtcdLock {
    /// Connects to the cluster named by an `etcd://` URL (see
    /// [`EtcdConfig::from_url`]).
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::with_config(EtcdConfig::from_url(url)?).await
    }

    /// Connects with `config`: authenticates if it has a user, and checks
    /// the cluster answers, within the connect timeout. A wrong password is an
    /// [`ErrorKind::Config`](distlock_core::ErrorKind) error.
    pub async fn with_config(config: EtcdConfig) -> Result<Self, LockError> {
        config.validate()?;
        let options = &config.client;
        // Require-leader: a member without a leader refuses requests at
        // once (and ends its watch streams) instead of stalling them, so
        // the client goes to a member that has one.
        let mut connect = ConnectOptions::new()
            .with_require_leader(true)
            .with_connect_timeout(options.connect_timeout)
            .with_timeout(options.operation_timeout)
            .with_keep_alive(KEEP_ALIVE_INTERVAL, options.operation_timeout)
            .with_keep_alive_while_idle(false)
            .with_auto_token_refresh(true);
        if let Some((name, password)) = config.credentials() {
            connect = connect.with_user(name.clone(), password.clone());
        }
        #[cfg(feature = "tls")]
        if config.uses_tls() {
            connect =
                connect.with_tls(crate::tls::options(&options.tls, options.connect_timeout).await?);
        }
        let endpoints = config.endpoints().to_vec();
        let what = format!("connecting to etcd at {}", endpoints.join(","));
        let client = distlock_core::with_timeout(options.connect_timeout, &what, async {
            Client::connect(&endpoints, Some(connect.clone()))
                .await
                .map_err(|e| errors::map(&what, e))
        })
        .await
        .map_err(unreachable_on_timeout)?;
        let health = (endpoints.len() > 1).then(|| {
            Health::new(
                client.clone(),
                endpoints.clone(),
                connect,
                KeyLayout::new(&options.namespace)
                    .prefix()
                    .as_bytes()
                    .to_vec(),
                (options.operation_timeout / errors::ATTEMPTS).max(errors::MIN_ATTEMPT),
            )
        });
        let lock = Self::build(client, config, health)?;
        lock.probe(&what).await?;
        lock.check_format(&what).await?;
        tracing::debug!(endpoints = ?lock.config().endpoints(), namespace = %lock.config().client.namespace, "connected to etcd");
        Ok(lock)
    }

    /// Uses an existing client (its endpoints, credentials and TLS), with
    /// `config.client` for namespace and timeouts. Its endpoints and
    /// credentials are not used to connect; if it lists several endpoints,
    /// a request that reaches no server is sent again (the client's channel
    /// picks another endpoint), so list the client's. Does not contact the
    /// server, so the namespace's format marker is not checked.
    pub fn from_client(client: Client, config: EtcdConfig) -> Result<Self, LockError> {
        Self::build(client, config, None)
    }

    fn build(
        client: Client,
        config: EtcdConfig,
        health: Option<Arc<Health>>,
    ) -> Result<Self, LockError> {
        config.client.validate()?;
        let layout = KeyLayout::new(&config.client.namespace);
        let watches = EtcdWatches::new(client.watch_client(), layout.prefix().as_bytes().to_vec());
        let listener = Listener::new(watches, &config.client).health_check_after(WATCH_SWEEP);
        let requests = Requests::new(config.client.clone(), config.endpoints().len(), health);
        let sessions = Sessions::new(client.kv_client(), client.lease_client(), requests.clone());
        Ok(Self {
            inner: Arc::new(Inner {
                kv: client.kv_client(),
                leases: client.lease_client(),
                layout,
                config,
                listener,
                waiting: ReleaseNotifier::new(),
                next_waiter: AtomicU64::new(0),
                sessions,
                requests,
            }),
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.config
    }

    /// The prefix of every etcd key this client touches (`NS/lock/`: locks,
    /// semaphores' permits, their waiter queues, and the namespace's format
    /// marker `NS/lock/%format`): a restricted etcd
    /// user needs a role with readwrite permission on it.
    pub fn key_prefix(&self) -> &str {
        self.inner.layout.prefix()
    }

    /// One read inside the namespace, to fail fast on an unreachable cluster,
    /// a refused certificate or a user without permission; sent again
    /// (within the connect timeout) while that may help.
    async fn probe(&self, what: &str) -> Result<(), LockError> {
        let deadline = Instant::now() + self.inner.config.client.connect_timeout;
        let tls = self.inner.config.uses_tls();
        let mut diagnosed = false;
        loop {
            let kv = self.inner.kv.clone();
            let key = self.inner.layout.prefix().as_bytes().to_vec();
            let left = deadline.saturating_duration_since(Instant::now());
            let probed = self
                .inner
                .requests
                .send_within(
                    left,
                    what,
                    Repeat::Safe,
                    || {
                        let mut kv = kv.clone();
                        let key = key.clone();
                        async move { kv.get(key, None).await.map(|_| ()) }
                    },
                    // A TLS connection the server closed: find out why
                    // (once) before trying again.
                    |e| tls && !diagnosed && errors::closed_by_peer(e),
                )
                .await;
            let error = match probed {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if !closed_by_peer(&error) {
                return Err(unreachable_on_timeout(error));
            }
            if tls && !diagnosed {
                diagnosed = true;
                let left = deadline.saturating_duration_since(Instant::now());
                if let Some(refused) = self.client_certificate_refused(what, left).await {
                    return Err(refused.with_source(error));
                }
                // Not that: a member going away, say. Try again.
                continue;
            }
            let hint = if tls {
                "the server closed the connection right after the TLS handshake each time, as an etcd with --client-cert-auth does to clients whose certificate it does not accept (tls_cert_file, tls_key_file)"
            } else {
                "the server closed the connection each time: if it serves TLS on this port, use etcds://"
            };
            let message = format!("{}; {hint}", error.message());
            return Err(LockError::unavailable(message).with_source(error));
        }
    }

    /// Stores the namespace's format marker if it has none (one
    /// transaction: of two clients connecting at once, one stores it and
    /// the other reads it), and refuses a marker naming another format
    /// (see [`distlock_core::check_storage_format`]).
    async fn check_format(&self, what: &str) -> Result<(), LockError> {
        let marker = self.inner.layout.format();
        let location = format!("at etcd key {marker:?}");
        let kv = self.inner.kv.clone();
        // Safe to send again: a second one finds the marker the first stored.
        let reply = self
            .inner
            .requests
            .send(what, Repeat::Safe, || {
                let mut kv = kv.clone();
                let txn = Txn::new()
                    .when([Compare::create_revision(
                        marker.as_str(),
                        CompareOp::Equal,
                        0,
                    )])
                    .and_then([TxnOp::put(
                        marker.as_str(),
                        STORAGE_FORMAT.to_string(),
                        None,
                    )])
                    .or_else([TxnOp::get(marker.as_str(), None)]);
                async move { kv.txn(txn).await }
            })
            .await?;
        if reply.succeeded() {
            return Ok(());
        }
        let stored = reply.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        });
        let Some(stored) = stored else {
            // Deleted between the comparison and the read of one
            // transaction cannot happen; an empty reply is a broken server.
            return Err(LockError::corrupted(format!(
                "{what}: etcd answered the format check {location} with no value"
            )));
        };
        let text = String::from_utf8_lossy(&stored);
        check_storage_format(&text, &location)
            .map_err(|e| LockError::new(e.kind(), format!("{what}: {}", e.message())))
    }

    /// Whether the server refuses this client's certificate after the
    /// handshake (tonic sees only a closed connection): one diagnostic
    /// handshake per endpoint, within `left`, reads the server's alert.
    async fn client_certificate_refused(&self, what: &str, left: Duration) -> Option<LockError> {
        #[cfg(feature = "tls")]
        {
            let config = &self.inner.config;
            let diagnose = async {
                for endpoint in config.endpoints() {
                    if let Some(refusal) =
                        crate::tls::refusal(endpoint, &config.client.tls, left).await
                    {
                        return Some(refusal);
                    }
                }
                None
            };
            if let Ok(Some(refusal)) = tokio::time::timeout(left, diagnose).await {
                return Some(crate::tls::error(what, &refusal));
            }
        }
        let _ = (what, left);
        None
    }

    /// Grants an etcd lease of `ttl` (whole seconds); returns its id and
    /// the TTL the server granted.
    pub(crate) async fn grant(
        &self,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<(i64, Duration), LockError> {
        let seconds = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX).max(1);
        let leases = &self.inner.leases;
        let reply = self
            .inner
            .requests
            .send_until(deadline, "etcd lease grant", Repeat::Safe, || {
                let mut leases = leases.clone();
                async move { leases.grant(seconds, None).await }
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
    pub(crate) fn revoke_later(&self, lease_id: i64) {
        let leases = self.inner.leases.clone();
        let requests = self.inner.requests.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            if let Err(e) = revoke(leases, &requests, lease_id).await {
                tracing::debug!(lease_id, error = %e, "could not revoke an etcd lease; it expires by its TTL");
            }
        });
    }

    /// Runs one transaction under the operation timeout (sent again as
    /// [`Requests::send`] says).
    pub(crate) async fn run_txn(
        &self,
        what: &'static str,
        repeat: Repeat,
        txn: etcd_client::Txn,
    ) -> Result<etcd_client::TxnResponse, LockError> {
        self.run_txn_until(self.inner.requests.deadline(), what, repeat, txn)
            .await
    }

    /// [`run_txn`](Self::run_txn) as one step of an operation that must end
    /// by `deadline`.
    pub(crate) async fn run_txn_until(
        &self,
        deadline: Instant,
        what: &'static str,
        repeat: Repeat,
        txn: etcd_client::Txn,
    ) -> Result<etcd_client::TxnResponse, LockError> {
        let mut sends = 0;
        self.send_txn(deadline, what, repeat, txn, &mut sends).await
    }

    /// [`run_txn`](Self::run_txn), saying whether the answer came to a
    /// resend (an earlier send may have been applied unanswered).
    pub(crate) async fn run_txn_resent(
        &self,
        what: &'static str,
        repeat: Repeat,
        txn: etcd_client::Txn,
    ) -> Result<(etcd_client::TxnResponse, bool), LockError> {
        let mut sends = 0;
        let deadline = self.inner.requests.deadline();
        let reply = self
            .send_txn(deadline, what, repeat, txn, &mut sends)
            .await?;
        Ok((reply, sends > 1))
    }

    async fn send_txn(
        &self,
        deadline: Instant,
        what: &'static str,
        repeat: Repeat,
        txn: etcd_client::Txn,
        sends: &mut u32,
    ) -> Result<etcd_client::TxnResponse, LockError> {
        let kv = &self.inner.kv;
        self.inner
            .requests
            .send_until(deadline, what, repeat, || {
                *sends += 1;
                let mut kv = kv.clone();
                let txn = txn.clone();
                async move { kv.txn(txn).await }
            })
            .await
    }

    /// A plain acquire: grants a lease of exactly the TTL, then creates the
    /// key on it if absent.
    async fn acquire_on_own_lease(
        &self,
        request: AcquireRequest<'_>,
    ) -> Result<AcquireReply, LockError> {
        let key = request.key;
        let etcd_key = self.inner.layout.lock_key(key);
        let value = encode_value(request.owner);
        // The grant and the transaction share one operation timeout.
        let deadline = self.inner.requests.deadline();
        let (lease_id, granted) = self.grant(request.ttl, deadline).await?;
        let reply = match self
            .run_txn_until(
                deadline,
                "etcd acquire",
                Repeat::Safe,
                txn::acquire(&etcd_key, &value, lease_id, None, &[]),
            )
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
        let outcome = txn::acquire_outcome(key, request.owner, &reply);
        if !matches!(outcome, Ok(AcquireOutcome::Created(_))) {
            // Not ours: the unused lease goes.
            self.revoke_later(lease_id);
        }
        Ok(match outcome? {
            AcquireOutcome::Created(fencing) => AcquireReply::Granted(
                Grant::new(fencing, granted).with_handle(u64::try_from(lease_id).unwrap_or(0)),
            ),
            AcquireOutcome::Refused(refused) => refused,
        })
    }

    /// Moves the key to a new lease of exactly `ttl` (its own lease, or a
    /// session lock renewed with another TTL or whose session was lost).
    async fn move_to_own_lease(
        &self,
        lock: HeldLock<'_>,
        ttl: Duration,
    ) -> Result<ExtendReply, LockError> {
        let etcd_key = self.inner.layout.lock_key(lock.key);
        let value = encode_value(lock.owner);
        let moved = self
            .move_to_new_lease(lock.fencing, lock.handle, ttl, "etcd extend", |new_lease| {
                txn::extend(&etcd_key, &value, lock.fencing, new_lease)
            })
            .await?;
        // Off the session lease either way: its expiry tracking stops.
        self.untrack(&lock);
        Ok(moved)
    }

    /// Grants a lease of exactly `ttl` and runs `moving(new lease)`, a
    /// transaction that moves a key (lock or permit of `fencing`) to it
    /// only if the key is still ours; then revokes whichever lease is left
    /// without it: the old one (`old_handle`, if the key's own) once it
    /// moved, else the new one. Grant and transaction share one operation
    /// timeout.
    pub(crate) async fn move_to_new_lease(
        &self,
        fencing: FencingToken,
        old_handle: u64,
        ttl: Duration,
        what: &'static str,
        moving: impl FnOnce(i64) -> etcd_client::Txn,
    ) -> Result<ExtendReply, LockError> {
        let deadline = self.inner.requests.deadline();
        let (new_lease, granted) = self.grant(ttl, deadline).await?;
        // Unknown outcome on error: if the move happened, the key now lives
        // on `new_lease`, so it is not revoked (that would delete a key we
        // still hold); it expires by its TTL, and a retried extend moves the
        // key on again.
        let reply = self
            .run_txn_until(deadline, what, Repeat::Safe, moving(new_lease))
            .await?;
        if !reply.succeeded() {
            self.revoke_later(new_lease);
            return Ok(ExtendReply::NotHeld);
        }
        if let Some(old) = own_lease_of(old_handle).filter(|old| *old != new_lease) {
            self.revoke_later(old);
        }
        Ok(ExtendReply::Extended(
            Grant::new(fencing, granted).with_handle(u64::try_from(new_lease).unwrap_or(0)),
        ))
    }
}

impl EtcdLock {
    /// Runs `release`, a transaction that deletes a key (lock or permit)
    /// only if it is still ours; once it did, revokes the key's own lease
    /// (in `handle`, if not a session's) in the background.
    pub(crate) async fn release_with(
        &self,
        what: &'static str,
        handle: u64,
        release: etcd_client::Txn,
    ) -> Result<ReleaseReply, LockError> {
        // Sent again after a lost reply: a second send that finds the key
        // gone may follow a first that released it, which the reply says
        // (the client decides by the lease's clock), instead of leaving it
        // to its TTL while everyone waits.
        let (reply, resent) = self.run_txn_resent(what, Repeat::Safe, release).await?;
        if !reply.succeeded() {
            return Ok(if resent {
                ReleaseReply::NotHeldAfterResend
            } else {
                ReleaseReply::NotHeld
            });
        }
        if let Some(own) = own_lease_of(handle) {
            self.revoke_later(own);
        }
        Ok(ReleaseReply::Released)
    }
}

/// Revokes an etcd lease (deleting its keys), under the operation timeout.
pub(crate) async fn revoke(
    leases: LeaseClient,
    requests: &Requests,
    lease_id: i64,
) -> Result<(), LockError> {
    requests
        .send("etcd lease revoke", Repeat::Safe, || {
            let mut leases = leases.clone();
            async move { leases.revoke(lease_id).await.map(|_| ()) }
        })
        .await
}

/// The lock's own etcd lease in a handle; `None` for a session lease (shared,
/// never revoked for one lock) or no lease.
fn own_lease_of(handle: u64) -> Option<i64> {
    if session::session_lease_of(handle).is_some() {
        return None;
    }
    i64::try_from(handle).ok().filter(|id| *id > 0)
}

/// A timeout while connecting means the cluster is unreachable.
/// Whether `error` came from a connection the server closed.
fn closed_by_peer(error: &LockError) -> bool {
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<etcd_client::Error>())
        .is_some_and(errors::closed_by_peer)
}

fn unreachable_on_timeout(error: LockError) -> LockError {
    if error.kind() == distlock_core::ErrorKind::Timeout {
        LockError::unavailable(error.message().to_owned()).with_source(error)
    } else {
        error
    }
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
            durable: true,
            ..Capabilities::default()
        }
    }

    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<AcquireReply, LockError> {
        if request.renewing {
            self.acquire_on_session(request).await
        } else {
            self.acquire_on_own_lease(request).await
        }
    }

    async fn extend(&self, lock: HeldLock<'_>, ttl: Duration) -> Result<ExtendReply, LockError> {
        if let Some(session) = session::session_lease_of(lock.handle)
            .and_then(|id| self.inner.sessions.by_lease(id))
            .filter(|session| session.is_alive() && session.ttl() == ttl)
        {
            return self.confirm_session_lock(lock, &session).await;
        }
        // Any other TTL (max hold, hold-at-least), or a lost session: move
        // the key to a lease of its own with exactly that TTL.
        self.move_to_own_lease(lock, ttl).await
    }

    async fn release(&self, lock: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let etcd_key = self.inner.layout.lock_key(lock.key);
        let value = encode_value(lock.owner);
        let released = self
            .release_with(
                "etcd release",
                lock.handle,
                txn::release(&etcd_key, &value, lock.fencing),
            )
            .await?;
        self.untrack(&lock);
        Ok(released)
    }

    async fn watch(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        queue::enqueue(self, queue::Line::Lock(key.clone()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_own_leases_are_revoked() {
        assert_eq!(own_lease_of(42), Some(42));
        assert_eq!(own_lease_of(session::session_handle(42)), None);
        assert_eq!(own_lease_of(0), None);
    }
}
