//! [`Line`]: what a waiter queue waits for (a lock, or a permit of a
//! semaphore), and where its entries, and what its first waiters watch,
//! are in the key layout.

use distlock_core::LockKey;
use etcd_client::{GetOptions, KeyValue, TxnOp};

use crate::keys::{decode_permit, KeyLayout};

/// What a waiter queue waits for.
#[derive(Debug, Clone)]
pub(crate) enum Line {
    /// The lock on a key: the first in line watches the lock key.
    Lock(LockKey),
    /// A permit of a key's semaphore of a limit (the waiter's own): the
    /// first in line watch deletions of its permits (a release, or a
    /// permit's lease running out).
    Permits(LockKey, u32),
}

impl Line {
    pub(crate) fn key(&self) -> &LockKey {
        match self {
            Line::Lock(key) | Line::Permits(key, _) => key,
        }
    }

    pub(super) fn what(&self) -> &'static str {
        match self {
            Line::Lock(_) => "lock",
            Line::Permits(..) => "semaphore",
        }
    }

    /// The etcd key the fences of queue entries go below.
    pub(super) fn base(&self, layout: &KeyLayout) -> Vec<u8> {
        match self {
            Line::Lock(key) => layout.lock_key(key),
            Line::Permits(key, _) => layout.semaphore_base(key),
        }
    }

    pub(super) fn queue_prefix(&self, layout: &KeyLayout) -> Vec<u8> {
        match self {
            Line::Lock(key) => layout.queue_prefix(key),
            Line::Permits(key, _) => layout.permit_queue_prefix(key),
        }
    }

    pub(super) fn entry(&self, layout: &KeyLayout, waiter_id: &str) -> Vec<u8> {
        match self {
            Line::Lock(key) => layout.queue_entry(key, waiter_id),
            Line::Permits(..) => {
                let mut entry = self.queue_prefix(layout);
                entry.extend_from_slice(waiter_id.as_bytes());
                entry
            }
        }
    }

    /// What the first in line watches: the lock key, or the prefix of the
    /// semaphore's permits.
    pub(super) fn held_target(&self, layout: &KeyLayout) -> Vec<u8> {
        match self {
            Line::Lock(key) => layout.lock_key(key),
            Line::Permits(key, _) => layout.permits_prefix(key),
        }
    }

    pub(super) fn is_held_target(&self, layout: &KeyLayout, target: &[u8]) -> bool {
        self.held_target(layout) == target
    }

    /// The read that tells whether what the line waits for is taken (a
    /// lock key with its value: by whom).
    pub(super) fn read_held(&self, layout: &KeyLayout) -> TxnOp {
        match self {
            Line::Lock(key) => TxnOp::get(layout.lock_key(key), None),
            Line::Permits(key, _) => TxnOp::get(
                layout.permits_prefix(key),
                Some(GetOptions::new().with_prefix()),
            ),
        }
    }

    /// The queue entry a waiter watches, given its `predecessor` and how
    /// many wait `ahead` of it: a semaphore's first `limit` waiters all
    /// watch its permits (`None`, as the first in a lock's line), so a
    /// release wakes one of them while the others still hold theirs, and
    /// up to `limit` waiters take permits at once; the ones after them
    /// watch their predecessor. The limit is the one stored with the
    /// permits, else (no permit held) the waiter's own: were every waiter
    /// to watch the permits while none is held, the next grant would wake
    /// them all.
    pub(super) fn to_watch(
        &self,
        predecessor: Option<Vec<u8>>,
        ahead: Option<i64>,
        permits: Option<&Vec<KeyValue>>,
    ) -> Option<Vec<u8>> {
        let Line::Permits(_, own) = self else {
            return predecessor;
        };
        let window = stored_limit(permits.map_or(&[][..], Vec::as_slice)).unwrap_or(*own);
        match ahead {
            Some(ahead) if ahead >= i64::from(window) => predecessor,
            _ => None,
        }
    }

    /// Whether [`read_held`](Self::read_held) found it taken.
    pub(super) fn held(&self, found: Option<&Vec<KeyValue>>) -> bool {
        let found = found.map_or(&[][..], Vec::as_slice);
        match self {
            Line::Lock(_) => !found.is_empty(),
            Line::Permits(..) => all_taken(found),
        }
    }
}

/// Whether every permit is taken, from a read of the permits prefix (for
/// the waiter queue: a value distlock did not write counts as taken, and
/// the waiter's attempt reports it).
fn all_taken(kvs: &[KeyValue]) -> bool {
    stored_limit(kvs).map_or(!kvs.is_empty(), |limit| {
        kvs.len() >= usize::try_from(limit).unwrap_or(usize::MAX)
    })
}

/// The limit stored with the permits a read of the permits prefix found,
/// if any (values distlock did not write are passed over).
fn stored_limit(kvs: &[KeyValue]) -> Option<u32> {
    kvs.iter()
        .filter_map(|kv| decode_permit(kv.value()))
        .map(|(_, limit)| limit)
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn permits(limit: u32) -> Line {
        Line::Permits(LockKey::new("k").unwrap(), limit)
    }

    #[test]
    fn with_no_permit_held_only_the_waiters_own_limit_watch_the_permits() {
        let predecessor = Some(b"pred".to_vec());
        // Before, every waiter watched the permits while none was held, so
        // the next grant woke the whole line.
        assert_eq!(
            permits(1).to_watch(predecessor.clone(), Some(3), None),
            predecessor
        );
        assert_eq!(
            permits(1).to_watch(predecessor.clone(), Some(0), None),
            None
        );
        assert_eq!(
            permits(4).to_watch(predecessor.clone(), Some(3), None),
            None
        );
        assert_eq!(
            permits(4).to_watch(predecessor.clone(), Some(4), Some(&Vec::new())),
            predecessor
        );
    }

    #[test]
    fn a_lock_waiter_watches_its_predecessor() {
        let line = Line::Lock(LockKey::new("k").unwrap());
        let predecessor = Some(b"pred".to_vec());
        assert_eq!(
            line.to_watch(predecessor.clone(), Some(0), None),
            predecessor
        );
    }
}
