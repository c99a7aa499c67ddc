//! The holder's marker: a lock waiter's queue entry kept in its line, on
//! the lock's lease, while it holds the lock it waited for.
//!
//! A waiter watches the entry ahead of it (see [`crate::queue`]). When
//! that waiter takes the lock, its acquire transaction puts its entry
//! again on the lock's lease instead of deleting it: same key, so the same
//! create revision (its place), and a version above 1, which no entry has
//! otherwise (a put of an entry is refused where the key exists). The
//! successor's watch sees that put and knows, with no request, that it is
//! first now; it keeps watching the marker, whose deletion is the lock's
//! end. A handoff then costs the same requests however many wait: without
//! the marker, the successor looked its place up and moved its watch to
//! the lock key (a read, a watch created and one cancelled: 9 requests a
//! handoff at 64 waiters against 6 at one).
//!
//! So a marker must never outlive its lock while its holder's client lives
//! (its successor would wait for it), and every request that ends or moves
//! the lock ends or moves the marker in the same transaction:
//!
//! - lease expiry and revoke: the marker is on the lock's lease;
//! - release ([`crate::txn::release`]), the session's undo
//!   ([`crate::txn::undo_session_lock`]): deleted;
//! - an extend to a new lease ([`crate::txn::extend`]): moved;
//! - a force release ([`crate::admin`]): found in the line by the lock's
//!   lease, deleted;
//! - a renewal that finds the lock gone (deleted by a client that knows no
//!   markers): deleted then, in the background.
//!
//! A waiter that finds its marker ahead gone yet the lock held (a path
//! above missed) looks its place up again, so a stray marker delays it,
//! never stalls it.
//!
//! The marker's name is the holder's queue entry name, whose number (see
//! [`crate::slots`]) another waiter of the client would reuse: the client
//! keeps the number until the marker is known deleted ([`HolderMarkers`]),
//! or, for a lock on a lease of its own, until that lease's TTL is past
//! (a lock left to expire, see [`crate::by_owner`]), and every request
//! that deletes or moves a marker checks its version, so it never touches
//! a plain entry of that name. Freeing a number early (etcd may keep a
//! lease past its TTL across a leader change) is safe, only slower: a
//! waiter of this client whose entry would take a name a marker still has
//! is refused its put (an entry is put only where no key is), retires the
//! number and tries again under another; the delete that undoes its put
//! may take the marker, which delays its successor (a stray marker's end,
//! above), never stalls it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use distlock_core::{LockKey, OwnerToken};
use etcd_client::{Compare, CompareOp, KeyValue, PutOptions, Txn, TxnOp};

use crate::by_owner::{expiry, ByOwner};
use crate::slots::Slot;

/// The value of every queue entry, marker or not (a client that knows no
/// markers reads a marker as an entry, and passes it as one).
pub(crate) const ENTRY_VALUE: &[u8] = b"dl1-waiter";

/// Whether a queue entry read from a lock's line is a holder's marker.
pub(crate) fn is_marker(kv: &KeyValue) -> bool {
    kv.version() > 1
}

/// The grant's part: the waiter's entry at `place` becomes the marker, on
/// the lock's `lease`. An entry of that name created elsewhere (a later
/// wait of the same seat) is deleted as before markers: its waiter took
/// the lock, and an entry put at another place than the one the attempt
/// claimed is no one's marker.
pub(crate) fn hold(entry: &[u8], place: i64, lease: i64) -> TxnOp {
    TxnOp::txn(
        Txn::new()
            .when([Compare::create_revision(entry, CompareOp::Equal, place)])
            .and_then([TxnOp::put(
                entry,
                ENTRY_VALUE,
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::delete(entry, None)]),
    )
}

/// Deletes the marker named `entry`, if there is one (a plain entry of that
/// name is left alone).
pub(crate) fn delete(entry: &[u8]) -> TxnOp {
    TxnOp::txn(
        Txn::new()
            .when([Compare::version(entry, CompareOp::Greater, 1)])
            .and_then([TxnOp::delete(entry, None)]),
    )
}

/// Deletes the marker named `entry` (as [`delete`]) unless the lock `key`
/// still holds `value`: a request that finds the lock no longer its own
/// leaves no marker of it, and one fenced off (its lock may have been
/// adopted by a later attempt, which keeps the marker) leaves it.
pub(crate) fn delete_unless_held(key: &[u8], value: &[u8], entry: &[u8]) -> TxnOp {
    TxnOp::txn(
        Txn::new()
            .when([Compare::value(key, CompareOp::Equal, value)])
            .or_else([delete(entry)]),
    )
}

/// Moves the marker named `entry`, if there is one, to `lease`.
pub(crate) fn move_to(entry: &[u8], lease: i64) -> TxnOp {
    TxnOp::txn(
        Txn::new()
            .when([Compare::version(entry, CompareOp::Greater, 1)])
            .and_then([TxnOp::put(
                entry,
                ENTRY_VALUE,
                Some(PutOptions::new().with_lease(lease)),
            )]),
    )
}

/// The markers of this client's held locks, by owner token: which entry
/// each release, extend and undo must delete or move, and the number in
/// its name, kept until the marker is known deleted (or its lock's own
/// lease has expired).
#[derive(Debug, Default)]
pub(crate) struct HolderMarkers {
    held: Mutex<ByOwner<Held>>,
}

#[derive(Debug)]
struct Held {
    key: LockKey,
    entry: Vec<u8>,
    /// The name's number, once its waiter's task handed it over.
    slot: Option<Slot>,
}

impl Held {
    /// Its lock's own lease expired: the marker went with it, and its
    /// name's number is free again.
    fn expired(self) {
        if let Some(slot) = self.slot {
            slot.free();
        }
    }
}

impl HolderMarkers {
    fn held(&self) -> std::sync::MutexGuard<'_, ByOwner<Held>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An attempt of `owner` in line at `entry` was granted `key`, for
    /// `ttl` on a lease of its own (`None`: on the session lease): its
    /// entry is the lock's marker (or was deleted, if it was not at the
    /// place the attempt claimed).
    pub(crate) fn granted(
        &self,
        key: &LockKey,
        owner: OwnerToken,
        entry: &[u8],
        ttl: Option<Duration>,
    ) {
        let mut held = self.held();
        match held.get(&owner) {
            // An adoption, by a later attempt of the same acquisition.
            Some(h) if h.entry == entry => {}
            _ => {
                let key = key.clone();
                let entry = entry.to_vec();
                held.insert(
                    owner,
                    Held {
                        key,
                        entry,
                        slot: None,
                    },
                );
            }
        }
        held.expire_at(owner, ttl.map(expiry));
    }

    /// `owner`'s lock on `key` was extended by `ttl` on a lease of its own
    /// (`None`: on the session lease), its marker with it.
    pub(crate) fn extended(&self, key: &LockKey, owner: OwnerToken, ttl: Option<Duration>) {
        let mut held = self.held();
        if held.get(&owner).is_some_and(|h| h.key == *key) {
            held.expire_at(owner, ttl.map(expiry));
        }
    }

    /// Frees the numbers of markers whose lock's own lease has expired
    /// unreleased: before a waiter of this client takes a number.
    pub(crate) fn sweep(&self) {
        self.held().sweep(Instant::now(), Held::expired);
    }

    /// The marker of `owner`'s lock on `key`, if its grant made one.
    pub(crate) fn of(&self, key: &LockKey, owner: OwnerToken) -> Option<Vec<u8>> {
        self.held()
            .get(&owner)
            .filter(|h| h.key == *key)
            .map(|h| h.entry.clone())
    }

    /// Whether `entry` is the marker of `owner`'s lock.
    pub(crate) fn holds(&self, owner: OwnerToken, entry: &[u8]) -> bool {
        self.held().get(&owner).is_some_and(|h| h.entry == entry)
    }

    /// The task of `owner`'s wait ends, its entry `entry` taken by a
    /// grant: the number in its name stays taken while the marker may
    /// exist. `Err` gives it back if no marker of that name is known (it
    /// was deleted already, or the grant made none).
    pub(crate) fn keep(&self, owner: OwnerToken, entry: &[u8], slot: Slot) -> Result<(), Slot> {
        let mut held = self.held();
        match held.get_mut(&owner) {
            Some(h) if h.entry == entry => {
                h.slot = Some(slot);
                Ok(())
            }
            _ => Err(slot),
        }
    }

    /// `owner`'s lock on `key` ended, and its marker with it: `deleted`
    /// (known deleted, and no earlier try of the request that deleted it
    /// can still be applied), its name's number is free again; else it is
    /// retired.
    pub(crate) fn ended(&self, key: &LockKey, owner: OwnerToken, deleted: bool) {
        let mut held = self.held();
        if held.get(&owner).is_none_or(|h| h.key != *key) {
            return;
        }
        let gone = held.remove(&owner);
        drop(held);
        if let Some(slot) = gone.and_then(|h| h.slot) {
            if deleted {
                slot.free();
            }
        }
    }

    /// How many markers are known.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.held().len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::slots::Slots;

    /// The marker of a lock on a lease of its own, left to expire, frees
    /// its name's number once the lease's TTL (and the slack) is past; an
    /// extend postpones that, and a lock on the session lease keeps it.
    #[test]
    fn the_marker_of_a_lock_left_to_expire_frees_its_number() {
        let slots = Arc::new(Slots::default());
        let markers = HolderMarkers::default();
        let key = LockKey::new("k").unwrap();
        let ttl = Some(Duration::from_secs(2));
        let mut held = Vec::new();
        for (n, ttl, extended) in [(0, ttl, None), (1, None, None), (2, ttl, Some(60))] {
            let owner = OwnerToken::random();
            let entry = format!("entry-{n}").into_bytes();
            markers.granted(&key, owner, &entry, ttl);
            let slot = slots.take();
            assert_eq!(slot.number(), n);
            markers.keep(owner, &entry, slot).expect("a marker to keep");
            if let Some(secs) = extended {
                markers.extended(&key, owner, Some(Duration::from_secs(secs)));
            }
            held.push(owner);
        }
        markers.sweep();
        assert_eq!(markers.len(), 3, "a marker went before its TTL");
        markers
            .held()
            .sweep(Instant::now() + Duration::from_secs(4), Held::expired);
        assert_eq!(markers.of(&key, held[0]), None, "kept past its TTL");
        assert!(markers.of(&key, held[1]).is_some(), "a session lock's went");
        assert!(
            markers.of(&key, held[2]).is_some(),
            "an extended lock's went"
        );
        assert_eq!(slots.take().number(), 0, "the expired marker's number");
    }
}
