//! How long to hold, wait for, renew and keep a lock.

use std::time::Duration;

use crate::lease::clock_drift;
use crate::{HolderId, LockError};

/// When a [`LockGuard`](crate::LockGuard) renews its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Renewal {
    /// Every third of the TTL (the default): with the default stop margin
    /// (a third of the TTL) a failed renewal is retried for another third
    /// of the TTL before the job is stopped.
    ///
    /// Whatever the period, a guard renews at the latest halfway between
    /// the arrival of its current lease and that lease's stop moment, so a
    /// renewal always has time to be retried.
    #[default]
    ThirdOfTtl,
    /// At a fixed period. The first renewal must come before the stop
    /// moment (TTL minus stop margin, see [`LockOptions::with_stop_margin`]);
    /// a longer period is refused as invalid input.
    Every(Duration),
    /// Never: the lock expires after its TTL unless released sooner.
    Off,
}

/// Options for one acquisition through a [`Locker`](crate::Locker).
///
/// Every duration is checked when the lock is acquired (or by
/// [`validate`](Self::validate)): a value that cannot work is a typed
/// [`InvalidInput`](crate::ErrorKind::InvalidInput) error before any request
/// is sent, never a panic.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::LockOptions;
/// let options = LockOptions::new(Duration::from_secs(30))
///     .with_wait(Duration::from_secs(5))          // wait up to 5 s if held
///     .with_max_hold(Duration::from_secs(600))    // stop renewing after 10 min
///     .with_hold_at_least(Duration::from_secs(20)) // keep it 20 s even if the job is quicker
///     .with_stop_margin(Duration::from_secs(5));  // stop the job 5 s before the lease can run out
/// assert_eq!(options.ttl(), Duration::from_secs(30));
/// assert_eq!(options.wait(), Duration::from_secs(5));
/// options.validate()?;
/// // A stop margin must leave time to hold the lock at all.
/// assert!(options.clone().with_stop_margin(Duration::from_secs(30)).validate().is_err());
/// # Ok::<(), distlock_core::LockError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockOptions {
    ttl: Duration,
    wait: Duration,
    renewal: Renewal,
    max_hold: Option<Duration>,
    hold_at_least: Option<Duration>,
    stop_margin: Option<Duration>,
    permits: Option<u32>,
    holder: Option<HolderId>,
}

impl LockOptions {
    /// Hold for `ttl` per lease (renewed by the guard), do not wait, renew
    /// every `ttl / 3`, stop the job `ttl / 3` before the lease can run out,
    /// no max hold, no hold-at-least.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            wait: Duration::ZERO,
            renewal: Renewal::default(),
            max_hold: None,
            hold_at_least: None,
            stop_margin: None,
            permits: None,
            holder: None,
        }
    }

    /// Wait up to `wait` for a held lock (zero: one attempt).
    pub fn with_wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// How the guard renews its lease.
    pub fn with_renewal(mut self, renewal: Renewal) -> Self {
        self.renewal = renewal;
        self
    }

    /// Stop renewing after `max_hold` since acquisition (ShedLock's
    /// lockAtMostFor): a hung job cannot keep the lock forever. The lock
    /// ends at `max_hold` (rounded up to the backend's TTL granularity),
    /// also when that is shorter than the TTL; the guard's lost signal fires
    /// the stop margin before that. Zero is refused; a huge value means no
    /// limit.
    pub fn with_max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold = Some(max_hold);
        self
    }

    /// On release, keep the lock until `min` has passed since acquisition
    /// (ShedLock's lockAtLeastFor), so instances whose clocks or tickers are
    /// a little late skip the same run. Counted from when the grant reached
    /// this client, never from an earlier lease start (a lock on an etcd
    /// session is dated from the session's last keep-alive for its expiry).
    pub fn with_hold_at_least(mut self, min: Duration) -> Self {
        self.hold_at_least = Some(min);
        self
    }

    /// Stop whatever the guard protects `margin` before the earliest moment
    /// the server may expire the lease, if renewal has not succeeded by
    /// then: the guard's [`lost`](crate::LockGuard::lost) signal fires at
    /// [`Lease::valid_until`](crate::Lease::valid_until) minus `margin`, so
    /// the job has `margin` to act on it (a job run by
    /// [`run_exclusive`](crate::run_exclusive) is dropped at once; a child
    /// process gets time to exit). A lease granted so late that it is
    /// already inside the margin is released and reported, never handed out.
    ///
    /// Default: a third of the lease's TTL (10 s of a 30 s TTL). Must be
    /// shorter than the TTL minus the clock-drift allowance and, with
    /// renewal on, leave room for the first renewal before the stop moment.
    /// Zero stops the job only at the conservative expiry itself.
    pub fn with_stop_margin(mut self, margin: Duration) -> Self {
        self.stop_margin = Some(margin);
        self
    }

    /// Take one of `limit` permits of the key's semaphore instead of the
    /// lock: at most `limit` guards hold the key at once, each with its own
    /// lease and fencing token (see [`SemaphoreBackend`](crate::SemaphoreBackend)).
    /// `try_lock`, `acquire` and `run_exclusive` all honour it.
    pub fn with_permits(mut self, limit: u32) -> Self {
        self.permits = Some(limit);
        self
    }

    /// Store `holder` with the lock (or permit) so others can read who holds
    /// it ([`LockState::Held`](crate::LockState::Held), `distlock status`).
    /// A permit's label is read with
    /// [`LockClient::inspect_permits`](crate::LockClient::inspect_permits).
    /// A label for people, never proof of ownership; ignored by a backend
    /// that does not declare [`Capabilities::holder_ids`](crate::Capabilities::holder_ids)
    /// (for permits, [`Capabilities::permit_holder_ids`](crate::Capabilities::permit_holder_ids)).
    pub fn with_holder(mut self, holder: HolderId) -> Self {
        self.holder = Some(holder);
        self
    }

    /// The holder label stored with the lock, if set.
    pub fn holder(&self) -> Option<&HolderId> {
        self.holder.as_ref()
    }

    /// Take the lock, not a permit.
    pub(crate) fn clear_permits(&mut self) {
        self.permits = None;
    }

    /// The semaphore limit, if the options take a permit.
    pub fn permits(&self) -> Option<u32> {
        self.permits
    }

    /// The TTL of each lease.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// How long to wait for a held lock.
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// The renewal policy.
    pub fn renewal(&self) -> Renewal {
        self.renewal
    }

    /// The maximum hold time (see [`with_max_hold`](Self::with_max_hold)), if any.
    pub fn max_hold(&self) -> Option<Duration> {
        self.max_hold
    }

    /// The minimum hold time (see
    /// [`with_hold_at_least`](Self::with_hold_at_least)), if any.
    pub fn hold_at_least(&self) -> Option<Duration> {
        self.hold_at_least
    }

    /// The stop margin set with [`with_stop_margin`](Self::with_stop_margin), if any.
    pub fn stop_margin(&self) -> Option<Duration> {
        self.stop_margin
    }

    /// The stop margin for a lease of `ttl`: the one set, else `ttl / 3`.
    pub fn stop_margin_for(&self, ttl: Duration) -> Duration {
        self.stop_margin.unwrap_or(ttl / 3)
    }

    /// The TTL to request: the TTL, shortened to the max hold time so a
    /// short max hold is not outlived by the first lease.
    pub(crate) fn request_ttl(&self) -> Duration {
        match self.max_hold {
            Some(max) => self.ttl.min(max),
            None => self.ttl,
        }
    }

    /// Checks that the durations can work together: a positive TTL and max
    /// hold, a stop margin that leaves time to hold the lock, and a renewal
    /// period that renews before the stop moment. [`Locker`](crate::Locker)
    /// calls it before sending anything; call it to check configuration
    /// early.
    pub fn validate(&self) -> Result<(), LockError> {
        if self.ttl.is_zero() {
            return Err(LockError::invalid_input(
                "TTL is zero; a lock needs a positive time to live",
            ));
        }
        if self.max_hold.is_some_and(|max| max.is_zero()) {
            return Err(LockError::invalid_input(
                "max hold is zero; leave it unset for no limit, or give the longest time a job may hold the lock",
            ));
        }
        let ttl = self.request_ttl();
        // The part of each lease the guard trusts (see Lease::valid_until).
        let usable = ttl.saturating_sub(clock_drift(ttl));
        let margin = self.stop_margin_for(ttl);
        if margin >= usable {
            return Err(LockError::invalid_input(format!(
                "stop margin {margin:?} leaves no time to hold a lease of {ttl:?} (the guard trusts {usable:?} of it); use a shorter stop margin or a longer TTL"
            )));
        }
        if let Some(period) = self.renew_period(ttl) {
            let stop_after = usable - margin;
            if period >= stop_after {
                return Err(LockError::invalid_input(format!(
                    "renewal period {period:?} is too long: the job is stopped {stop_after:?} into each lease of {ttl:?} (TTL minus drift allowance minus stop margin {margin:?}) unless renewed by then; renew more often, or use a shorter stop margin or a longer TTL"
                )));
            }
        }
        Ok(())
    }

    /// The renewal period for a lease of `ttl`, or `None` if the guard
    /// does not renew: renewal off, or a max hold within the first lease.
    pub(crate) fn renew_period(&self, ttl: Duration) -> Option<Duration> {
        if self.max_hold.is_some_and(|max| max <= self.ttl) {
            return None;
        }
        match self.renewal {
            Renewal::ThirdOfTtl => Some(ttl / 3),
            Renewal::Every(period) => Some(period),
            Renewal::Off => None,
        }
        .map(|p| p.max(Duration::from_millis(1)))
    }
}
