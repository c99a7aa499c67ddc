//! A backend wrapper that lets a test see what went through it, and bend it:
//! late replies, held requests, injected errors.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_core::{
    AcquireAttempt, Capabilities, DistributedLock, ErrorKind, Lease, LockError, LockKey, LockState,
    ReleaseWatch,
};
use tokio::sync::Notify;

/// Which calls of the wrapped backend a fault applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    /// `try_acquire` and `try_acquire_renewing` (so also every attempt of a
    /// waiting `acquire`).
    Acquire,
    /// `extend` (renewals, hold-at-least).
    Extend,
    /// `release`.
    Release,
}

/// Where a held call waits: before the request reaches the backend, or
/// after the backend answered (the server acted; the answer is late).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Point {
    Request,
    Reply,
}

#[derive(Default)]
struct Faults {
    /// Calls held at a point until [`ObservedLock::open`].
    holds: HashMap<(Call, Point), usize>,
    /// Calls waiting at a hold right now.
    waiting: HashMap<Call, usize>,
    reply_delays: HashMap<Call, Duration>,
    /// One-shot errors per call and key.
    failures: Vec<(Call, LockKey, ErrorKind)>,
}

/// Forwards every [`DistributedLock`] call — the provided ones too, so the
/// backend's own `try_acquire_renewing`, `inspect` and `force_release` still
/// run (`acquire` keeps the shared loop, over this wrapper, so its attempts
/// are counted) — and counts acquisition attempts and remembers the
/// leases granted, so a test can count a waiter's attempts or release a
/// guard's lease behind its back.
///
/// Faults a test can inject, for any backend: a reply delayed after the
/// server acted ([`delay_replies`](Self::delay_replies)), requests or
/// replies held until the test opens them ([`hold_requests`](Self::hold_requests),
/// [`hold_replies`](Self::hold_replies), [`open`](Self::open), with
/// [`waiting`](Self::waiting) to see a call arrive), and a one-shot error on
/// a key ([`fail_next`](Self::fail_next)).
///
/// ```
/// use std::sync::Arc;
/// use conformance_tests::ObservedLock;
/// use lock_core::{Locker, LockKey, LockOptions, MemoryLock};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_core::LockError> {
/// let observed = Arc::new(ObservedLock::new(Arc::new(MemoryLock::new())));
/// let guard = Locker::new(observed.clone())
///     .try_lock(&LockKey::new("job")?, &LockOptions::new(std::time::Duration::from_secs(5)))
///     .await?
///     .expect("free");
/// assert_eq!(observed.attempts(), 1);
/// assert_eq!(observed.last_granted().map(|l| l.fencing_token()), Some(guard.fencing_token()));
/// # Ok(()) }
/// ```
pub struct ObservedLock {
    inner: Arc<dyn DistributedLock>,
    attempts: AtomicU64,
    granted: Mutex<Vec<Lease>>,
    faults: Mutex<Faults>,
    opened: Notify,
}

impl fmt::Debug for ObservedLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObservedLock")
            .field("inner", &self.inner)
            .field("attempts", &self.attempts())
            .finish_non_exhaustive()
    }
}

/// Counts a call as waiting at a hold while it lives (also if its future
/// is dropped there).
struct Waiting<'a> {
    lock: &'a ObservedLock,
    call: Call,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut faults = self.lock.faults();
        if let Some(n) = faults.waiting.get_mut(&self.call) {
            *n = n.saturating_sub(1);
        }
    }
}

impl ObservedLock {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn DistributedLock>) -> Self {
        Self {
            inner,
            attempts: AtomicU64::new(0),
            granted: Mutex::new(Vec::new()),
            faults: Mutex::new(Faults::default()),
            opened: Notify::new(),
        }
    }

    /// Acquisition attempts so far (`try_acquire` and `try_acquire_renewing`).
    pub fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::SeqCst)
    }

    /// The last lease granted through this wrapper.
    pub fn last_granted(&self) -> Option<Lease> {
        self.granted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .last()
            .cloned()
    }

    /// Every lease granted through this wrapper, oldest first (recorded
    /// when the backend answered, before any delay or hold of the reply).
    pub fn granted(&self) -> Vec<Lease> {
        self.granted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Delays every later reply of `call` by `delay` after the backend
    /// answered: the server acted, the caller learns it late (a slow
    /// network or a stalled client). Zero removes the delay.
    pub fn delay_replies(&self, call: Call, delay: Duration) {
        self.faults().reply_delays.insert(call, delay);
    }

    /// Holds every later `call` before it reaches the backend, until
    /// [`open`](Self::open).
    pub fn hold_requests(&self, call: Call) {
        self.faults().holds.insert((call, Point::Request), 0);
    }

    /// Forwards every later `call` but holds its reply until
    /// [`open`](Self::open): the server has acted, the caller does not know.
    pub fn hold_replies(&self, call: Call) {
        self.faults().holds.insert((call, Point::Reply), 0);
    }

    /// Lets every held `call` go on, and later ones through.
    pub fn open(&self, call: Call) {
        self.faults().holds.retain(|(held, _), _| *held != call);
        self.opened.notify_waiters();
    }

    /// How many `call`s wait at a hold right now.
    pub fn waiting(&self, call: Call) -> usize {
        self.faults().waiting.get(&call).copied().unwrap_or(0)
    }

    /// Waits until at least `n` `call`s wait at a hold (a fact to wait for
    /// instead of a sleep).
    pub async fn until_waiting(&self, call: Call, n: usize) {
        while self.waiting(call) < n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Fails the next `call` on `key` with an error of `kind`, without
    /// forwarding it (the server never sees it).
    pub fn fail_next(&self, call: Call, key: &LockKey, kind: ErrorKind) {
        self.faults().failures.push((call, key.clone(), kind));
    }

    fn faults(&self) -> std::sync::MutexGuard<'_, Faults> {
        self.faults.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn injected(&self, call: Call, key: &LockKey) -> Result<(), LockError> {
        let mut faults = self.faults();
        match faults
            .failures
            .iter()
            .position(|(c, k, _)| *c == call && k == key)
        {
            Some(i) => {
                let (_, _, kind) = faults.failures.remove(i);
                Err(LockError::new(
                    kind,
                    format!("injected by ObservedLock into {call:?} of {key:?}"),
                ))
            }
            None => Ok(()),
        }
    }

    async fn gate(&self, call: Call, point: Point) {
        let mut counted = None;
        loop {
            let opened = self.opened.notified();
            tokio::pin!(opened);
            // Registered before the check, so an open() in between wakes it.
            opened.as_mut().enable();
            {
                let mut faults = self.faults();
                if !faults.holds.contains_key(&(call, point)) {
                    return;
                }
                if counted.is_none() {
                    *faults.waiting.entry(call).or_default() += 1;
                    counted = Some(Waiting { lock: self, call });
                }
            }
            opened.await;
        }
    }

    /// Runs one forwarded call through the faults set for `call`.
    async fn around<T, F>(&self, call: Call, key: &LockKey, forward: F) -> Result<T, LockError>
    where
        F: std::future::Future<Output = Result<T, LockError>>,
    {
        self.gate(call, Point::Request).await;
        self.injected(call, key)?;
        let result = forward.await;
        let delay = self.faults().reply_delays.get(&call).copied();
        if let Some(delay) = delay.filter(|d| !d.is_zero()) {
            tokio::time::sleep(delay).await;
        }
        self.gate(call, Point::Reply).await;
        result
    }

    fn observe(
        &self,
        attempt: Result<AcquireAttempt, LockError>,
    ) -> Result<AcquireAttempt, LockError> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        if let Ok(AcquireAttempt::Acquired(lease)) = &attempt {
            self.granted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(lease.clone());
        }
        attempt
    }
}

#[lock_core::async_trait]
impl DistributedLock for ObservedLock {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<AcquireAttempt, LockError> {
        self.around(Call::Acquire, key, async {
            self.observe(self.inner.try_acquire(key, ttl).await)
        })
        .await
    }

    async fn try_acquire_renewing(
        &self,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<AcquireAttempt, LockError> {
        self.around(Call::Acquire, key, async {
            self.observe(self.inner.try_acquire_renewing(key, ttl).await)
        })
        .await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease, LockError> {
        self.around(Call::Extend, lease.key(), self.inner.extend(lease, ttl))
            .await
    }

    async fn release(&self, lease: &Lease) -> Result<(), LockError> {
        self.around(Call::Release, lease.key(), self.inner.release(lease))
            .await
    }

    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        self.inner.inspect(key).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        self.inner.force_release(key).await
    }

    async fn watch(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        self.inner.watch(key).await
    }
}
