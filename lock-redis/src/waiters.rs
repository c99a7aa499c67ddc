//! The waiter line: one wake-up per release.
//!
//! Each key (and each semaphore) has a line on the server, a sorted set of
//! `<client hex>:<owner hex>` scored by arrival ([`RedisKeys::waiters`]).
//! A waiting attempt that finds the key held joins it in the same script;
//! a granted one leaves it. A release wakes the first waiter alone: it
//! publishes the waiter's owner token on its client's channel
//! (`<channel>:<client hex>`), where this client's listener wakes only that
//! waiter. A lock's woken waiter stays first in the line with a turn
//! ([`TURN`]): the free key is refused to everyone else until it comes,
//! leaves, or its turn is over (a semaphore's is taken off its line as it
//! is woken). A waiter whose wait ends without the lock (cancelled, out of
//! time) leaves the line with one more script, which passes a wake-up it
//! may have taken on to the next waiter while the key is free; so does a
//! wake-up the listener receives for a lock waiter of this client that no
//! longer waits.
//!
//! What this client knows: which waits are open (a watch registered them
//! under their owner token), so that their attempts join the line, and
//! whether each may still be in it.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::{LockKey, OpenWaits, OwnerToken};

use crate::keys::RedisKeys;

/// How long a lock's woken waiter keeps the free key from everyone else
/// (its turn, measured by the server's clock): a waiter woken and never
/// coming (its client frozen, or its wake-up lost) holds the line up this
/// long at most. See "Waiting" in the crate docs.
pub(crate) const TURN: Duration = Duration::from_secs(5);

/// Lock or semaphore: the two lines a key has.
pub(crate) use distlock_core::WaitLine as Line;

/// The open waits of one client.
#[derive(Debug)]
pub(crate) struct Waiters {
    /// This client's id on the server: its channels' suffix and its line
    /// members' prefix.
    client: String,
    /// Open waits: which registration (a wait may subscribe again after
    /// its notification connection was lost) and whether it may be in its
    /// line on the server.
    open: OpenWaits,
}

impl Waiters {
    /// A fresh client id, no open waits.
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            client: OwnerToken::random().to_hex(),
            open: OpenWaits::default(),
        })
    }

    /// This client's channel for `keys`' line.
    pub(crate) fn channel(&self, keys: &RedisKeys) -> String {
        keys.client_channel(&self.client)
    }

    /// The line member of `owner`'s wait.
    pub(crate) fn member(&self, owner: OwnerToken) -> String {
        format!("{}:{}", self.client, owner.to_hex())
    }

    /// A wait opens (its watch is registered): its registration, for
    /// [`closed`](Self::closed). A wait that subscribes again replaces its
    /// earlier registration and keeps its place in the line.
    pub(crate) fn opened(&self, line: Line, key: &LockKey, owner: OwnerToken) -> u64 {
        self.open.register(line, key, owner)
    }

    /// The member an attempt of `owner` on `key` sends: empty unless it
    /// is an open wait's (then it may join the line from now on).
    pub(crate) fn attempting(&self, line: Line, key: &LockKey, owner: OwnerToken) -> String {
        if self.open.joins(line, key, owner) {
            self.member(owner)
        } else {
            String::new()
        }
    }

    /// An open wait's attempt was granted: it left the line (unless
    /// `settling`, see [`OpenWaits::granted`]).
    pub(crate) fn granted(&self, line: Line, key: &LockKey, owner: OwnerToken, settling: bool) {
        self.open.granted(line, key, owner, settling);
    }

    /// The watch of `registration` dropped: whether the wait may still be
    /// in the line, and so must leave it. `false` if the wait subscribed
    /// again since (the newer registration owns its place).
    pub(crate) fn closed(
        &self,
        line: Line,
        key: &LockKey,
        owner: OwnerToken,
        registration: u64,
    ) -> bool {
        self.open.ended(line, key, owner, registration)
    }

    /// How many waits are open (for tests: none left behind).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.open.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_open_waits_join_and_only_those_that_may_be_queued_leave() {
        let waiters = Waiters::new();
        let key = LockKey::new("k").unwrap();
        let (a, b) = (OwnerToken::random(), OwnerToken::random());
        // Not waiting: an attempt sends no member.
        assert_eq!(waiters.attempting(Line::Lock, &key, a), "");
        let first = waiters.opened(Line::Lock, &key, a);
        let of_b = waiters.opened(Line::Lock, &key, b);
        // Opened but never attempted: nothing to leave.
        assert!(!waiters.closed(Line::Lock, &key, b, of_b));
        let member = waiters.attempting(Line::Lock, &key, a);
        assert_eq!(member, waiters.member(a));
        assert!(member.ends_with(&a.to_hex()));
        // The semaphore's line is another line.
        assert_eq!(waiters.attempting(Line::Permits, &key, a), "");
        // Subscribed again: the first watch's drop leaves nothing, and the
        // wait keeps its place.
        let second = waiters.opened(Line::Lock, &key, a);
        assert!(!waiters.closed(Line::Lock, &key, a, first));
        assert_eq!(waiters.attempting(Line::Lock, &key, a), member);
        waiters.granted(Line::Lock, &key, a, false);
        assert!(!waiters.closed(Line::Lock, &key, a, second));
        let third = waiters.opened(Line::Lock, &key, a);
        waiters.attempting(Line::Lock, &key, a);
        assert!(waiters.closed(Line::Lock, &key, a, third));
        assert_eq!(waiters.len(), 0);
    }
}
