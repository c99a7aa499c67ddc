//! A `DistributedLock` wrapper that counts the calls reaching the backend,
//! for backends whose server cannot count its own statements here
//! (PostgreSQL without pg_stat_statements) and as a cross-check for the rest.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock::{
    AcquireAttempt, Capabilities, DistributedLock, Lease, LockError, LockKey, ReleaseWatch,
};

/// Calls made through every [`Counting`] sharing these counters.
#[derive(Debug, Default)]
pub struct Counters {
    pub try_acquire: AtomicU64,
    pub extend: AtomicU64,
    pub release: AtomicU64,
    pub watch: AtomicU64,
}

/// A snapshot of [`Counters`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Calls {
    pub try_acquire: u64,
    pub extend: u64,
    pub release: u64,
    pub watch: u64,
}

impl Calls {
    /// try_acquire + extend + release: the lock operations (each is one
    /// statement on PostgreSQL, one script call on Redis, 2-3 RPCs on etcd).
    pub fn ops(&self) -> u64 {
        self.try_acquire + self.extend + self.release
    }

    pub fn since(&self, earlier: &Calls) -> Calls {
        Calls {
            try_acquire: self.try_acquire - earlier.try_acquire,
            extend: self.extend - earlier.extend,
            release: self.release - earlier.release,
            watch: self.watch - earlier.watch,
        }
    }
}

impl Counters {
    pub fn snapshot(&self) -> Calls {
        Calls {
            try_acquire: self.try_acquire.load(Ordering::Relaxed),
            extend: self.extend.load(Ordering::Relaxed),
            release: self.release.load(Ordering::Relaxed),
            watch: self.watch.load(Ordering::Relaxed),
        }
    }
}

/// Forwards to `inner`, counting.
#[derive(Debug)]
pub struct Counting {
    pub inner: Arc<dyn DistributedLock>,
    pub counters: Arc<Counters>,
}

#[async_trait]
impl DistributedLock for Counting {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<AcquireAttempt, LockError> {
        self.counters.try_acquire.fetch_add(1, Ordering::Relaxed);
        self.inner.try_acquire(key, ttl).await
    }

    // Forwarded so guards take the backend's renewing path (etcd: the
    // session lease), counted as an acquire attempt.
    async fn try_acquire_renewing(
        &self,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<AcquireAttempt, LockError> {
        self.counters.try_acquire.fetch_add(1, Ordering::Relaxed);
        self.inner.try_acquire_renewing(key, ttl).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease, LockError> {
        self.counters.extend.fetch_add(1, Ordering::Relaxed);
        self.inner.extend(lease, ttl).await
    }

    async fn release(&self, lease: &Lease) -> Result<(), LockError> {
        self.counters.release.fetch_add(1, Ordering::Relaxed);
        self.inner.release(lease).await
    }

    async fn watch(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        self.counters.watch.fetch_add(1, Ordering::Relaxed);
        self.inner.watch(key).await
    }
}
