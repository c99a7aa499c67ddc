//! The contract every lock server implements: a few atomic operations.

use std::fmt;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::{Capabilities, FencingToken, Lease, LockError, LockKey, ReleaseWatch};

/// The result of one atomic acquisition attempt.
///
/// Unlike a bare `Option<Lease>`, a refusal carries the holder's remaining
/// time as the server sees it, so a waiter can set one timer for a holder
/// that crashed without releasing, instead of polling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AcquireAttempt {
    /// The lock is ours.
    Acquired(Lease),
    /// Someone else holds it.
    Held {
        /// How long until the holder's lease runs out by the server's clock,
        /// if the server said. Renewal may push it further.
        expires_in: Option<Duration>,
    },
}

impl AcquireAttempt {
    /// The lease, if acquired.
    pub fn lease(self) -> Option<Lease> {
        match self {
            AcquireAttempt::Acquired(lease) => Some(lease),
            AcquireAttempt::Held { .. } => None,
        }
    }
}

/// What the server holds at a key, read without taking the lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockState {
    /// Nobody holds the key (never locked, released, or expired).
    Free,
    /// Someone holds it.
    Held {
        /// Time left on the holder's lease by the server's clock, if known
        /// (renewal may extend it).
        expires_in: Option<Duration>,
        /// The holder's fencing token.
        fencing_token: FencingToken,
    },
}

/// A lock server, reduced to the operations it must do atomically.
///
/// Everything else — waiting with a deadline, guards that renew themselves,
/// the lost signal, `run_exclusive` — is written once on top of this trait in
/// [`Locker`](crate::Locker) and works for every backend. The trait is object
/// safe: job code holds an `Arc<dyn DistributedLock>` and never names a
/// backend.
///
/// Implementations must:
/// - validate the TTL with [`Capabilities::effective_ttl`] and leases with
///   [`Lease::check_issuer`];
/// - generate a fresh [`OwnerToken`](crate::OwnerToken) per acquisition and
///   compare it on the server in `extend` and `release`;
/// - take `sent_at` for the [`Lease`] before sending the request;
/// - never read or write outside their configured namespace, and report a
///   value they did not write as [`ErrorKind::Corrupted`](crate::ErrorKind).
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use lock_core::{DistributedLock, LockKey, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_core::LockError> {
/// let lock: Arc<dyn DistributedLock> = Arc::new(MemoryLock::new());
/// let key = LockKey::new("nightly-report")?;
/// let lease = lock.try_acquire(&key, Duration::from_secs(30)).await?.lease().unwrap();
/// assert!(lock.try_acquire(&key, Duration::from_secs(30)).await?.lease().is_none());
/// lock.release(&lease).await?;
/// # Ok(()) }
/// ```
#[async_trait]
pub trait DistributedLock: Send + Sync + fmt::Debug {
    /// What this backend supports; constant for the life of the client.
    fn capabilities(&self) -> Capabilities;

    /// One atomic attempt: takes `key` for `ttl` if nobody holds it (or the
    /// previous holder's TTL ran out), with a fresh owner token and a fencing
    /// token greater than any earlier one for this key. Never waits.
    ///
    /// Cancel safety: if this future is dropped after the request was sent,
    /// the server may have granted a lock nobody will release; it expires
    /// after `ttl`. [`Locker`](crate::Locker) never drops it mid-flight.
    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<AcquireAttempt, LockError>;

    /// As [`try_acquire`](Self::try_acquire), for a lock its holder will keep
    /// renewing (a [`LockGuard`](crate::LockGuard) with renewal on). A backend
    /// may then attach it to a shared session that one keep-alive renews
    /// (etcd: one lease per client and TTL), making acquisition one round
    /// trip. The lock must still expire within `ttl` of the holder's last
    /// renewal if the holder stops renewing, and an [`extend`](Self::extend)
    /// with a shorter TTL (max hold, hold-at-least) must make it expire
    /// then. The default is `try_acquire`.
    async fn try_acquire_renewing(
        &self,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<AcquireAttempt, LockError> {
        self.try_acquire(key, ttl).await
    }

    /// Resets the lease's TTL to `ttl` from now if, and only if, the server
    /// still holds it for this owner. Never recreates an expired or released
    /// lock. Returns the renewed lease (same owner and fencing token), or an
    /// [`ErrorKind::NotHeld`](crate::ErrorKind) error.
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease, LockError>;

    /// Deletes the lock if, and only if, this owner still holds it; returns
    /// an [`ErrorKind::NotHeld`](crate::ErrorKind) error otherwise (released
    /// already, expired, or taken by someone else — whose lock stays).
    async fn release(&self, lease: &Lease) -> Result<(), LockError>;

    /// Subscribes to release notifications for `key` from the server.
    /// Called *before* an attempt, so a release between the attempt and the
    /// wait is not missed. `None` (the default) means the backend has no
    /// server-driven wake-up and waiters retry every
    /// [`Capabilities::retry_interval`].
    async fn watch(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        let _ = key;
        Ok(None)
    }

    /// Reads who holds `key`, without taking or changing anything. For
    /// operators and status commands; a job should never decide to run on
    /// it (the answer is stale as soon as it arrives). Optional: backends
    /// that implement it declare [`Capabilities::admin`].
    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        let _ = key;
        Err(LockError::unsupported(format!(
            "{self:?} cannot inspect locks (Capabilities::admin is false)"
        )))
    }

    /// Deletes the lock at `key` whoever holds it, waking waiters; returns
    /// whether a lock was held. For an operator clearing a stuck lock: the
    /// holder learns it lost the lock at its next renewal, and fencing
    /// tokens keep growing. Never touches a value the library did not
    /// write ([`ErrorKind::Corrupted`](crate::ErrorKind)). Optional:
    /// backends that implement it declare [`Capabilities::admin`].
    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let _ = key;
        Err(LockError::unsupported(format!(
            "{self:?} cannot force-release locks (Capabilities::admin is false)"
        )))
    }

    /// Waits until the lock is acquired or `deadline` passes (`Ok(None)`).
    /// A deadline in the past means one attempt.
    ///
    /// The provided implementation subscribes with [`watch`](Self::watch),
    /// then attempts, then sleeps until a release notification, the holder's
    /// expiry or the deadline, and repeats. Backends with a better native
    /// mechanism (a FIFO queue of waiters) may override it.
    ///
    /// Cancel safety: as for [`try_acquire`](Self::try_acquire); use
    /// [`Locker::acquire`](crate::Locker::acquire) for a cancel-safe wait.
    async fn acquire(
        &self,
        key: &LockKey,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<Option<Lease>, LockError> {
        crate::wait::acquire_by_watching(self, key, ttl, deadline).await
    }
}
