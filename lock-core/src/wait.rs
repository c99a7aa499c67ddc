//! The shared waiting loop: subscribe, attempt, sleep until woken, repeat.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::lease::later;
use crate::{AcquireAttempt, DistributedLock, Lease, LockError, LockKey, ReleaseWatch};

/// Extra wait after a holder's predicted expiry, so the retry lands after the
/// server expired it rather than just before.
const EXPIRY_SLACK: Duration = Duration::from_millis(2);

/// The default [`DistributedLock::acquire`]: waits for `key` until `deadline`,
/// woken by the server's release notifications or the holder's expiry.
pub async fn acquire_by_watching<B: DistributedLock + ?Sized>(
    backend: &B,
    key: &LockKey,
    ttl: Duration,
    deadline: Instant,
) -> Result<Option<Lease>, LockError> {
    acquire_until_cancelled(
        backend,
        key,
        ttl,
        deadline,
        Attempt::Plain,
        &CancellationToken::new(),
    )
    .await
}

/// Which acquisition call the waiting loop makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// [`DistributedLock::try_acquire`].
    Plain,
    /// [`DistributedLock::try_acquire_renewing`]: a guard will renew it.
    Renewing,
}

/// As [`acquire_by_watching`], but gives up (`Ok(None)`) when `cancel` fires.
/// Cancellation is only observed between attempts, never while an attempt
/// is in flight, so a lock the server granted is always returned.
pub(crate) async fn acquire_until_cancelled<B: DistributedLock + ?Sized>(
    backend: &B,
    key: &LockKey,
    ttl: Duration,
    deadline: Instant,
    attempt: Attempt,
    cancel: &CancellationToken,
) -> Result<Option<Lease>, LockError> {
    let caps = backend.capabilities();
    // Subscribe before the first attempt: a release between a failed attempt
    // and a later subscription would otherwise be missed.
    let mut watch = if caps.native_wait && Instant::now() < deadline {
        backend.watch(key).await?
    } else {
        None
    };
    let poll = watch.is_none().then_some(caps.retry_interval);
    let mut never = ReleaseWatch::never();
    let mut attempts = 0u64;
    loop {
        attempts += 1;
        let result = match attempt {
            Attempt::Plain => backend.try_acquire(key, ttl).await?,
            Attempt::Renewing => backend.try_acquire_renewing(key, ttl).await?,
        };
        let expires_in = match result {
            AcquireAttempt::Acquired(lease) => {
                tracing::debug!(key = %key, fencing = %lease.fencing_token(), attempts, "lock acquired");
                return Ok(Some(lease));
            }
            AcquireAttempt::Held { expires_in } => expires_in,
        };
        let now = Instant::now();
        if now >= deadline {
            tracing::debug!(key = %key, attempts, "lock still held at deadline");
            return Ok(None);
        }
        let mut wake_at = deadline;
        // Saturating: the server's answer is not trusted to be small.
        if let Some(expires_in) = expires_in {
            wake_at = wake_at.min(later(now, expires_in.saturating_add(EXPIRY_SLACK)));
        }
        if let Some(poll) = poll {
            wake_at = wake_at.min(later(now, poll));
        }
        tracing::trace!(key = %key, ?expires_in, "waiting for release");
        let watch_ref = watch.as_mut().unwrap_or(&mut never);
        tokio::select! {
            _ = cancel.cancelled() => return Ok(None),
            woke = watch_ref.released() => woke?,
            _ = tokio::time::sleep_until(wake_at.into()) => {}
        }
    }
}
