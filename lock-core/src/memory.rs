//! The in-process backend: real TTL, owner-token, fencing and wake-up
//! semantics in a map, for tests and single-process programs.

mod line;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::lease::later;

use crate::{
    AcquireReply, AcquireRequest, BackendDescriptor, Capabilities, Connecting, ExtendReply,
    FencingToken, Grant, HeldLock, HolderId, LockAdmin, LockBackend, LockClient, LockError,
    LockKey, LockState, OwnerToken, PermitReply, PermitRequest, PermitState, ReleaseNotifier,
    ReleaseReply, ReleaseWatch, SemaphoreBackend,
};
use line::Lines;

#[derive(Debug)]
struct Held {
    owner: OwnerToken,
    fencing: FencingToken,
    expires_at: Instant,
    holder: Option<HolderId>,
}

/// One semaphore: its limit and its permits (live or not yet swept).
#[derive(Debug)]
struct Semaphore {
    limit: u32,
    permits: Vec<Held>,
}

#[derive(Debug)]
struct Store {
    locks: Mutex<HashMap<LockKey, Held>>,
    semaphores: Mutex<HashMap<LockKey, Semaphore>>,
    /// The semaphores' waiter lines.
    permit_lines: Lines,
    /// One counter for every key: strictly increasing per key, and no state
    /// left behind for keys nobody holds.
    fencing: AtomicU64,
    /// The locks' waiter lines.
    lock_lines: Lines,
    /// Observers of who holds a lock, told of every take and release.
    observers: ReleaseNotifier,
}

impl Default for Store {
    fn default() -> Self {
        Self {
            locks: Mutex::default(),
            semaphores: Mutex::default(),
            permit_lines: Lines::default(),
            fencing: AtomicU64::default(),
            lock_lines: Lines::fair(),
            observers: ReleaseNotifier::default(),
        }
    }
}

impl Store {
    fn locks(&self) -> std::sync::MutexGuard<'_, HashMap<LockKey, Held>> {
        self.locks.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn semaphores(&self) -> std::sync::MutexGuard<'_, HashMap<LockKey, Semaphore>> {
        self.semaphores.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `key`'s lock is free.
    fn lock_free(&self, key: &LockKey) -> bool {
        let now = Instant::now();
        self.locks().get(key).is_none_or(|h| h.expires_at <= now)
    }

    /// Whether `key`'s semaphore has a permit free.
    fn permit_free(&self, key: &LockKey) -> bool {
        let now = Instant::now();
        self.semaphores().get(key).is_none_or(|s| {
            s.permits.iter().filter(|p| p.expires_at > now).count() < s.limit as usize
        })
    }

    fn next_fencing(&self) -> FencingToken {
        FencingToken::new(self.fencing.fetch_add(1, Ordering::SeqCst) + 1)
    }
}

/// The live permit `permit` names, if it holds one.
fn live_permit<'a>(
    semaphores: &'a mut HashMap<LockKey, Semaphore>,
    permit: &HeldLock<'_>,
    now: Instant,
) -> Option<&'a mut Held> {
    semaphores
        .get_mut(permit.key)?
        .permits
        .iter_mut()
        .find(|p| p.owner == permit.owner && p.fencing == permit.fencing && p.expires_at > now)
}

/// [`MemoryLock::DESCRIPTOR`]'s connect: a client of the process-wide
/// server named by what follows `memory://`.
fn connect_named(url: &str) -> Connecting<'_> {
    Box::pin(async move {
        match url.split_once("://") {
            Some((scheme, name)) if scheme.eq_ignore_ascii_case("memory") => {
                Ok(named_server(name).client())
            }
            _ => Err(LockError::config(format!("{url:?} is not a memory:// URL"))),
        }
    })
}

/// The process-wide in-memory server called `name`.
fn named_server(name: &str) -> MemoryLock {
    static SERVERS: OnceLock<Mutex<HashMap<String, MemoryLock>>> = OnceLock::new();
    let servers = SERVERS.get_or_init(Default::default);
    let mut servers = servers.lock().unwrap_or_else(|e| e.into_inner());
    servers.entry(name.to_owned()).or_default().clone()
}

/// An in-memory lock server, shared by every clone.
///
/// It is a product backend, not a test double: it passes the whole
/// conformance suite. Time is the process's monotonic clock; a release
/// wakes the first waiter of the key alone, and a free key goes to that
/// waiter, never to whoever asks first (it keeps its turn for 5 s, or
/// until its wait ends); the map holds only live locks. An acquire (or permit
/// attempt) by the owner token that holds the key adopts that lock, as
/// the [`LockBackend`] contract asks. Each
/// [`client`](MemoryLock::client) is a separate client of the same server,
/// as a separate process would have.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::{Locker, LockKey, LockOptions, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock_core::LockError> {
/// let server = MemoryLock::new();
/// let worker_a = Locker::new(server.client());
/// let worker_b = Locker::new(server.client());
/// let key = LockKey::new("nightly-report")?;
/// let options = LockOptions::new(Duration::from_secs(30));
/// let guard = worker_a.try_lock(&key, &options).await?.expect("free");
/// assert!(worker_b.try_lock(&key, &options).await?.is_none());
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default)]
pub struct MemoryLock {
    store: Arc<Store>,
}

impl MemoryLock {
    /// The in-memory backend as the `distlock` facade opens it:
    /// `memory://NAME` URLs, where clients of one process share one server
    /// per name (`memory://` is the name "").
    ///
    /// ```
    /// use std::time::Duration;
    /// use distlock_core::{LockKey, MemoryLock};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock_core::LockError> {
    /// let a = MemoryLock::DESCRIPTOR.connect("memory://jobs").await?;
    /// let b = MemoryLock::DESCRIPTOR.connect("memory://jobs").await?;
    /// let key = LockKey::new("report")?;
    /// let ttl = Duration::from_secs(10);
    /// let lease = a.try_acquire(&key, ttl).await?.lease().expect("free");
    /// assert!(b.try_acquire(&key, ttl).await?.lease().is_none(), "one server per name");
    /// # a.release(&lease).await?;
    /// # Ok(()) }
    /// ```
    pub const DESCRIPTOR: BackendDescriptor =
        BackendDescriptor::new("memory", &["memory"], connect_named);

    /// A new, empty lock server.
    pub fn new() -> Self {
        Self::default()
    }

    /// A new client of this server: leases it issues are refused by other
    /// clients.
    pub fn client(&self) -> LockClient {
        LockClient::new(self.clone())
    }

    /// How many keys are held right now (expired ones not counted).
    pub fn held_count(&self) -> usize {
        let now = Instant::now();
        self.store
            .locks()
            .values()
            .filter(|h| h.expires_at > now)
            .count()
    }

    /// The live lock at `lock.key` if `lock` holds it.
    fn owned<'a>(
        locks: &'a mut HashMap<LockKey, Held>,
        lock: &HeldLock<'_>,
        now: Instant,
    ) -> Option<&'a mut Held> {
        locks.get_mut(lock.key).filter(|held| {
            held.owner == lock.owner && held.fencing == lock.fencing && held.expires_at > now
        })
    }

    /// Resets `lock`'s TTL to `ttl` from `now` if this owner holds it.
    fn extend_held(
        locks: &mut HashMap<LockKey, Held>,
        lock: &HeldLock<'_>,
        ttl: Duration,
        now: Instant,
    ) -> ExtendReply {
        match Self::owned(locks, lock, now) {
            Some(held) => {
                held.expires_at = later(now, ttl);
                ExtendReply::Extended(Grant::new(lock.fencing, ttl))
            }
            None => ExtendReply::NotHeld,
        }
    }
}

/// The most locks one `extend_many` call renews (one pass under the lock).
const MEMORY_EXTEND_BATCH: usize = 1024;

#[async_trait]
impl LockBackend for MemoryLock {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            native_wait: true,
            wakes_one_waiter: true,
            fair_handoff: true,
            extend_batch: MEMORY_EXTEND_BATCH,
            holder_ids: true,
            permit_holder_ids: true,
            holder_watch: true,
            ..Capabilities::default()
        }
    }

    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<AcquireReply, LockError> {
        let now = Instant::now();
        let mut locks = self.store.locks();
        if let Some(held) = locks.get_mut(request.key) {
            if held.expires_at > now {
                if held.owner == request.owner {
                    // An earlier attempt of this acquisition took it unseen:
                    // adopted, its TTL reset from now.
                    held.expires_at = later(now, request.ttl);
                    self.store.lock_lines.leave(request.key, request.owner);
                    return Ok(AcquireReply::Granted(Grant::new(held.fencing, request.ttl)));
                }
                self.store.lock_lines.refused(request.key, request.owner);
                return Ok(AcquireReply::Held {
                    expires_in: Some(held.expires_at - now),
                });
            }
        }
        // Free: it goes to the first waiter of its line alone.
        if let Err(turn_left) = self.store.lock_lines.admits(request.key, request.owner) {
            self.store.lock_lines.refused(request.key, request.owner);
            return Ok(AcquireReply::Held {
                expires_in: Some(turn_left),
            });
        }
        // Keep the map to live locks: sweep expired entries when it has grown.
        if locks.len() >= 1024 && locks.len().is_power_of_two() {
            locks.retain(|_, h| h.expires_at > now);
        }
        let fencing = FencingToken::new(self.store.fencing.fetch_add(1, Ordering::SeqCst) + 1);
        locks.insert(
            request.key.clone(),
            Held {
                owner: request.owner,
                fencing,
                expires_at: later(now, request.ttl),
                holder: request.holder.cloned(),
            },
        );
        drop(locks);
        self.store.lock_lines.leave(request.key, request.owner);
        self.store.observers.notify(request.key.as_str());
        Ok(AcquireReply::Granted(Grant::new(fencing, request.ttl)))
    }

    async fn extend(&self, lock: HeldLock<'_>, ttl: Duration) -> Result<ExtendReply, LockError> {
        let now = Instant::now();
        Ok(Self::extend_held(&mut self.store.locks(), &lock, ttl, now))
    }

    async fn extend_many(
        &self,
        locks: &[HeldLock<'_>],
        ttl: Duration,
    ) -> Result<Vec<Result<ExtendReply, LockError>>, LockError> {
        let now = Instant::now();
        let mut held = self.store.locks();
        Ok(locks
            .iter()
            .map(|lock| Ok(Self::extend_held(&mut held, lock, ttl, now)))
            .collect())
    }

    async fn release(&self, lock: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let now = Instant::now();
        {
            let mut locks = self.store.locks();
            if Self::owned(&mut locks, &lock, now).is_none() {
                return Ok(ReleaseReply::NotHeld);
            }
            locks.remove(lock.key);
        }
        self.store.observers.notify(lock.key.as_str());
        self.store.lock_lines.wake_next(lock.key);
        Ok(ReleaseReply::Released)
    }

    async fn watch(
        &self,
        key: &LockKey,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        let mut watch = self.store.lock_lines.watch(key, waiter).await?;
        let (store, key) = (self.store.clone(), key.clone());
        // A waiter that leaves may have taken a wake-up with it: passed on
        // while the key is free.
        watch.leave_with(async move {
            store.lock_lines.leave(&key, waiter);
            if store.lock_free(&key) {
                store.lock_lines.wake_next(&key);
            }
        });
        Ok(Some(watch))
    }

    fn admin(&self) -> Option<&dyn LockAdmin> {
        Some(self)
    }

    fn semaphore(&self) -> Option<&dyn SemaphoreBackend> {
        Some(self)
    }
}

#[async_trait]
impl SemaphoreBackend for MemoryLock {
    async fn acquire_permit(&self, request: PermitRequest<'_>) -> Result<PermitReply, LockError> {
        let now = Instant::now();
        let mut semaphores = self.store.semaphores();
        let semaphore = semaphores
            .entry(request.key.clone())
            .or_insert_with(|| Semaphore {
                limit: request.limit,
                permits: Vec::new(),
            });
        semaphore.permits.retain(|p| p.expires_at > now);
        if semaphore.permits.is_empty() {
            // Nobody holds a permit: the new limit applies.
            semaphore.limit = request.limit;
        } else if semaphore.limit != request.limit {
            return Ok(PermitReply::LimitMismatch {
                stored: semaphore.limit,
            });
        }
        if let Some(own) = semaphore
            .permits
            .iter_mut()
            .find(|p| p.owner == request.owner)
        {
            // This owner's permit, taken by an earlier attempt unseen:
            // adopted, its TTL reset from now (never a second permit).
            own.expires_at = later(now, request.ttl);
            self.store.permit_lines.leave(request.key, request.owner);
            return Ok(PermitReply::Granted(Grant::new(own.fencing, request.ttl)));
        }
        if semaphore.permits.len() >= semaphore.limit as usize {
            self.store.permit_lines.refused(request.key, request.owner);
            let first_out = semaphore.permits.iter().map(|p| p.expires_at).min();
            return Ok(PermitReply::Full {
                expires_in: first_out.map(|at| at - now),
            });
        }
        let fencing = self.store.next_fencing();
        semaphore.permits.push(Held {
            owner: request.owner,
            fencing,
            expires_at: later(now, request.ttl),
            holder: request.holder.cloned(),
        });
        self.store.permit_lines.leave(request.key, request.owner);
        Ok(PermitReply::Granted(Grant::new(fencing, request.ttl)))
    }

    async fn extend_permit(
        &self,
        permit: HeldLock<'_>,
        ttl: Duration,
    ) -> Result<ExtendReply, LockError> {
        let now = Instant::now();
        let mut semaphores = self.store.semaphores();
        Ok(match live_permit(&mut semaphores, &permit, now) {
            Some(held) => {
                held.expires_at = later(now, ttl);
                ExtendReply::Extended(Grant::new(permit.fencing, ttl))
            }
            None => ExtendReply::NotHeld,
        })
    }

    async fn release_permit(&self, permit: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let now = Instant::now();
        {
            let mut semaphores = self.store.semaphores();
            if live_permit(&mut semaphores, &permit, now).is_none() {
                return Ok(ReleaseReply::NotHeld);
            }
            if let Some(semaphore) = semaphores.get_mut(permit.key) {
                semaphore
                    .permits
                    .retain(|p| p.owner != permit.owner && p.expires_at > now);
                if semaphore.permits.is_empty() {
                    semaphores.remove(permit.key);
                }
            }
        }
        self.store.permit_lines.wake_next(permit.key);
        Ok(ReleaseReply::Released)
    }

    async fn watch_permits(
        &self,
        key: &LockKey,
        _limit: u32,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        let mut watch = self.store.permit_lines.watch(key, waiter).await?;
        let (store, key) = (self.store.clone(), key.clone());
        // As for the lock's waiters.
        watch.leave_with(async move {
            store.permit_lines.leave(&key, waiter);
            if store.permit_free(&key) {
                store.permit_lines.wake_next(&key);
            }
        });
        Ok(Some(watch))
    }
}

#[async_trait]
impl LockAdmin for MemoryLock {
    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        let now = Instant::now();
        Ok(match self.store.locks().get(key) {
            Some(held) if held.expires_at > now => LockState::Held {
                expires_in: Some(held.expires_at - now),
                fencing_token: held.fencing,
                holder: held.holder.clone(),
            },
            _ => LockState::Free,
        })
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let now = Instant::now();
        let was_held = {
            let mut locks = self.store.locks();
            matches!(locks.remove(key), Some(held) if held.expires_at > now)
        };
        if was_held {
            self.store.observers.notify(key.as_str());
            self.store.lock_lines.wake_next(key);
        }
        Ok(was_held)
    }

    async fn watch_holder(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        let watch = self
            .store
            .observers
            .subscribe(key.as_str(), || async { Ok(()) })
            .await?;
        Ok(Some(watch))
    }

    async fn inspect_permits(&self, key: &LockKey) -> Result<Vec<PermitState>, LockError> {
        let now = Instant::now();
        let semaphores = self.store.semaphores();
        let Some(semaphore) = semaphores.get(key) else {
            return Ok(Vec::new());
        };
        // Each permit's label is its own acquisition's: it lives and goes
        // with the permit.
        let mut permits: Vec<PermitState> = semaphore
            .permits
            .iter()
            .filter(|p| p.expires_at > now)
            .map(|p| PermitState {
                fencing_token: p.fencing,
                expires_in: Some(p.expires_at - now),
                limit: semaphore.limit,
                holder: p.holder.clone(),
            })
            .collect();
        permits.sort_by_key(|p| p.fencing_token);
        Ok(permits)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    /// Waits that end — served, cancelled, out of time — leave nothing in
    /// the lines.
    #[tokio::test]
    async fn ended_waits_leave_the_lines_empty() {
        let server = MemoryLock::new();
        let (holder, waiter) = (server.client(), server.client());
        let key = LockKey::new("k").unwrap();
        let ttl = Duration::from_secs(30);
        let lease = holder
            .try_acquire(&key, ttl)
            .await
            .unwrap()
            .lease()
            .unwrap();
        // Out of time, while queued.
        let soon = Instant::now() + Duration::from_millis(30);
        assert!(waiter.acquire(&key, ttl, soon).await.unwrap().is_none());
        // Cancelled while queued.
        let later = Instant::now() + Duration::from_secs(60);
        let cancelled =
            tokio::time::timeout(Duration::from_millis(30), waiter.acquire(&key, ttl, later)).await;
        assert!(cancelled.is_err());
        // Served.
        let served = {
            let (waiter, key) = (waiter.clone(), key.clone());
            tokio::spawn(async move { waiter.acquire(&key, ttl, later).await })
        };
        while server.store.lock_lines.queued() == 0 {
            tokio::task::yield_now().await;
        }
        holder.release(&lease).await.unwrap();
        let got = served.await.unwrap().unwrap().expect("served");
        waiter.release(&got).await.unwrap();
        // The leave tasks run once their watches are gone.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(server.store.lock_lines.queued(), 0);
    }

    /// A free key goes to the first waiter alone: woken, it keeps its place
    /// while others ask, for its turn only if it never comes; then the next
    /// waiter gets the key and the one that did not come queues again at
    /// the end.
    #[tokio::test]
    async fn a_woken_waiter_keeps_the_key_for_its_turn() {
        let server = MemoryLock::new();
        let key = LockKey::new("k").unwrap();
        let ttl = Duration::from_secs(30);
        let request = |owner| AcquireRequest {
            key: &key,
            owner,
            ttl,
            renewing: false,
            settling: false,
            holder: None,
        };
        let [holder, stuck, next, newcomer] = [(); 4].map(|()| OwnerToken::random());
        let AcquireReply::Granted(grant) = server.acquire(request(holder)).await.unwrap() else {
            panic!("a free key with nobody waiting is granted");
        };
        let mut stuck_watch = server.watch(&key, stuck).await.unwrap().unwrap();
        let _next_watch = server.watch(&key, next).await.unwrap().unwrap();
        for waiter in [stuck, next] {
            let reply = server.acquire(request(waiter)).await.unwrap();
            assert!(matches!(reply, AcquireReply::Held { .. }), "{reply:?}");
        }
        let held = HeldLock {
            key: &key,
            owner: holder,
            fencing: grant.fencing,
            handle: grant.handle,
        };
        assert_eq!(server.release(held).await.unwrap(), ReleaseReply::Released);
        stuck_watch.released().await.unwrap();
        // The woken waiter never comes; everyone else is refused meanwhile,
        // told when its turn ends at the latest.
        let mut turn_left = Duration::ZERO;
        for owner in [next, newcomer, holder] {
            match server.acquire(request(owner)).await.unwrap() {
                AcquireReply::Held {
                    expires_in: Some(left),
                } if left <= line::TURN => turn_left = turn_left.max(left),
                reply => panic!("asked during the woken waiter's turn: {reply:?}"),
            }
        }
        tokio::time::sleep(turn_left).await;
        let reply = server.acquire(request(next)).await.unwrap();
        assert!(matches!(reply, AcquireReply::Granted(_)), "{reply:?}");
        // Late, it is refused and queues behind the others again.
        let reply = server.acquire(request(stuck)).await.unwrap();
        assert!(matches!(reply, AcquireReply::Held { .. }), "{reply:?}");
        assert_eq!(server.store.lock_lines.queued(), 1);
    }
}
