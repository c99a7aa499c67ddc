//! Acquiring guards over any backend, cancel-safely.

use std::future::Future;
use std::time::{Duration, Instant};

use crate::wait::Attempt;
use crate::{LockClient, LockError, LockGuard, LockKey, LockOptions};

/// The entry point for job code: acquires [`LockGuard`]s from any backend.
///
/// Cheap to clone. Every future it returns is cancel-safe: dropping a waiting
/// future leaves no lock held, even if the server granted the lock just
/// before the drop (the grant is released in the background).
///
/// ```
/// use std::time::Duration;
/// use lock_core::{Locker, LockKey, LockOptions, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_core::LockError> {
/// let locker = Locker::new(MemoryLock::new());
/// let key = LockKey::new("invoices")?;
/// let options = LockOptions::new(Duration::from_secs(10)).wait(Duration::from_secs(1));
/// if let Some(guard) = locker.acquire(&key, &options).await? {
///     println!("fencing token {}", guard.fencing_token());
///     guard.release().await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Locker {
    client: LockClient,
}

impl Locker {
    /// A locker over `client` (a [`LockClient`], or any backend).
    pub fn new(client: impl Into<LockClient>) -> Self {
        Self {
            client: client.into(),
        }
    }

    /// The lease-level client underneath.
    pub fn client(&self) -> &LockClient {
        &self.client
    }

    /// One attempt, never waits (ignores [`LockOptions::wait`]); a
    /// transient error is reported at once.
    pub async fn try_lock(
        &self,
        key: &LockKey,
        options: &LockOptions,
    ) -> Result<Option<LockGuard>, LockError> {
        self.lock_until(key, options, Instant::now()).await
    }

    /// Acquires, waiting up to the options' wait time; `Ok(None)` if the lock
    /// was still held then. Transient errors (`Unavailable`, `Timeout`) are
    /// retried with backoff within the wait time.
    pub async fn acquire(
        &self,
        key: &LockKey,
        options: &LockOptions,
    ) -> Result<Option<LockGuard>, LockError> {
        let deadline = Instant::now()
            .checked_add(options.wait_time())
            .unwrap_or_else(far_future);
        self.lock_until(key, options, deadline).await
    }

    async fn lock_until(
        &self,
        key: &LockKey,
        options: &LockOptions,
        deadline: Instant,
    ) -> Result<Option<LockGuard>, LockError> {
        let attempt = if options.renewal_policy() == crate::Renewal::Off {
            Attempt::Plain
        } else {
            Attempt::Renewing
        };
        let lease = self
            .client
            .acquire_until(key, options.ttl(), deadline, attempt)
            .await?;
        match lease {
            Some(lease) => {
                tracing::info!(key = %key, fencing = %lease.fencing_token(), "lock acquired");
                Ok(Some(LockGuard::new(self.client.clone(), lease, options)))
            }
            None => {
                tracing::info!(key = %key, "lock held elsewhere; not acquired");
                Ok(None)
            }
        }
    }

    /// Runs `job` if the lock is free; see [`run_exclusive`](crate::run_exclusive).
    pub async fn run_exclusive<F, Fut, T>(
        &self,
        key: &LockKey,
        options: &crate::RunOptions,
        job: F,
    ) -> Result<crate::RunOutcome<T>, LockError>
    where
        F: FnOnce(crate::JobContext) -> Fut,
        Fut: Future<Output = T>,
    {
        crate::run::run_exclusive(self, key, options, job).await
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600)
}
