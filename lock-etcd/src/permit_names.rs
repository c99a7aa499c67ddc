//! The names of a client's permits, reused.
//!
//! A permit attempt reads its semaphore's whole permits range, and etcd
//! walks every key that range had since its last compaction: permits named
//! after their owner tokens (a new name per acquisition) made every attempt
//! slower by each acquisition before it (see [`crate::slots`]). A client
//! names its permits `<client>-<slot>` instead: a random id of the client
//! (16 hex digits) and the lowest slot number free in it, so a semaphore
//! has no more names of one client than permits it held at once. The owner
//! stays in the permit's value (`dl1:<owner>/<limit>`).
//!
//! An acquisition keeps its name from its first attempt that writes until
//! it ends: its retries adopt the permit an earlier attempt put there, and
//! extend and release find it here (a client that lost the entry reads the
//! permits for it). Its name is free again once the acquisition ends
//! (released, refused, or found lost), even while requests of it may still
//! be applied, because none of them can touch a permit of another
//! acquisition put under the name later:
//!
//! - an attempt puts the permit only where no key is (or its own value
//!   is), and an attempt whose outcome is unknown is undone by revoking its
//!   lease (a late put on it fails) or by the session's fenced undo (a late
//!   put writes nothing);
//! - the session's undo deletes only a permit holding its owner's value;
//! - extend and release compare the permit's create revision.
//!
//! A late attempt may still put its permit under a free name before its
//! undo lands; an attempt of another acquisition that finds that name
//! taken gives the name up (retired, see [`PermitNames::taken`]) and tries
//! again under another.
//!
//! An acquisition's entry here goes when its permit is released or found
//! lost by an extend; a permit that is neither (a raw lease left to
//! expire) keeps its entry, and its name, until the client is dropped.
//! Holder labels stay named by the owner (`holders/<owner>`): only a
//! status listing reads their range.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use distlock_core::{FencingToken, OwnerToken};

use crate::slots::{Slot, Slots};

/// A client's permit names, by the acquisition (owner token) using each.
#[derive(Debug)]
pub(crate) struct PermitNames {
    /// Random per client: its names are nobody else's.
    client: String,
    slots: Arc<Slots>,
    in_use: Mutex<HashMap<OwnerToken, Named>>,
}

/// An acquisition's permit name and the limit it asked for.
#[derive(Debug)]
struct Named {
    name: Vec<u8>,
    limit: u32,
    /// Its permit's fencing token, once granted.
    fencing: Option<FencingToken>,
    /// `None` for a name the client found on the server (an earlier
    /// attempt's, adopted): nothing to give back.
    slot: Option<Slot>,
}

impl Default for PermitNames {
    fn default() -> Self {
        let random = OwnerToken::random().to_hex();
        Self {
            client: random[..16].to_owned(),
            slots: Arc::default(),
            in_use: Mutex::default(),
        }
    }
}

impl PermitNames {
    fn in_use(&self) -> std::sync::MutexGuard<'_, HashMap<OwnerToken, Named>> {
        self.in_use.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The name an attempt of `owner` (under `limit`) puts its permit at:
    /// `found`, the name of its permit an earlier attempt put (read just
    /// before); else the one its acquisition has; else a free one.
    pub(crate) fn for_attempt(
        &self,
        owner: OwnerToken,
        limit: u32,
        found: Option<&[u8]>,
    ) -> Vec<u8> {
        let mut in_use = self.in_use();
        if let Some(named) = in_use.get(&owner) {
            if found.is_none_or(|found| found == named.name) {
                return named.name.clone();
            }
        }
        let named = match found {
            Some(name) => Named {
                name: name.to_vec(),
                limit,
                fencing: None,
                slot: None,
            },
            None => {
                let slot = self.slots.take();
                Named {
                    name: format!("{}-{:x}", self.client, slot.number()).into_bytes(),
                    limit,
                    fencing: None,
                    slot: Some(slot),
                }
            }
        };
        let name = named.name.clone();
        // A name it had before (not its permit's) is retired.
        in_use.insert(owner, named);
        name
    }

    /// `owner`'s attempt was granted the permit created at `fencing`.
    pub(crate) fn granted(&self, owner: OwnerToken, fencing: FencingToken) {
        if let Some(named) = self.in_use().get_mut(&owner) {
            named.fencing = Some(fencing);
        }
    }

    /// The name and limit of the permit `owner` was granted at `fencing`,
    /// if this client named it.
    pub(crate) fn of(&self, owner: OwnerToken, fencing: FencingToken) -> Option<(Vec<u8>, u32)> {
        self.in_use()
            .get(&owner)
            .filter(|named| named.fencing == Some(fencing))
            .map(|named| (named.name.clone(), named.limit))
    }

    /// `owner`'s acquisition ended without a permit: its name is free for
    /// another.
    pub(crate) fn done(&self, owner: OwnerToken) {
        let named = self.in_use().remove(&owner);
        if let Some(slot) = named.and_then(|named| named.slot) {
            slot.free();
        }
    }

    /// The permit `owner` was granted at `fencing` is released or lost:
    /// its name is free for another. Nothing if that is not the permit the
    /// client named (a forged or stale handle).
    pub(crate) fn ended(&self, owner: OwnerToken, fencing: FencingToken) {
        if self.of(owner, fencing).is_some() {
            self.done(owner);
        }
    }

    /// `owner`'s attempt found its name holding another acquisition's
    /// permit (one put late, before its undo): the name is retired, and
    /// the next attempt takes another.
    pub(crate) fn taken(&self, owner: OwnerToken) {
        // Dropping the slot retires its number.
        self.in_use().remove(&owner);
    }

    /// How many acquisitions have a name.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.in_use().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_kept_per_acquisition_and_reused_once_it_ends() {
        let names = PermitNames::default();
        let (a, b) = (OwnerToken::random(), OwnerToken::random());
        let first = names.for_attempt(a, 3, None);
        assert!(crate::slots::is_slot_name(&first), "{first:?}");
        assert_eq!(names.for_attempt(a, 3, None), first, "a retry moved");
        let token = FencingToken::new(7);
        assert_eq!(names.of(a, token), None, "named before its grant");
        names.granted(a, token);
        assert_eq!(names.of(a, token), Some((first.clone(), 3)));
        let second = names.for_attempt(b, 3, None);
        assert_ne!(second, first, "two acquisitions share a name");
        // A handle of the owner with another token (forged, stale) is
        // not the permit: its name stays.
        names.ended(a, FencingToken::new(8));
        assert_eq!(names.of(a, token), Some((first.clone(), 3)));
        names.ended(a, token);
        assert_eq!(names.of(a, token), None);
        let c = OwnerToken::random();
        assert_eq!(
            names.for_attempt(c, 3, None),
            first,
            "a free name was not reused"
        );
        names.taken(c);
        let d = OwnerToken::random();
        let fourth = names.for_attempt(d, 3, None);
        assert!(
            fourth != first && fourth != second,
            "a retired name came back"
        );
        // A name found on the server wins over the one it had, and is
        // never handed out again.
        let e = OwnerToken::random();
        let own = names.for_attempt(e, 3, None);
        assert_eq!(names.for_attempt(e, 3, Some(b"old")), b"old");
        names.done(e);
        let f = OwnerToken::random();
        let next = names.for_attempt(f, 3, None);
        assert!(next != own, "the name it had before was reused");
        for owner in [b, d, f] {
            names.done(owner);
        }
        assert_eq!(names.len(), 0);
    }

    #[test]
    fn clients_name_their_permits_apart() {
        let (one, two) = (PermitNames::default(), PermitNames::default());
        let owner = OwnerToken::random();
        assert_ne!(
            one.for_attempt(owner, 1, None),
            two.for_attempt(owner, 1, None)
        );
    }
}
