//! The in-memory backend's waiter lines: a release wakes the first waiter
//! of its key alone, in arrival order, as the server backends' lines do.
//!
//! A lock's line is fair ([`Lines::fair`]): a free key goes to the line's
//! first waiter alone. Woken, it keeps its place for its [`TURN`]; anyone
//! else asking meanwhile is refused and queues behind. A semaphore's line
//! hands its woken waiter the wake-up only, as before: a free permit goes
//! to whoever asks.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::{LockError, LockKey, OwnerToken, ReleaseNotifier, ReleaseWatch};

/// How long a woken first waiter keeps a free lock from everyone else: it
/// takes the key well inside it unless its task is stuck. A waiter whose
/// wait ends leaves at once and passes the turn on; this bounds only one
/// that is still waiting and never comes.
pub(super) const TURN: Duration = Duration::from_secs(5);

/// One waiter in a line.
#[derive(Debug)]
struct Waiter {
    owner: OwnerToken,
    /// Until when it keeps the free key, once woken (fair lines only).
    turn_until: Option<Instant>,
}

/// The lines of one kind (locks, or semaphores), and their waiters' watches.
#[derive(Debug, Default)]
pub(super) struct Lines {
    notifier: ReleaseNotifier,
    lines: Mutex<HashMap<LockKey, VecDeque<Waiter>>>,
    /// A free key goes to the first waiter alone, which keeps its place
    /// when woken (locks); otherwise a woken waiter leaves the line and a
    /// free key goes to whoever asks (permits).
    fair: bool,
}

impl Lines {
    /// A line whose free key goes to its first waiter alone.
    pub(super) fn fair() -> Self {
        Self {
            fair: true,
            ..Self::default()
        }
    }

    fn lines(&self) -> std::sync::MutexGuard<'_, HashMap<LockKey, VecDeque<Waiter>>> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `head` still has a claim on the key: waiting, and not past
    /// its turn.
    fn live(&self, key: &LockKey, head: &Waiter, now: Instant) -> bool {
        head.turn_until.is_none_or(|until| until > now)
            && self.notifier.is_waiting(key.as_str(), &head.owner.to_hex())
    }

    /// Wakes `head` and starts its turn; `false` if nobody received it.
    fn wake(&self, key: &LockKey, head: &mut Waiter, now: Instant) -> bool {
        if !self
            .notifier
            .notify_waiter(key.as_str(), &head.owner.to_hex())
        {
            return false;
        }
        if self.fair {
            head.turn_until = Some(crate::lease::later(now, TURN));
        }
        true
    }

    /// Whether `owner` may take `key`, which is free: yes if nobody waits
    /// before it in a fair line. Otherwise the time left of the first
    /// waiter's turn, which starts now if it was never woken (the key came
    /// free by its holder's expiry).
    pub(super) fn admits(&self, key: &LockKey, owner: OwnerToken) -> Result<(), Duration> {
        if !self.fair {
            return Ok(());
        }
        let now = Instant::now();
        let mut lines = self.lines();
        let Some(line) = lines.get_mut(key) else {
            return Ok(());
        };
        let admitted = loop {
            let Some(head) = line.front_mut() else {
                break Ok(());
            };
            if head.owner == owner {
                break Ok(());
            }
            if self.live(key, head, now) {
                if let Some(until) = head.turn_until {
                    break Err(until - now);
                }
                if self.wake(key, head, now) {
                    break Err(TURN);
                }
            }
            line.pop_front();
        };
        if line.is_empty() {
            lines.remove(key);
        }
        admitted
    }

    /// Registers `waiter`'s watch on `key`; the future resolves once that
    /// watch is dropped (the wait ended).
    pub(super) async fn watch(
        &self,
        key: &LockKey,
        waiter: OwnerToken,
    ) -> Result<ReleaseWatch, LockError> {
        let name = waiter.to_hex();
        self.notifier
            .subscribe_as(key.as_str(), Some(&name), || async { Ok(()) })
            .await
    }

    /// An attempt of `owner` found `key` taken: a waiter joins the line
    /// (keeping its place if it has one).
    pub(super) fn refused(&self, key: &LockKey, owner: OwnerToken) {
        if !self.notifier.is_waiting(key.as_str(), &owner.to_hex()) {
            return;
        }
        let mut lines = self.lines();
        let line = lines.entry(key.clone()).or_default();
        if !line.iter().any(|w| w.owner == owner) {
            line.push_back(Waiter {
                owner,
                turn_until: None,
            });
        }
    }

    /// `owner` got the key, or stopped waiting: it leaves the line.
    pub(super) fn leave(&self, key: &LockKey, owner: OwnerToken) {
        let mut lines = self.lines();
        if let Some(line) = lines.get_mut(key) {
            line.retain(|w| w.owner != owner);
            if line.is_empty() {
                lines.remove(key);
            }
        }
    }

    /// `key` came free: wakes the first waiter still waiting. A fair line
    /// keeps it first for its turn (one already woken and in its turn is
    /// not woken again); otherwise it leaves the line (and joins again if
    /// its attempt is refused).
    pub(super) fn wake_next(&self, key: &LockKey) {
        let now = Instant::now();
        let mut lines = self.lines();
        let Some(line) = lines.get_mut(key) else {
            return;
        };
        while let Some(head) = line.front_mut() {
            if self.fair {
                if !self.live(key, head, now) {
                    line.pop_front();
                    continue;
                }
                if head.turn_until.is_some() || self.wake(key, head, now) {
                    break;
                }
                line.pop_front();
            } else if let Some(head) = line.pop_front() {
                if self.wake(key, &mut { head }, now) {
                    break;
                }
            }
        }
        if line.is_empty() {
            lines.remove(key);
        }
    }

    /// How many wait in lines (for tests: nothing left behind).
    #[cfg(test)]
    pub(super) fn queued(&self) -> usize {
        self.lines().values().map(VecDeque::len).sum()
    }
}
