//! `exclusion::` — many clients around a non-atomic counter; the
//! [`ExclusionChecker`] proves no overlap, growing tokens, no lost update.

use std::time::Duration;

use distlock_core::{LockKey, LockOptions, Locker, RunOptions, RunOutcome};

use super::support::within;
use crate::checker::ExclusionChecker;
use crate::context::{CaseResult, TestContext};
use crate::{check, check_eq};

const CLIENTS: usize = 8;
const ITERATIONS: usize = 100;

/// 8 independent clients x 2 keys x 100 iterations of Locker::acquire (with
/// a wait) around the checker's non-atomic counter.
pub async fn counter_is_exact(ctx: TestContext) -> CaseResult {
    let keys = [ctx.key("exclusion-a"), ctx.key("exclusion-b")];
    let checker = ExclusionChecker::new();
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let locker = ctx.locker().await?;
        for key in &keys {
            let locker = locker.clone();
            let key = key.clone();
            let checker = checker.clone();
            let options =
                LockOptions::new(Duration::from_secs(30)).with_wait(Duration::from_secs(120));
            tasks.push(tokio::spawn(async move {
                for i in 0..ITERATIONS {
                    let guard = locker.acquire(&key, &options).await?.ok_or_else(|| {
                        format!("iteration {i} on {key:?}: waited 120 s without getting the lock")
                    })?;
                    checker.critical_section(&key, guard.fencing_token()).await;
                    guard.release().await?;
                }
                Ok::<(), crate::CaseError>(())
            }));
        }
    }
    for task in tasks {
        within(Duration::from_secs(170), task, "exclusion worker")
            .await?
            .map_err(|e| format!("worker panicked: {e}"))??;
    }
    let report = checker.verify()?;
    check_eq!(
        report.sections,
        CLIENTS * 2 * ITERATIONS,
        "sections recorded"
    );
    for key in &keys {
        check_eq!(
            report.counters.get(key).copied(),
            Some((CLIENTS * ITERATIONS) as u64),
            "guarded counter of {key:?}"
        );
    }
    Ok(())
}

/// Workers on several clients hammer try_lock (no waiting) on one key; the
/// ones that get it never overlap.
pub async fn try_lock_never_overlaps(ctx: TestContext) -> CaseResult {
    let key = ctx.key("exclusion");
    let checker = ExclusionChecker::new();
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let locker = ctx.locker().await?;
        let key = key.clone();
        let checker = checker.clone();
        tasks.push(tokio::spawn(async move {
            let options = LockOptions::new(Duration::from_secs(30));
            let mut won = 0usize;
            for _ in 0..60 {
                if let Some(guard) = locker.try_lock(&key, &options).await? {
                    checker.critical_section(&key, guard.fencing_token()).await;
                    guard.release().await?;
                    won += 1;
                } else {
                    tokio::task::yield_now().await;
                }
            }
            Ok::<usize, crate::CaseError>(won)
        }));
    }
    let mut won = 0;
    for task in tasks {
        won += within(Duration::from_secs(120), task, "try_lock worker")
            .await?
            .map_err(|e| format!("worker panicked: {e}"))??;
    }
    let report = checker.verify()?;
    check_eq!(report.sections, won, "sections recorded");
    check!(won > 0, "nobody ever got the lock");
    Ok(())
}

/// Several clients call run_exclusive in loops (some waiting, some
/// skipping); completed jobs never overlap and the counter is exact.
pub async fn run_exclusive_never_overlaps(ctx: TestContext) -> CaseResult {
    let key = ctx.key("exclusion-run");
    let checker = ExclusionChecker::new();
    let mut tasks = Vec::new();
    for worker in 0..6 {
        let locker = ctx.locker().await?;
        let key = key.clone();
        let checker = checker.clone();
        let wait = if worker % 2 == 0 {
            Duration::from_secs(60)
        } else {
            Duration::ZERO
        };
        tasks.push(tokio::spawn(async move {
            let options =
                RunOptions::new(LockOptions::new(Duration::from_secs(30)).with_wait(wait));
            let (mut completed, mut skipped) = (0usize, 0usize);
            for _ in 0..30 {
                let checker = checker.clone();
                let job_key: LockKey = key.clone();
                let outcome = locker
                    .run_exclusive(&key, &options, |job| async move {
                        checker.critical_section(&job_key, job.fencing_token).await;
                        job.fencing_token
                    })
                    .await?;
                match outcome {
                    RunOutcome::Completed {
                        output,
                        fencing_token,
                        ..
                    } => {
                        if output != fencing_token {
                            return Err(crate::CaseError(format!(
                                "job saw token {output}, outcome says {fencing_token}"
                            )));
                        }
                        completed += 1;
                    }
                    RunOutcome::Skipped => skipped += 1,
                    RunOutcome::Lost { reason, .. } => {
                        return Err(crate::CaseError(format!("lock lost mid-run: {reason}")))
                    }
                }
            }
            Ok::<_, crate::CaseError>((completed, skipped))
        }));
    }
    let mut completed = 0;
    for task in tasks {
        let (c, _s) = within(Duration::from_secs(150), task, "run_exclusive worker")
            .await?
            .map_err(|e| format!("worker panicked: {e}"))??;
        completed += c;
    }
    let report = checker.verify()?;
    check_eq!(
        report.sections,
        completed,
        "every completed run recorded one section"
    );
    check_eq!(
        report.counters.get(&key).copied(),
        Some(completed as u64),
        "guarded counter"
    );
    // The waiting workers always run: 3 workers x 30 runs at least.
    check!(completed >= 90, "only {completed} runs completed");
    Ok(())
}

/// Sections on different keys may overlap; the checker keeps keys apart.
/// (Two holders of two keys at the same time is not a violation.)
pub async fn distinct_keys_run_concurrently(ctx: TestContext) -> CaseResult {
    let checker = ExclusionChecker::new();
    let a = Locker::new(ctx.client().await?);
    let b = Locker::new(ctx.client().await?);
    let (ka, kb) = (ctx.key("exclusion-p"), ctx.key("exclusion-q"));
    let options = LockOptions::new(ctx.long_ttl());
    let ga = a.try_lock(&ka, &options).await?.ok_or("key a refused")?;
    let gb = b
        .try_lock(&kb, &options)
        .await?
        .ok_or("key b refused while only key a is held")?;
    let sa = checker.enter(&ka, ga.fencing_token());
    let sb = checker.enter(&kb, gb.fencing_token());
    sa.exit();
    sb.exit();
    ga.release().await?;
    gb.release().await?;
    let report = checker.verify()?;
    check_eq!(report.sections, 2, "sections");
    Ok(())
}
