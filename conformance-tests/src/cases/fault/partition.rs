//! `fault::` cases that cut a client off from the server through its
//! fault path (a TCP proxy, or the simulated network): a black-holed
//! holder, connections reset mid-operation, and `run_exclusive` losing its
//! lock to a partition.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{
    AcquireAttempt, FencingToken, LockKey, LockOptions, Locker, LostReason, RunOptions,
};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::{fault_ttl, join, measure, ErrorTally, EXPIRY_SLACK};
use crate::cases::support::{
    background_bound, eventually_acquire, every_key_free_within, expect_stopped, holder_id, within,
};
use crate::checker::ExclusionChecker;
use crate::context::{CaseError, CaseResult, TestContext};
use crate::fault::Direction;
use crate::{check, check_eq};

/// A critical section of `token` on `key` in `checker`, from now until
/// `lost` fires: the task answers why, and when it fired.
fn section_until_lost(
    checker: &Arc<ExclusionChecker>,
    key: &LockKey,
    token: FencingToken,
    lost: impl Future<Output = LostReason> + Send + 'static,
) -> JoinHandle<Result<(LostReason, Instant), CaseError>> {
    let (checker, key) = (checker.clone(), key.clone());
    tokio::spawn(async move {
        let section = checker.enter(&key, token);
        let reason = lost.await;
        let at = Instant::now();
        section.exit();
        Ok((reason, at))
    })
}

/// Joins `section` (see [`section_until_lost`]) and checks that its
/// holder, cut off, lost by expiry, and that both its `lost()` and the end
/// of its lease (`valid_until`) came no later than `taken_at`, when
/// another client took the key: when it fired.
async fn lost_before_taken(
    section: JoinHandle<Result<(LostReason, Instant), CaseError>>,
    valid_until: Instant,
    taken_at: Instant,
    who: &str,
) -> Result<Instant, CaseError> {
    let (reason, lost_at) = join(section, background_bound(), &format!("{who}'s lost()")).await?;
    check_eq!(reason, LostReason::Expired, "why {who} lost");
    check!(
        valid_until <= taken_at,
        "{who}'s lease was still valid when another client took the key"
    );
    check!(
        lost_at <= taken_at,
        "{who}'s lost() fired {:?} after another client took the key",
        lost_at - taken_at
    );
    Ok(lost_at)
}

/// The holder's connection is black-holed: its guard's `lost()` fires, and
/// only after that (an ordering, not a duration) does a second client,
/// talking to the server directly, get the lock; the checker sees no
/// overlap between the holder's critical section (ended by `lost()`) and
/// the second client's.
pub async fn black_holed_holder_loses_first(ctx: TestContext) -> CaseResult {
    let proxy = ctx.fault_path().await?;
    let via_proxy = ctx.client_through(&proxy).await?;
    let direct = ctx.client().await?;
    let key = ctx.key("fault-blackhole");
    let ttl = fault_ttl(&ctx, Duration::from_secs(2))?;
    let guard = Locker::new(via_proxy)
        .try_lock(&key, &LockOptions::new(ttl))
        .await?
        .ok_or("the key should be free")?;
    let checker = ExclusionChecker::new();
    let holder_token = guard.fencing_token();
    let holder_section = section_until_lost(&checker, &key, holder_token, guard.lost());
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.black_hole();
    let cut_at = Instant::now();
    let bound = ttl * 2 + EXPIRY_SLACK;
    let lease = eventually_acquire(&direct, &key, ttl, bound, "the direct client").await?;
    let acquired_at = Instant::now();
    checker.critical_section(&key, lease.fencing_token()).await;
    let lost_at = lost_before_taken(
        holder_section,
        guard.lease().valid_until(),
        acquired_at,
        "the holder",
    )
    .await?;
    check!(
        lease.fencing_token() > holder_token,
        "the second client's token grows"
    );
    checker.verify()?;
    measure(
        &ctx,
        "black_holed_holder_loses_first",
        format_args!(
            "TTL {ttl:?}; black hole to lost {:?}; lost to other client's acquire {:?}",
            lost_at - cut_at,
            acquired_at - lost_at
        ),
    );
    direct.release(&lease).await?;
    drop(guard);
    drop(proxy);
    Ok(())
}

/// A leader's connection is black-holed while a standby campaigns on
/// another client, and an observer follows on a third: the leader's
/// `lost()` fires, and only after that (an ordering, not a duration) does
/// the standby lead, with a newer term; its leadership's lease outlives
/// the old one's, and the observer reports the old leader's term and
/// then the new one's, never an older term after a newer.
pub async fn partitioned_leader_loses_first(ctx: TestContext) -> CaseResult {
    let proxy = ctx.fault_path().await?;
    let via_proxy = Locker::new(ctx.client_through(&proxy).await?);
    let (standby, observer) = (ctx.locker().await?, ctx.locker().await?);
    let key = ctx.key("fault-partitioned-leader");
    let ttl = fault_ttl(&ctx, Duration::from_secs(2))?;
    let options = LockOptions::new(ttl);
    let leading = via_proxy
        .campaign(&key, &holder_id("partitioned")?, &options)
        .await?;
    let old_term = leading.term();
    let mut watch = observer
        .observe(&key)
        .with_poll_interval(Duration::from_millis(100));
    let first = within(
        background_bound(),
        watch.changed(),
        "the observer's first answer",
    )
    .await??;
    check_eq!(
        first.map(|l| l.term),
        Some(old_term),
        "the observer sees the leader"
    );
    let checker = ExclusionChecker::new();
    let leader_section = section_until_lost(&checker, &key, old_term, leading.lost());
    let campaign = {
        let (key, options, identity) = (key.clone(), options.clone(), holder_id("standby")?);
        tokio::spawn(async move { standby.campaign(&key, &identity, &options).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.black_hole();
    let bound = ttl * 2 + EXPIRY_SLACK;
    let next = within(bound, campaign, "the standby's leadership")
        .await?
        .map_err(|e| CaseError(format!("the standby panicked: {e}")))??;
    let led_at = Instant::now();
    checker.critical_section(&key, next.term()).await;
    lost_before_taken(
        leader_section,
        leading.guard().lease().valid_until(),
        led_at,
        "the partitioned leader",
    )
    .await?;
    check!(
        next.term() > old_term,
        "the new term {} is newer than {old_term}",
        next.term()
    );
    // The observer: the new leader, possibly after a vacancy, and never
    // the old term again.
    loop {
        let seen = within(
            background_bound(),
            watch.changed(),
            "the observer's next answer",
        )
        .await??;
        match seen {
            None => continue,
            Some(leader) => {
                check_eq!(leader.term, next.term(), "the observer's next leader");
                break;
            }
        }
    }
    checker.verify()?;
    next.resign().await?;
    drop(leading);
    drop(proxy);
    Ok(())
}

/// Three guards renew together on one client (one request where the
/// backend batches renewals) whose replies are then held: the server
/// applies every renewal, the client hears nothing. Each guard's `lost()`
/// fires (the lease ran out) before another client, talking to the server
/// directly, gets its key, although the server extended it; the checker
/// sees no overlap.
pub async fn held_renewal_replies_lose_first(ctx: TestContext) -> CaseResult {
    let proxy = ctx.fault_path().await?;
    let locker = Locker::new(ctx.client_through(&proxy).await?);
    let direct = ctx.client().await?;
    let ttl = fault_ttl(&ctx, Duration::from_secs(2))?;
    let checker = ExclusionChecker::new();
    let mut holders = Vec::new();
    for _ in 0..3 {
        let key = ctx.key("fault-held-renewals");
        let guard = locker
            .try_lock(&key, &LockOptions::new(ttl))
            .await?
            .ok_or("the key should be free")?;
        let (checker, key_held, token) = (checker.clone(), key.clone(), guard.fencing_token());
        let lost = guard.lost();
        let ended = tokio::spawn(async move {
            let section = checker.enter(&key_held, token);
            let reason = lost.await;
            let at = Instant::now();
            section.exit();
            Ok::<_, CaseError>((reason, at))
        });
        holders.push((key, guard, ended));
    }
    proxy.hold(Direction::ToClient);
    let bound = ttl * 2 + EXPIRY_SLACK;
    for (key, guard, ended) in holders {
        let lease = eventually_acquire(&direct, &key, ttl, bound, "the direct client").await?;
        let acquired_at = Instant::now();
        checker.critical_section(&key, lease.fencing_token()).await;
        let (reason, lost_at) = join(ended, background_bound(), "a holder's lost()").await?;
        check_eq!(
            reason,
            LostReason::Expired,
            "why a holder whose replies were held lost"
        );
        check!(
            lost_at <= acquired_at,
            "a holder's lost() fired {:?} after the other client acquired its key",
            lost_at - acquired_at
        );
        check!(
            guard.lease().valid_until() <= acquired_at,
            "a holder's lease was still valid when the other client got its key"
        );
        direct.release(&lease).await?;
        drop(guard);
    }
    checker.verify()?;
    drop(proxy);
    Ok(())
}

/// Connections reset at random points while three clients acquire, extend
/// and release on six keys (50 rounds each; before each operation a reset
/// of that client's connections is scheduled 0-3 ms later with
/// probability 0.3): every failure is a typed
/// error (Unavailable, Timeout or NotHeld), the checker sees no two holders,
/// and afterwards a fresh client gets every key within TTL + 10 s.
pub async fn resets_during_operations(ctx: TestContext) -> CaseResult {
    const CLIENTS: usize = 3;
    const ROUNDS: usize = 50;
    let ttl = fault_ttl(&ctx, Duration::from_secs(3))?;
    let keys: Arc<Vec<LockKey>> = Arc::new((0..6).map(|_| ctx.key("fault-reset")).collect());
    let checker = ExclusionChecker::new();
    let errors = Arc::new(ErrorTally::default());
    let resets = Arc::new(AtomicUsize::new(0));
    let refusals = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..CLIENTS {
        let proxy = ctx.fault_path().await?;
        let client = ctx.client_through(&proxy).await?;
        let proxy = Arc::new(proxy);
        let (keys, checker, errors, resets, refusals) = (
            keys.clone(),
            checker.clone(),
            errors.clone(),
            resets.clone(),
            refusals.clone(),
        );
        // Before an operation, maybe schedule a reset of this client's
        // connections a random 0-3 ms later: mid-request, mid-reply, or
        // just before or after.
        let chaos = move || {
            if rand::random_bool(0.3) {
                let (proxy, resets) = (proxy.clone(), resets.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_micros(rand::random_range(0..3000))).await;
                    proxy.drop_all();
                    resets.fetch_add(1, Ordering::SeqCst);
                });
            }
        };
        workers.push(tokio::spawn(async move {
            let mut held = 0usize;
            for _ in 0..ROUNDS {
                let key = &keys[rand::random_range(0..keys.len())];
                chaos();
                let lease = match client.try_acquire(key, ttl).await {
                    Ok(AcquireAttempt::Acquired(lease)) => lease,
                    Ok(AcquireAttempt::Held { .. }) => {
                        // Possibly a grant whose answer a reset lost: it
                        // runs out after its TTL.
                        refusals.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(30)).await;
                        continue;
                    }
                    Err(e) => {
                        errors.record("try_acquire", e)?;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                held += 1;
                let mut section = checker.enter(key, lease.fencing_token());
                section.increment().await;
                // Give up on the extension well inside the lease: the
                // section must end while the lease is surely valid.
                let give_up = lease.sent_at() + ttl / 2;
                chaos();
                let extended =
                    tokio::time::timeout_at(give_up.into(), client.extend(&lease, ttl)).await;
                section.exit();
                let current = match extended {
                    Ok(Ok(renewed)) => {
                        if renewed.fencing_token() != lease.fencing_token() {
                            return Err(CaseError("extend changed the fencing token".into()));
                        }
                        renewed
                    }
                    Ok(Err(e)) => {
                        errors.record("extend", e)?;
                        lease
                    }
                    Err(_) => lease,
                };
                chaos();
                if let Err(e) = client.release(&current).await {
                    errors.record("release", e)?;
                }
            }
            Ok(held)
        }));
    }
    let mut held = 0;
    for worker in workers {
        held += join(worker, Duration::from_secs(150), "a worker").await?;
    }
    checker.verify()?;
    // Nothing stays held past its TTL, whatever the resets left behind.
    let fresh = ctx.client().await?;
    let after = Instant::now();
    every_key_free_within(
        &fresh,
        &keys,
        ttl,
        ttl + EXPIRY_SLACK,
        "a fresh client after the resets",
    )
    .await?;
    measure(
        &ctx,
        "resets_during_operations",
        format_args!(
            "{} resets, {held} acquisitions, {} refusals, errors {}; all keys free again after {:?} (TTL {ttl:?})",
            resets.load(Ordering::SeqCst),
            refusals.load(Ordering::SeqCst),
            errors.summary(),
            after.elapsed()
        ),
    );
    Ok(())
}

/// `run_exclusive` loses its lock mid-job to a real partition (the
/// holder's connection is black-holed): the job is stopped and the outcome
/// is `Lost` (reason: the lease ran out); afterwards another client gets
/// the lock with a newer token.
pub async fn run_exclusive_lost_to_partition(ctx: TestContext) -> CaseResult {
    let proxy = ctx.fault_path().await?;
    let locker = Locker::new(ctx.client_through(&proxy).await?);
    let key = ctx.key("fault-run");
    let ttl = fault_ttl(&ctx, Duration::from_secs(2))?;
    let (started_tx, started_rx) = oneshot::channel();
    let finished = Arc::new(AtomicBool::new(false));
    let run = {
        let (key, finished) = (key.clone(), finished.clone());
        tokio::spawn(async move {
            let options = RunOptions::new(LockOptions::new(ttl));
            locker
                .run_exclusive(&key, &options, |job| async move {
                    let _ = started_tx.send(job.fencing_token);
                    tokio::time::sleep(Duration::from_secs(120)).await;
                    finished.store(true, Ordering::SeqCst);
                })
                .await
        })
    };
    let token = within(Duration::from_secs(30), started_rx, "the job starting")
        .await?
        .map_err(|_| "run_exclusive did not start the job")?;
    proxy.black_hole();
    let cut_at = Instant::now();
    let outcome = within(
        ttl * 2 + Duration::from_secs(30),
        run,
        "run_exclusive after the partition",
    )
    .await?
    .map_err(|e| format!("run_exclusive panicked: {e}"))??;
    let stopped_after = cut_at.elapsed();
    check_eq!(
        expect_stopped(outcome, LostReason::Expired)?,
        token,
        "the outcome's token"
    );
    check!(
        !finished.load(Ordering::SeqCst),
        "the job ran on after the loss"
    );
    let other = ctx.client().await?;
    let lease = eventually_acquire(
        &other,
        &key,
        ttl,
        ttl + EXPIRY_SLACK,
        "another client after the partition",
    )
    .await?;
    check!(
        lease.fencing_token() > token,
        "the next holder's token grows"
    );
    other.release(&lease).await?;
    measure(
        &ctx,
        "run_exclusive_lost_to_partition",
        format_args!("TTL {ttl:?}; partition to Lost outcome {stopped_after:?}"),
    );
    drop(proxy);
    Ok(())
}
