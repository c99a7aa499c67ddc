//! `fault::` cases where the server is down or cut off: every call is an
//! `Unavailable` or `Timeout` error, never an answer (`Held`, `NotHeld`,
//! `Skipped`, a success), and a renewal that meets a brief outage keeps
//! its guard.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock_core::{
    AcquireAttempt, ErrorKind, LockClient, LockError, LockKey, LockOptions, Locker, OwnerToken,
    RunOptions,
};

use super::{fault_ttl, ErrorTally, EXPIRY_SLACK};
use crate::cases::support::{acquire, refused, within};
use crate::check;
use crate::context::{CaseError, CaseResult, TestContext};

/// What a fault turned a call into: a typed transient error is right;
/// anything that looks like an answer from the server is not.
fn expect_unreachable<T: std::fmt::Debug>(
    result: Result<T, LockError>,
    what: &str,
) -> Result<(), CaseError> {
    match result {
        Err(e) if matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::Timeout) => Ok(()),
        Err(e) => Err(CaseError(format!(
            "{what}: expected Unavailable or Timeout, got {:?}: {e}",
            e.kind()
        ))),
        Ok(answer) => Err(CaseError(format!(
            "{what}: expected Unavailable or Timeout, got an answer as if the server had replied: {answer:?} (a dead server must not look like a lock held elsewhere)"
        ))),
    }
}

/// A server that is down, or cut off by a black hole, yields `Unavailable`
/// or `Timeout` from `try_acquire` and `try_acquire_renewing` — on a free
/// key and on a key another client holds — and from `Locker::try_lock`
/// and `run_exclusive`; never `Held`/`None`/`Skipped`, which would make
/// every job skip silently while the lock server is dead. Afterwards the
/// same client works again by itself.
pub async fn unreachable_is_an_error_not_held(ctx: TestContext) -> CaseResult {
    let path = ctx.fault_path().await?;
    let client = ctx.client_through(&path).await?;
    let holder = ctx.client().await?;
    let ttl = fault_ttl(&ctx, Duration::from_secs(2))?;
    let free = ctx.key("fault-unreachable");
    let held = ctx.key("fault-unreachable");
    let held_lease = acquire(&holder, &held, ctx.long_ttl(), "the other holder").await?;
    let lease = acquire(&client, &free, ttl, "through the path, reachable").await?;
    client.release(&lease).await?;
    refused(&client, &held, "through the path, reachable").await?;
    let locker = Locker::new(client.clone());
    let hang = Duration::from_secs(30);
    for (fault, apply) in [("down", true), ("black-holed", false)] {
        if apply {
            path.down();
        } else {
            path.black_hole();
        }
        let options = LockOptions::new(ttl);
        let run_options = RunOptions::new(options.clone());
        let (plain_free, plain_held, renewing_free, renewing_held, guard, run) = tokio::join!(
            within(hang, client.try_acquire(&free, ttl), "try_acquire"),
            within(hang, client.try_acquire(&held, ttl), "try_acquire"),
            within(
                hang,
                client.try_acquire_renewing(&free, ttl),
                "try_acquire_renewing"
            ),
            within(
                hang,
                client.try_acquire_renewing(&held, ttl),
                "try_acquire_renewing"
            ),
            within(hang, locker.try_lock(&held, &options), "try_lock"),
            within(
                hang,
                locker.run_exclusive(&held, &run_options, |_| async {}),
                "run_exclusive"
            ),
        );
        expect_unreachable(
            plain_free?,
            &format!("server {fault}: try_acquire of a free key"),
        )?;
        expect_unreachable(
            plain_held?,
            &format!("server {fault}: try_acquire of a held key"),
        )?;
        expect_unreachable(
            renewing_free?,
            &format!("server {fault}: try_acquire_renewing of a free key"),
        )?;
        expect_unreachable(
            renewing_held?,
            &format!("server {fault}: try_acquire_renewing of a held key"),
        )?;
        expect_unreachable(
            guard?,
            &format!("server {fault}: Locker::try_lock of a held key"),
        )?;
        expect_unreachable(
            run?,
            &format!("server {fault}: run_exclusive of a held key"),
        )?;
        path.up();
        path.heal();
    }
    // Requests a black hole held back may land late and take the free key
    // for their TTL; the client recovers by itself either way.
    let errors = ErrorTally::default();
    let give_up = Instant::now() + ttl + EXPIRY_SLACK * 3;
    let lease = loop {
        match within(
            hang,
            client.try_acquire(&free, ttl),
            "try_acquire after the faults",
        )
        .await?
        {
            Ok(AcquireAttempt::Acquired(lease)) => break lease,
            Ok(AcquireAttempt::Held { .. }) => {}
            Err(e) => errors.record("try_acquire after the faults", e)?,
        }
        if Instant::now() >= give_up {
            return Err(format!(
                "the client did not recover after the server came back (errors {})",
                errors.summary()
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    client.release(&lease).await?;
    refused(&client, &held, "the other holder kept its lock").await?;
    holder.release(&held_lease).await?;
    Ok(())
}

/// Where a renewal ended, as [`ExtendLog`] saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExtendOutcome {
    Extended,
    NotHeld,
    Failed(ErrorKind),
}

/// Forwards everything to the backend of a client, recording when each
/// `extend` started and how it ended, so a case can see a renewal meet a
/// fault and the next one succeed.
#[derive(Debug)]
struct ExtendLog {
    inner: Arc<dyn distlock_core::LockBackend>,
    extends: Mutex<Vec<(Instant, ExtendOutcome)>>,
}

impl ExtendLog {
    fn new(client: &LockClient) -> Arc<Self> {
        Arc::new(Self {
            inner: client.backend().clone(),
            extends: Mutex::new(Vec::new()),
        })
    }

    /// Waits for the first extend that started at or after `since` to end.
    async fn first_since(&self, since: Instant) -> ExtendOutcome {
        loop {
            let first = self
                .extends
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .find(|(started, _)| *started >= since)
                .map(|(_, outcome)| *outcome);
            if let Some(outcome) = first {
                return outcome;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits for an extend that started at or after `since` to succeed.
    async fn extended_since(&self, since: Instant) {
        loop {
            let extended = self
                .extends
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .any(|(started, outcome)| *started >= since && *outcome == ExtendOutcome::Extended);
            if extended {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl ExtendLog {
    /// Records one extend's outcome, sent at `started`.
    fn log(&self, started: Instant, reply: &Result<distlock_core::ExtendReply, LockError>) {
        let outcome = match reply {
            Ok(distlock_core::ExtendReply::Extended(_)) => ExtendOutcome::Extended,
            Ok(distlock_core::ExtendReply::NotHeld) => ExtendOutcome::NotHeld,
            Err(e) => ExtendOutcome::Failed(e.kind()),
        };
        self.extends
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((started, outcome));
    }
}

#[deny(clippy::missing_trait_methods)]
#[distlock_core::async_trait]
impl distlock_core::LockBackend for ExtendLog {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capabilities(&self) -> distlock_core::Capabilities {
        self.inner.capabilities()
    }

    async fn acquire(
        &self,
        request: distlock_core::AcquireRequest<'_>,
    ) -> Result<distlock_core::AcquireReply, LockError> {
        self.inner.acquire(request).await
    }

    async fn extend(
        &self,
        lock: distlock_core::HeldLock<'_>,
        ttl: Duration,
    ) -> Result<distlock_core::ExtendReply, LockError> {
        let started = Instant::now();
        let reply = self.inner.extend(lock, ttl).await;
        self.log(started, &reply);
        reply
    }

    async fn extend_many(
        &self,
        locks: &[distlock_core::HeldLock<'_>],
        ttl: Duration,
    ) -> Result<Vec<Result<distlock_core::ExtendReply, LockError>>, LockError> {
        let started = Instant::now();
        let replies = self.inner.extend_many(locks, ttl).await;
        match &replies {
            Ok(replies) => replies.iter().for_each(|reply| self.log(started, reply)),
            Err(e) => {
                let failed = Err(e.duplicate());
                locks.iter().for_each(|_| self.log(started, &failed));
            }
        }
        replies
    }

    async fn release(
        &self,
        lock: distlock_core::HeldLock<'_>,
    ) -> Result<distlock_core::ReleaseReply, LockError> {
        self.inner.release(lock).await
    }

    async fn watch(
        &self,
        key: &LockKey,
        waiter: OwnerToken,
    ) -> Result<Option<distlock_core::ReleaseWatch>, LockError> {
        self.inner.watch(key, waiter).await
    }

    fn admin(&self) -> Option<&dyn distlock_core::LockAdmin> {
        self.inner.admin()
    }

    fn semaphore(&self) -> Option<&dyn distlock_core::SemaphoreBackend> {
        self.inner.semaphore()
    }
}

/// `release` of `lease` through `client`, retried while the client
/// reconnects after a fault (transient errors), until `bound`.
async fn release_after_fault(
    client: &LockClient,
    lease: &distlock_core::Lease,
    bound: Duration,
    what: &str,
) -> CaseResult {
    let give_up = Instant::now() + bound;
    loop {
        match client.release(lease).await {
            Ok(()) => return Ok(()),
            Err(e) if e.is_transient() && Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => {
                return Err(CaseError(format!(
                    "{what}: release after the fault failed with {:?}: {e}",
                    e.kind()
                )))
            }
        }
    }
}

/// An extend or a release that cannot reach the server (down: every call
/// refused; black-holed: no reply) is an `Unavailable` or `Timeout` error,
/// for a plain and a renewing lock: never `NotHeld` (a guard would give up
/// a lock the server still holds for it) and never a success (a job would
/// believe its lock renewed, or free for the next run). With the server
/// down nothing reached it, so afterwards the server still holds each lock
/// for its holder, and the holder releases it for real.
pub async fn unreachable_extend_and_release_are_errors(ctx: TestContext) -> CaseResult {
    let path = ctx.fault_path().await?;
    let client = ctx.client_through(&path).await?;
    let observer = ctx.client().await?;
    let ttl = fault_ttl(&ctx, Duration::from_secs(30))?;
    let hang = Duration::from_secs(30);
    for (fault, down) in [("down", true), ("black-holed", false)] {
        let mut leases = Vec::new();
        for renewing in [false, true] {
            let key = ctx.key("fault-unreachable-release");
            let attempt = if renewing {
                client.try_acquire_renewing(&key, ttl).await?
            } else {
                client.try_acquire(&key, ttl).await?
            };
            let AcquireAttempt::Acquired(lease) = attempt else {
                return Err(format!("a free key must be acquired, got {attempt:?}").into());
            };
            leases.push((renewing, lease));
        }
        if down {
            path.down();
        } else {
            path.black_hole();
        }
        for (renewing, lease) in &leases {
            let what = format!("server {fault}, renewing: {renewing}");
            let extended = within(hang, client.extend(lease, ttl), "extend").await?;
            expect_unreachable(extended, &format!("{what}: extend"))?;
            let released = within(hang, client.release(lease), "release").await?;
            expect_unreachable(released, &format!("{what}: release"))?;
        }
        path.up();
        path.heal();
        for (renewing, lease) in &leases {
            let what = format!("server {fault}, renewing: {renewing}");
            if down {
                // Nothing reached the server.
                check!(
                    crate::cases::support::still_held_by(&observer, lease.key(), lease.fencing_token())
                        .await?,
                    "{what}: after an extend and a release that failed, the server no longer holds the lock (token {}) for its holder",
                    lease.fencing_token()
                );
                release_after_fault(&client, lease, hang, &what).await?;
                let next = acquire(&observer, lease.key(), ctx.long_ttl(), &what).await?;
                observer.release(&next).await?;
            } else {
                // What the black hole held back may land late: the outcome
                // is unknown, the lock is released or runs out.
                let _ = client.release(lease).await;
            }
        }
    }
    Ok(())
}

/// A brief outage during one renewal does not lose the guard: the server
/// goes down (every call refused) right after a renewing guard is granted
/// its lock, until its first renewal (a third of the TTL in) has failed;
/// that renewal must fail with `Unavailable`/`Timeout`, not `NotHeld`.
/// Once the server is back the guard's retry renews the lock: the guard is
/// not lost, and the server holds the lock for it until it releases.
pub async fn renewal_outage_keeps_guard(ctx: TestContext) -> CaseResult {
    // A third of it between the failed renewal and the stop moment, for the
    // failure to surface and the client to reconnect.
    let ttl = fault_ttl(&ctx, Duration::from_secs(12))?;
    let path = ctx.fault_path().await?;
    let log = ExtendLog::new(&ctx.client_through(&path).await?);
    let observer = ctx.client().await?;
    let key = ctx.key("fault-renewal-outage");
    let guard = Locker::new(LockClient::new(log.clone()))
        .acquire(
            &key,
            &LockOptions::new(ttl).with_wait(Duration::from_secs(20)),
        )
        .await?
        .ok_or("the key should be free")?;
    let down_at = Instant::now();
    path.down();
    let first = within(ttl, log.first_since(down_at), "the guard's first renewal").await;
    path.up();
    match first? {
        ExtendOutcome::Failed(ErrorKind::Unavailable | ErrorKind::Timeout) => {}
        ExtendOutcome::NotHeld => {
            return Err(
                "a renewal that could not reach the server (down) was answered NotHeld: the guard gives up a lock the server still holds for it".into(),
            )
        }
        outcome => {
            return Err(format!(
                "a renewal against a server that is down ended {outcome:?}; expected an Unavailable or Timeout error"
            )
            .into())
        }
    }
    let up_at = Instant::now();
    tokio::select! {
        renewed = within(ttl, log.extended_since(up_at), "a renewal after the outage") => renewed?,
        reason = guard.lost() => {
            return Err(format!("the guard was lost ({reason:?}) after one renewal failed transiently").into())
        }
    }
    check!(
        !guard.is_lost(),
        "the guard was lost ({:?}) although a renewal after the outage succeeded",
        guard.lost_signal().reason()
    );
    check!(
        crate::cases::support::still_held_by(&observer, &key, guard.fencing_token()).await?,
        "the server does not hold the lock for the renewed guard"
    );
    guard.release().await?;
    let next = acquire(&observer, &key, ctx.long_ttl(), "after the guard released").await?;
    observer.release(&next).await?;
    Ok(())
}
