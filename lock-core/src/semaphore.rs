//! Counting semaphores: at most N holders of a key, one lease per permit.
//!
//! The raw side a backend implements ([`SemaphoreBackend`]); the client side
//! is [`LockClient::try_acquire_permit`](crate::LockClient::try_acquire_permit)
//! and [`LockOptions::with_permits`](crate::LockOptions::with_permits), which make every
//! [`Locker`](crate::Locker) call — `try_lock`, `acquire`, `run_exclusive` —
//! take a permit instead of the lock, with the same guard (renewal, max
//! hold, `lost()`, release on drop) and the same lease rules.
//!
//! A semaphore's key space is its own: the semaphore `exports` and the lock
//! `exports` are independent. The limit is stored with the semaphore. A
//! client asking with another limit while permits are held gets an
//! [`ErrorKind::InvalidInput`](crate::ErrorKind) error naming both numbers;
//! once no permit is held, the next acquisition's limit applies (so a
//! redeploy that changes N needs no manual cleanup, and two versions can
//! never hold permits under two limits at once).

use std::time::Duration;

use async_trait::async_trait;

use crate::{
    ExtendReply, Grant, HeldLock, HolderId, LockError, LockKey, OwnerToken, ReleaseReply,
    ReleaseWatch,
};

/// What the client asks a backend to take: one permit of `key`'s semaphore.
#[derive(Debug, Clone, Copy)]
pub struct PermitRequest<'a> {
    /// The semaphore.
    pub key: &'a LockKey,
    /// This permit's identity; store it, compare it in extend and release.
    /// Every attempt of one logical acquisition carries the same token: a
    /// live permit held by it is this acquisition's own, taken by an
    /// earlier attempt whose reply was lost, and is granted again (adopted).
    pub owner: OwnerToken,
    /// How long the server keeps this permit unless extended.
    pub ttl: Duration,
    /// At most this many live permits (at least 1).
    pub limit: u32,
    /// A guard will renew this permit.
    pub renewing: bool,
    /// This attempt only settles an earlier attempt of the same owner whose
    /// outcome is unknown: the client gives back at once whatever it is
    /// granted (adopted or new). A backend may skip what only a lock that
    /// someone will use needs (waiting for replicas to acknowledge it), so
    /// the give-back is not held up by what delays the attempt it settles.
    pub settling: bool,
    /// Who asks, as in [`AcquireRequest::holder`](crate::AcquireRequest::holder).
    pub holder: Option<&'a HolderId>,
}

/// The server's answer to one permit attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PermitReply {
    /// A permit is the requester's; the fencing token is strictly greater
    /// than every earlier token of this semaphore (any permit).
    Granted(Grant),
    /// `limit` live permits are held by others.
    Full {
        /// How long until the first of them runs out by the server's
        /// clock, if the server said.
        expires_in: Option<Duration>,
    },
    /// Live permits are held under another limit.
    LimitMismatch {
        /// The limit stored with the semaphore.
        stored: u32,
    },
}

/// Semaphores, reduced to what the server must do atomically. A backend
/// returns it from [`LockBackend::semaphore`](crate::LockBackend::semaphore).
///
/// The rules are a lock's, per permit: owner token and fencing token
/// compared atomically in extend and release, expiry by the server's clock,
/// nothing outside the namespace, cancel-safe futures, and the
/// [unknown-outcome rule](crate::LockBackend#unknown-outcomes): a permit
/// attempt by an owner token that holds a live permit of the semaphore
/// adopts that permit — its fencing token, its TTL reset to the request's
/// from now, atomically — and never takes a second one. A crashed holder's
/// permit comes back when its TTL runs out.
#[async_trait]
pub trait SemaphoreBackend: Send + Sync {
    /// One atomic attempt: takes a permit if fewer than `request.limit`
    /// live permits are held (expired ones do not count) and no live permit
    /// is held under another limit; if `request.owner` holds a live permit,
    /// adopts it (same fencing token, TTL reset from now). Never waits.
    async fn acquire_permit(&self, request: PermitRequest<'_>) -> Result<PermitReply, LockError>;

    /// Resets the permit's TTL if, and only if, this owner and token still
    /// hold it. Never recreates an expired or released permit.
    async fn extend_permit(
        &self,
        permit: HeldLock<'_>,
        ttl: Duration,
    ) -> Result<ExtendReply, LockError>;

    /// Gives the permit back if, and only if, this owner and token hold it,
    /// and wakes a waiter.
    async fn release_permit(&self, permit: HeldLock<'_>) -> Result<ReleaseReply, LockError>;

    /// Subscribes to "a permit came back" for `key`'s semaphore of
    /// `limit` (the waiter's own; a server may use it to wake only as
    /// many waiters as there are permits), before an attempt; `waiter` as
    /// in [`LockBackend::watch`](crate::LockBackend::watch). `None`:
    /// waiters poll.
    async fn watch_permits(
        &self,
        key: &LockKey,
        limit: u32,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        let _ = (key, limit, waiter);
        Ok(None)
    }
}
