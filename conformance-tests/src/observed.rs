//! A backend wrapper that lets a test see what went through it.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_core::{
    AcquireAttempt, Capabilities, DistributedLock, Lease, LockError, LockKey, LockState,
    ReleaseWatch,
};

/// Forwards every [`DistributedLock`] call — the provided ones too, so the
/// backend's own `try_acquire_renewing`, `inspect` and `force_release` still
/// run (`acquire` keeps the shared loop, over this wrapper, so its attempts
/// are counted) — and counts acquisition attempts and remembers the
/// leases granted, so a test can count a waiter's attempts or release a
/// guard's lease behind its back.
///
/// ```
/// use std::sync::Arc;
/// use conformance_tests::ObservedLock;
/// use lock_core::{Locker, LockKey, LockOptions, MemoryLock};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_core::LockError> {
/// let observed = Arc::new(ObservedLock::new(Arc::new(MemoryLock::new())));
/// let guard = Locker::new(observed.clone())
///     .try_lock(&LockKey::new("job")?, &LockOptions::new(std::time::Duration::from_secs(5)))
///     .await?
///     .expect("free");
/// assert_eq!(observed.attempts(), 1);
/// assert_eq!(observed.last_granted().map(|l| l.fencing_token()), Some(guard.fencing_token()));
/// # Ok(()) }
/// ```
pub struct ObservedLock {
    inner: Arc<dyn DistributedLock>,
    attempts: AtomicU64,
    granted: Mutex<Vec<Lease>>,
}

impl fmt::Debug for ObservedLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObservedLock")
            .field("inner", &self.inner)
            .field("attempts", &self.attempts())
            .finish_non_exhaustive()
    }
}

impl ObservedLock {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn DistributedLock>) -> Self {
        Self {
            inner,
            attempts: AtomicU64::new(0),
            granted: Mutex::new(Vec::new()),
        }
    }

    /// Acquisition attempts so far (`try_acquire` and `try_acquire_renewing`).
    pub fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::SeqCst)
    }

    /// The last lease granted through this wrapper.
    pub fn last_granted(&self) -> Option<Lease> {
        self.granted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .last()
            .cloned()
    }

    fn observe(
        &self,
        attempt: Result<AcquireAttempt, LockError>,
    ) -> Result<AcquireAttempt, LockError> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        if let Ok(AcquireAttempt::Acquired(lease)) = &attempt {
            self.granted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(lease.clone());
        }
        attempt
    }
}

#[lock_core::async_trait]
impl DistributedLock for ObservedLock {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<AcquireAttempt, LockError> {
        self.observe(self.inner.try_acquire(key, ttl).await)
    }

    async fn try_acquire_renewing(
        &self,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<AcquireAttempt, LockError> {
        self.observe(self.inner.try_acquire_renewing(key, ttl).await)
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease, LockError> {
        self.inner.extend(lease, ttl).await
    }

    async fn release(&self, lease: &Lease) -> Result<(), LockError> {
        self.inner.release(lease).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        self.inner.inspect(key).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        self.inner.force_release(key).await
    }

    async fn watch(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        self.inner.watch(key).await
    }
}
