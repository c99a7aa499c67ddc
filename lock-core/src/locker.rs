//! Acquiring guards over any backend, cancel-safely.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::wait::{acquire_until_cancelled, Attempt};
use crate::{DistributedLock, Lease, LockError, LockGuard, LockKey, LockOptions};

/// The entry point for job code: acquires [`LockGuard`]s from any backend.
///
/// Cheap to clone. Every future it returns is cancel-safe: dropping a waiting
/// future leaves no lock held, even if the server granted the lock just
/// before the drop (the grant is released in the background).
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use lock_core::{DistributedLock, Locker, LockKey, LockOptions, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_core::LockError> {
/// let backend: Arc<dyn DistributedLock> = Arc::new(MemoryLock::new());
/// let locker = Locker::new(backend);
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
    backend: Arc<dyn DistributedLock>,
}

impl Locker {
    /// A locker over `backend`.
    pub fn new(backend: Arc<dyn DistributedLock>) -> Self {
        Self { backend }
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn DistributedLock> {
        &self.backend
    }

    /// One attempt, never waits (ignores [`LockOptions::wait`]).
    pub async fn try_lock(
        &self,
        key: &LockKey,
        options: &LockOptions,
    ) -> Result<Option<LockGuard>, LockError> {
        self.lock_until(key, options, Instant::now()).await
    }

    /// Acquires, waiting up to the options' wait time; `Ok(None)` if the lock
    /// was still held then.
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
            .acquire_lease(key, options.ttl(), deadline, attempt)
            .await?;
        match lease {
            Some(lease) => {
                tracing::info!(key = %key, fencing = %lease.fencing_token(), "lock acquired");
                Ok(Some(LockGuard::new(self.backend.clone(), lease, options)))
            }
            None => {
                tracing::info!(key = %key, "lock held elsewhere; not acquired");
                Ok(None)
            }
        }
    }

    /// Runs the waiting loop on its own task so that dropping the caller's
    /// future never abandons an attempt in flight: a lease granted after the
    /// caller left is released at once.
    async fn acquire_lease(
        &self,
        key: &LockKey,
        ttl: Duration,
        deadline: Instant,
        attempt: Attempt,
    ) -> Result<Option<Lease>, LockError> {
        let backend = self.backend.clone();
        let key = key.clone();
        let cancel = CancellationToken::new();
        let task_cancel = cancel.clone();
        let (reply, answer) = oneshot::channel();
        tokio::spawn(async move {
            let result =
                acquire_until_cancelled(&*backend, &key, ttl, deadline, attempt, &task_cancel)
                    .await;
            if let Err(Ok(Some(lease))) = reply.send(result) {
                tracing::debug!(key = %key, fencing = %lease.fencing_token(), "waiter gone; releasing the lock it was granted");
                let _ = backend.release(&lease).await;
            }
        });
        let _cancel_on_drop = cancel.drop_guard();
        let mut answer = UnreadAnswer {
            answer,
            backend: self.backend.clone(),
        };
        (&mut answer.answer)
            .await
            .unwrap_or_else(|_| Err(LockError::unavailable("the acquire task panicked")))
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

type AcquireAnswer = oneshot::Receiver<Result<Option<Lease>, LockError>>;

/// The caller's end of an acquisition. If the caller's future is dropped
/// after the task sent a lease but before it was read, the lease would be
/// dropped unread and stay held for its whole TTL; on drop this releases it.
struct UnreadAnswer {
    answer: AcquireAnswer,
    backend: Arc<dyn DistributedLock>,
}

impl Drop for UnreadAnswer {
    fn drop(&mut self) {
        // After close(), the task's send fails (and it releases itself), or
        // the value it sent before is here to take.
        self.answer.close();
        if let Ok(Ok(Some(lease))) = self.answer.try_recv() {
            let backend = self.backend.clone();
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                tracing::debug!(key = %lease.key(), fencing = %lease.fencing_token(), "waiter dropped as the lock was granted; releasing it");
                runtime.spawn(async move {
                    let _ = backend.release(&lease).await;
                });
            }
        }
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600)
}
