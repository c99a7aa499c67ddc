//! A complete backend written the way a third party would write one — with
//! only the published API of `distlock-core` — run through the whole
//! conformance suite. The README's "Running the conformance suite against
//! a new backend" walks through this file.
//!
//! The "server" is a map in this process; a real backend would send each
//! operation to its server as one atomic request (a script, a transaction,
//! one SQL statement). What the backend does *not* do is as telling: it
//! never validates a TTL, mints an owner token, dates a lease or checks
//! which client issued it — `LockClient` does all of that, once, for every
//! backend.
//!
//! What it must do beyond the obvious is the unknown-outcome rule of the
//! `LockBackend` docs: an acquire by the owner token that already holds
//! the key is that owner's retry of a request whose reply was lost, and it
//! is granted the same lock with its TTL reset (adoption).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock_conformance::fault::Link;
use distlock_conformance::{namespace_of, Suite};
use distlock_core::{
    async_trait, AcquireReply, AcquireRequest, Capabilities, ExtendReply, FencingToken, Grant,
    HeldLock, LockAdmin, LockBackend, LockClient, LockError, LockKey, LockState, OwnerToken,
    ReleaseNotifier, ReleaseReply, ReleaseWatch,
};

/// One held lock on the server.
#[derive(Debug)]
struct Entry {
    owner: OwnerToken,
    fencing: FencingToken,
    expires_at: Instant,
}

/// The server's state: live locks and one fencing counter.
#[derive(Debug, Default)]
struct Store {
    locks: HashMap<LockKey, Entry>,
    last_fencing: u64,
}

/// A tiny in-process lock server, shared by every client made from it.
#[derive(Debug, Clone, Default)]
struct TinyLock {
    store: Arc<Mutex<Store>>,
    releases: ReleaseNotifier,
}

impl TinyLock {
    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whether `entry` is `lock`'s and still live: owner and fencing token
/// compared together, expiry by the server's clock.
fn holds(entry: Option<&Entry>, lock: &HeldLock<'_>, now: Instant) -> bool {
    entry.is_some_and(|e| e.owner == lock.owner && e.fencing == lock.fencing && e.expires_at > now)
}

#[async_trait]
impl LockBackend for TinyLock {
    fn name(&self) -> &'static str {
        "tiny"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // TTLs are rounded up to whole milliseconds by the client.
            ttl_granularity: Duration::from_millis(1),
            native_wait: true,
            ..Capabilities::default()
        }
    }

    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<AcquireReply, LockError> {
        let now = Instant::now();
        let mut store = self.store();
        let expires_at = now
            .checked_add(request.ttl)
            .ok_or_else(|| LockError::invalid_input("TTL too long for this server's clock"))?;
        if let Some(held) = store
            .locks
            .get_mut(request.key)
            .filter(|e| e.expires_at > now)
        {
            if held.owner == request.owner {
                // Adoption: the client retries one acquisition under one
                // owner token, so this is its own earlier attempt, applied
                // although its reply was lost. Same lock, same fencing
                // token, TTL reset from now — in the same atomic step.
                held.expires_at = expires_at;
                return Ok(AcquireReply::Granted(Grant::new(held.fencing, request.ttl)));
            }
            return Ok(AcquireReply::Held {
                expires_in: Some(held.expires_at - now),
            });
        }
        store.last_fencing += 1;
        let fencing = FencingToken::new(store.last_fencing);
        store.locks.insert(
            request.key.clone(),
            Entry {
                owner: request.owner,
                fencing,
                expires_at,
            },
        );
        Ok(AcquireReply::Granted(Grant::new(fencing, request.ttl)))
    }

    async fn extend(&self, lock: HeldLock<'_>, ttl: Duration) -> Result<ExtendReply, LockError> {
        let now = Instant::now();
        let mut store = self.store();
        if !holds(store.locks.get(lock.key), &lock, now) {
            return Ok(ExtendReply::NotHeld);
        }
        let expires_at = now
            .checked_add(ttl)
            .ok_or_else(|| LockError::invalid_input("TTL too long for this server's clock"))?;
        if let Some(entry) = store.locks.get_mut(lock.key) {
            entry.expires_at = expires_at;
        }
        Ok(ExtendReply::Extended(Grant::new(lock.fencing, ttl)))
    }

    async fn release(&self, lock: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let now = Instant::now();
        {
            let mut store = self.store();
            if !holds(store.locks.get(lock.key), &lock, now) {
                return Ok(ReleaseReply::NotHeld);
            }
            store.locks.remove(lock.key);
        }
        self.releases.notify(lock.key.as_str());
        Ok(ReleaseReply::Released)
    }

    async fn watch(
        &self,
        key: &LockKey,
        _waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        // A real server subscribes in the closure (SUBSCRIBE, LISTEN, a
        // watch) and confirms before returning, so no release is missed.
        let watch = self
            .releases
            .subscribe(key.as_str(), || async { Ok(()) })
            .await?;
        Ok(Some(watch))
    }

    fn admin(&self) -> Option<&dyn LockAdmin> {
        Some(self)
    }
}

#[async_trait]
impl LockAdmin for TinyLock {
    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        let now = Instant::now();
        Ok(match self.store().locks.get(key) {
            Some(entry) if entry.expires_at > now => LockState::Held {
                expires_in: Some(entry.expires_at - now),
                fencing_token: entry.fencing,
                holder: None,
            },
            _ => LockState::Free,
        })
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let now = Instant::now();
        let was_held = matches!(self.store().locks.remove(key), Some(e) if e.expires_at > now);
        if was_held {
            self.releases.notify(key.as_str());
        }
        Ok(was_held)
    }
}

fn main() -> std::process::ExitCode {
    // A server per namespace: the suite opens clients with `namespace=NAME`
    // in their URL (`?namespace=NAME` for an in-process backend), and two
    // namespaces must share nothing.
    let servers = Arc::new(Mutex::new(HashMap::<String, TinyLock>::new()));
    Suite::new("tiny", move |url: String| {
        let namespace = namespace_of(&url).unwrap_or_default().to_owned();
        let mut servers = servers.lock().unwrap_or_else(|e| e.into_inner());
        let client = LockClient::new(servers.entry(namespace).or_default().clone());
        // Fault cases get `link://` URLs: the client behind a simulated
        // network (an in-process server has no process to cut off).
        async move { Link::attach(&url, client) }
    })
    .simulated_network()
    .namespaces()
    .run()
}
