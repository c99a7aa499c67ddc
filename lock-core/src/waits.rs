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

/// A line: whose, and of which key.
type LineId = (WaitLine, LockKey);

/// Where a wait stands before its next attempt ([`OpenWaits::place`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitPlace {
    /// No open wait: the attempt does not join a line.
    NotWaiting,
    /// An earlier attempt of the wait joined its line (it may be there).
    /// `refused`: the last attempt was refused (it is in line, and a
    /// wake-up since most likely made it the head); not after an attempt
    /// whose outcome is unknown, which may have taken the key.
    InLine {
        /// The wait's last attempt was refused.
        refused: bool,
    },
    /// The attempt is the wait's first that joins the line. `behind_others`:
    /// another wait of this client may be in that line, so the attempt is
    /// most likely refused (a crowd in one process: a holder that released
    /// and asks again queues behind the waiter its release woke).
    Joining {
        /// Another wait of this client may be in the line.
        behind_others: bool,
    },
}

/// One open wait: its registration, whether it may be in its line, and
/// whether its last attempt was refused.
#[derive(Debug, Clone, Copy)]
struct Open {
    registration: u64,
    in_line: bool,
    refused: bool,
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
    waits: Mutex<Waits>,
    registrations: AtomicU64,
}

/// The open waits, and how many of them may be in each line.
#[derive(Debug, Default)]
struct Waits {
    open: HashMap<WaitId, Open>,
    in_line: HashMap<LineId, usize>,
}

impl Waits {
    /// Sets whether the wait `id` may be in its line, keeping the count.
    fn set_in_line(&mut self, id: &WaitId, in_line: bool) {
        let Some(wait) = self.open.get_mut(id) else {
            return;
        };
        if wait.in_line == in_line {
            return;
        }
        wait.in_line = in_line;
        let line = (id.0, id.1.clone());
        if in_line {
            *self.in_line.entry(line).or_default() += 1;
        } else if let Some(count) = self.in_line.get_mut(&line) {
            *count -= 1;
            if *count == 0 {
                self.in_line.remove(&line);
            }
        }
    }
}

impl OpenWaits {
    fn waits(&self) -> MutexGuard<'_, Waits> {
        self.waits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `owner`'s wait on `key` registered a watch: the registration that
    /// [`ended`](Self::ended) names. A wait that registers again keeps
    /// what it knew of its place.
    pub fn register(&self, line: WaitLine, key: &LockKey, owner: OwnerToken) -> u64 {
        let registration = self.registrations.fetch_add(1, Ordering::Relaxed);
        let mut waits = self.waits();
        let wait = waits
            .open
            .entry((line, key.clone(), owner))
            .or_insert(Open {
                registration,
                in_line: false,
                refused: false,
            });
        wait.registration = registration;
        registration
    }

    /// Whether an attempt of `owner` on `key` is an open wait's (it then
    /// joins the line if refused, and so may be in it from now on).
    pub fn joins(&self, line: WaitLine, key: &LockKey, owner: OwnerToken) -> bool {
        let mut waits = self.waits();
        let id = (line, key.clone(), owner);
        let Some(wait) = waits.open.get_mut(&id) else {
            return false;
        };
        // Until its outcome is known.
        wait.refused = false;
        waits.set_in_line(&id, true);
        true
    }

    /// `owner`'s attempt (one that [`joins`](Self::joins)) was refused.
    pub fn refused(&self, line: WaitLine, key: &LockKey, owner: OwnerToken) {
        if let Some(wait) = self.waits().open.get_mut(&(line, key.clone(), owner)) {
            wait.refused = true;
        }
    }

    /// Where `owner`'s wait on `key` stands before its next attempt (ask
    /// before [`joins`](Self::joins), which puts it in line).
    pub fn place(&self, line: WaitLine, key: &LockKey, owner: OwnerToken) -> WaitPlace {
        let waits = self.waits();
        match waits.open.get(&(line, key.clone(), owner)) {
            None => WaitPlace::NotWaiting,
            Some(wait) if wait.in_line => WaitPlace::InLine {
                refused: wait.refused,
            },
            // Counts of 0 are removed.
            Some(_) => WaitPlace::Joining {
                behind_others: waits.in_line.contains_key(&(line, key.clone())),
            },
        }
    }

    /// `owner`'s attempt was granted: its statement left the line.
    ///
    /// Unless it was `settling`: a settling attempt runs beside the wait's
    /// own attempt, still in flight, which may join the line after this
    /// grant took the wait out of it (it goes on, is refused once the key
    /// changed hands, and joins). The wait then still leaves its line when
    /// it ends; a row left there would be a live client's, woken by every
    /// release and waited out for its whole turn.
    pub fn granted(&self, line: WaitLine, key: &LockKey, owner: OwnerToken, settling: bool) {
        if !settling {
            self.waits().set_in_line(&(line, key.clone(), owner), false);
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
        let Some(wait) = waits.open.get(&id).copied() else {
            return false;
        };
        if wait.registration != registration {
            return false;
        }
        waits.set_in_line(&id, false);
        waits.open.remove(&id);
        wait.in_line
    }

    /// How many waits are open.
    pub fn len(&self) -> usize {
        self.waits().open.len()
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
        waits.granted(WaitLine::Lock, &key, a, false);
        assert!(!waits.ended(WaitLine::Lock, &key, a, second));
        let third = waits.register(WaitLine::Lock, &key, a);
        assert!(waits.joins(WaitLine::Lock, &key, a));
        assert!(waits.ended(WaitLine::Lock, &key, a, third));
        assert!(waits.is_empty());
    }

    #[test]
    fn a_settling_grant_leaves_the_wait_in_line() {
        // The wait's own attempt joins; its caller leaves, and a settling
        // attempt beside it is granted. The wait's attempt may still join
        // after that grant: the wait must leave the line when it ends.
        let waits = OpenWaits::default();
        let (key, owner) = (LockKey::new("k").unwrap(), OwnerToken::random());
        let registration = waits.register(WaitLine::Lock, &key, owner);
        assert!(waits.joins(WaitLine::Lock, &key, owner));
        waits.granted(WaitLine::Lock, &key, owner, true);
        assert!(
            waits.ended(WaitLine::Lock, &key, owner, registration),
            "after a settling grant, the ended wait must still leave"
        );
        // The wait's own grant takes it out of line.
        let registration = waits.register(WaitLine::Lock, &key, owner);
        assert!(waits.joins(WaitLine::Lock, &key, owner));
        waits.granted(WaitLine::Lock, &key, owner, false);
        assert!(!waits.ended(WaitLine::Lock, &key, owner, registration));
    }

    #[test]
    fn a_first_attempt_is_behind_others_while_another_wait_may_be_in_line() {
        let behind = |waits: &OpenWaits, line, key, owner| {
            waits.place(line, key, owner)
                == WaitPlace::Joining {
                    behind_others: true,
                }
        };
        let waits = OpenWaits::default();
        let (key, other) = (LockKey::new("k").unwrap(), LockKey::new("other").unwrap());
        let (a, b) = (OwnerToken::random(), OwnerToken::random());
        let of_a = waits.register(WaitLine::Lock, &key, a);
        waits.register(WaitLine::Lock, &key, b);
        assert!(
            !behind(&waits, WaitLine::Lock, &key, b),
            "nobody is in line"
        );
        assert!(waits.joins(WaitLine::Lock, &key, a));
        assert!(behind(&waits, WaitLine::Lock, &key, b));
        // Not another key's line, nor the semaphore's, nor no open wait.
        waits.register(WaitLine::Lock, &other, b);
        assert!(!behind(&waits, WaitLine::Lock, &other, b));
        assert!(!behind(&waits, WaitLine::Permits, &key, b));
        let stranger = OwnerToken::random();
        assert_eq!(
            waits.place(WaitLine::Lock, &key, stranger),
            WaitPlace::NotWaiting
        );
        // Its own place does not count, nor does a second join.
        assert!(waits.joins(WaitLine::Lock, &key, b));
        assert!(waits.joins(WaitLine::Lock, &key, b));
        assert_eq!(
            waits.place(WaitLine::Lock, &key, b),
            WaitPlace::InLine { refused: false },
            "in line itself, its outcome unknown yet"
        );
        waits.refused(WaitLine::Lock, &key, b);
        assert_eq!(
            waits.place(WaitLine::Lock, &key, b),
            WaitPlace::InLine { refused: true }
        );
        assert!(waits.joins(WaitLine::Lock, &key, b));
        assert_eq!(
            waits.place(WaitLine::Lock, &key, b),
            WaitPlace::InLine { refused: false },
            "the next attempt's outcome is unknown until it is told"
        );
        waits.granted(WaitLine::Lock, &key, b, false);
        assert!(
            behind(&waits, WaitLine::Lock, &key, b),
            "a is still in line"
        );
        // a registered again keeps its place; when its wait ends, it is gone.
        let again = waits.register(WaitLine::Lock, &key, a);
        assert!(!waits.ended(WaitLine::Lock, &key, a, of_a));
        assert!(behind(&waits, WaitLine::Lock, &key, b));
        assert!(waits.ended(WaitLine::Lock, &key, a, again));
        assert!(!behind(&waits, WaitLine::Lock, &key, b), "a left");
    }
}
