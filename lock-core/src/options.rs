//! How long to hold, wait for, renew and keep a lock.

use std::time::Duration;

/// When a [`LockGuard`](crate::LockGuard) renews its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Renewal {
    /// Every third of the TTL (the default): two renewals may fail before the
    /// lease runs out.
    #[default]
    ThirdOfTtl,
    /// At a fixed period (must be shorter than the TTL to be useful).
    Every(Duration),
    /// Never: the lock expires after its TTL unless released sooner.
    Off,
}

/// Options for one acquisition through a [`Locker`](crate::Locker).
///
/// ```
/// use std::time::Duration;
/// use lock_core::LockOptions;
/// let options = LockOptions::new(Duration::from_secs(30))
///     .wait(Duration::from_secs(5))          // wait up to 5 s if held
///     .max_hold(Duration::from_secs(600))    // stop renewing after 10 min
///     .hold_at_least(Duration::from_secs(20)); // keep it 20 s even if the job is quicker
/// assert_eq!(options.ttl(), Duration::from_secs(30));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockOptions {
    ttl: Duration,
    wait: Duration,
    renewal: Renewal,
    max_hold: Option<Duration>,
    hold_at_least: Option<Duration>,
}

impl LockOptions {
    /// Hold for `ttl` per lease (renewed by the guard), do not wait, renew
    /// every `ttl / 3`, no max hold, no hold-at-least.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            wait: Duration::ZERO,
            renewal: Renewal::default(),
            max_hold: None,
            hold_at_least: None,
        }
    }

    /// Wait up to `wait` for a held lock (zero: one attempt).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// How the guard renews its lease.
    pub fn renewal(mut self, renewal: Renewal) -> Self {
        self.renewal = renewal;
        self
    }

    /// Stop renewing after `max_hold` since acquisition (ShedLock's
    /// lockAtMostFor): a hung job cannot keep the lock forever.
    pub fn max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold = Some(max_hold);
        self
    }

    /// On release, keep the lock until `min` has passed since acquisition
    /// (ShedLock's lockAtLeastFor), so instances whose clocks or tickers are
    /// a little late skip the same run.
    pub fn hold_at_least(mut self, min: Duration) -> Self {
        self.hold_at_least = Some(min);
        self
    }

    /// The TTL of each lease.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// How long to wait for a held lock.
    pub fn wait_time(&self) -> Duration {
        self.wait
    }

    /// The renewal policy.
    pub fn renewal_policy(&self) -> Renewal {
        self.renewal
    }

    /// The maximum hold time, if any.
    pub fn max_hold_time(&self) -> Option<Duration> {
        self.max_hold
    }

    /// The minimum hold time, if any.
    pub fn min_hold_time(&self) -> Option<Duration> {
        self.hold_at_least
    }

    /// The renewal period for a lease of `ttl`, or `None` if off.
    pub(crate) fn renew_period(&self, ttl: Duration) -> Option<Duration> {
        match self.renewal {
            Renewal::ThirdOfTtl => Some(ttl / 3),
            Renewal::Every(period) => Some(period),
            Renewal::Off => None,
        }
        .map(|p| p.max(Duration::from_millis(1)))
    }
}
