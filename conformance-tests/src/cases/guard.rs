//! `guard::` — renewal, the lost signal, max hold, drop, hold-at-least.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{
    AcquireAttempt, ErrorKind, Fire, LockOptions, Locker, LostReason, Renewal, ScheduledJob,
};

use super::support::{
    acquire, background_bound, eventually_acquire, expect_kind, expiry_bound, lock_free_key,
    refused, within,
};
use crate::context::{CaseError, CaseResult, TestContext};
use crate::fault::Link;
use crate::{check, check_eq, Call, ObservedLock};

/// Default renewal (every ttl/3) keeps the lock for 3x its TTL; another
/// client is refused throughout.
///
/// A round in which the guard could not renew in time (a loaded machine:
/// the guard passed its stop moment, `Expired`) proves nothing and is tried
/// again on a new key, up to five times. A refused renewal, or another
/// client let in before the guard's stop moment, fails at once.
pub async fn renewal_keeps_lock_past_ttl(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let other = ctx.client().await?;
    let ttl = ctx.short_ttl();
    let mut late = Vec::new();
    for _ in 0..5 {
        let key = ctx.key("guard");
        let guard = lock_free_key(&locker, &key, &LockOptions::new(ttl)).await?;
        let until = Instant::now() + ttl * 3;
        let mut checks = 0u32;
        let mut renewed_late = false;
        while Instant::now() < until {
            if let Some(reason) = guard.lost_signal().reason() {
                check_eq!(reason, LostReason::Expired, "why the guard lost its lock");
                renewed_late = true;
                break;
            }
            match other.try_acquire(&key, ctx.long_ttl()).await? {
                AcquireAttempt::Held { .. } => {}
                AcquireAttempt::Acquired(lease) => {
                    let answered = Instant::now();
                    other.release(&lease).await?;
                    // Granted after the guard's stop moment: it had not
                    // renewed in time. Before it: the server freed a lock
                    // the guard still held.
                    check!(
                        answered >= guard.stop_moment(),
                        "another client got the lock while the guard renewed it (check {checks})"
                    );
                    renewed_late = true;
                    break;
                }
            }
            checks += 1;
            tokio::time::sleep(ttl / 4).await;
        }
        if let Some(reason) = guard.lost_signal().reason() {
            check_eq!(reason, LostReason::Expired, "why the guard lost its lock");
            renewed_late = true;
        }
        if renewed_late {
            late.push(format!("{key:?} after {checks} checks"));
            drop(guard);
            within(
                Duration::from_secs(30),
                locker.client().idle(),
                "the guard's release",
            )
            .await?;
            continue;
        }
        guard.release().await?;
        let after = acquire(&other, &key, ctx.long_ttl(), "after release").await?;
        other.release(&after).await?;
        return Ok(());
    }
    Err(format!("in five rounds the guard never renewed in time: {late:?}").into())
}

/// Guards of one client renew together where the backend batches extends
/// ([`Capabilities::extend_batch`](distlock_core::Capabilities) above 1),
/// yet each learns its own fate. Eight guards renew on one client; once
/// each has renewed, one guard's lock is deleted behind its back: that
/// guard alone learns `lost()` (refused), and the seven others renew again
/// and keep their locks past their first lease's TTL (another client is
/// refused each). Where the
/// backend batches, some renewal carried more than one lock.
///
/// A round in which a guard could not renew in time (a loaded machine: it
/// passed its stop moment, `Expired`) proves nothing and is tried again,
/// up to five times.
pub async fn renewed_together_each_learns_alone(ctx: TestContext) -> CaseResult {
    const GUARDS: usize = 8;
    let other = ctx.client().await?;
    let ttl = ctx.steady_ttl();
    let mut late = Vec::new();
    for round in 0..5 {
        let observed = Arc::new(ObservedLock::new(ctx.client().await?));
        let client = distlock_core::LockClient::from_arc(observed.clone());
        let locker = Locker::new(client.clone());
        let mut guards = Vec::new();
        for _ in 0..GUARDS {
            let key = ctx.key("together");
            guards.push(lock_free_key(&locker, &key, &LockOptions::new(ttl)).await?);
        }
        let last_acquired = guards.last().map(|g| g.lease().sent_at());
        let start = Instant::now();
        all_renewed_since(start, &guards, ttl, "every guard's first renewal").await?;
        let victim = guards.remove(GUARDS / 2);
        client.release(&victim.lease()).await?;
        let deleted = Instant::now();
        let reason = within(expiry_bound(ttl), victim.lost(), "the deleted guard's loss").await?;
        all_renewed_since(
            deleted,
            &guards,
            ttl,
            "the other guards' renewals after the delete",
        )
        .await?;
        // Past every first lease's TTL: only renewals that reached the
        // server keep the locks now.
        if let Some(acquired) = last_acquired {
            tokio::time::sleep_until((acquired + ttl + ttl / 4).into()).await;
        }
        let expired: Vec<_> = guards
            .iter()
            .filter_map(|g| g.lost_signal().reason())
            .collect();
        if reason == LostReason::Expired || !expired.is_empty() {
            late.push(format!("round {round}: {reason:?}, others {expired:?}"));
            continue;
        }
        check_eq!(
            reason,
            LostReason::Refused,
            "why the deleted guard lost its lock"
        );
        for (i, guard) in guards.iter().enumerate() {
            refused(
                &other,
                &guard.key(),
                &format!("guard {i}, renewed with the others"),
            )
            .await?;
        }
        if client.capabilities().extend_batch > 1 {
            check!(
                observed.largest_extend_batch() > 1,
                "{GUARDS} guards of one client with one TTL renewed one lock per request, although the backend batches up to {} (largest batch: {})",
                client.capabilities().extend_batch,
                observed.largest_extend_batch()
            );
        }
        for guard in guards {
            guard.release().await?;
        }
        return Ok(());
    }
    Err(format!("in five rounds some guard never renewed in time: {late:?}").into())
}

/// Waits until each of `guards` renewed after `at` (or is lost).
async fn all_renewed_since(
    at: Instant,
    guards: &[distlock_core::LockGuard],
    ttl: Duration,
    what: &str,
) -> Result<(), CaseError> {
    let renewed = || {
        guards
            .iter()
            .all(|g| g.is_lost() || g.lease().sent_at() > at)
    };
    within(
        expiry_bound(ttl),
        async {
            while !renewed() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        },
        what,
    )
    .await
}

/// A custom renewal period is used: with `Renewal::Every(ttl / 10)` the
/// guard's fourth extend is sent before the moment (acquisition + TTL) by
/// which the default policy (every TTL/3) could have sent only three — the
/// extends are counted by a transparent [`Link`] in front of the client —
/// and another client is refused throughout.
pub async fn renewal_every_period(ctx: TestContext) -> CaseResult {
    let link = Link::new();
    let locker = Locker::new(link.wrap(ctx.client().await?, Duration::from_secs(5)));
    let other = ctx.client().await?;
    let key = ctx.key("guard");
    // 2 s: the fourth renewal at ttl/10 comes 1.2 s before the TTL runs out,
    // which a loaded machine keeps (at 200 ms the margin was 120 ms).
    let ttl = ctx.steady_ttl();
    let options = LockOptions::new(ttl).with_renewal(Renewal::Every(ttl / 10));
    let guard = lock_free_key(&locker, &key, &options).await?;
    let acquired_at = guard.lease().sent_at();
    let fourth = within(
        expiry_bound(ttl),
        async {
            while link.requests("extend") < 4 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Instant::now()
        },
        "four renewals",
    )
    .await?;
    check!(
        fourth < acquired_at + ttl,
        "the guard sent its fourth renewal only {:?} after acquiring (TTL {ttl:?}): the renewal period ttl/10 was not used",
        fourth - acquired_at
    );
    for i in 0..4 {
        tokio::time::sleep(ttl / 2).await;
        refused(&other, &key, &format!("renewed, check {i}")).await?;
    }
    check!(!guard.is_lost(), "guard lost");
    guard.release().await?;
    Ok(())
}

/// With renewal off the lock runs out after its TTL and the guard says so.
pub async fn renewal_off_expires(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let other = ctx.client().await?;
    let key = ctx.key("guard");
    let ttl = ctx.short_ttl();
    let options = LockOptions::new(ttl).with_renewal(Renewal::Off);
    let guard = lock_free_key(&locker, &key, &options).await?;
    let reason = within(
        expiry_bound(ttl),
        guard.lost(),
        "lost after the TTL without renewal",
    )
    .await?;
    check_eq!(reason, LostReason::Expired, "lost reason");
    check!(guard.is_lost(), "is_lost after lost()");
    let next = eventually_acquire(
        &other,
        &key,
        ctx.long_ttl(),
        expiry_bound(ttl),
        "after expiry",
    )
    .await?;
    expect_kind(
        guard.release().await,
        ErrorKind::NotHeld,
        "releasing an expired guard",
    )?;
    refused(&ctx.client().await?, &key, "the next holder keeps it").await?;
    other.release(&next).await?;
    Ok(())
}

/// The lock is deleted behind the guard's back and taken by someone else:
/// the next renewal is refused and `lost` fires.
pub async fn lost_fires_when_taken(ctx: TestContext) -> CaseResult {
    let client = ctx.client().await?;
    let locker = distlock_core::Locker::new(client.clone());
    let other = ctx.client().await?;
    let key = ctx.key("guard");
    // Why the guard lost the lock is tested, not expiry: a TTL whose first
    // renewal a loaded machine sends before the stop moment (at 200 ms a
    // late renewal made the loss `Expired`).
    let ttl = ctx.steady_ttl();
    let guard = lock_free_key(&locker, &key, &LockOptions::new(ttl)).await?;
    let signal = guard.lost_signal();
    check!(!signal.is_lost(), "lost before anything happened");
    // Delete it through the raw lease on the same client, then take it.
    client.release(&guard.lease()).await?;
    let theirs = acquire(
        &other,
        &key,
        ctx.long_ttl(),
        "other client after the delete",
    )
    .await?;
    let reason = within(
        expiry_bound(ttl),
        guard.lost(),
        "lost after the key was taken",
    )
    .await?;
    check_eq!(reason, LostReason::Refused, "lost reason");
    check!(
        signal.is_lost() && guard.is_lost(),
        "every handle sees the loss"
    );
    check_eq!(signal.reason(), Some(LostReason::Refused), "signal reason");
    expect_kind(
        guard.release().await,
        ErrorKind::NotHeld,
        "releasing a lost guard",
    )?;
    refused(&ctx.client().await?, &key, "the new holder keeps it").await?;
    other.release(&theirs).await?;
    Ok(())
}

/// The lock is deleted behind the guard's back and nobody takes it: the
/// renewal is refused (never recreates the key) and `lost` fires.
pub async fn lost_fires_when_deleted(ctx: TestContext) -> CaseResult {
    let client = ctx.client().await?;
    let locker = distlock_core::Locker::new(client.clone());
    let key = ctx.key("guard");
    let ttl = ctx.short_ttl();
    let guard = lock_free_key(&locker, &key, &LockOptions::new(ttl)).await?;
    client.release(&guard.lease()).await?;
    let reason = within(
        expiry_bound(ttl),
        guard.lost(),
        "lost after the key was deleted",
    )
    .await?;
    check_eq!(reason, LostReason::Refused, "lost reason");
    // The refused renewal did not resurrect the key.
    let other = ctx.client().await?;
    let lease = acquire(&other, &key, ctx.long_ttl(), "key free after the loss").await?;
    other.release(&lease).await?;
    drop(guard);
    Ok(())
}

/// The max hold time stops renewal: the lock is free after max_hold + ttl
/// and `lost` fires.
pub async fn max_hold_stops_renewal(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let other = ctx.client().await?;
    let key = ctx.key("guard");
    let ttl = ctx.short_ttl();
    let max_hold = ttl + ttl / 2;
    let options = LockOptions::new(ttl).with_max_hold(max_hold);
    let guard = lock_free_key(&locker, &key, &options).await?;
    refused(&other, &key, "within max hold").await?;
    let reason = within(
        max_hold + expiry_bound(ttl),
        guard.lost(),
        "lost after max hold",
    )
    .await?;
    check_eq!(reason, LostReason::Expired, "lost reason");
    let next = eventually_acquire(
        &other,
        &key,
        ctx.long_ttl(),
        expiry_bound(ttl),
        "free after max hold",
    )
    .await?;
    other.release(&next).await?;
    drop(guard);
    Ok(())
}

/// Dropping a guard releases the lock in the background (long before its
/// TTL).
pub async fn drop_releases(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let key = ctx.key("guard");
    let guard = locker
        .try_lock(&key, &LockOptions::new(ctx.long_ttl()))
        .await?
        .ok_or("free key refused")?;
    let token = guard.fencing_token();
    drop(guard);
    let other = ctx.locker().await?;
    let options = LockOptions::new(ctx.long_ttl()).with_wait(background_bound());
    let next = other.acquire(&key, &options).await?.ok_or(
        "a dropped guard's lock was not released (it would only expire after the long TTL)",
    )?;
    check!(next.fencing_token() > token, "token grows");
    next.release().await?;
    Ok(())
}

/// Hold-at-least: after an early release the key stays held until the
/// minimum time, then it is free.
pub async fn hold_at_least_keeps_key(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let other = ctx.client().await?;
    let key = ctx.key("guard");
    let min = (ctx.short_ttl() * 2).max(Duration::from_secs(1));
    let options = LockOptions::new(ctx.long_ttl()).with_hold_at_least(min);
    let guard = lock_free_key(&locker, &key, &options).await?;
    guard.release().await?;
    refused(
        &other,
        &key,
        "right after an early release with hold-at-least",
    )
    .await?;
    // Free after the minimum, far before the long TTL.
    tokio::time::sleep(min / 2).await;
    let next = eventually_acquire(
        &other,
        &key,
        ctx.long_ttl(),
        expiry_bound(min),
        "after the minimum hold",
    )
    .await?;
    other.release(&next).await?;
    Ok(())
}

/// Hold-at-least counts from when the grant arrived, not from an earlier
/// lease start. A lock on a shared renewal session (etcd) is dated, for its
/// expiry, from the session's last keep-alive, which may be most of a
/// renewal period old: a minimum hold measured from there ends early, and
/// a late scheduler instance runs the same fire again. Each round takes a
/// lock most of a renewal period after the client's first renewing lock
/// (when a session's last keep-alive is old), releases it at once, and
/// asks for it two thirds into the minimum hold; a round whose answer came
/// after the minimum (a stalled machine) proves nothing and is not counted.
pub async fn hold_at_least_counts_from_the_grant(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let other = ctx.client().await?;
    // Long enough that a hold cut short by most of a renewal period (a
    // third of the TTL) ends before the check even after rounding up to
    // whole seconds (etcd).
    let ttl = ctx.capabilities().effective_ttl(Duration::from_secs(9))?;
    let min = ttl / 2;
    let session = locker
        .try_lock(&ctx.key("session"), &LockOptions::new(ttl))
        .await?
        .ok_or("free key refused")?;
    let mut conclusive = 0;
    for round in 0..2 {
        tokio::time::sleep(ttl / 3 * 9 / 10).await;
        let key = ctx.key("hold-from-grant");
        let options = LockOptions::new(ttl).with_hold_at_least(min);
        let guard = locker
            .try_lock(&key, &options)
            .await?
            .ok_or("free key refused")?;
        let granted = Instant::now();
        guard.release().await?;
        tokio::time::sleep_until((granted + min * 2 / 3).into()).await;
        let reply = other.try_acquire(&key, ttl).await?;
        let answered = Instant::now();
        if let AcquireAttempt::Acquired(lease) = reply {
            other.release(&lease).await?;
            check!(
                answered >= granted + min,
                "round {round}: the key was free {:?} after the grant, inside its minimum hold of {min:?} (released at once with hold-at-least)",
                answered - granted
            );
            continue;
        }
        conclusive += usize::from(answered < granted + min);
    }
    session.release().await?;
    check!(
        conclusive > 0,
        "no round was answered within the minimum hold of {min:?}: the case proved nothing"
    );
    Ok(())
}

/// Hold-at-least that has already passed releases normally, at once.
pub async fn hold_at_least_elapsed_releases(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let other = ctx.client().await?;
    let key = ctx.key("guard");
    let min = Duration::from_millis(100);
    let options = LockOptions::new(ctx.long_ttl()).with_hold_at_least(min);
    let guard = lock_free_key(&locker, &key, &options).await?;
    tokio::time::sleep(min * 2).await;
    guard.release().await?;
    let next = acquire(
        &other,
        &key,
        ctx.long_ttl(),
        "right after a release past the minimum",
    )
    .await?;
    other.release(&next).await?;
    Ok(())
}

/// try_lock gives None for a held key and a guard for a free one; the
/// guard's accessors describe the acquisition.
pub async fn try_lock_and_accessors(ctx: TestContext) -> CaseResult {
    let a = ctx.locker().await?;
    let b = ctx.locker().await?;
    let key = ctx.key("guard");
    let options = LockOptions::new(ctx.long_ttl());
    let guard = a
        .try_lock(&key, &options)
        .await?
        .ok_or("free key refused")?;
    check_eq!(guard.key(), key, "guard key");
    check_eq!(guard.lease().key().clone(), key, "lease key");
    check_eq!(
        guard.lease().fencing_token(),
        guard.fencing_token(),
        "tokens agree"
    );
    check!(!guard.is_lost(), "fresh guard is lost");
    check!(
        b.try_lock(&key, &options).await?.is_none(),
        "held key granted to try_lock"
    );
    guard.release().await?;
    let second = b
        .try_lock(&key, &options)
        .await?
        .ok_or("released key refused")?;
    second.release().await?;
    Ok(())
}

/// A released guard's lost signal never fires (release is not loss).
pub async fn release_is_not_loss(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let key = ctx.key("guard");
    let ttl = ctx.short_ttl();
    let guard = lock_free_key(&locker, &key, &LockOptions::new(ttl)).await?;
    let signal = guard.lost_signal();
    guard.release().await?;
    tokio::time::sleep(ttl + ttl / 2).await;
    check!(
        !signal.is_lost(),
        "a released guard reported its lock lost ({:?})",
        signal.reason()
    );
    Ok(())
}

/// Suspected: `release()` must not count as done before the server
/// answered. A caller that drops the release future (a timeout around it)
/// leaves the lock to the guard's background release, not to its TTL.
pub async fn dropped_release_future_still_releases(ctx: TestContext) -> CaseResult {
    let observed = Arc::new(ObservedLock::new(ctx.client().await?));
    let other = ctx.client().await?;
    let key = ctx.key("guard");
    let guard = Locker::new(observed.clone())
        .try_lock(&key, &LockOptions::new(ctx.long_ttl()))
        .await?
        .ok_or("free key refused")?;
    observed.hold_requests(Call::Release);
    let release = tokio::spawn(guard.release());
    within(
        background_bound(),
        observed.until_waiting(Call::Release, 1),
        "the release request reaches the hold",
    )
    .await?;
    // The caller gives up before the request was sent.
    release.abort();
    let _ = release.await;
    observed.open(Call::Release);
    let next = eventually_acquire(
        &other,
        &key,
        ctx.long_ttl(),
        background_bound(),
        "after the release future was dropped (else held for the long TTL)",
    )
    .await?;
    other.release(&next).await?;
    Ok(())
}

/// Suspected: a max hold shorter than a third of the TTL was ignored (no
/// renewal came before it, so the lock lasted the whole TTL). The lock must
/// end at the max hold and `lost` fire by then.
pub async fn short_max_hold_ends_lock_early(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let other = ctx.client().await?;
    let key = ctx.key("guard");
    let max_hold = ctx.short_ttl();
    let options = LockOptions::new(ctx.long_ttl()).with_max_hold(max_hold);
    let guard = lock_free_key(&locker, &key, &options).await?;
    let reason = within(
        expiry_bound(max_hold),
        guard.lost(),
        "lost after a max hold far shorter than the TTL",
    )
    .await?;
    check_eq!(reason, LostReason::Expired, "lost reason");
    let next = eventually_acquire(
        &other,
        &key,
        ctx.long_ttl(),
        expiry_bound(max_hold),
        "free after the max hold (not after the long TTL)",
    )
    .await?;
    other.release(&next).await?;
    drop(guard);
    Ok(())
}

/// Huge durations are typed errors or saturate, never a panic (a
/// panic after the grant leaked the lease; one in the renewal task meant
/// `lost` never fired).
pub async fn huge_durations_rejected_or_saturated(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let other = ctx.client().await?;
    let key = ctx.key("guard");
    let long = ctx.long_ttl();
    // A huge max hold means no limit.
    let guard = locker
        .try_lock(&key, &LockOptions::new(long).with_max_hold(Duration::MAX))
        .await?
        .ok_or("free key refused")?;
    check!(
        !guard.is_lost(),
        "a guard with no effective max hold is lost"
    );
    guard.release().await?;
    // A huge minimum hold cannot be kept by any server: refused up front.
    expect_kind(
        locker
            .try_lock(
                &key,
                &LockOptions::new(long).with_hold_at_least(Duration::MAX),
            )
            .await,
        ErrorKind::InvalidInput,
        "hold_at_least(Duration::MAX)",
    )?;
    // A renewal period past the stop moment could never renew: refused.
    expect_kind(
        locker
            .try_lock(
                &key,
                &LockOptions::new(long).with_renewal(Renewal::Every(Duration::MAX)),
            )
            .await,
        ErrorKind::InvalidInput,
        "Renewal::Every(Duration::MAX)",
    )?;
    // Nothing was left held by the refused calls.
    let lease = acquire(&other, &key, long, "after the refused calls").await?;
    other.release(&lease).await?;
    // Scheduled jobs: a huge window or period is a typed error.
    let name = ctx.key("guard-schedule").as_str().to_owned();
    let job = ScheduledJob::new(name.clone(), Duration::from_secs(60))?.with_window(Duration::MAX);
    expect_kind(
        job.run(&locker, Fire::Now, |_| async {}).await,
        ErrorKind::InvalidInput,
        "ScheduledJob window(Duration::MAX)",
    )?;
    let job = ScheduledJob::new(name, Duration::MAX)?;
    expect_kind(
        job.run(&locker, Fire::Now, |_| async {}).await,
        ErrorKind::InvalidInput,
        "ScheduledJob with period Duration::MAX",
    )?;
    Ok(())
}

/// Stop before expiry: without renewal, `lost` fires the stop margin before
/// the lease may run out — the server still holds the lock then, and the
/// guard can still release it.
pub async fn lost_fires_a_stop_margin_before_expiry(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let other = ctx.client().await?;
    let key = ctx.key("guard");
    let ttl = ctx.long_ttl();
    // All but one second of the TTL is margin: lost fires about a second
    // in, the server holds the lock for another minute.
    let options = LockOptions::new(ttl)
        .with_renewal(Renewal::Off)
        .with_stop_margin(ttl - Duration::from_secs(1));
    let guard = lock_free_key(&locker, &key, &options).await?;
    check!(
        guard.stop_moment() < guard.lease().valid_until(),
        "the stop moment is before the lease's conservative expiry"
    );
    let reason = within(background_bound(), guard.lost(), "lost at the stop moment").await?;
    check_eq!(reason, LostReason::Expired, "lost reason");
    refused(
        &other,
        &key,
        "the server still holds the lock at the stop moment",
    )
    .await?;
    guard.release().await?;
    let next = acquire(
        &other,
        &key,
        ctx.long_ttl(),
        "after the stopped guard released",
    )
    .await?;
    other.release(&next).await?;
    Ok(())
}

/// A stop margin that leaves no time to hold the lock, or a renewal period
/// that would come after the stop moment, is refused before anything is
/// sent.
pub async fn unworkable_stop_margin_rejected(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let key = ctx.key("guard");
    let ttl = ctx.long_ttl();
    for (options, what) in [
        (
            LockOptions::new(ttl).with_stop_margin(ttl),
            "a margin as long as the TTL",
        ),
        (
            LockOptions::new(ttl)
                .with_stop_margin(ttl / 2)
                .with_renewal(Renewal::Every(ttl / 2)),
            "renewal at the stop moment",
        ),
        (
            LockOptions::new(ttl).with_max_hold(Duration::ZERO),
            "a zero max hold",
        ),
    ] {
        expect_kind(
            locker.try_lock(&key, &options).await,
            ErrorKind::InvalidInput,
            what,
        )?;
    }
    let lease = acquire(&ctx.client().await?, &key, ttl, "nothing was sent").await?;
    ctx.client().await?.release(&lease).await.ok();
    Ok(())
}

/// `acquire_unless`: cancelled while an attempt is in flight (the server
/// granted the lock, its reply is held), it returns `Ok(None)` at once —
/// while the reply is still held, so it cannot have waited for it. The
/// attempt finishes on its task, which gives the late grant back: once the
/// client is idle ([`LockClient::idle`](distlock_core::LockClient::idle))
/// the key is free, long before its 60 s TTL.
pub async fn cancel_returns_at_once_and_late_grant_is_released(ctx: TestContext) -> CaseResult {
    let slow = Arc::new(ObservedLock::new(ctx.client().await?));
    let locker = Locker::new(slow.clone());
    let other = ctx.client().await?;
    let key = ctx.key("guard");
    slow.hold_replies(Call::Acquire);
    let (cancel_tx, cancel_rx) = tokio::sync::oneshot::channel::<()>();
    let acquiring = {
        let (key, locker) = (key.clone(), locker.clone());
        let options = LockOptions::new(ctx.long_ttl()).with_wait(ctx.long_ttl());
        tokio::spawn(async move {
            locker
                .acquire_unless(&key, &options, async {
                    let _ = cancel_rx.await;
                })
                .await
        })
    };
    within(
        background_bound(),
        slow.until_waiting(Call::Acquire, 1),
        "the grant reaches the hold",
    )
    .await?;
    check!(
        slow.last_granted().is_some(),
        "the server granted the lock whose reply is held"
    );
    let _ = cancel_tx.send(());
    let result = within(background_bound(), acquiring, "the cancelled acquire")
        .await?
        .map_err(|e| format!("acquire task panicked: {e}"))??;
    check!(result.is_none(), "a cancelled acquire returned a guard");
    // The attempt is still in flight (beside it, the client may already
    // have sent the settling attempt that gives back what it took; its
    // reply is held too).
    let in_flight = slow.waiting(Call::Acquire);
    check!(
        (1..=2).contains(&in_flight),
        "the attempt in flight when the acquire returned: {in_flight} acquires waiting for their replies, expected the attempt (and its settling attempt)"
    );
    refused(&other, &key, "while the late grant is still on its way").await?;
    slow.open(Call::Acquire);
    within(
        background_bound(),
        locker.client().idle(),
        "the client's background work",
    )
    .await?;
    let lease = acquire(
        &other,
        &key,
        ctx.long_ttl(),
        "once the late grant was given back",
    )
    .await?;
    other.release(&lease).await?;
    Ok(())
}
