//! Acquiring guards over any backend, cancel-safely.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::lease::later;
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
        self.lock_until(key, options, Instant::now(), std::future::pending())
            .await
    }

    /// Acquires, waiting up to the options' wait time; `Ok(None)` if the lock
    /// was still held then.
    ///
    /// Fails with [`ErrorKind::InvalidInput`](crate::ErrorKind) before
    /// sending anything if the options cannot work (see
    /// [`LockOptions::validate`]), and with
    /// [`ErrorKind::Timeout`](crate::ErrorKind) if the server granted the
    /// lock so late that the lease was already inside its stop margin (the
    /// lease is then released: a job must not start on it).
    pub async fn acquire(
        &self,
        key: &LockKey,
        options: &LockOptions,
    ) -> Result<Option<LockGuard>, LockError> {
        self.acquire_unless(key, options, std::future::pending())
            .await
    }

    /// As [`acquire`](Self::acquire), but gives up waiting when `cancel`
    /// completes (a signal, a shutdown), returning `Ok(None)`. Unlike
    /// dropping the future of `acquire` (which releases a late grant in the
    /// background), this returns only once nothing is held: an attempt in
    /// flight is finished, and a lease it got is released before returning.
    /// Use it where the process may exit right after.
    pub async fn acquire_unless<C>(
        &self,
        key: &LockKey,
        options: &LockOptions,
        cancel: C,
    ) -> Result<Option<LockGuard>, LockError>
    where
        C: Future<Output = ()>,
    {
        let deadline = later(Instant::now(), options.wait_time());
        self.lock_until(key, options, deadline, cancel).await
    }

    async fn lock_until<C: Future<Output = ()>>(
        &self,
        key: &LockKey,
        options: &LockOptions,
        deadline: Instant,
        cancel: C,
    ) -> Result<Option<LockGuard>, LockError> {
        self.check(options)?;
        let attempt = if options.renew_period(options.request_ttl()).is_none() {
            Attempt::Plain
        } else {
            Attempt::Renewing
        };
        let lease = self
            .acquire_lease(key, options.request_ttl(), deadline, attempt, cancel)
            .await?;
        let Some(lease) = lease else {
            tracing::info!(key = %key, "lock held elsewhere; not acquired");
            return Ok(None);
        };
        let margin = options.stop_margin_for(lease.ttl());
        let stop_at = lease.valid_until().checked_sub(margin);
        if stop_at.is_none_or(|at| Instant::now() >= at) {
            let late = lease.sent_at().elapsed();
            tracing::warn!(key = %key, fencing = %lease.fencing_token(), ?late, "lock granted inside its stop margin; releasing it unused");
            let ttl = lease.ttl();
            self.release_unused(lease).await;
            return Err(LockError::timeout(format!(
                "lock {key:?} was granted {late:?} after the request was sent, too late to use: less than the stop margin {margin:?} of its {ttl:?} TTL was left. It was released and nothing ran; the server or network is too slow for this TTL: retry, or use a longer TTL"
            )));
        }
        tracing::info!(key = %key, fencing = %lease.fencing_token(), "lock acquired");
        Ok(Some(LockGuard::new(self.backend.clone(), lease, options)))
    }

    /// Refuses options that cannot work, before any request is sent.
    fn check(&self, options: &LockOptions) -> Result<(), LockError> {
        options.validate()?;
        let max_ttl = self.backend.capabilities().max_ttl;
        if let Some(min) = options.min_hold_time().filter(|min| *min > max_ttl) {
            return Err(LockError::invalid_input(format!(
                "hold-at-least {min:?} is above this backend's maximum TTL of {max_ttl:?}; use a shorter minimum hold time"
            )));
        }
        Ok(())
    }

    /// Releases a lease nobody will use, on its own task so that dropping
    /// the caller's future cannot abandon the release; waits for it.
    async fn release_unused(&self, lease: Lease) {
        let backend = self.backend.clone();
        let release = tokio::spawn(async move {
            if let Err(e) = backend.release(&lease).await {
                tracing::debug!(key = %lease.key(), fencing = %lease.fencing_token(), error = %e, "releasing an unused lease failed; it expires after its TTL");
            }
        });
        let _ = release.await;
    }

    /// Runs the waiting loop on its own task so that dropping the caller's
    /// future never abandons an attempt in flight: a lease granted after the
    /// caller left is released at once. When `cancel` completes, the loop
    /// stops at its next wait and a lease it got is released here.
    async fn acquire_lease<C: Future<Output = ()>>(
        &self,
        key: &LockKey,
        ttl: Duration,
        deadline: Instant,
        attempt: Attempt,
        cancel: C,
    ) -> Result<Option<Lease>, LockError> {
        let backend = self.backend.clone();
        let task_key = key.clone();
        let stop_waiting = CancellationToken::new();
        let task_cancel = stop_waiting.clone();
        let (reply, answer) = oneshot::channel();
        tokio::spawn(async move {
            let result =
                acquire_until_cancelled(&*backend, &task_key, ttl, deadline, attempt, &task_cancel)
                    .await;
            if let Err(Ok(Some(lease))) = reply.send(result) {
                tracing::debug!(key = %task_key, fencing = %lease.fencing_token(), "waiter gone; releasing the lock it was granted");
                let _ = backend.release(&lease).await;
            }
        });
        let _cancel_on_drop = stop_waiting.clone().drop_guard();
        let mut answer = UnreadAnswer {
            answer,
            backend: self.backend.clone(),
        };
        let panicked = |_| Err(LockError::unavailable("the acquire task panicked"));
        tokio::select! {
            // Cancel first: a caller that was cancelled never gets a guard.
            biased;
            () = cancel => {
                stop_waiting.cancel();
                let result = (&mut answer.answer).await.unwrap_or_else(panicked);
                if let Ok(Some(lease)) = result {
                    tracing::debug!(key = %key, fencing = %lease.fencing_token(), "acquire cancelled as the lock was granted; releasing it");
                    self.release_unused(lease).await;
                }
                Ok(None)
            }
            result = &mut answer.answer => result.unwrap_or_else(panicked),
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
