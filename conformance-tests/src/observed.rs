//! A backend wrapper that lets a test see what went through it, and bend it:
//! late replies, held requests, injected errors.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock_core::{
    AcquireReply, AcquireRequest, Capabilities, ErrorKind, ExtendReply, FencingToken, Grant,
    HeldLock, LockAdmin, LockBackend, LockClient, LockError, LockKey, LockState, OwnerToken,
    PermitReply, PermitRequest, PermitState, ReleaseReply, ReleaseWatch, SemaphoreBackend,
};
use tokio::sync::Notify;

/// Which calls of the wrapped backend a fault applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    /// `acquire` (every attempt: `try_acquire`, `try_acquire_renewing`, and
    /// each attempt of a waiting acquire).
    Acquire,
    /// `extend` (renewals, hold-at-least).
    Extend,
    /// `release`.
    Release,
    /// `watch` and `watch_permits` (a waiter's registration; only requests
    /// are held).
    Watch,
}

/// Where a held call waits: before the request reaches the backend, or
/// after the backend answered (the server acted; the answer is late).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Point {
    Request,
    Reply,
    /// The reply of an attempt in line ([`ObservedLock::attempts_in_line`]).
    InLineReply,
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

impl Faults {
    /// Whether any fault is set for `call`.
    fn touch(&self, call: Call) -> bool {
        self.holds.keys().any(|(held, _)| *held == call)
            || self.reply_delays.contains_key(&call)
            || self.failures.iter().any(|(failing, _, _)| *failing == call)
    }
}

/// A lock the backend granted through an [`ObservedLock`]: enough to act
/// on it at the raw level ([`ObservedLock::release_behind`]), as a holder
/// that was never told would.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Granted {
    key: LockKey,
    owner: OwnerToken,
    grant: Grant,
    /// A semaphore permit rather than the lock.
    permit: bool,
}

impl Granted {
    /// The key granted.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// Its fencing token.
    pub fn fencing_token(&self) -> FencingToken {
        self.grant.fencing
    }

    /// The raw lock, as the backend's `extend`/`release` take it.
    pub fn held(&self) -> HeldLock<'_> {
        HeldLock {
            key: &self.key,
            owner: self.owner,
            fencing: self.grant.fencing,
            handle: self.grant.handle,
        }
    }
}

/// Forwards every [`LockBackend`] call — the provided ones too, so the
/// backend's own `watch` and admin calls still run — and counts acquisition
/// attempts and remembers the grants, so a test can count a waiter's
/// attempts or release a guard's lock behind its back.
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
/// use distlock_conformance::ObservedLock;
/// use distlock_core::{Locker, LockKey, LockOptions, MemoryLock};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock_core::LockError> {
/// let observed = Arc::new(ObservedLock::new(MemoryLock::new()));
/// let guard = Locker::new(observed.clone())
///     .try_lock(&LockKey::new("job")?, &LockOptions::new(std::time::Duration::from_secs(5)))
///     .await?
///     .expect("free");
/// assert_eq!(observed.attempts(), 1);
/// assert_eq!(observed.last_granted().map(|l| l.fencing_token()), Some(guard.fencing_token()));
/// # Ok(()) }
/// ```
pub struct ObservedLock {
    inner: Arc<dyn LockBackend>,
    attempts: AtomicU64,
    attempts_in_line: AtomicU64,
    /// Owner tokens a watch (of the lock or of permits) was registered for.
    watched: Mutex<HashSet<OwnerToken>>,
    granted: Mutex<Vec<Granted>>,
    faults: Mutex<Faults>,
    opened: Notify,
    /// The most locks one `extend_many` call carried.
    largest_extend_batch: AtomicUsize,
    /// `inspect` calls the backend answered.
    inspects: AtomicU64,
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
    /// Wraps the backend of `client` (a [`LockClient`] or any backend).
    /// Use it through a client of its own (`LockClient::new(observed)` or
    /// `Locker::new(observed)`).
    pub fn new(client: impl Into<LockClient>) -> Self {
        Self {
            inner: client.into().backend().clone(),
            attempts: AtomicU64::new(0),
            attempts_in_line: AtomicU64::new(0),
            watched: Mutex::new(HashSet::new()),
            granted: Mutex::new(Vec::new()),
            faults: Mutex::new(Faults::default()),
            opened: Notify::new(),
            largest_extend_batch: AtomicUsize::new(0),
            inspects: AtomicU64::new(0),
        }
    }

    /// Acquisition attempts so far (`try_acquire` and `try_acquire_renewing`).
    pub fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::SeqCst)
    }

    /// Acquisition attempts that may join a waiter line: all of them,
    /// except, where the backend declares
    /// [`attempt_before_watch`](Capabilities::attempt_before_watch), those
    /// made before their owner registered a watch (a waiting acquire's
    /// first attempt, which never joins a line). A waiter whose first such
    /// attempt was refused is in line.
    pub fn attempts_in_line(&self) -> u64 {
        self.attempts_in_line.load(Ordering::SeqCst)
    }

    /// Holds the replies of the attempts in line
    /// ([`attempts_in_line`](Self::attempts_in_line)) until
    /// [`open`](Self::open)`(Call::Acquire)`, as
    /// [`hold_replies`](Self::hold_replies) holds every reply.
    pub fn hold_replies_in_line(&self) {
        self.faults()
            .holds
            .insert((Call::Acquire, Point::InLineReply), 0);
    }

    /// Whether an attempt of `owner` now may join a line (see
    /// [`attempts_in_line`](Self::attempts_in_line)).
    fn in_line(&self, owner: OwnerToken) -> bool {
        !self.inner.capabilities().attempt_before_watch
            || self
                .watched
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&owner)
    }

    fn watched(&self, owner: OwnerToken) {
        self.watched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(owner);
    }

    /// Counts one attempt (`in_line`: see [`in_line`](Self::in_line)), and
    /// holds the reply of one in line while told to.
    async fn attempted(&self, in_line: bool) {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        if in_line {
            self.attempts_in_line.fetch_add(1, Ordering::SeqCst);
            self.gate(Call::Acquire, Point::InLineReply).await;
        }
    }

    /// `inspect` calls answered so far (counted once the backend replied,
    /// so a change made after the count moved is one that read missed).
    pub fn inspects(&self) -> u64 {
        self.inspects.load(Ordering::SeqCst)
    }

    /// The most locks one batched renewal
    /// ([`LockBackend::extend_many`]) carried through this wrapper.
    pub fn largest_extend_batch(&self) -> usize {
        self.largest_extend_batch.load(Ordering::SeqCst)
    }

    /// The last lock granted through this wrapper.
    pub fn last_granted(&self) -> Option<Granted> {
        self.granted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .last()
            .cloned()
    }

    /// Every lock granted through this wrapper, oldest first (recorded
    /// when the backend answered, before any delay or hold of the reply).
    pub fn granted(&self) -> Vec<Granted> {
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

    /// Releases `granted` at the raw level, bypassing whatever client and
    /// guard hold it (a lock deleted behind its holder's back).
    pub async fn release_behind(&self, granted: &Granted) -> Result<(), LockError> {
        let reply = match (granted.permit, self.inner.semaphore()) {
            (true, Some(semaphore)) => semaphore.release_permit(granted.held()).await?,
            _ => self.inner.release(granted.held()).await?,
        };
        match reply {
            // A resend that found it gone: most likely released by the
            // first send, and the holder is not told either way.
            ReleaseReply::Released | ReleaseReply::NotHeldAfterResend => Ok(()),
            ReleaseReply::NotHeld => Err(LockError::not_held(format!(
                "lock {:?} was no longer held when released behind its holder's back",
                granted.key.as_str()
            ))),
        }
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
        request: &AcquireRequest<'_>,
        reply: Result<AcquireReply, LockError>,
    ) -> Result<AcquireReply, LockError> {
        if let Ok(AcquireReply::Granted(grant)) = &reply {
            self.record(request.key, request.owner, *grant, false);
        }
        reply
    }

    /// Records one attempt that was granted `grant`.
    fn record(&self, key: &LockKey, owner: OwnerToken, grant: Grant, permit: bool) {
        self.granted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Granted {
                key: key.clone(),
                owner,
                grant,
                permit,
            });
    }
}

#[deny(clippy::missing_trait_methods)]
#[distlock_core::async_trait]
impl LockBackend for ObservedLock {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<AcquireReply, LockError> {
        let in_line = self.in_line(request.owner);
        self.around(Call::Acquire, request.key, async {
            let reply = self.observe(&request, self.inner.acquire(request).await);
            self.attempted(in_line).await;
            reply
        })
        .await
    }

    async fn extend(&self, lock: HeldLock<'_>, ttl: Duration) -> Result<ExtendReply, LockError> {
        self.around(Call::Extend, lock.key, self.inner.extend(lock, ttl))
            .await
    }

    async fn extend_many(
        &self,
        locks: &[HeldLock<'_>],
        ttl: Duration,
    ) -> Result<Vec<Result<ExtendReply, LockError>>, LockError> {
        self.largest_extend_batch
            .fetch_max(locks.len(), Ordering::SeqCst);
        if !self.faults().touch(Call::Extend) {
            return self.inner.extend_many(locks, ttl).await;
        }
        // Faults act per lock: one call each.
        let mut replies = Vec::with_capacity(locks.len());
        for lock in locks {
            replies.push(self.extend(*lock, ttl).await);
        }
        Ok(replies)
    }

    async fn release(&self, lock: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        self.around(Call::Release, lock.key, self.inner.release(lock))
            .await
    }

    async fn watch(
        &self,
        key: &LockKey,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        self.gate(Call::Watch, Point::Request).await;
        self.watched(waiter);
        self.inner.watch(key, waiter).await
    }

    fn admin(&self) -> Option<&dyn LockAdmin> {
        self.inner.admin().map(|_| self as &dyn LockAdmin)
    }

    fn semaphore(&self) -> Option<&dyn SemaphoreBackend> {
        self.inner
            .semaphore()
            .map(|_| self as &dyn SemaphoreBackend)
    }
}

/// Counts inspects; the rest goes straight through.
#[deny(clippy::missing_trait_methods)]
#[distlock_core::async_trait]
impl LockAdmin for ObservedLock {
    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        let state = self.inner.admin().ok_or_else(no_admin)?.inspect(key).await;
        self.inspects.fetch_add(1, Ordering::SeqCst);
        state
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        self.inner
            .admin()
            .ok_or_else(no_admin)?
            .force_release(key)
            .await
    }

    async fn watch_holder(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        self.inner
            .admin()
            .ok_or_else(no_admin)?
            .watch_holder(key)
            .await
    }

    async fn inspect_permits(&self, key: &LockKey) -> Result<Vec<PermitState>, LockError> {
        self.inner
            .admin()
            .ok_or_else(no_admin)?
            .inspect_permits(key)
            .await
    }
}

/// Permits go through the same counts and faults as the lock's calls.
#[deny(clippy::missing_trait_methods)]
#[distlock_core::async_trait]
impl SemaphoreBackend for ObservedLock {
    async fn acquire_permit(&self, request: PermitRequest<'_>) -> Result<PermitReply, LockError> {
        let semaphore = self.inner.semaphore().ok_or_else(no_semaphore)?;
        let in_line = self.in_line(request.owner);
        self.around(Call::Acquire, request.key, async {
            let reply = semaphore.acquire_permit(request).await;
            if let Ok(PermitReply::Granted(grant)) = &reply {
                self.record(request.key, request.owner, *grant, true);
            }
            self.attempted(in_line).await;
            reply
        })
        .await
    }

    async fn extend_permit(
        &self,
        permit: HeldLock<'_>,
        ttl: Duration,
    ) -> Result<ExtendReply, LockError> {
        let semaphore = self.inner.semaphore().ok_or_else(no_semaphore)?;
        self.around(
            Call::Extend,
            permit.key,
            semaphore.extend_permit(permit, ttl),
        )
        .await
    }

    async fn release_permit(&self, permit: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let semaphore = self.inner.semaphore().ok_or_else(no_semaphore)?;
        self.around(Call::Release, permit.key, semaphore.release_permit(permit))
            .await
    }

    async fn watch_permits(
        &self,
        key: &LockKey,
        limit: u32,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        self.gate(Call::Watch, Point::Request).await;
        self.watched(waiter);
        self.inner
            .semaphore()
            .ok_or_else(no_semaphore)?
            .watch_permits(key, limit, waiter)
            .await
    }
}

fn no_admin() -> LockError {
    LockError::unsupported("the wrapped backend has no operator calls")
}

fn no_semaphore() -> LockError {
    LockError::unsupported("the wrapped backend has no semaphores")
}
