//! Fences: what makes a request whose outcome is unknown unable to take
//! effect after its undo.
//!
//! A request that timed out may still be applied by the server later (it
//! may sit in a socket buffer, or a connection the client gave up may
//! deliver it after requests sent on a newer one). Deleting what it would
//! have written does not help if it lands after the delete. So every
//! write the backend may have to undo before its outcome is known (a
//! renewing acquire or permit attempt, a queue entry) is conditional on its fence key not
//! existing, and the undo writes the fence in the same transaction as its
//! delete: applied late, the request then finds the fence and writes
//! nothing.
//!
//! A fence lives on the session lease the fenced request attaches its key
//! to: a late request needs that lease to exist (a put on a missing lease
//! fails the whole transaction), so the fence lasts exactly as long as it
//! is needed and goes with the session. Fences are written only when an
//! outcome was unknown, one small key each.

use std::sync::atomic::{AtomicU64, Ordering};

use etcd_client::{Compare, CompareOp, PutOptions, TxnOp};

/// Numbers fences, unique per process (with the session lease id in the
/// name, unique in the cluster).
static NEXT: AtomicU64 = AtomicU64::new(0);

/// The fence of one request, on session lease `lease_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fence {
    key: Vec<u8>,
    lease_id: i64,
}

impl Fence {
    /// A fresh fence for a request on the lock at etcd key `lock_key` (or
    /// on the semaphore whose base that is) attached to `lease_id`:
    /// `<lock_key>/fences/<lease id>-<number>`, outside the lock's waiter
    /// queue and the semaphore's permits (see [`crate::keys`]).
    pub(crate) fn new(lock_key: &[u8], lease_id: i64) -> Self {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let mut key = lock_key.to_vec();
        key.extend_from_slice(format!("/fences/{lease_id:x}-{n:x}").as_bytes());
        Self { key, lease_id }
    }

    /// The fence's etcd key.
    #[cfg(test)]
    pub(crate) fn key(&self) -> &[u8] {
        &self.key
    }

    /// The comparison the fenced request carries: the fence is not up.
    pub(crate) fn down(&self) -> Compare {
        Compare::create_revision(self.key.clone(), CompareOp::Equal, 0)
    }

    /// Puts the fence up (on the fenced request's lease): the request,
    /// applied from now on, writes nothing.
    pub(crate) fn raise(&self) -> TxnOp {
        TxnOp::put(
            self.key.clone(),
            Vec::new(),
            Some(PutOptions::new().with_lease(self.lease_id)),
        )
    }
}
