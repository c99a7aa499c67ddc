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
    ExtendReply, FencingToken, Grant, HeldLock, HolderId, LockError, LockKey, OwnerToken,
    ReleaseReply, ReleaseWatch,
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
    /// Who asks, as in [`AcquireRequest::holder`](crate::AcquireRequest::holder):
    /// store it with this permit, bound to `owner`, where
    /// [`Capabilities::permit_holder_ids`](crate::Capabilities::permit_holder_ids)
    /// is declared. Never compare it for ownership.
    pub holder: Option<&'a HolderId>,
}

/// One live permit of a semaphore, read without taking or changing
/// anything ([`LockAdmin::inspect_permits`](crate::LockAdmin::inspect_permits)).
///
/// ```
/// use std::time::Duration;
/// use distlock_core::{HolderId, LockKey, LockOptions, Locker, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock_core::LockError> {
/// let locker = Locker::new(MemoryLock::new());
/// let key = LockKey::new("exports")?;
/// let options = LockOptions::new(Duration::from_secs(30))
///     .with_permits(3)
///     .with_holder(HolderId::new("worker-3:4242")?);
/// let guard = locker.try_lock(&key, &options).await?.expect("a free permit");
/// let permits = locker.client().inspect_permits(&key).await?;
/// assert_eq!(permits.len(), 1);
/// assert_eq!(permits[0].fencing_token, guard.fencing_token());
/// assert_eq!(permits[0].holder.as_ref().map(HolderId::as_str), Some("worker-3:4242"));
/// assert_eq!(permits[0].limit, 3);
/// guard.release().await?;
/// assert!(locker.client().inspect_permits(&key).await?.is_empty());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PermitState {
    /// The permit's fencing token.
    pub fencing_token: FencingToken,
    /// Time left on the permit's lease by the server's clock, if known
    /// (renewal may extend it).
    pub expires_in: Option<Duration>,
    /// The limit the permit was granted under (every live permit of a
    /// semaphore has the same one).
    pub limit: u32,
    /// The holder's label, if it gave one and the backend stores them
    /// ([`Capabilities::permit_holder_ids`](crate::Capabilities::permit_holder_ids)).
    /// Only the label stored by the acquisition that holds this permit is
    /// shown, never one left by an earlier holder. For people: not proof
    /// of anything (the owner token alone is).
    pub holder: Option<HolderId>,
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
