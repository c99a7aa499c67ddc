//! [`LockClient`]: any [`LockBackend`] wrapped in the one place that owns
//! every lease rule.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::backend::{AcquireReply, AcquireRequest, ExtendReply, ReleaseReply};
use crate::lease::LeaseIssuer;
use crate::renewal::Renewals;
use crate::wait::{self, Attempt};
use crate::{
    instrument, Capabilities, Lease, LockAdmin, LockBackend, LockError, LockKey, LockOptions,
    LockState, OwnerToken, PermitReply, PermitRequest, PermitState, ReleaseWatch, SemaphoreBackend,
};

/// The result of one atomic acquisition attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AcquireAttempt {
    /// The lock is ours.
    Acquired(Lease),
    /// Someone else holds it.
    Held {
        /// How long until the holder's lease runs out by the server's clock,
        /// if the server said. Renewal may push it further.
        expires_in: Option<Duration>,
    },
}

impl AcquireAttempt {
    /// The lease, if acquired.
    pub fn lease(self) -> Option<Lease> {
        match self {
            AcquireAttempt::Acquired(lease) => Some(lease),
            AcquireAttempt::Held { .. } => None,
        }
    }
}

/// A lock client over any backend: the lease-level API.
///
/// It alone validates TTLs, mints owner tokens, records when each request
/// was sent, builds and checks leases (a lease from another client is
/// refused), words the errors and emits tracing spans and metrics, so every
/// backend behaves alike. Job code usually goes through [`Locker`](crate::Locker),
/// which builds guards on top of it. Cheap to clone (clones are the same
/// client).
///
/// ```
/// use std::time::Duration;
/// use distlock_core::{LockClient, LockKey, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock_core::LockError> {
/// let server = MemoryLock::new();
/// let client = LockClient::new(server.clone());
/// let other = LockClient::new(server);
/// let key = LockKey::new("nightly-report")?;
/// let lease = client.try_acquire(&key, Duration::from_secs(30)).await?.lease().expect("free");
/// assert!(other.try_acquire(&key, Duration::from_secs(30)).await?.lease().is_none());
/// client.release(&lease).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LockClient {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Arc<dyn LockBackend>,
    name: &'static str,
    capabilities: Capabilities,
    issuer: LeaseIssuer,
    /// How many of the client's background tasks run (see [`LockClient::idle`]).
    background: tokio::sync::watch::Sender<usize>,
    /// The held guards' renewal queue and its driver.
    renewals: Arc<Renewals>,
}

impl fmt::Debug for LockClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockClient")
            .field("backend", &self.inner.backend)
            .finish_non_exhaustive()
    }
}

impl<B: LockBackend> From<B> for LockClient {
    fn from(backend: B) -> Self {
        Self::new(backend)
    }
}

impl LockClient {
    /// A client over `backend`.
    pub fn new(backend: impl LockBackend) -> Self {
        Self::from_arc(Arc::new(backend))
    }

    /// A client over a shared backend. Leases it issues are refused by
    /// every other client, even over the same backend.
    pub fn from_arc(backend: Arc<dyn LockBackend>) -> Self {
        Self {
            inner: Arc::new(Inner {
                name: backend.name(),
                capabilities: backend.capabilities(),
                issuer: LeaseIssuer::random(),
                background: tokio::sync::watch::Sender::new(0),
                renewals: Arc::default(),
                backend,
            }),
        }
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn LockBackend> {
        &self.inner.backend
    }

    /// The backend itself. Calls go through this, not through the `Arc`:
    /// method lookup on `Arc<dyn LockBackend>` picks the forwarding impl
    /// for `Arc`, which boxes every call's future a second time.
    pub(crate) fn raw(&self) -> &dyn LockBackend {
        &*self.inner.backend
    }

    /// The backend's name (`redis`, `etcd`, ...).
    pub fn name(&self) -> &'static str {
        self.inner.name
    }

    /// What the backend declared it supports.
    pub fn capabilities(&self) -> &Capabilities {
        &self.inner.capabilities
    }

    /// The operator calls, if the backend has them.
    pub fn admin(&self) -> Option<&dyn LockAdmin> {
        self.raw().admin()
    }

    /// One atomic attempt: takes `key` for `ttl` if nobody holds it (or its
    /// holder's TTL ran out). Never waits.
    ///
    /// A grant that arrived so late that its conservative deadline has
    /// already passed comes back as a lease whose
    /// [`is_expired`](Lease::is_expired) is true: do not act on it (release
    /// it; [`Locker`](crate::Locker) never hands such a lease to a job).
    ///
    /// Errors: [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for a zero or too long TTL;
    /// [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable) / [`ErrorKind::Timeout`](crate::ErrorKind::Timeout) if the server
    /// cannot answer; [`ErrorKind::Corrupted`](crate::ErrorKind::Corrupted) for a value at the key that
    /// distlock did not write.
    ///
    /// Cancel safety: if this future is dropped after the request was sent,
    /// a lock the server granted is not released; it expires after `ttl`.
    /// The same holds for a `Timeout` or `Unavailable` error: the request
    /// may have been applied (its outcome is unknown), and a lock it took
    /// expires after `ttl`. [`acquire`](Self::acquire) and
    /// [`Locker`](crate::Locker) give such a lock back (see
    /// [`acquire`](Self::acquire)).
    pub async fn try_acquire(
        &self,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<AcquireAttempt, LockError> {
        self.attempt(key, ttl, &Attempt::PLAIN, OwnerToken::random())
            .await
    }

    /// As [`try_acquire`](Self::try_acquire), for a lock its holder will
    /// keep renewing (what a [`LockGuard`](crate::LockGuard) with renewal
    /// does): a backend may attach it to a session lease (etcd), making
    /// acquisition one round trip.
    pub async fn try_acquire_renewing(
        &self,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<AcquireAttempt, LockError> {
        self.attempt(key, ttl, &Attempt::RENEWING, OwnerToken::random())
            .await
    }

    /// One atomic attempt at a permit of `key`'s semaphore of `limit`: at
    /// most `limit` holders at once, each with its own lease, owner token
    /// and fencing token (strictly increasing per key across all permits).
    /// `Held` when all permits are taken. Errors as
    /// [`try_acquire`](Self::try_acquire), plus
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind) for a zero limit or a
    /// limit other than the one live permits are held under (see the
    /// [`SemaphoreBackend`] docs), and
    /// [`ErrorKind::Unsupported`](crate::ErrorKind) for a backend without
    /// semaphores.
    pub async fn try_acquire_permit(
        &self,
        key: &LockKey,
        limit: u32,
        ttl: Duration,
    ) -> Result<AcquireAttempt, LockError> {
        self.attempt(key, ttl, &Attempt::permit(limit), OwnerToken::random())
            .await
    }

    /// Waits for a permit of `key`'s semaphore of `limit` until `deadline`,
    /// as [`acquire`](Self::acquire) waits for a lock. Cancel-safe.
    pub async fn acquire_permit(
        &self,
        key: &LockKey,
        limit: u32,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<Option<Lease>, LockError> {
        let attempt = Attempt::permit(limit);
        self.acquire_until(key, ttl, deadline, attempt, None, std::future::pending())
            .await
    }

    /// The backend's semaphores, if it has them.
    pub fn semaphore(&self) -> Option<&dyn SemaphoreBackend> {
        self.raw().semaphore()
    }

    fn semaphore_or_error(&self) -> Result<&dyn SemaphoreBackend, LockError> {
        self.semaphore().ok_or_else(|| {
            LockError::unsupported(
                "this backend has no semaphores; use a lock, or a backend with semaphores",
            )
        })
    }

    /// Subscribes to returned permits of `key` (the waiting loop's watch).
    pub(crate) async fn watch_permits(
        &self,
        key: &LockKey,
        limit: u32,
        waiter: OwnerToken,
    ) -> Result<Option<crate::ReleaseWatch>, LockError> {
        self.semaphore_or_error()?
            .watch_permits(key, limit, waiter)
            .await
    }

    /// Waits for `key` until `deadline` (`Ok(None)` if it is still held
    /// then, returned once the wait's place in the server's line is given
    /// up: at most 2 s after the deadline, usually one request), woken by
    /// the server's release notifications or the holder's expiry.
    /// Transient errors (`Unavailable`, `Timeout`) are retried with backoff
    /// until the deadline, then the last one is returned; a deadline in the
    /// past means one attempt.
    ///
    /// Every attempt of one call uses the same owner token, so an attempt
    /// that timed out but was applied by the server is recognised by the
    /// next one: the backend hands that lock back to its owner (adoption)
    /// instead of refusing it, and the call never waits on its own orphan.
    /// If the call ends (deadline, error, cancellation) while the last
    /// attempt's outcome is unknown, one more attempt with that token is
    /// made in the background and a lock it finds is released.
    ///
    /// Cancel-safe: dropping the future leaves no lock held, even if the
    /// server granted it at that moment (the grant is released in the
    /// background, while the runtime runs; see [`idle`](Self::idle)).
    pub async fn acquire(
        &self,
        key: &LockKey,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<Option<Lease>, LockError> {
        self.acquire_until(
            key,
            ttl,
            deadline,
            Attempt::PLAIN,
            None,
            std::future::pending(),
        )
        .await
    }

    /// Resets the lease's TTL to `ttl` from now if, and only if, the server
    /// still holds it for this owner; returns the renewed lease (same owner
    /// and fencing token). [`ErrorKind::NotHeld`](crate::ErrorKind::NotHeld) if it does not: an expired
    /// or released lock is never recreated.
    pub async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease, LockError> {
        let span = tracing::debug_span!("distlock.extend", backend = self.name(), key = %lease.key(), fencing = %lease.fencing_token());
        let result = async {
            self.check_issuer(lease)?;
            let ttl = self.inner.capabilities.effective_ttl(ttl)?;
            let sent_at = Instant::now();
            let reply = match lease.permit_limit() {
                None => {
                    self.timed("extend", self.raw().extend(lease.held(), ttl))
                        .await?
                }
                Some(_) => {
                    let semaphore = self.semaphore_or_error()?;
                    self.timed("extend_permit", semaphore.extend_permit(lease.held(), ttl))
                        .await?
                }
            };
            self.extended(lease, ttl, sent_at, reply)
        }
        .instrument(span)
        .await;
        let operation = on_lease(lease, "extend", "extend a permit");
        self.finish("extend", operation, lease.key(), result)
    }

    /// What `lease` becomes after the server's `reply` to extending it for
    /// `ttl`, sent at `sent_at`.
    fn extended(
        &self,
        lease: &Lease,
        ttl: Duration,
        sent_at: Instant,
        reply: ExtendReply,
    ) -> Result<Lease, LockError> {
        match reply {
            ExtendReply::Extended(grant) => {
                if grant.fencing != lease.fencing_token() {
                    return Err(LockError::corrupted(format!(
                        "the server extended the lock under fencing token {} but it was acquired with {}",
                        grant.fencing,
                        lease.fencing_token()
                    )));
                }
                let renewed = lease
                    .renewed(valid_from(sent_at, grant.clock_started), grant.ttl.max(ttl))
                    .with_handle(grant.handle);
                tracing::trace!(key = %lease.key(), ttl = ?ttl, "lock extended");
                Ok(renewed)
            }
            ExtendReply::NotHeld => {
                tracing::debug!(key = %lease.key(), "lock not held on extend");
                Err(LockError::not_held(
                    "this lease no longer holds the lock (released, expired or taken over); it was not extended",
                ))
            }
        }
    }

    /// The held guards' renewal queue.
    pub(crate) fn renewals(&self) -> &Arc<Renewals> {
        &self.inner.renewals
    }

    /// [`extend`](Self::extend) for each of `leases` (this client's locks)
    /// in one backend call: each answered alone, each dated from the
    /// call's send time.
    pub(crate) async fn extend_together(
        &self,
        leases: &[Lease],
        ttl: Duration,
    ) -> Vec<Result<Lease, LockError>> {
        let span = tracing::debug_span!(
            "distlock.extend_many",
            backend = self.name(),
            locks = leases.len()
        );
        let replies = async {
            let ttl = self.inner.capabilities.effective_ttl(ttl)?;
            let held: Vec<_> = leases.iter().map(Lease::held).collect();
            let sent_at = Instant::now();
            let replies = self
                .timed("extend", self.raw().extend_many(&held, ttl))
                .await?;
            if replies.len() != leases.len() {
                return Err(LockError::corrupted(format!(
                    "the backend answered {} of {} extends in one call",
                    replies.len(),
                    leases.len()
                )));
            }
            Ok((ttl, sent_at, replies))
        }
        .instrument(span)
        .await;
        match replies {
            Ok((ttl, sent_at, replies)) => leases
                .iter()
                .zip(replies)
                .map(|(lease, reply)| {
                    let result = reply.and_then(|r| self.extended(lease, ttl, sent_at, r));
                    self.finish("extend", "extend", lease.key(), result)
                })
                .collect(),
            Err(e) => leases
                .iter()
                .map(|lease| self.finish("extend", "extend", lease.key(), Err(e.duplicate())))
                .collect(),
        }
    }

    /// Deletes the lock if, and only if, this lease still holds it, waking
    /// waiters. [`ErrorKind::NotHeld`](crate::ErrorKind::NotHeld) if it does not (released already,
    /// expired, or taken by someone else — whose lock stays).
    pub async fn release(&self, lease: &Lease) -> Result<(), LockError> {
        let span = tracing::debug_span!("distlock.release", backend = self.name(), key = %lease.key(), fencing = %lease.fencing_token());
        let result = async {
            self.check_issuer(lease)?;
            let reply = match lease.permit_limit() {
                None => self.timed("release", self.raw().release(lease.held())).await?,
                Some(_) => {
                    let semaphore = self.semaphore_or_error()?;
                    self.timed("release_permit", semaphore.release_permit(lease.held()))
                        .await?
                }
            };
            match reply {
                ReleaseReply::Released => {
                    tracing::debug!("lock released");
                    Ok(())
                }
                ReleaseReply::NotHeldAfterResend if !lease.is_expired() => {
                    tracing::debug!("lock gone when the release was resent: released by its first send");
                    Ok(())
                }
                ReleaseReply::NotHeld | ReleaseReply::NotHeldAfterResend => {
                    tracing::debug!("lock not held on release");
                    Err(LockError::not_held(
                        "this lease no longer holds the lock (released already, expired or taken over)",
                    ))
                }
            }
        }
        .instrument(span)
        .await;
        let operation = on_lease(lease, "release", "release a permit");
        self.finish("release", operation, lease.key(), result)
    }

    /// Reads who holds `key` (an operator call; [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported)
    /// if the backend has none).
    pub async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        let result = match self.admin() {
            Some(admin) => admin.inspect(key).await,
            None => Err(no_admin()),
        };
        self.finish("inspect", "inspect", key, result)
    }

    /// Subscribes to changes of who holds `key`, for observers: `None`
    /// where the backend does not tell them (no operator calls, or
    /// [`LockAdmin::watch_holder`](crate::LockAdmin::watch_holder) says so).
    pub(crate) async fn watch_holder(
        &self,
        key: &LockKey,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        let result = match self.admin() {
            Some(admin) => admin.watch_holder(key).await,
            None => Ok(None),
        };
        self.finish("watch_holder", "watch_holder", key, result)
    }

    /// Reads the live permits of `key`'s semaphore, oldest first, with
    /// their holders' labels (an operator call; see
    /// [`LockAdmin::inspect_permits`]: [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported)
    /// unless the backend declares
    /// [`Capabilities::permit_holder_ids`]).
    pub async fn inspect_permits(&self, key: &LockKey) -> Result<Vec<PermitState>, LockError> {
        let result = match self.admin() {
            Some(admin) => admin.inspect_permits(key).await,
            None => Err(no_admin()),
        };
        self.finish("inspect_permits", "inspect the permits of", key, result)
    }

    /// Deletes the lock at `key` whoever holds it, waking waiters; returns
    /// whether one was held (an operator call; [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported)
    /// if the backend has none).
    pub async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let result = match self.admin() {
            Some(admin) => {
                let result = admin.force_release(key).await;
                if let Ok(was_held) = &result {
                    tracing::info!(backend = self.name(), key = %key, was_held, "lock force-released");
                }
                result
            }
            None => Err(no_admin()),
        };
        self.finish("force_release", "force-release", key, result)
    }

    fn check_issuer(&self, lease: &Lease) -> Result<(), LockError> {
        if lease.issuer() == self.inner.issuer {
            Ok(())
        } else {
            Err(LockError::invalid_input(
                "the lease was issued by another lock client; release or extend it through the client that acquired it",
            ))
        }
    }

    /// One call into the backend, timed for the operation-latency
    /// histogram (every raw acquire, extend and release goes through here).
    async fn timed<T>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<T, LockError>>,
    ) -> Result<T, LockError> {
        let started = Instant::now();
        let result = call.await;
        instrument::operation(self.name(), op, started.elapsed());
        result
    }

    /// The one place a call's error gains its context (this backend, the
    /// `operation`, the key), so that no backend words it; also counts it
    /// under the metric label `op`.
    fn finish<T>(
        &self,
        op: &'static str,
        operation: &str,
        key: &LockKey,
        result: Result<T, LockError>,
    ) -> Result<T, LockError> {
        result.map_err(|e| {
            let e = e.with_context(self.name(), operation, key.as_str());
            instrument::error(self.name(), op, &e);
            e
        })
    }

    /// One attempt under `owner`, inline (not cancel-safe by itself).
    /// Every attempt of one logical acquisition passes the same `owner`, so
    /// the backend recognises a lock an earlier attempt took unseen.
    pub(crate) async fn attempt(
        &self,
        key: &LockKey,
        ttl: Duration,
        attempt: &Attempt,
        owner: OwnerToken,
    ) -> Result<AcquireAttempt, LockError> {
        let span = tracing::debug_span!(
            "distlock.try_acquire",
            backend = self.name(),
            key = %key,
            fencing = tracing::field::Empty,
        );
        let result = async {
            let ttl = self.inner.capabilities.effective_ttl(ttl)?;
            if attempt.permits == Some(0) {
                return Err(LockError::invalid_input(
                    "a limit of 0 permits can never be acquired; use at least 1",
                ));
            }
            // Taken before the request leaves: the lease's deadline can
            // only be earlier than the server's.
            let sent_at = Instant::now();
            let reply = match attempt.permits {
                None => {
                    let request = AcquireRequest {
                        key,
                        owner,
                        ttl,
                        renewing: attempt.renewing,
                        settling: attempt.settling,
                        holder: attempt.holder.as_ref(),
                    };
                    self.timed("acquire", self.raw().acquire(request)).await?
                }
                Some(limit) => {
                    let request = PermitRequest {
                        key,
                        owner,
                        ttl,
                        limit,
                        renewing: attempt.renewing,
                        settling: attempt.settling,
                        holder: attempt.holder.as_ref(),
                    };
                    let semaphore = self.semaphore_or_error()?;
                    match self
                        .timed("acquire_permit", semaphore.acquire_permit(request))
                        .await?
                    {
                        PermitReply::Granted(grant) => AcquireReply::Granted(grant),
                        PermitReply::Full { expires_in } => AcquireReply::Held { expires_in },
                        PermitReply::LimitMismatch { stored } => {
                            return Err(LockError::invalid_input(format!(
                                "the semaphore is held under a limit of {stored} permits, but this call asked for {limit}; use the same limit everywhere (a new limit applies once no permit is held)"
                            )))
                        }
                    }
                }
            };
            match reply {
                AcquireReply::Held { expires_in } => {
                    instrument::attempt(self.name(), false);
                    tracing::trace!(?expires_in, "lock held elsewhere");
                    Ok(AcquireAttempt::Held { expires_in })
                }
                AcquireReply::Granted(grant) => {
                    instrument::attempt(self.name(), true);
                    tracing::Span::current().record("fencing", grant.fencing.get());
                    let lease = Lease::new(
                        key.clone(),
                        owner,
                        grant.fencing,
                        valid_from(sent_at, grant.clock_started),
                        grant.ttl.max(ttl),
                        self.inner.issuer,
                    )
                    .with_handle(grant.handle);
                    let lease = match attempt.permits {
                        Some(limit) => lease.into_permit(limit),
                        None => lease,
                    };
                    if lease.is_expired() {
                        tracing::debug!(late = ?sent_at.elapsed(), "lock granted after its lease could have expired");
                    } else {
                        tracing::debug!("lock acquired");
                    }
                    Ok(AcquireAttempt::Acquired(lease))
                }
            }
        }
        .instrument(span)
        .await;
        self.finish("acquire", attempt.operation(), key, result)
    }

    /// The waiting loop on a task of its own, so that dropping the
    /// caller's future never abandons an attempt in flight: a lease granted
    /// after the caller left is released. When `cancel` completes this
    /// returns `Ok(None)` at once; an attempt in flight finishes on the task,
    /// and a lease it (or the settling attempt after an unknown outcome)
    /// gets is released there. With `guard_options`, a grant already inside
    /// its stop margin is given back and retried while time remains.
    pub(crate) async fn acquire_until<C: Future<Output = ()>>(
        &self,
        key: &LockKey,
        ttl: Duration,
        deadline: Instant,
        attempt: Attempt,
        guard_options: Option<LockOptions>,
        cancel: C,
    ) -> Result<Option<Lease>, LockError> {
        let client = self.clone();
        let task_key = key.clone();
        let operation = attempt.operation();
        let task_attempt = attempt;
        let stop_waiting = CancellationToken::new();
        let task_cancel = stop_waiting.clone();
        let (reply, answer) = oneshot::channel();
        let span = tracing::debug_span!("distlock.acquire", backend = self.name(), key = %key);
        let started = Instant::now();
        self.spawn_background(
            async move {
                let result = wait::acquire_until_cancelled(
                    &client,
                    &task_key,
                    ttl,
                    deadline,
                    &task_attempt,
                    guard_options.as_ref(),
                    &task_cancel,
                )
                .await;
                let outcome = match &result {
                    Ok(Some(_)) => "acquired",
                    Ok(None) => "timed_out",
                    Err(_) => "error",
                };
                instrument::waited(client.name(), outcome, started.elapsed());
                if let Err(Ok(Some(lease))) = reply.send(result) {
                    tracing::debug!(fencing = %lease.fencing_token(), "waiter gone; releasing the lock it was granted");
                    let _ = client.release(&lease).await;
                }
            }
            .instrument(span),
        );
        let _cancel_on_drop = stop_waiting.clone().drop_guard();
        let mut answer = UnreadAnswer {
            answer,
            client: self.clone(),
        };
        let panicked = |_| {
            Err(LockError::unavailable(
                "the acquire task stopped before answering (it panicked, or no tokio runtime runs it)",
            ))
        };
        tokio::select! {
            // Cancel first: a caller that was cancelled never gets a lease.
            biased;
            () = cancel => {
                // At once, even with an attempt in flight: the task finishes
                // it, and this side's answer is dropped unread, so a lease
                // sent now or later is released (UnreadAnswer, the task).
                tracing::debug!(key = %key, "acquire cancelled; a lock still granted is released in the background");
                stop_waiting.cancel();
                Ok(None)
            }
            // Attempts' errors have their context already; this names the
            // call for the others (a failed subscription, a lost task).
            result = &mut answer.answer => result
                .unwrap_or_else(panicked)
                .map_err(|e| e.with_context(self.name(), operation, key.as_str())),
        }
    }

    /// One attempt for a caller that does not wait, polled inline: no task,
    /// no channel (a waiting acquisition's task costs a spawn and a hop per
    /// call). `Ok(None)` if the lock is held. Cancel-safe as
    /// [`acquire_until`](Self::acquire_until): if this future is dropped
    /// while the attempt is in flight, a settling attempt with its owner
    /// token gives back what it took at once, and the attempt itself is
    /// finished on a task of its own, which releases a lock it is granted.
    /// An attempt whose outcome is unknown (a transient error) is settled
    /// in the background, as after a waiting acquisition's last attempt.
    pub(crate) async fn try_once(
        &self,
        key: &LockKey,
        ttl: Duration,
        attempt: Attempt,
    ) -> Result<Option<Lease>, LockError> {
        let span = tracing::debug_span!("distlock.acquire", backend = self.name(), key = %key);
        let started = Instant::now();
        let owner = OwnerToken::random();
        let (client, task_key, task_attempt) = (self.clone(), key.clone(), attempt.clone());
        let in_flight = InFlight {
            attempt: Some(Box::pin(async move {
                client.attempt(&task_key, ttl, &task_attempt, owner).await
            })),
            client: self.clone(),
            key: key.clone(),
            ttl,
            kind: attempt.clone(),
            owner,
        };
        let result = match in_flight.instrument(span).await {
            Ok(AcquireAttempt::Acquired(lease)) => Ok(Some(lease)),
            Ok(AcquireAttempt::Held { .. }) => Ok(None),
            Err(e) => {
                if e.is_transient() {
                    self.settle_in_background(key, ttl, &attempt, owner);
                }
                Err(e)
            }
        };
        let outcome = match &result {
            Ok(Some(_)) => "acquired",
            Ok(None) => "timed_out",
            Err(_) => "error",
        };
        instrument::waited(self.name(), outcome, started.elapsed());
        result
    }

    /// Releases a lease nobody will use, on its own task so that dropping
    /// the caller's future cannot abandon the release; waits for it.
    pub(crate) async fn release_unused(&self, lease: Lease) {
        let client = self.clone();
        let release = self.spawn_background(async move {
            if let Err(e) = client.release(&lease).await {
                tracing::debug!(key = %lease.key(), fencing = %lease.fencing_token(), error = %e, "releasing an unused lease failed; it expires after its TTL");
            }
        });
        if let Some(release) = release {
            let _ = release.await;
        }
    }

    /// Releases `lease` on the current runtime without waiting (a late
    /// grant, a waiter that left). Failing only means it expires by its TTL.
    pub(crate) fn release_in_background(&self, lease: Lease) {
        let client = self.clone();
        self.spawn_background(async move {
            let _ = client.release(&lease).await;
        });
    }

    /// Settles an attempt whose outcome is unknown (it timed out or lost
    /// its connection, and the server may have applied it), in the
    /// background: one more attempt with the same owner token is answered
    /// with that lock if the server holds it for the token (adoption), and
    /// the lock is released. Failing only means it expires by its TTL.
    pub(crate) fn settle_in_background(
        &self,
        key: &LockKey,
        ttl: Duration,
        attempt: &Attempt,
        owner: OwnerToken,
    ) {
        let (client, key, attempt) = (self.clone(), key.clone(), attempt.clone());
        self.spawn_background(async move {
            if let Some(lease) = client.settle(&key, ttl, &attempt, owner).await {
                let _ = client.release(&lease).await;
            }
        });
    }

    /// One more attempt under `owner` after an unknown outcome: the lock
    /// that token holds, if any (a lock it takes now is ours as well).
    pub(crate) async fn settle(
        &self,
        key: &LockKey,
        ttl: Duration,
        attempt: &Attempt,
        owner: OwnerToken,
    ) -> Option<Lease> {
        match self.attempt(key, ttl, &attempt.settling(), owner).await {
            Ok(AcquireAttempt::Acquired(lease)) => {
                tracing::debug!(key = %key, fencing = %lease.fencing_token(), "an attempt whose outcome was unknown had been granted; giving it back");
                Some(lease)
            }
            Ok(AcquireAttempt::Held { .. }) => None,
            Err(e) => {
                tracing::debug!(key = %key, error = %e, "could not settle an attempt whose outcome is unknown; a lock it took expires after its TTL");
                None
            }
        }
    }

    /// Resolves once none of this client's background work runs: waiting
    /// acquisitions whose caller left or was cancelled (an attempt in
    /// flight finishing, a late grant being released), releases of dropped
    /// guards and unused leases, settling attempts whose outcome was
    /// unknown. Also waits for acquisitions in progress on other tasks.
    ///
    /// Background work runs on the tokio runtime; a process that exits
    /// with it pending leaves such locks to expire by their TTL. Await this,
    /// with a timeout, before exiting to give them back:
    ///
    /// ```
    /// # use std::time::Duration;
    /// # async fn demo(client: distlock_core::LockClient) {
    /// let _ = tokio::time::timeout(Duration::from_secs(5), client.idle()).await;
    /// # }
    /// ```
    pub async fn idle(&self) {
        let mut running = self.inner.background.subscribe();
        let _ = running.wait_for(|n| *n == 0).await;
    }

    /// Spawns `task` on the current runtime, counted for [`idle`](Self::idle);
    /// `None` outside a runtime (nothing runs).
    pub(crate) fn spawn_background<F>(&self, task: F) -> Option<tokio::task::JoinHandle<()>>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let count = BackgroundCount::start(self.inner.clone());
        Some(runtime.spawn(async move {
            let _count = count;
            task.await;
        }))
    }
}

/// One running background task of a client, counted until dropped (also
/// when the task is aborted by a runtime shutting down).
struct BackgroundCount(Arc<Inner>);

impl BackgroundCount {
    fn start(inner: Arc<Inner>) -> Self {
        inner.background.send_modify(|n| *n += 1);
        Self(inner)
    }
}

impl Drop for BackgroundCount {
    fn drop(&mut self) {
        self.0.background.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// The error of an operator call on a backend without them.
fn no_admin() -> LockError {
    LockError::unsupported("this backend has no operator calls (inspect, force-release)")
}

/// The operation on `lease` as an error's context names it: `lock` for a
/// lock, `permit` for a semaphore's permit.
fn on_lease(lease: &Lease, lock: &'static str, permit: &'static str) -> &'static str {
    match lease.permit_limit() {
        None => lock,
        Some(_) => permit,
    }
}

/// The instant a lease is dated from: the request's send time, or earlier
/// if the server's clock for it started before (a session lease).
fn valid_from(sent_at: Instant, clock_started: Option<Instant>) -> Instant {
    clock_started.map_or(sent_at, |at| at.min(sent_at))
}

/// One acquisition attempt, owned (it can move to a background task).
type AttemptFuture = Pin<Box<dyn Future<Output = Result<AcquireAttempt, LockError>> + Send>>;

/// The attempt of [`LockClient::try_once`], polled by its caller. Dropped
/// unfinished (its caller left while it was in flight), it is handed to a
/// background task as the waiting loop hands over a cancelled attempt: a
/// settling attempt beside it adopts and releases what it took, and a lock
/// it is granted when its reply comes is released.
struct InFlight {
    attempt: Option<AttemptFuture>,
    client: LockClient,
    key: LockKey,
    ttl: Duration,
    kind: Attempt,
    owner: OwnerToken,
}

impl Future for InFlight {
    type Output = Result<AcquireAttempt, LockError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(attempt) = self.attempt.as_mut() else {
            // Polled again after it answered: never by `try_once`.
            return Poll::Pending;
        };
        let result = std::task::ready!(attempt.as_mut().poll(cx));
        self.attempt = None;
        Poll::Ready(result)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(attempt) = self.attempt.take() else {
            return;
        };
        tracing::debug!(key = %self.key, "try-acquire dropped with its attempt in flight; a lock it takes is given back in the background");
        self.client
            .settle_in_background(&self.key, self.ttl, &self.kind, self.owner);
        let client = self.client.clone();
        self.client.spawn_background(async move {
            if let Ok(AcquireAttempt::Acquired(lease)) = attempt.await {
                let _ = client.release(&lease).await;
            }
        });
    }
}

/// The caller's end of a waiting acquisition. If the caller's future is
/// dropped after the task sent a lease but before it was read, the lease
/// would be dropped unread and stay held for its whole TTL; on drop this
/// releases it.
struct UnreadAnswer {
    answer: oneshot::Receiver<Result<Option<Lease>, LockError>>,
    client: LockClient,
}

impl Drop for UnreadAnswer {
    fn drop(&mut self) {
        // After close(), the task's send fails (and it releases itself), or
        // the value it sent before is here to take.
        self.answer.close();
        if let Ok(Ok(Some(lease))) = self.answer.try_recv() {
            tracing::debug!(key = %lease.key(), fencing = %lease.fencing_token(), "waiter dropped as the lock was granted; releasing it");
            self.client.release_in_background(lease);
        }
    }
}
