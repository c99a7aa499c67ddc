//! The raw contract a lock server implements: the few operations it must do
//! atomically, over inputs the client already validated.

use std::fmt;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::{
    Capabilities, FencingToken, HolderId, LockError, LockKey, OwnerToken, PermitState, ReleaseWatch,
};

/// What the client asks a backend to take.
///
/// Everything in it is already checked: the key is valid, the owner token is
/// random and never used by another acquisition, the TTL is one the
/// backend declared it can honour (see [`Capabilities::effective_ttl`]).
#[derive(Debug, Clone, Copy)]
pub struct AcquireRequest<'a> {
    /// The lock to take.
    pub key: &'a LockKey,
    /// This acquisition's identity; store it, and compare it in `extend`
    /// and `release`. Every attempt of one logical acquisition (the retries
    /// of a waiting acquire) carries the same token: a key held by it is
    /// this acquisition's own lock, taken by an earlier attempt whose reply
    /// was lost, and must be granted again (adopted, see [`LockBackend`]),
    /// never refused as held.
    pub owner: OwnerToken,
    /// How long the server keeps the lock unless extended.
    pub ttl: Duration,
    /// A guard will renew this lock: the backend may attach it to a shared
    /// session that one keep-alive renews (etcd). It must still expire
    /// within `ttl` of its last renewal if its holder stops renewing.
    pub renewing: bool,
    /// This attempt only settles an earlier attempt of the same owner whose
    /// outcome is unknown: the client gives back at once whatever it is
    /// granted (adopted or new). A backend may skip what only a lock that
    /// someone will use needs (waiting for replicas to acknowledge it), so
    /// the give-back is not held up by what delays the attempt it settles.
    pub settling: bool,
    /// Who asks, for people to read ([`LockState::Held::holder`]): store
    /// it with the lock, bound to `owner`, where
    /// [`Capabilities::holder_ids`] is declared. Never compare it for
    /// ownership.
    pub holder: Option<&'a HolderId>,
}

/// A lock the client holds, as the backend is asked to extend or release it.
#[derive(Debug, Clone, Copy)]
pub struct HeldLock<'a> {
    /// The lock.
    pub key: &'a LockKey,
    /// The owner token it was acquired with.
    pub owner: OwnerToken,
    /// The fencing token the server gave it.
    pub fencing: FencingToken,
    /// What the backend attached to the grant ([`Grant::handle`]).
    pub handle: u64,
}

/// What the server granted: the fencing token and how long the lock lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Strictly greater than every earlier token for this key (on extend:
    /// the lock's own token, unchanged).
    pub fencing: FencingToken,
    /// The TTL the server applied (the request's, or more if the server
    /// rounds up; never less).
    pub ttl: Duration,
    /// A number the backend wants back in [`HeldLock::handle`] (an etcd
    /// lease id, say); 0 if none.
    pub handle: u64,
    /// When the server's clock for this TTL may have started, if that can be
    /// *before* the request was sent (a lock attached to a session lease
    /// whose last confirmed keep-alive is older). The client dates the lease
    /// from the earlier of this and its own send time; a session that is
    /// already dead gives its last confirmed instant, so the lease comes
    /// back expired and is never handed to a job.
    pub clock_started: Option<Instant>,
}

impl Grant {
    /// A grant of `fencing` for `ttl`, dated from the request's send time.
    pub fn new(fencing: FencingToken, ttl: Duration) -> Self {
        Self {
            fencing,
            ttl,
            handle: 0,
            clock_started: None,
        }
    }

    /// Attaches a backend-defined number.
    pub fn with_handle(mut self, handle: u64) -> Self {
        self.handle = handle;
        self
    }

    /// Dates the TTL from `at` if that is earlier than the send time.
    pub fn clock_started(mut self, at: Instant) -> Self {
        self.clock_started = Some(at);
        self
    }
}

/// The server's answer to one acquisition attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcquireReply {
    /// The lock is the requester's now.
    Granted(Grant),
    /// Someone else holds it.
    Held {
        /// How long until the holder's lease runs out by the server's clock,
        /// if the server said (renewal may push it further). Lets a waiter
        /// set one timer for a holder that crashed, instead of polling.
        expires_in: Option<Duration>,
    },
}

/// The server's answer to an extend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtendReply {
    /// Still held by this owner; its TTL is reset (same fencing token).
    Extended(Grant),
    /// Not held by this owner (released, expired, taken over): nothing changed.
    NotHeld,
}

/// The server's answer to a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseReply {
    /// It was held by this owner and is free now (waiters notified).
    Released,
    /// Not held by this owner: nothing changed.
    NotHeld,
    /// Not held by this owner when a resend of this release arrived, after
    /// an earlier send whose outcome is unknown (no reply in time, a lost
    /// connection): that send may have been the one that released it. For
    /// a backend that cannot recognise its own earlier release on the
    /// server (Redis keeps a released-by marker and answers `Released`).
    /// The client reports the release as done while the lease is still
    /// valid by its conservative clock (nothing but a release, this one or
    /// an operator's force-release, frees a lock before then), and as
    /// [`NotHeld`](Self::NotHeld) after.
    NotHeldAfterResend,
}

/// A lock server, reduced to what it must do atomically.
///
/// Everything else — TTL validation, owner tokens, send times and lease
/// deadlines, issuer checks, error wording, tracing and metrics, waiting,
/// guards, renewal, `run_exclusive` — is written once in
/// [`LockClient`](crate::LockClient) and [`Locker`](crate::Locker) on top of
/// this trait, so a backend cannot get them wrong. A backend:
///
/// - keeps every key, row or channel inside its configured namespace and
///   never reads or writes outside it;
/// - stores the request's owner token and fencing token atomically in
///   [`acquire`](Self::acquire), and compares both atomically in
///   [`extend`](Self::extend) and [`release`](Self::release): never
///   extends, releases or recreates a lock it does not hold;
/// - measures TTLs by the server's clock;
/// - reports a value it did not write as
///   [`ErrorKind::Corrupted`](crate::ErrorKind), never overwrites it;
/// - bounds every network call by its connect and operation timeouts
///   ([`ErrorKind::Unavailable`](crate::ErrorKind) /
///   [`ErrorKind::Timeout`](crate::ErrorKind));
/// - follows the unknown-outcome rule below;
/// - is cancel-safe: a future dropped at any await point leaves nothing that
///   outlives the TTL (the client drives acquisitions to completion on a
///   task of their own, but the suite drops raw futures on purpose).
///
/// # Unknown outcomes
///
/// Every call has one of three outcomes: granted (done), refused (nothing
/// changed), or **unknown**. A request that timed out or lost its
/// connection may still be applied by the server, later; its outcome is
/// unknown, never "refused". The client answers that with one owner token
/// per logical acquisition, and the backend's part is:
///
/// - **Adoption.** When [`acquire`](Self::acquire) finds the key held —
///   live, not expired — by a lock whose stored owner token equals
///   `request.owner`, it resets that lock's TTL to `request.ttl` from now
///   by the server's clock, atomically in the same step, and answers
///   [`AcquireReply::Granted`] with the lock's *existing* fencing token (and
///   its handle). So an earlier attempt that the server applied but whose
///   reply was lost is handed back to its owner by the next attempt,
///   instead of becoming a lock nobody holds and every attempt is refused.
///   The client dates the adopted lease from the adopting attempt's send
///   time, which the TTL reset makes right. Never a second lock, never a
///   new fencing token, never `Held` for its own owner.
/// - **Undo only once the outcome is known.** A step the backend takes to
///   undo a request it sent (a delete, a lease revoke, a queue entry
///   removed) is sent only once that request's outcome is known, or is
///   built so that the request, applied late, cannot outlive it: the
///   request is itself conditional, or the undo revokes the lease the
///   request was attached to instead of deleting a key. Something left on
///   a session or lease that a client keeps alive (etcd) is tracked until
///   its outcome is known, and removed then.
/// - **Bounded resends.** A backend that resends a request (after a
///   reconnect, on another endpoint) resends the same request (same owner
///   token), and the whole call, resends included, ends within its
///   operation timeout counted from the *first* send.
///
/// The suite checks all three by letting the server apply each operation
/// while its reply is held past the client's operation timeout
/// (`fault::late_reply_*`), and adoption at the raw level
/// (`lease::same_owner_acquire_adopts`, `lease::same_owner_permit_adopts`).
///
/// Object safe: the client holds an `Arc<dyn LockBackend>`. See the
/// distlock-conformance crate for a complete third-party backend.
#[async_trait]
pub trait LockBackend: Send + Sync + fmt::Debug + 'static {
    /// A short name for logs and metric labels (`redis`, `etcd`, ...).
    fn name(&self) -> &'static str;

    /// What this backend supports; constant for the life of the client.
    fn capabilities(&self) -> Capabilities;

    /// One atomic attempt: takes `request.key` for `request.ttl` if nobody
    /// holds it (or its holder's TTL ran out), storing the owner token and
    /// a fencing token greater than every earlier one for the key. If
    /// `request.owner` holds it, adopts it: same fencing token, TTL reset
    /// to `request.ttl` from now (see [Unknown outcomes](Self#unknown-outcomes)).
    /// Never waits.
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<AcquireReply, LockError>;

    /// Resets the lock's TTL to `ttl` from now if, and only if, the server
    /// still holds it for this owner and fencing token. Never recreates an
    /// expired or released lock. `ttl` may differ from the acquisition's
    /// (max hold, hold-at-least).
    async fn extend(&self, lock: HeldLock<'_>, ttl: Duration) -> Result<ExtendReply, LockError>;

    /// [`extend`](Self::extend) for each of `locks` (at most
    /// [`Capabilities::extend_batch`] of them, all for `ttl`), in as few
    /// requests as the server allows: one reply per lock, in order. An
    /// `Err` says the whole call failed (nothing is known of any lock);
    /// an item's `Err` concerns that lock alone (data distlock did not
    /// write at its key). The client calls it only when the backend
    /// declares `extend_batch` above 1; the default extends one by one.
    async fn extend_many(
        &self,
        locks: &[HeldLock<'_>],
        ttl: Duration,
    ) -> Result<Vec<Result<ExtendReply, LockError>>, LockError> {
        let mut replies = Vec::with_capacity(locks.len());
        for lock in locks {
            replies.push(self.extend(*lock, ttl).await);
        }
        Ok(replies)
    }

    /// Deletes the lock if, and only if, this owner still holds it, and
    /// wakes the key's waiters. A lock that was deleted is `Released` even
    /// if waking the waiters failed (they fall back to their timers).
    async fn release(&self, lock: HeldLock<'_>) -> Result<ReleaseReply, LockError>;

    /// Subscribes to release notifications for `key`. The client calls it
    /// *before* an attempt, so a release between a failed attempt and the
    /// wait is not missed. `None` (the default): no server-driven wake-up;
    /// waiters retry every [`Capabilities::retry_interval`] and at the
    /// holder's expiry.
    ///
    /// `waiter` is the owner token every attempt of this wait uses, so a
    /// backend can queue the waiter on the server and wake it alone
    /// ([`Capabilities::wakes_one_waiter`]); the watch's drop says the wait
    /// ended. A backend that then takes the waiter out of its line on the
    /// server, in a task of its own, holds the watch's
    /// [`departure`](ReleaseWatch::departure) in that task until it is
    /// done: a wait that ends at its deadline returns only after that (at
    /// most 2 s more), so the caller's next attempt does not meet the
    /// ended wait's place or turn (suite case
    /// `handoff::a_timed_out_wait_gives_up_its_place`).
    async fn watch(
        &self,
        key: &LockKey,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        let _ = (key, waiter);
        Ok(None)
    }

    /// The operator calls, if this backend has them.
    fn admin(&self) -> Option<&dyn LockAdmin> {
        None
    }

    /// Counting semaphores, if this backend has them.
    fn semaphore(&self) -> Option<&dyn crate::SemaphoreBackend> {
        None
    }
}

/// A shared backend is a backend (wrappers and tests hand out `Arc`s).
/// Forwards every method, the provided ones too.
#[deny(clippy::missing_trait_methods)]
#[async_trait]
impl<B: LockBackend + ?Sized> LockBackend for std::sync::Arc<B> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }

    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<AcquireReply, LockError> {
        (**self).acquire(request).await
    }

    async fn extend(&self, lock: HeldLock<'_>, ttl: Duration) -> Result<ExtendReply, LockError> {
        (**self).extend(lock, ttl).await
    }

    async fn extend_many(
        &self,
        locks: &[HeldLock<'_>],
        ttl: Duration,
    ) -> Result<Vec<Result<ExtendReply, LockError>>, LockError> {
        (**self).extend_many(locks, ttl).await
    }

    async fn release(&self, lock: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        (**self).release(lock).await
    }

    async fn watch(
        &self,
        key: &LockKey,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        (**self).watch(key, waiter).await
    }

    fn admin(&self) -> Option<&dyn LockAdmin> {
        (**self).admin()
    }

    fn semaphore(&self) -> Option<&dyn crate::SemaphoreBackend> {
        (**self).semaphore()
    }
}

/// What the server holds at a key, read without taking the lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockState {
    /// Nobody holds the key (never locked, released, or expired).
    Free,
    /// Someone holds it.
    Held {
        /// Time left on the holder's lease by the server's clock, if known
        /// (renewal may extend it).
        expires_in: Option<Duration>,
        /// The holder's fencing token.
        fencing_token: FencingToken,
        /// The holder's label, if the holder gave one and the backend
        /// stores them ([`Capabilities::holder_ids`]). Only a label stored
        /// by the acquisition that holds the lock now is shown, never one
        /// left by an earlier holder. For people: not proof of anything.
        holder: Option<HolderId>,
    },
}

/// Operator calls: read or clear a lock whoever holds it. For status
/// commands and stuck locks, never for job decisions (the answer is stale as
/// soon as it arrives).
#[async_trait]
pub trait LockAdmin: Send + Sync {
    /// Reads who holds `key`, without taking or changing anything.
    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError>;

    /// Deletes the lock at `key` whoever holds it, waking waiters; returns
    /// whether a lock was held. The holder learns it lost the lock at its
    /// next renewal; fencing tokens keep growing. Never touches a value the
    /// library did not write ([`ErrorKind::Corrupted`](crate::ErrorKind)).
    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError>;

    /// Subscribes to changes of who holds `key` (taken, released,
    /// force-released, expired where the server notices), for observers
    /// ([`Locker::observe`](crate::Locker::observe)); the watch fires at
    /// least once after each change. A backend may tell only changes that
    /// involve a labelled holder (every election's leader is one), if it
    /// says so; observers still read at the holder's expiry and every poll
    /// interval. An observer must never take a place in a waiter line, nor
    /// a waiter's wake-up. Declared by [`Capabilities::holder_watch`]. `None` (the default): observers read
    /// [`inspect`](Self::inspect) at the holder's expiry and every poll
    /// interval.
    async fn watch_holder(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        let _ = key;
        Ok(None)
    }

    /// Reads the live permits of `key`'s semaphore, oldest first (by
    /// fencing token), without taking or changing anything; empty if none
    /// is held. A backend that declares
    /// [`Capabilities::permit_holder_ids`] answers it, with each permit's
    /// label; the default is an [`ErrorKind::Unsupported`](crate::ErrorKind)
    /// error.
    async fn inspect_permits(&self, key: &LockKey) -> Result<Vec<PermitState>, LockError> {
        let _ = key;
        Err(LockError::unsupported(
            "this backend cannot list a semaphore's permits; use a backend that declares permit_holder_ids",
        ))
    }
}
