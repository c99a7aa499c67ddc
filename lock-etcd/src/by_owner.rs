//! What a client keeps about each of its acquisitions, by owner token, for
//! as long as the acquisition may hold something on the server: a permit's
//! name ([`crate::permit_names`]), a lock's holder marker
//! ([`crate::marker`]).
//!
//! A record ends when its lock or permit is released or found lost; one
//! granted on a lease of its own is also *dated*: dropped once that lease
//! has expired for sure (its TTL from the reply, plus [`EXPIRY_SLACK`]),
//! or a client that takes leases and lets them expire (a raw lease, a
//! guard's hold-at-least) would keep ever more records, and the names in
//! them. Dropping one early is safe where its module says so. A record on
//! the session lease lives as long as the client renews it, and stays
//! until it ends.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use distlock_core::OwnerToken;

/// Added to a lease's TTL before a record of it is dropped unreleased: a
/// lease that etcd's clock started a little after the client's, or whose
/// TTL it rounded up to a whole second.
const EXPIRY_SLACK: Duration = Duration::from_secs(1);

/// When a lease of its own, granted or extended now for `ttl`, has expired
/// for sure.
pub(crate) fn expiry(ttl: Duration) -> Instant {
    Instant::now() + ttl + EXPIRY_SLACK
}

/// Records by owner token, some dated (see the module docs).
#[derive(Debug)]
pub(crate) struct ByOwner<T> {
    records: HashMap<OwnerToken, Dated<T>>,
    /// The earliest date of a record, if any: no sweep before it.
    next_expiry: Option<Instant>,
}

#[derive(Debug)]
struct Dated<T> {
    record: T,
    /// When it is dropped unreleased; `None`: kept until it ends.
    until: Option<Instant>,
}

impl<T> Default for ByOwner<T> {
    fn default() -> Self {
        Self {
            records: HashMap::new(),
            next_expiry: None,
        }
    }
}

impl<T> ByOwner<T> {
    pub(crate) fn get(&self, owner: &OwnerToken) -> Option<&T> {
        self.records.get(owner).map(|d| &d.record)
    }

    pub(crate) fn get_mut(&mut self, owner: &OwnerToken) -> Option<&mut T> {
        self.records.get_mut(owner).map(|d| &mut d.record)
    }

    /// Records `record` for `owner`, undated, in place of any earlier one.
    pub(crate) fn insert(&mut self, owner: OwnerToken, record: T) {
        let until = None;
        self.records.insert(owner, Dated { record, until });
    }

    pub(crate) fn remove(&mut self, owner: &OwnerToken) -> Option<T> {
        self.records.remove(owner).map(|d| d.record)
    }

    /// Dates `owner`'s record to be dropped at `until` (`None`: kept until
    /// it ends).
    pub(crate) fn expire_at(&mut self, owner: OwnerToken, until: Option<Instant>) {
        if let Some(dated) = self.records.get_mut(&owner) {
            dated.until = until;
            if let Some(until) = until {
                self.next_expiry = Some(self.next_expiry.map_or(until, |next| next.min(until)));
            }
        }
    }

    /// Drops the records dated `now` or earlier, each handed to `dropped`.
    pub(crate) fn sweep(&mut self, now: Instant, mut dropped: impl FnMut(T)) {
        if self.next_expiry.is_none_or(|next| next > now) {
            return;
        }
        let mut next = None;
        let due: Vec<OwnerToken> = self
            .records
            .iter()
            .filter_map(|(owner, dated)| match dated.until {
                Some(until) if until <= now => Some(*owner),
                Some(until) => {
                    next = Some(next.map_or(until, |next: Instant| next.min(until)));
                    None
                }
                None => None,
            })
            .collect();
        self.next_expiry = next;
        for owner in due {
            if let Some(dated) = self.records.remove(&owner) {
                dropped(dated.record);
            }
        }
    }

    /// How many records there are.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.records.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dated_record_is_dropped_once_its_date_is_past() {
        let mut records = ByOwner::default();
        let (dated, undated, redated) = (
            OwnerToken::random(),
            OwnerToken::random(),
            OwnerToken::random(),
        );
        let now = Instant::now();
        records.insert(dated, 1);
        records.expire_at(dated, Some(now + Duration::from_secs(2)));
        records.insert(undated, 2);
        records.insert(redated, 3);
        records.expire_at(redated, Some(now + Duration::from_secs(1)));
        records.expire_at(redated, None);
        let mut dropped = Vec::new();
        records.sweep(now + Duration::from_secs(1), |r| dropped.push(r));
        assert!(dropped.is_empty(), "dropped before its date: {dropped:?}");
        records.sweep(now + Duration::from_secs(3), |r| dropped.push(r));
        assert_eq!(dropped, [1], "the dated record alone goes");
        assert_eq!(records.get(&dated), None);
        assert_eq!(records.len(), 2);
        // Nothing dated is left: a sweep has nothing to look at.
        assert_eq!(records.next_expiry, None);
    }
}
