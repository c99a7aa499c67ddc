//! The in-process backend: real TTL, owner-token, fencing and wake-up
//! semantics in a map, for tests and single-process programs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::lease::later;

use crate::{
    AcquireAttempt, Capabilities, DistributedLock, FencingToken, Lease, LeaseIssuer, LockError,
    LockKey, LockState, OwnerToken, ReleaseNotifier, ReleaseWatch,
};

#[derive(Debug)]
struct Held {
    owner: OwnerToken,
    fencing: FencingToken,
    expires_at: Instant,
}

#[derive(Debug, Default)]
struct Store {
    locks: Mutex<HashMap<LockKey, Held>>,
    /// One counter for every key: strictly increasing per key, and no state
    /// left behind for keys nobody holds.
    fencing: AtomicU64,
    releases: ReleaseNotifier,
}

impl Store {
    fn locks(&self) -> std::sync::MutexGuard<'_, HashMap<LockKey, Held>> {
        self.locks.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An in-memory lock server, shared by every clone and every
/// [`client`](MemoryLock::client) of it.
///
/// It is a product backend, not a test double: it passes the whole
/// conformance suite. Time is the process's monotonic clock; waiters are
/// woken on release; the map holds only live locks.
///
/// ```
/// use std::time::Duration;
/// use lock_core::{Locker, LockKey, LockOptions, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_core::LockError> {
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
#[derive(Debug, Clone)]
pub struct MemoryLock {
    store: Arc<Store>,
    issuer: LeaseIssuer,
}

impl Default for MemoryLock {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryLock {
    /// A new, empty lock server with one client handle.
    pub fn new() -> Self {
        Self {
            store: Arc::default(),
            issuer: LeaseIssuer::random(),
        }
    }

    /// Another client of the same server, as a separate process would have:
    /// leases it issues are refused by other clients.
    pub fn client(&self) -> Arc<Self> {
        Arc::new(Self {
            store: self.store.clone(),
            issuer: LeaseIssuer::random(),
        })
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

    fn check_owner<'a>(
        locks: &'a mut HashMap<LockKey, Held>,
        lease: &Lease,
        now: Instant,
    ) -> Result<&'a mut Held, LockError> {
        match locks.get_mut(lease.key()) {
            Some(held) if held.owner == lease.owner() && held.expires_at > now => Ok(held),
            _ => Err(LockError::not_held(format!(
                "lock {:?} is no longer held by this lease (released, expired or taken over)",
                lease.key().as_str()
            ))),
        }
    }
}

#[async_trait]
impl DistributedLock for MemoryLock {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            native_wait: true,
            admin: true,
            ..Capabilities::default()
        }
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<AcquireAttempt, LockError> {
        let ttl = self.capabilities().effective_ttl(ttl)?;
        let now = Instant::now();
        let mut locks = self.store.locks();
        if let Some(held) = locks.get(key) {
            if held.expires_at > now {
                return Ok(AcquireAttempt::Held {
                    expires_in: Some(held.expires_at - now),
                });
            }
        }
        // Keep the map to live locks: sweep expired entries when it has grown.
        if locks.len() >= 1024 && locks.len().is_power_of_two() {
            locks.retain(|_, h| h.expires_at > now);
        }
        let owner = OwnerToken::random();
        let fencing = FencingToken::new(self.store.fencing.fetch_add(1, Ordering::SeqCst) + 1);
        locks.insert(
            key.clone(),
            Held {
                owner,
                fencing,
                expires_at: later(now, ttl),
            },
        );
        Ok(AcquireAttempt::Acquired(Lease::new(
            key.clone(),
            owner,
            fencing,
            now,
            ttl,
            self.issuer,
        )))
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease, LockError> {
        lease.check_issuer(self.issuer)?;
        let ttl = self.capabilities().effective_ttl(ttl)?;
        let now = Instant::now();
        let mut locks = self.store.locks();
        let held = Self::check_owner(&mut locks, lease, now)?;
        held.expires_at = later(now, ttl);
        Ok(lease.renewed(now, ttl))
    }

    async fn release(&self, lease: &Lease) -> Result<(), LockError> {
        lease.check_issuer(self.issuer)?;
        let now = Instant::now();
        {
            let mut locks = self.store.locks();
            Self::check_owner(&mut locks, lease, now)?;
            locks.remove(lease.key());
        }
        self.store.releases.notify(lease.key().as_str());
        Ok(())
    }

    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        let now = Instant::now();
        Ok(match self.store.locks().get(key) {
            Some(held) if held.expires_at > now => LockState::Held {
                expires_in: Some(held.expires_at - now),
                fencing_token: held.fencing,
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
            self.store.releases.notify(key.as_str());
        }
        Ok(was_held)
    }

    async fn watch(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        let watch = self
            .store
            .releases
            .subscribe(key.as_str(), || async { Ok(()) })
            .await?;
        Ok(Some(watch))
    }
}
