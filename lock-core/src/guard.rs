//! A held lock that renews itself, says when it is lost, and releases.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::{
    instrument, ErrorKind, FencingToken, Lease, LockClient, LockError, LockKey, LockOptions,
};

/// Why a guard stopped holding its lock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostReason {
    /// The server refused a renewal: the key is gone or has another owner.
    Refused,
    /// The lease ran out before a renewal succeeded: the server was
    /// unreachable, or renewal was off or stopped by the max hold time.
    Expired,
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LostReason::Refused => "the server refused renewal (key deleted or taken over)",
            LostReason::Expired => "the lease ran out before it could be renewed",
        })
    }
}

/// Resolves when a guard no longer holds its lock. Cheap to clone; hand it to
/// the job so it can stop writing.
#[derive(Debug, Clone, Default)]
pub struct LostSignal {
    token: CancellationToken,
    reason: Arc<Mutex<Option<LostReason>>>,
}

impl LostSignal {
    /// Whether the lock is known or assumed lost.
    pub fn is_lost(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Why the lock was lost, once it was.
    pub fn reason(&self) -> Option<LostReason> {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits until the lock is lost. Cancel-safe.
    pub async fn wait(&self) -> LostReason {
        self.token.cancelled().await;
        self.reason().unwrap_or(LostReason::Expired)
    }

    fn fire(&self, reason: LostReason) {
        let mut slot = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(reason);
        }
        drop(slot);
        self.token.cancel();
    }
}

#[derive(Debug)]
struct Shared {
    client: LockClient,
    lease: Mutex<Lease>,
    lost: LostSignal,
    acquired_at: Instant,
    hold_at_least: Option<Duration>,
}

impl Shared {
    fn lease(&self) -> Lease {
        self.lease.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn mark_lost(&self, reason: LostReason) {
        if !self.lost.is_lost() {
            let lease = self.lease();
            tracing::warn!(backend = self.client.name(), key = %lease.key(), fencing = %lease.fencing_token(), %reason, "lock lost");
            instrument::lost(
                self.client.name(),
                match reason {
                    LostReason::Refused => "refused",
                    LostReason::Expired => "expired",
                },
            );
            instrument::held(self.client.name(), self.acquired_at.elapsed());
            self.lost.fire(reason);
        }
    }

    /// Releases, or, with hold-at-least, shortens the lease so it ends when
    /// the minimum hold time is over.
    async fn release(&self) -> Result<(), LockError> {
        let lease = self.lease();
        if !self.lost.is_lost() {
            instrument::held(self.client.name(), self.acquired_at.elapsed());
        }
        if let Some(min) = self.hold_at_least {
            let keep_until = self.acquired_at + min;
            let now = Instant::now();
            if now < keep_until {
                self.client.extend(&lease, keep_until - now).await?;
                tracing::debug!(key = %lease.key(), fencing = %lease.fencing_token(), remaining = ?(keep_until - now), "lock kept until hold-at-least time");
                return Ok(());
            }
        }
        let result = self.client.release(&lease).await;
        match &result {
            Ok(()) => {
                tracing::debug!(key = %lease.key(), fencing = %lease.fencing_token(), "lock released")
            }
            Err(e) => {
                tracing::warn!(key = %lease.key(), fencing = %lease.fencing_token(), error = %e, "lock release failed")
            }
        }
        result
    }
}

/// A held lock.
///
/// While it lives, a background task renews the lease (by default every third
/// of the TTL) until the optional max hold time. [`lost`](Self::lost)
/// resolves as soon as the guard knows or must assume it no longer holds the
/// lock. [`release`](Self::release) releases and reports; dropping the guard
/// releases in the background on the current tokio runtime.
pub struct LockGuard {
    shared: Arc<Shared>,
    stop_renewal: CancellationToken,
    released: bool,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("lease", &self.shared.lease())
            .field("lost", &self.shared.lost.is_lost())
            .finish()
    }
}

impl LockGuard {
    /// Wraps a freshly acquired lease and starts renewing it per `options`.
    /// Must be called within a tokio runtime.
    pub fn new(client: LockClient, lease: Lease, options: &LockOptions) -> Self {
        let acquired_at = lease.sent_at();
        let renew_period = options.renew_period(lease.ttl());
        let renew_until = options.max_hold_time().map(|max| acquired_at + max);
        let shared = Arc::new(Shared {
            client,
            lease: Mutex::new(lease),
            lost: LostSignal::default(),
            acquired_at,
            hold_at_least: options.min_hold_time(),
        });
        let stop_renewal = CancellationToken::new();
        tokio::spawn(keep_alive(
            shared.clone(),
            stop_renewal.clone(),
            renew_period,
            renew_until,
        ));
        Self {
            shared,
            stop_renewal,
            released: false,
        }
    }

    /// The key held.
    pub fn key(&self) -> LockKey {
        self.shared.lease().key().clone()
    }

    /// The fencing token of this acquisition; pass it to the resource you
    /// protect.
    pub fn fencing_token(&self) -> FencingToken {
        self.shared.lease().fencing_token()
    }

    /// The current lease (renewals replace it).
    pub fn lease(&self) -> Lease {
        self.shared.lease()
    }

    /// Whether the lock is known or assumed lost.
    pub fn is_lost(&self) -> bool {
        self.shared.lost.is_lost()
    }

    /// Resolves when the lock is lost; never, if it is released first.
    pub fn lost(&self) -> impl std::future::Future<Output = LostReason> + Send + 'static {
        let signal = self.shared.lost.clone();
        async move { signal.wait().await }
    }

    /// A clonable handle on the lost signal, for the job.
    pub fn lost_signal(&self) -> LostSignal {
        self.shared.lost.clone()
    }

    /// Stops renewal and releases the lock (or, with hold-at-least, lets it
    /// run out at the minimum hold time). Reports
    /// [`ErrorKind::NotHeld`] if the lock was no longer held.
    pub async fn release(mut self) -> Result<(), LockError> {
        self.released = true;
        self.stop_renewal.cancel();
        self.shared.release().await
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        self.stop_renewal.cancel();
        if self.released {
            return;
        }
        let shared = self.shared.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let _ = shared.release().await;
                });
            }
            Err(_) => {
                let lease = shared.lease();
                tracing::warn!(key = %lease.key(), fencing = %lease.fencing_token(),
                    "lock guard dropped outside a tokio runtime; the lock expires after its TTL");
            }
        }
    }
}

/// Renews `shared`'s lease every `period` until `renew_until`, and fires the
/// lost signal when renewal is refused or the lease runs out.
async fn keep_alive(
    shared: Arc<Shared>,
    stop: CancellationToken,
    period: Option<Duration>,
    renew_until: Option<Instant>,
) {
    let mut next_renewal = period.map(|p| shared.acquired_at + p);
    loop {
        let lease = shared.lease();
        let valid_until = lease.valid_until();
        let renew_at = next_renewal.filter(|at| renew_until.is_none_or(|until| *at < until));
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep_until(valid_until.into()) => {
                shared.mark_lost(LostReason::Expired);
                return;
            }
            _ = sleep_until_opt(renew_at), if renew_at.is_some() => {}
        }
        // Never extend beyond the max hold time.
        let mut ttl = lease.ttl();
        if let Some(until) = renew_until {
            ttl = ttl.min(until.saturating_duration_since(Instant::now()));
        }
        let extend = async {
            if ttl.is_zero() {
                return Ok(None);
            }
            shared.client.extend(&lease, ttl).await.map(Some)
        };
        let result = tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep_until(valid_until.into()) => {
                shared.mark_lost(LostReason::Expired);
                return;
            }
            result = extend => result,
        };
        match result {
            Ok(Some(renewed)) => {
                tracing::trace!(key = %renewed.key(), fencing = %renewed.fencing_token(), "lock renewed");
                *shared.lease.lock().unwrap_or_else(|e| e.into_inner()) = renewed;
                next_renewal = period.map(|p| Instant::now() + p);
            }
            Ok(None) => next_renewal = None,
            Err(e) if e.kind() == ErrorKind::NotHeld => {
                shared.mark_lost(LostReason::Refused);
                return;
            }
            Err(e) => {
                // Transient: retry soon, well before the lease runs out.
                let left = valid_until.saturating_duration_since(Instant::now());
                let retry = (left / 4).max(Duration::from_millis(5));
                tracing::warn!(key = %lease.key(), fencing = %lease.fencing_token(), error = %e, retry_in = ?retry, "lock renewal failed; retrying");
                next_renewal = Some(Instant::now() + retry);
            }
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
