//! The state of one session lease: whether it is alive, the send time of
//! its last confirmed keep-alive, and the locks and permits attached to it
//! with their last renewal (the ones not renewed for the TTL are undone by
//! [`super::keepalive`]), and the fences of requests whose outcome is
//! unknown.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use distlock_core::FencingToken;

use super::Attached;
use crate::fence::Fence;

/// One session lease.
pub(crate) struct Session {
    lease_id: i64,
    ttl: Duration,
    state: Mutex<State>,
}

struct State {
    alive: bool,
    /// When the last keep-alive (or the grant) the server answered
    /// positively was sent: the server keeps the lease at least `ttl`
    /// from then.
    confirmed_sent_at: Instant,
    /// Attached locks and permits by [`Attached::id`] (unique per
    /// acquisition): one entry per held lock, so the key is the only copy
    /// of its `Attached`.
    locks: HashMap<ById, Entry>,
    /// By [`Attached::id`]: the fences of requests (acquires, undos) whose
    /// outcome is unknown; the next request for that owner puts them up.
    pending: HashMap<ById, Vec<Fence>>,
}

/// An [`Attached`] as a map key: hashed and compared by its id, and
/// looked up by it.
#[derive(Clone)]
struct ById(Attached);

impl PartialEq for ById {
    fn eq(&self, other: &Self) -> bool {
        self.0.id() == other.0.id()
    }
}

impl Eq for ById {}

impl Hash for ById {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // As the `[u8]` it borrows as hashes.
        self.0.id().hash(state);
    }
}

impl Borrow<[u8]> for ById {
    fn borrow(&self) -> &[u8] {
        self.0.id()
    }
}

/// What the session knows of an attached lock or permit besides itself.
#[derive(Clone, Copy)]
struct Entry {
    fencing: Option<FencingToken>,
    renewed_at: Instant,
}

impl Entry {
    fn of(self, attached: Attached) -> Tracked {
        Tracked {
            attached,
            fencing: self.fencing,
            renewed_at: self.renewed_at,
        }
    }
}

/// A lock or permit the session undoes (its holder stopped renewing it,
/// or its acquire's outcome is unknown): the undo is fenced by `fence` and
/// puts up `raise`, the fences of the owner's earlier unknown requests.
pub(crate) struct Undo {
    pub(crate) tracked: Tracked,
    pub(crate) fence: Fence,
    pub(crate) raise: Vec<Fence>,
}

#[derive(Clone)]
pub(crate) struct Tracked {
    pub(crate) attached: Attached,
    pub(crate) fencing: Option<FencingToken>,
    pub(crate) renewed_at: Instant,
}

impl Session {
    /// A live session on lease `lease_id`, granted `ttl` by a request sent
    /// at `sent_at`, with no locks attached yet.
    pub(crate) fn new(lease_id: i64, ttl: Duration, sent_at: Instant) -> Self {
        Self {
            lease_id,
            ttl,
            state: Mutex::new(State {
                alive: true,
                confirmed_sent_at: sent_at,
                locks: HashMap::new(),
                pending: HashMap::new(),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn lease_id(&self) -> i64 {
        self.lease_id
    }

    /// The TTL the server granted the session lease.
    pub(crate) fn ttl(&self) -> Duration {
        self.ttl
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.state().alive
    }

    /// The send time of the last positively answered keep-alive, if the
    /// session is alive.
    pub(crate) fn confirmed_sent_at(&self) -> Option<Instant> {
        let state = self.state();
        state.alive.then_some(state.confirmed_sent_at)
    }

    /// Attaches a lock or permit (renewed at `renewed_at`); `fencing` is
    /// `None` when the acquire's outcome is unknown.
    pub(crate) fn track(
        &self,
        attached: &Attached,
        fencing: Option<FencingToken>,
        renewed_at: Instant,
    ) {
        let mut state = self.state();
        if state.alive {
            state.locks.insert(
                ById(attached.clone()),
                Entry {
                    fencing,
                    renewed_at,
                },
            );
        }
    }

    /// Records a renewal at `at` of the lock or permit `id`; false if it is
    /// no longer attached (expired and being deleted, or the session died).
    pub(crate) fn renew(&self, id: &[u8], at: Instant) -> bool {
        let mut state = self.state();
        if !state.alive {
            return false;
        }
        match state.locks.get_mut(id) {
            Some(entry) => {
                entry.renewed_at = entry.renewed_at.max(at);
                true
            }
            None => false,
        }
    }

    /// Starts an acquire request of `attached` fenced by `fence`, sent at
    /// `at`: tracks it as attached (outcome unknown) and returns the fences
    /// it must put up.
    pub(crate) fn begin(&self, attached: &Attached, fence: &Fence, at: Instant) -> Vec<Fence> {
        let mut state = self.state();
        if !state.alive {
            return Vec::new();
        }
        state.locks.insert(
            ById(attached.clone()),
            Entry {
                fencing: None,
                renewed_at: at,
            },
        );
        let pending = state.pending.entry(ById(attached.clone())).or_default();
        let raise = pending.clone();
        pending.push(fence.clone());
        raise
    }

    /// A request of `id` fenced by `fence` that put up `raised` was
    /// answered: the outcome of both is known.
    pub(crate) fn settled(&self, id: &[u8], raised: &[Fence], fence: &Fence) {
        let mut state = self.state();
        if let Some(pending) = state.pending.get_mut(id) {
            pending.retain(|f| f != fence && !raised.contains(f));
            if pending.is_empty() {
                state.pending.remove(id);
            }
        }
    }

    /// Detaches the lock or permit `id` (released, moved to its own lease,
    /// or gone). If a request of its owner has an unknown outcome, it stays
    /// due for an undo, which puts that request's fence up.
    pub(crate) fn untrack(&self, id: &[u8]) {
        let mut state = self.state();
        let removed = state.locks.remove_entry(id);
        if let Some((attached, entry)) = removed {
            if state.pending.contains_key(id) {
                let due = entry
                    .renewed_at
                    .checked_sub(self.ttl)
                    .unwrap_or(entry.renewed_at);
                state.locks.insert(
                    attached,
                    Entry {
                        fencing: None,
                        renewed_at: due,
                    },
                );
            }
        }
    }

    /// How many locks and permits are attached.
    #[cfg(test)]
    fn attached(&self) -> usize {
        self.state().locks.len()
    }

    /// Removes and returns the locks and permits not renewed for the TTL,
    /// each with the
    /// fence of its undo (counted as pending until the undo is answered),
    /// and the earliest deadline of the others.
    pub(crate) fn take_expired(&self, now: Instant) -> (Vec<Undo>, Option<Instant>) {
        let mut state = self.state();
        let ttl = self.ttl;
        let expired: Vec<ById> = state
            .locks
            .iter()
            .filter(|(_, t)| t.renewed_at + ttl <= now)
            .map(|(v, _)| v.clone())
            .collect();
        let mut taken = Vec::with_capacity(expired.len());
        for id in expired {
            if let Some((attached, entry)) = state.locks.remove_entry(&id) {
                taken.push(self.undo(&mut state, entry.of(attached.0)));
            }
        }
        let next = state.locks.values().map(|t| t.renewed_at + ttl).min();
        (taken, next)
    }

    /// Takes `attached` (created at `fencing`, if known) for an undo now,
    /// whatever its last renewal, as [`take_expired`](Self::take_expired)
    /// takes the keys it finds; `None` once the session died (its keys go
    /// with its lease).
    pub(crate) fn take(&self, attached: &Attached, fencing: Option<FencingToken>) -> Option<Undo> {
        let mut state = self.state();
        if !state.alive {
            return None;
        }
        state.locks.remove(attached.id());
        let now = Instant::now();
        // Due already, should the undo fail and the key be put back.
        let tracked = Tracked {
            attached: attached.clone(),
            fencing,
            renewed_at: now.checked_sub(self.ttl).unwrap_or(now),
        };
        Some(self.undo(&mut state, tracked))
    }

    /// The undo of `tracked`, taken out of the tracking: its fence counts
    /// as pending until the undo is answered.
    fn undo(&self, state: &mut State, tracked: Tracked) -> Undo {
        let fence = tracked.attached.fence(self.lease_id);
        let pending = state
            .pending
            .entry(ById(tracked.attached.clone()))
            .or_default();
        let raise = pending.clone();
        pending.push(fence.clone());
        Undo {
            tracked,
            fence,
            raise,
        }
    }

    /// Puts back a lock or permit whose undo failed, to be undone again
    /// (unless a new request of its owner tracks it already).
    pub(crate) fn put_back(&self, tracked: Tracked) {
        let mut state = self.state();
        if state.alive {
            let entry = Entry {
                fencing: tracked.fencing,
                renewed_at: tracked.renewed_at,
            };
            state.locks.entry(ById(tracked.attached)).or_insert(entry);
        }
    }

    pub(crate) fn confirm(&self, sent_at: Instant) {
        let mut state = self.state();
        state.confirmed_sent_at = state.confirmed_sent_at.max(sent_at);
    }

    /// Marks the session dead; its locks and permits are gone (or going) on
    /// the server.
    pub(crate) fn kill(&self) {
        let mut state = self.state();
        state.alive = false;
        state.locks.clear();
        state.pending.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracking_expires_only_unrenewed_locks() {
        let start = Instant::now();
        let session = Session {
            lease_id: 7,
            ttl: Duration::from_secs(2),
            state: Mutex::new(State {
                alive: true,
                confirmed_sent_at: start,
                locks: HashMap::new(),
                pending: HashMap::new(),
            }),
        };
        let attached = |id: &[u8]| {
            let (bytes, [span]) = super::super::pack([id]);
            Attached {
                bytes,
                key: span,
                value: span,
                label_key: None,
                marker: None,
                fence_base: span,
                what: "lock",
            }
        };
        session.track(&attached(b"v1"), Some(FencingToken::new(3)), start);
        session.track(&attached(b"v2"), None, start);
        assert!(session.renew(b"v2", start + Duration::from_secs(1)));
        let (expired, next) = session.take_expired(start + Duration::from_secs(2));
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].tracked.attached.id(), b"v1");
        assert_eq!(next, Some(start + Duration::from_secs(3)));
        assert!(!session.renew(b"v1", start + Duration::from_secs(2)));
        session.untrack(b"v2");
        assert_eq!(session.attached(), 0);
        session.track(&attached(b"v3"), None, start);
        session.kill();
        assert_eq!(session.attached(), 0);
        assert_eq!(session.confirmed_sent_at(), None);
        assert!(!session.renew(b"v3", start));
    }
}
