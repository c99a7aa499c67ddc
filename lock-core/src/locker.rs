//! Acquiring guards over any backend, cancel-safely.

use std::future::Future;
use std::time::Instant;

use crate::lease::later;
use crate::wait::Attempt;
use crate::{LockClient, LockError, LockGuard, LockKey, LockOptions};

/// The entry point for job code: acquires [`LockGuard`]s from any backend.
///
/// Cheap to clone. Every future it returns is cancel-safe: dropping a waiting
/// future leaves no lock held, even if the server granted the lock just
/// before the drop (the grant is released in the background; see
/// [`LockClient::idle`]). All attempts of one call share one owner token,
/// so an attempt that timed out although the server applied it is
/// recognised by the next (see [`LockClient::acquire`]).
///
/// ```
/// use std::time::Duration;
/// use distlock_core::{Locker, LockKey, LockOptions, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock_core::LockError> {
/// let locker = Locker::new(MemoryLock::new());
/// let key = LockKey::new("invoices")?;
/// let options = LockOptions::new(Duration::from_secs(10)).with_wait(Duration::from_secs(1));
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

    /// One attempt, never waits (ignores [`LockOptions::with_wait`]); a
    /// transient error is reported at once.
    pub async fn try_lock(
        &self,
        key: &LockKey,
        options: &LockOptions,
    ) -> Result<Option<LockGuard>, LockError> {
        self.lock_until(key, options, None, std::future::pending())
            .await
    }

    /// Acquires, waiting up to the options' wait time; `Ok(None)` if the lock
    /// was still held then. Transient errors (`Unavailable`, `Timeout`: a
    /// failover, a restarting server) are retried with backoff within the
    /// wait time; the last one is returned if it runs out.
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
    /// completes (a signal, a shutdown), returning `Ok(None)` at once — also
    /// while an attempt is in flight, however long its operation timeout.
    ///
    /// What was granted is still given back: beside an attempt in flight,
    /// one more attempt with its owner token settles it at once (it adopts
    /// a lock the first one took, without waiting for that one's reply,
    /// which a server may hold up for the whole operation timeout) and
    /// releases what it gets; the attempt in flight finishes on the
    /// acquisition's own task, and a lock it is granted (or that a settling
    /// attempt finds, when its outcome was unknown) is released there,
    /// while the tokio runtime runs. A process
    /// that exits right after awaits [`LockClient::idle`] first (with a
    /// timeout of its choice); a lock whose give-back did not finish
    /// expires by its TTL (a renewing one once its client is gone).
    pub async fn acquire_unless<C>(
        &self,
        key: &LockKey,
        options: &LockOptions,
        cancel: C,
    ) -> Result<Option<LockGuard>, LockError>
    where
        C: Future<Output = ()>,
    {
        let deadline = later(Instant::now(), options.wait());
        self.lock_until(key, options, Some(deadline), cancel).await
    }

    /// Acquires a guard for `key`: one inline attempt without a
    /// `deadline` (`cancel` is then never polled), else waiting until it.
    pub(crate) async fn lock_until<C: Future<Output = ()>>(
        &self,
        key: &LockKey,
        options: &LockOptions,
        deadline: Option<Instant>,
        cancel: C,
    ) -> Result<Option<LockGuard>, LockError> {
        self.check(options)?;
        let attempt = options
            .permits()
            .map_or(Attempt::PLAIN, Attempt::permit)
            .renewed(options.renew_period(options.request_ttl()).is_some())
            .held_by(options.holder().cloned());
        tokio::pin!(cancel);
        let lease = loop {
            let lease = match deadline {
                None => {
                    self.client
                        .try_once(key, options.request_ttl(), attempt.clone())
                        .await?
                }
                Some(deadline) => {
                    self.client
                        .acquire_until(
                            key,
                            options.request_ttl(),
                            deadline,
                            attempt.clone(),
                            Some(options.clone()),
                            &mut cancel,
                        )
                        .await?
                }
            };
            let Some(lease) = lease else {
                tracing::info!(key = %key, "lock held elsewhere; not acquired");
                return Ok(None);
            };
            let margin = options.stop_margin_for(lease.ttl());
            let stop_at = lease.valid_until().checked_sub(margin);
            let now = Instant::now();
            if stop_at.is_some_and(|at| now < at) {
                break lease;
            }
            // The waiting loop found it usable a moment ago, but a loaded
            // machine let its stop margin begin since: given back unused,
            // and tried again while the wait allows.
            let late = lease.sent_at().elapsed();
            tracing::warn!(key = %key, fencing = %lease.fencing_token(), ?late, "lock granted inside its stop margin; releasing it unused");
            let ttl = lease.ttl();
            self.client.release_unused(lease).await;
            if deadline.is_none_or(|deadline| Instant::now() >= deadline) {
                return Err(LockError::timeout(format!(
                    "lock {key:?} was granted {late:?} after the request was sent, too late to use: less than the stop margin {margin:?} of its {ttl:?} TTL was left. It was released and nothing ran; the server or network is too slow for this TTL: retry, or use a longer TTL"
                )));
            }
        };
        tracing::info!(key = %key, fencing = %lease.fencing_token(), "lock acquired");
        Ok(Some(LockGuard::new(self.client.clone(), lease, options)))
    }

    /// Refuses options that cannot work, before any request is sent.
    fn check(&self, options: &LockOptions) -> Result<(), LockError> {
        options.validate()?;
        let max_ttl = self.client.capabilities().max_ttl;
        if let Some(min) = options.hold_at_least().filter(|min| *min > max_ttl) {
            return Err(LockError::invalid_input(format!(
                "hold-at-least {min:?} is above this backend's maximum TTL of {max_ttl:?}; use a shorter minimum hold time"
            )));
        }
        Ok(())
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
