//! What a backend can do, declared so the suite and the waiting loop adapt.

use std::time::Duration;

use crate::LockError;

/// What a backend declares about itself.
///
/// The conformance suite reads it to decide which cases apply (a case a
/// backend cannot support shows as `ignored` with the reason), and the
/// shared code reads it to round TTLs and to choose how to wait.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::Capabilities;
/// let caps = Capabilities {
///     min_ttl: Duration::from_secs(1),
///     ttl_granularity: Duration::from_secs(1),
///     ..Capabilities::default()
/// };
/// // Shorter TTLs are rounded up, never dropped.
/// assert_eq!(caps.effective_ttl(Duration::from_millis(1500))?, Duration::from_secs(2));
/// assert!(caps.effective_ttl(Duration::ZERO).is_err());
/// # Ok::<(), distlock_core::LockError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// The shortest TTL the server honours; shorter requests are rounded up.
    pub min_ttl: Duration,
    /// TTLs are rounded up to a multiple of this (etcd leases: whole seconds).
    pub ttl_granularity: Duration,
    /// The longest TTL accepted; longer requests are refused as invalid input.
    pub max_ttl: Duration,
    /// The server wakes waiters (pub/sub, watch, NOTIFY) through
    /// [`LockBackend::watch`](crate::LockBackend::watch).
    pub native_wait: bool,
    /// A release wakes only the next waiter (the server keeps the line),
    /// not every waiter of the key: one attempt per release, whatever the
    /// crowd. The suite then checks it (`wait::one_attempt_per_release`).
    pub wakes_one_waiter: bool,
    /// A released key goes to the first waiter of its line, never to
    /// whoever asks first: while the line has a waiter, an attempt by
    /// anyone else (a newcomer, a `try_lock`, the holder that just
    /// released and came straight back) is refused, and joins the line's
    /// end if it waits. The woken waiter keeps its place until it takes
    /// the key, leaves the wait, or its turn runs out (a waiter that was
    /// woken and never came: its client frozen or gone; each backend
    /// bounds the turn and says how). With [`wakes_one_waiter`](Self::wakes_one_waiter),
    /// waiters are served in arrival order even when others keep asking.
    /// The suite then checks it (`handoff::no_cut_in`).
    pub fair_handoff: bool,
    /// How often a waiter retries when the backend has no native wake-up.
    pub retry_interval: Duration,
    /// Lock data (and so fencing order) survives a server restart.
    pub durable: bool,
    /// The most locks one [`LockBackend::extend_many`](crate::LockBackend::extend_many)
    /// call renews in one request. Above 1, guards of one client that
    /// share a TTL renew together, at shared moments; 1 (the default):
    /// each guard renews alone.
    pub extend_batch: usize,
    /// The backend stores a lock's [`HolderId`](crate::HolderId) with it
    /// and shows it in [`LockState::Held`](crate::LockState::Held). The
    /// suite then checks it round-trips (`holder::`).
    pub holder_ids: bool,
    /// The backend stores a permit's [`HolderId`](crate::HolderId) with it
    /// and lists a semaphore's live permits with their labels
    /// ([`LockAdmin::inspect_permits`](crate::LockAdmin::inspect_permits)).
    /// The suite then checks they round-trip
    /// (`holder::permit_labels_round_trip`).
    pub permit_holder_ids: bool,
    /// The server tells observers when who holds a lock changes
    /// ([`LockAdmin::watch_holder`](crate::LockAdmin::watch_holder)
    /// returns a watch): [`Locker::observe`](crate::Locker::observe) is
    /// woken by it rather than by reading every poll interval. The suite
    /// then checks an observer is woken with no poll to fall back on
    /// (`election::observers_woken_by_the_server`).
    pub holder_watch: bool,
    /// Registering a waiter ([`LockBackend::watch`](crate::LockBackend::watch))
    /// costs the server a request of its own (a subscription, a queue
    /// entry written through consensus), which an attempt on a free key
    /// does not need: a waiting acquire then makes its first attempt
    /// before registering, and registers (and attempts again at once)
    /// only when refused. Off (the default): it registers first, so its
    /// first refused attempt already joins the line. Either way no release
    /// is missed: every registration is followed by an attempt.
    pub attempt_before_watch: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Self {
            min_ttl: Duration::from_millis(1),
            ttl_granularity: Duration::from_millis(1),
            max_ttl: Duration::from_secs(365 * 24 * 3600),
            native_wait: false,
            wakes_one_waiter: false,
            fair_handoff: false,
            retry_interval: Duration::from_millis(50),
            durable: false,
            extend_batch: 1,
            holder_ids: false,
            permit_holder_ids: false,
            holder_watch: false,
            attempt_before_watch: false,
        }
    }
}

impl Capabilities {
    /// The TTL the backend will really use for a request of `ttl`: refused if
    /// zero or above [`max_ttl`](Self::max_ttl), raised to
    /// [`min_ttl`](Self::min_ttl), rounded up to the granularity.
    pub fn effective_ttl(&self, ttl: Duration) -> Result<Duration, LockError> {
        if ttl.is_zero() {
            return Err(LockError::invalid_input(
                "TTL is zero; a lock needs a positive time to live",
            ));
        }
        if ttl > self.max_ttl {
            return Err(LockError::invalid_input(format!(
                "TTL {ttl:?} is above this backend's maximum of {:?}; use a shorter TTL and let the guard renew it",
                self.max_ttl
            )));
        }
        let ttl = ttl.max(self.min_ttl);
        let step = self.ttl_granularity.as_nanos().max(1);
        let rounded = ttl.as_nanos().div_ceil(step) * step;
        // Cannot overflow: max_ttl bounds ttl and is itself a Duration.
        Ok(Duration::from_nanos(
            u64::try_from(rounded).unwrap_or(u64::MAX),
        ))
    }
}
