//! [`OpenWaits`]: a client's record of the waits that may be in a
//! server's waiter line.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::{LockKey, OwnerToken};

/// The line of a lock, or of a semaphore's permits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WaitLine {
    /// A lock's.
    Lock,
    /// A semaphore's.
    Permits,
}

type WaitId = (WaitLine, LockKey, OwnerToken);

/// One open wait: its registration and whether it may be in its line.
#[derive(Debug, Clone, Copy)]
struct Open {
    registration: u64,
    in_line: bool,
}

/// The open waits of one client of a server that keeps waiter lines
/// ([`Capabilities::wakes_one_waiter`](crate::Capabilities)): which
/// attempts join a line, and which ended waits must leave one.
///
/// A wait opens when its watch is registered under its owner token (see
/// [`LockBackend::watch`](crate::LockBackend::watch)); from then on its
/// attempts join the line when refused. When the watch drops
/// ([`ReleaseWatch::leave_with`](crate::ReleaseWatch::leave_with)),
/// the wait leaves the line — unless it never joined, was granted (the
/// grant left the line), or subscribed again meanwhile (after a lost
/// notification connection: the newer registration owns its place).
///
/// ```
/// use distlock_core::{LockKey, OpenWaits, OwnerToken, WaitLine};
///
/// let waits = OpenWaits::default();
/// let (key, owner) = (LockKey::new("k").unwrap(), OwnerToken::random());
/// let registration = waits.register(WaitLine::Lock, &key, owner);
/// // Its attempt joins the line if refused; the watch then drops.
/// assert!(waits.joins(WaitLine::Lock, &key, owner));
/// assert!(waits.ended(WaitLine::Lock, &key, owner, registration), "it must leave");
/// assert!(waits.is_empty());
/// ```
#[derive(Debug, Default)]
pub struct OpenWaits {
    waits: Mutex<HashMap<WaitId, Open>>,
    registrations: AtomicU64,
}

impl OpenWaits {
    fn waits(&self) -> MutexGuard<'_, HashMap<WaitId, Open>> {
        self.waits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `owner`'s wait on `key` registered a watch: the registration that
    /// [`ended`](Self::ended) names. A wait that registers again keeps
    /// what it knew of its place.
    pub fn register(&self, line: WaitLine, key: &LockKey, owner: OwnerToken) -> u64 {
        let registration = self.registrations.fetch_add(1, Ordering::Relaxed);
        let mut waits = self.waits();
        let wait = waits.entry((line, key.clone(), owner)).or_insert(Open {
            registration,
            in_line: false,
        });
        wait.registration = registration;
        registration
    }

    /// Whether an attempt of `owner` on `key` is an open wait's (it then
    /// joins the line if refused, and so may be in it from now on).
    pub fn joins(&self, line: WaitLine, key: &LockKey, owner: OwnerToken) -> bool {
        let mut waits = self.waits();
        let Some(wait) = waits.get_mut(&(line, key.clone(), owner)) else {
            return false;
        };
        wait.in_line = true;
        true
    }

    /// `owner`'s attempt was granted: its statement left the line.
    pub fn granted(&self, line: WaitLine, key: &LockKey, owner: OwnerToken) {
        if let Some(wait) = self.waits().get_mut(&(line, key.clone(), owner)) {
            wait.in_line = false;
        }
    }

    /// The watch of `registration` dropped: the wait is over unless it
    /// registered again since. Whether it must leave its line.
    pub fn ended(
        &self,
        line: WaitLine,
        key: &LockKey,
        owner: OwnerToken,
        registration: u64,
    ) -> bool {
        let mut waits = self.waits();
        let id = (line, key.clone(), owner);
        if waits.get(&id).map(|w| w.registration) != Some(registration) {
            return false;
        }
        waits.remove(&id).is_some_and(|w| w.in_line)
    }

    /// How many waits are open.
    pub fn len(&self) -> usize {
        self.waits().len()
    }

    /// Whether no wait is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_waits_that_may_be_in_line_leave_it() {
        let waits = OpenWaits::default();
        let key = LockKey::new("k").unwrap();
        let (a, b) = (OwnerToken::random(), OwnerToken::random());
        // An attempt of no open wait (try_acquire, a settling attempt)
        // never joins.
        assert!(!waits.joins(WaitLine::Lock, &key, a));
        let first = waits.register(WaitLine::Lock, &key, a);
        let of_b = waits.register(WaitLine::Lock, &key, b);
        // Registered, never refused: nothing to leave.
        assert!(!waits.ended(WaitLine::Lock, &key, b, of_b));
        assert!(waits.joins(WaitLine::Lock, &key, a));
        // The semaphore's line is another one.
        assert!(!waits.joins(WaitLine::Permits, &key, a));
        // Registered again (a lost listener): the older watch's drop
        // leaves nothing, and the wait stays in line.
        let second = waits.register(WaitLine::Lock, &key, a);
        assert!(!waits.ended(WaitLine::Lock, &key, a, first));
        waits.granted(WaitLine::Lock, &key, a);
        assert!(!waits.ended(WaitLine::Lock, &key, a, second));
        let third = waits.register(WaitLine::Lock, &key, a);
        assert!(waits.joins(WaitLine::Lock, &key, a));
        assert!(waits.ended(WaitLine::Lock, &key, a, third));
        assert!(waits.is_empty());
    }
}
