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
//! lost by an extend, or, for a permit on a lease of its own, once that
//! lease's TTL is past (see [`crate::by_owner`]). Freeing a name early is
//! safe, only slower: a permit still under it is found by
//! the next attempt that takes the name, which retires it, as above; and
//! the permit's own extend or release, finding no name here, reads the
//! permits for it. A permit on the session lease lives as long as the
//! client renews it, and keeps its name until it ends.
//! Holder labels stay named by the owner (`holders/<owner>`): only a
//! status listing reads their range.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock_core::{FencingToken, OwnerToken};

use crate::by_owner::{expiry, ByOwner};
use crate::slots::{Slot, Slots};

/// A client's permit names, by the acquisition (owner token) using each.
#[derive(Debug)]
pub(crate) struct PermitNames {
    /// Random per client: its names are nobody else's.
    client: String,
    slots: Arc<Slots>,
    in_use: Mutex<ByOwner<Named>>,
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

impl Named {
    /// Its permit expired unreleased: the name is free again.
    fn expired(self) {
        if let Some(slot) = self.slot {
            slot.free();
        }
    }
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
    fn in_use(&self) -> std::sync::MutexGuard<'_, ByOwner<Named>> {
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
                in_use.sweep(Instant::now(), Named::expired);
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

    /// `owner`'s attempt was granted the permit created at `fencing`, for
    /// `ttl` on a lease of its own (`None`: on the session lease).
    pub(crate) fn granted(&self, owner: OwnerToken, fencing: FencingToken, ttl: Option<Duration>) {
        let mut in_use = self.in_use();
        if let Some(named) = in_use.get_mut(&owner) {
            named.fencing = Some(fencing);
        }
        in_use.expire_at(owner, ttl.map(expiry));
    }

    /// The permit `owner` was granted at `fencing` was extended by `ttl`
    /// on a lease of its own (`None`: confirmed on the session lease).
    pub(crate) fn extended(&self, owner: OwnerToken, fencing: FencingToken, ttl: Option<Duration>) {
        let mut in_use = self.in_use();
        if in_use
            .get(&owner)
            .is_some_and(|named| named.fencing == Some(fencing))
        {
            in_use.expire_at(owner, ttl.map(expiry));
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
        names.granted(a, token, None);
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

    /// A permit on a lease of its own frees its name once its TTL (and
    /// the slack) is past, unreleased; an extend postpones that, and a
    /// permit on the session lease keeps its name.
    #[test]
    fn a_permit_left_to_expire_frees_its_name() {
        let names = PermitNames::default();
        let (own, session, extended) = (
            OwnerToken::random(),
            OwnerToken::random(),
            OwnerToken::random(),
        );
        let tokens = [
            FencingToken::new(5),
            FencingToken::new(6),
            FencingToken::new(7),
        ];
        let ttl = Some(Duration::from_secs(2));
        let first = names.for_attempt(own, 1, None);
        names.granted(own, tokens[0], ttl);
        names.for_attempt(session, 1, None);
        names.granted(session, tokens[1], None);
        names.for_attempt(extended, 1, None);
        names.granted(extended, tokens[2], ttl);
        names.extended(extended, tokens[2], Some(Duration::from_secs(60)));
        names.in_use().sweep(Instant::now(), Named::expired);
        assert!(names.of(own, tokens[0]).is_some(), "freed before its TTL");
        names
            .in_use()
            .sweep(Instant::now() + Duration::from_secs(4), Named::expired);
        assert_eq!(names.of(own, tokens[0]), None, "kept past its TTL");
        assert!(
            names.of(session, tokens[1]).is_some(),
            "a session permit's name went"
        );
        assert!(
            names.of(extended, tokens[2]).is_some(),
            "an extended permit's name went"
        );
        assert_eq!(
            names.for_attempt(OwnerToken::random(), 1, None),
            first,
            "an expired permit's name was not reused"
        );
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
