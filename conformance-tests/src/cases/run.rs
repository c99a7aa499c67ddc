//! `run::` — run_exclusive: completed, skipped, lost; always releases; job
//! code over `LockClient`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use distlock_core::{
    AcquireAttempt, ErrorKind, Lease, LockClient, LockError, LockKey, LockOptions, Locker,
    LostReason, OnLost, Renewal, RunOptions, RunOutcome,
};
use tokio::sync::oneshot;

use super::support::{
    acquire, background_bound, eventually_acquire, expect_kind, expect_stopped, expiry_bound,
    refused, until_attempts, within,
};
use crate::context::{CaseResult, TestContext};
use crate::{check, check_eq, Call, ObservedLock};

pub async fn completed_returns_output_and_token(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let key = ctx.key("run");
    let options = RunOptions::new(LockOptions::new(ctx.long_ttl()));
    let job_key = key.clone();
    let outcome = locker
        .run_exclusive(&key, &options, |job| async move {
            (job.key == job_key, job.fencing_token, job.lost.is_lost())
        })
        .await?;
    match outcome {
        RunOutcome::Completed {
            output: (same_key, token, lost),
            fencing_token,
            ..
        } => {
            check!(same_key, "the job was told another key");
            check_eq!(token, fencing_token, "the job ran under the reported token");
            check!(!lost, "the job saw its lock lost");
        }
        other => return Err(format!("expected Completed, got {other:?}").into()),
    }
    Ok(())
}

/// A completed run releases the lock at once.
pub async fn completed_releases_lock(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let other = ctx.client().await?;
    let key = ctx.key("run");
    let options = RunOptions::new(LockOptions::new(ctx.long_ttl()));
    let outcome = locker
        .run_exclusive(&key, &options, |_| async { 1 })
        .await?;
    check!(
        outcome.is_completed(),
        "expected Completed, got {outcome:?}"
    );
    let lease = acquire(&other, &key, ctx.long_ttl(), "right after the run").await?;
    other.release(&lease).await?;
    Ok(())
}

/// A held lock means Skipped, the job does not run, and the holder keeps it.
pub async fn skipped_when_held(ctx: TestContext) -> CaseResult {
    let holder = ctx.client().await?;
    let locker = ctx.locker().await?;
    let key = ctx.key("run");
    let lease = acquire(&holder, &key, ctx.long_ttl(), "holder").await?;
    let ran = Arc::new(AtomicBool::new(false));
    let flag = ran.clone();
    let options = RunOptions::new(LockOptions::new(ctx.long_ttl()));
    let outcome = locker
        .run_exclusive(&key, &options, |_| async move {
            flag.store(true, Ordering::SeqCst)
        })
        .await?;
    check!(outcome.is_skipped(), "expected Skipped, got {outcome:?}");
    check!(!ran.load(Ordering::SeqCst), "a skipped job ran");
    refused(&ctx.client().await?, &key, "the holder keeps its lock").await?;
    holder.extend(&lease, ctx.long_ttl()).await?;
    holder.release(&lease).await?;
    Ok(())
}

/// With a wait, run_exclusive waits for the holder and then runs.
pub async fn waits_then_runs(ctx: TestContext) -> CaseResult {
    let holder = ctx.client().await?;
    let observed = Arc::new(ObservedLock::new(ctx.client().await?));
    let locker = Locker::new(observed.clone());
    let key = ctx.key("run");
    let lease = acquire(&holder, &key, ctx.long_ttl(), "holder").await?;
    let options =
        RunOptions::new(LockOptions::new(ctx.long_ttl()).with_wait(Duration::from_secs(60)));
    let task = {
        let key = key.clone();
        tokio::spawn(async move {
            locker
                .run_exclusive(&key, &options, |job| async move { job.fencing_token })
                .await
        })
    };
    until_attempts(&observed, 1, "the waiting run").await?;
    holder.release(&lease).await?;
    let outcome = within(background_bound(), task, "run after release")
        .await?
        .map_err(|e| format!("run task panicked: {e}"))??;
    match outcome {
        RunOutcome::Completed { output, .. } => {
            check!(output > lease.fencing_token(), "token grows")
        }
        other => return Err(format!("expected Completed, got {other:?}").into()),
    }
    Ok(())
}

/// Hold-at-least makes the next tick on another instance skip, even when
/// the job was quick (scheduled jobs on skewed clocks).
pub async fn hold_at_least_skips_next_tick(ctx: TestContext) -> CaseResult {
    let first = ctx.locker().await?;
    let second = ctx.locker().await?;
    let key = ctx.key("run");
    let min = (ctx.short_ttl() * 2).max(Duration::from_secs(1));
    let options = RunOptions::new(LockOptions::new(ctx.long_ttl()).with_hold_at_least(min));
    let outcome = first.run_exclusive(&key, &options, |_| async {}).await?;
    check!(
        outcome.is_completed(),
        "first tick: expected Completed, got {outcome:?}"
    );
    let outcome = second.run_exclusive(&key, &options, |_| async {}).await?;
    check!(
        outcome.is_skipped(),
        "second tick within the minimum: expected Skipped, got {outcome:?}"
    );
    // After the minimum the lock is free again.
    let other = ctx.client().await?;
    let lease = eventually_acquire(
        &other,
        &key,
        ctx.long_ttl(),
        expiry_bound(min),
        "after the minimum",
    )
    .await?;
    other.release(&lease).await?;
    Ok(())
}

/// Deletes the lock behind a running job's back: waits for the job to
/// start, releases the raw lease through the same client, then another
/// client takes the key. Returns the other client's lease.
async fn steal_when_started(
    recording: Arc<ObservedLock>,
    thief: LockClient,
    started: oneshot::Receiver<()>,
    ttl: Duration,
) -> Result<Lease, crate::CaseError> {
    started.await.map_err(|_| "the job never started")?;
    let granted = recording.last_granted().ok_or("no lease was granted")?;
    recording.release_behind(&granted).await?;
    acquire(&thief, granted.key(), ttl, "thief after the delete").await
}

/// OnLost::Stop (the default): the job is stopped when the lock is lost.
pub async fn lost_stops_job(ctx: TestContext) -> CaseResult {
    let recording = Arc::new(ObservedLock::new(ctx.client().await?));
    let locker = Locker::new(recording.clone());
    let thief = ctx.client().await?;
    let key = ctx.key("run");
    let ttl = ctx.steady_ttl();
    let (started_tx, started_rx) = oneshot::channel();
    let stealer = tokio::spawn(steal_when_started(
        recording.clone(),
        thief.clone(),
        started_rx,
        ctx.long_ttl(),
    ));
    let finished = Arc::new(AtomicBool::new(false));
    let flag = finished.clone();
    let options = RunOptions::new(LockOptions::new(ttl));
    let outcome = within(
        expiry_bound(ttl) + Duration::from_secs(5),
        locker.run_exclusive(&key, &options, |job| async move {
            let _ = started_tx.send(());
            job.lost.wait().await;
            // Keeps going after the loss; Stop must cut it off here.
            tokio::time::sleep(Duration::from_secs(120)).await;
            flag.store(true, Ordering::SeqCst);
        }),
        "run_exclusive with a lost lock",
    )
    .await??;
    let stolen = stealer
        .await
        .map_err(|e| format!("stealer panicked: {e}"))??;
    let fencing_token = expect_stopped(outcome, LostReason::Refused)?;
    check!(
        fencing_token < stolen.fencing_token(),
        "the thief's token is newer"
    );
    check!(
        !finished.load(Ordering::SeqCst),
        "the job ran on after the loss"
    );
    refused(&ctx.client().await?, &key, "the thief keeps the lock").await?;
    thief.release(&stolen).await?;
    Ok(())
}

/// OnLost::Continue: the job is told (ctx.lost) and finishes; the outcome is
/// Lost with its output.
pub async fn lost_continue_lets_job_finish(ctx: TestContext) -> CaseResult {
    let recording = Arc::new(ObservedLock::new(ctx.client().await?));
    let locker = Locker::new(recording.clone());
    let thief = ctx.client().await?;
    let key = ctx.key("run");
    let ttl = ctx.steady_ttl();
    let (started_tx, started_rx) = oneshot::channel();
    let stealer = tokio::spawn(steal_when_started(
        recording.clone(),
        thief.clone(),
        started_rx,
        ctx.long_ttl(),
    ));
    let options = RunOptions::new(LockOptions::new(ttl)).with_on_lost(OnLost::Continue);
    let outcome = within(
        expiry_bound(ttl) + Duration::from_secs(5),
        locker.run_exclusive(&key, &options, |job| async move {
            let _ = started_tx.send(());
            let reason = job.lost.wait().await;
            (reason, "cleaned up")
        }),
        "run_exclusive with a lost lock",
    )
    .await??;
    let stolen = stealer
        .await
        .map_err(|e| format!("stealer panicked: {e}"))??;
    match outcome {
        RunOutcome::Lost { output, reason, .. } => {
            check_eq!(
                output,
                Some((LostReason::Refused, "cleaned up")),
                "the job finished and saw why"
            );
            check_eq!(reason, LostReason::Refused, "lost reason");
        }
        other => return Err(format!("expected Lost, got {other:?}").into()),
    }
    refused(&ctx.client().await?, &key, "the thief keeps the lock").await?;
    thief.release(&stolen).await?;
    Ok(())
}

/// Under OnLost::Stop, a job that returns right after observing the loss
/// must not be reported as Completed (it did not complete under the lock).
pub async fn job_finishing_after_loss_is_not_completed(ctx: TestContext) -> CaseResult {
    let recording = Arc::new(ObservedLock::new(ctx.client().await?));
    let locker = Locker::new(recording.clone());
    let thief = ctx.client().await?;
    let key = ctx.key("run");
    let ttl = ctx.steady_ttl();
    let (started_tx, started_rx) = oneshot::channel();
    let stealer = tokio::spawn(steal_when_started(
        recording.clone(),
        thief.clone(),
        started_rx,
        ctx.long_ttl(),
    ));
    let options = RunOptions::new(LockOptions::new(ttl));
    let outcome = within(
        expiry_bound(ttl) + Duration::from_secs(5),
        locker.run_exclusive(&key, &options, |job| async move {
            let _ = started_tx.send(());
            job.lost.wait().await;
            "returned after the loss"
        }),
        "run_exclusive with a lost lock",
    )
    .await??;
    let stolen = stealer
        .await
        .map_err(|e| format!("stealer panicked: {e}"))??;
    thief.release(&stolen).await?;
    check!(
        outcome.is_lost(),
        "the lock was lost before the job returned, yet run_exclusive reported {outcome:?}"
    );
    Ok(())
}

/// Job code written against `LockClient` only: raw calls and
/// the shared `Locker`, no backend named.
async fn portable_job(lock: LockClient, key: &LockKey) -> Result<u64, LockError> {
    let caps = lock.capabilities();
    let ttl = caps.effective_ttl(Duration::from_secs(10))?;
    let lease = match lock.try_acquire(key, ttl).await? {
        AcquireAttempt::Acquired(lease) => lease,
        AcquireAttempt::Held { .. } => return Err(LockError::not_held("busy")),
    };
    let lease = lock.extend(&lease, ttl).await?;
    lock.release(&lease).await?;
    let locker = Locker::new(lock);
    let options = RunOptions::new(LockOptions::new(ttl));
    match locker
        .run_exclusive(key, &options, |job| async move { job.fencing_token.get() })
        .await?
    {
        RunOutcome::Completed { output, .. } => Ok(output),
        RunOutcome::Skipped => Err(LockError::not_held("skipped")),
        RunOutcome::Lost { reason, .. } => Err(LockError::not_held(reason.to_string())),
    }
}

pub async fn dyn_job_code_runs_unchanged(ctx: TestContext) -> CaseResult {
    let key = ctx.key("run");
    let first = portable_job(ctx.client().await?, &key).await?;
    let second = portable_job(ctx.client().await?, &key).await?;
    check!(
        second > first,
        "tokens grow across portable runs ({first} then {second})"
    );
    // A lease from another client is still refused through the trait object.
    let a = ctx.client().await?;
    let b = ctx.client().await?;
    let lease = acquire(&a, &key, ctx.long_ttl(), "holder").await?;
    let refused_release = b.release(&lease).await;
    check!(
        matches!(&refused_release, Err(e) if e.kind() == ErrorKind::InvalidInput),
        "foreign lease through dyn: {refused_release:?}"
    );
    a.release(&lease).await?;
    Ok(())
}

/// Runs on one key from several instances in sequence: each completes, with
/// growing tokens, and the key is free at the end.
pub async fn sequential_runs_grow_tokens(ctx: TestContext) -> CaseResult {
    let key = ctx.key("run");
    let options = RunOptions::new(LockOptions::new(ctx.long_ttl()));
    let mut last = None;
    for i in 0..4 {
        let locker = ctx.locker().await?;
        match locker.run_exclusive(&key, &options, |_| async {}).await? {
            RunOutcome::Completed { fencing_token, .. } => {
                if let Some(prev) = last {
                    check!(
                        fencing_token > prev,
                        "run {i}: token {fencing_token} after {prev}"
                    );
                }
                last = Some(fencing_token);
            }
            other => return Err(format!("run {i}: expected Completed, got {other:?}").into()),
        }
    }
    Ok(())
}

/// The server granted the lock, but the reply came after the lease
/// ran out and another client took the key. The job must never run on it;
/// the call fails with a typed Timeout, and the other client keeps the key.
pub async fn expired_grant_never_runs_job(ctx: TestContext) -> CaseResult {
    let slow = Arc::new(ObservedLock::new(ctx.client().await?));
    let locker = Locker::new(slow.clone());
    let other = ctx.client().await?;
    let key = ctx.key("run");
    let ttl = ctx.short_ttl();
    slow.hold_replies(Call::Acquire);
    let ran = Arc::new(AtomicBool::new(false));
    let run = {
        let (key, ran) = (key.clone(), ran.clone());
        let options = RunOptions::new(LockOptions::new(ttl));
        tokio::spawn(async move {
            locker
                .run_exclusive(&key, &options, |_| async move {
                    ran.store(true, Ordering::SeqCst)
                })
                .await
        })
    };
    within(
        background_bound(),
        slow.until_waiting(Call::Acquire, 1),
        "the acquire reply reaches the hold",
    )
    .await?;
    check!(
        slow.last_granted().is_some(),
        "the held reply should be a grant (the key was free)"
    );
    // The lease runs out on the server while its reply is held.
    let theirs = eventually_acquire(
        &other,
        &key,
        ctx.long_ttl(),
        expiry_bound(ttl),
        "another client once the held grant expired",
    )
    .await?;
    slow.open(Call::Acquire);
    let result = within(
        background_bound(),
        run,
        "run_exclusive after the late reply",
    )
    .await?
    .map_err(|e| format!("run task panicked: {e}"))?;
    check!(
        !ran.load(Ordering::SeqCst),
        "the job ran on a lease that had expired before its grant arrived (another client held the key): {result:?}"
    );
    expect_kind(result, ErrorKind::Timeout, "a grant that arrived expired")?;
    refused(
        &ctx.client().await?,
        &key,
        "the other client keeps the lock",
    )
    .await?;
    other.release(&theirs).await?;
    Ok(())
}

/// A grant whose reply arrives with less than the stop margin left
/// (default: a third of the TTL) is not handed to the job either.
pub async fn late_grant_inside_margin_never_runs_job(ctx: TestContext) -> CaseResult {
    let slow = Arc::new(ObservedLock::new(ctx.client().await?));
    let locker = Locker::new(slow.clone());
    let key = ctx.key("run");
    let ttl = ctx.short_ttl();
    // Four fifths of the TTL late: less than a fifth is left, inside the
    // default margin of a third, whatever the load (more delay is deeper).
    slow.delay_replies(Call::Acquire, ttl * 4 / 5);
    let ran = Arc::new(AtomicBool::new(false));
    let flag = ran.clone();
    let options = RunOptions::new(LockOptions::new(ttl));
    let result = within(
        background_bound() + ttl,
        locker.run_exclusive(&key, &options, |_| async move {
            flag.store(true, Ordering::SeqCst)
        }),
        "run_exclusive with a late reply",
    )
    .await?;
    check!(
        !ran.load(Ordering::SeqCst),
        "the job ran on a lease granted inside its stop margin: {result:?}"
    );
    expect_kind(result, ErrorKind::Timeout, "a grant inside the stop margin")?;
    Ok(())
}

/// Once the lost signal fired, no further step of the job runs
/// (lost is polled before the job), even a step that was woken by the same
/// signal.
pub async fn no_job_step_after_lost(ctx: TestContext) -> CaseResult {
    let locker = ctx.locker().await?;
    let key = ctx.key("run");
    let ttl = ctx.short_ttl();
    let options = RunOptions::new(LockOptions::new(ttl).with_renewal(Renewal::Off));
    let stepped = Arc::new(AtomicBool::new(false));
    let flag = stepped.clone();
    let outcome = within(
        expiry_bound(ttl),
        locker.run_exclusive(&key, &options, |job| async move {
            job.lost.wait().await;
            // A step after the loss: Stop must drop the job before it.
            flag.store(true, Ordering::SeqCst);
        }),
        "run_exclusive until the lease runs out",
    )
    .await??;
    check!(
        !stepped.load(Ordering::SeqCst),
        "a job step ran after the lost signal fired ({outcome:?})"
    );
    expect_stopped(outcome, LostReason::Expired)?;
    Ok(())
}

/// A grant that arrives inside its stop margin is released at once (not
/// left to expire) and reported; the job does not run.
pub async fn grant_inside_margin_is_released(ctx: TestContext) -> CaseResult {
    let slow = Arc::new(ObservedLock::new(ctx.client().await?));
    let locker = Locker::new(slow.clone());
    let key = ctx.key("run");
    let ttl = ctx.long_ttl();
    // The stop moment is under half a second after the request; the reply
    // comes a second after the server answered. The server holds the lock
    // for the whole minute unless it is released.
    let options = RunOptions::new(
        LockOptions::new(ttl)
            .with_renewal(Renewal::Off)
            .with_stop_margin(ttl - Duration::from_secs(1)),
    );
    slow.delay_replies(Call::Acquire, Duration::from_secs(1));
    let ran = Arc::new(AtomicBool::new(false));
    let flag = ran.clone();
    let result = within(
        background_bound(),
        locker.run_exclusive(&key, &options, |_| async move {
            flag.store(true, Ordering::SeqCst)
        }),
        "run_exclusive with a late reply",
    )
    .await?;
    check!(!ran.load(Ordering::SeqCst), "the job ran: {result:?}");
    expect_kind(result, ErrorKind::Timeout, "a grant inside the stop margin")?;
    check!(
        slow.last_granted().is_some(),
        "the server had granted the lock"
    );
    let other = ctx.client().await?;
    let lease = acquire(
        &other,
        &key,
        ctx.long_ttl(),
        "right after the refused grant",
    )
    .await?;
    other.release(&lease).await?;
    Ok(())
}
