//! `schedule::` — one run per schedule fire, across instances whose tickers
//! are shifted and whose clocks are skewed (and the plain-lock problem it
//! solves, asserted).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use distlock_core::{
    ErrorKind, Fire, LockOptions, Locker, RunOptions, ScheduledJob, ScheduledOutcome, SkipReason,
};

use super::support::{self, acquire, expect_kind, expiry_bound};
use crate::context::{CaseResult, TestContext};
use crate::{check, check_eq, Call, ObservedLock};

const PERIOD: Duration = Duration::from_secs(1);
const FIRES: u64 = 20;
const TICKER_OFFSETS_MS: [u64; 3] = [0, 300, 700];
const JOB: Duration = Duration::from_millis(50);

/// One instance of a simulated scheduler.
#[derive(Clone, Copy)]
struct Instance {
    /// How late its ticker fires after the schedule's fire time.
    ticker_offset: Duration,
    /// Its clock minus the true clock (positive: ahead), in milliseconds.
    skew_ms: i64,
}

/// Which way an instance labels a fire.
#[derive(Clone, Copy, PartialEq)]
enum Labels {
    /// A plain lock on the job name, no fire labels (the problem).
    PlainLock,
    /// `Fire::Now`: the slot of the instance's current time.
    SlotOfNow,
    /// `Fire::At(intended)`: the schedule's fire time by the instance's clock.
    Intended,
}

/// A run that happened: which slot it was for, when it ran, and when its
/// `run` call returned (its keys released or kept).
#[derive(Debug, Clone, Copy)]
struct Ran {
    slot: u64,
    start: Instant,
    end: Instant,
    returned: Instant,
}

/// A fire an instance skipped as "previous still running", and when it
/// asked.
#[derive(Debug, Clone, Copy)]
struct StillRunning {
    slot: u64,
    asked: Instant,
}

/// What the instances did.
#[derive(Debug, Default)]
struct Simulation {
    runs: Vec<Ran>,
    still_running: Vec<StillRunning>,
}

/// Runs `FIRES` fires on three instances and returns every run.
async fn simulate(
    ctx: &TestContext,
    instances: &[Instance],
    labels: Labels,
) -> Result<Simulation, crate::CaseError> {
    let name = ctx.key("scheduled").as_str().to_owned();
    // The fire key must outlive the run until its release keeps it for the
    // window: a TTL of a few hundred ms can run out while a loaded machine
    // (the fault:: torture runs alongside) stalls the renewals, and a late
    // instance then rightly runs the fire again. The TTL is not what this
    // case is about (keys are released or kept per the schedule anyway), so
    // it is long enough that a grant delayed by a loaded etcd cluster's
    // fsync (1.5 s seen on a 2-core machine) is still usable: a 2 s TTL
    // made such a grant too late to use (its stop margin is TTL/3).
    // An etcd session (the renewing locks' shared lease) keeps alive every
    // third of this TTL and is given up after a TTL without an answer: on
    // a 3-member cluster under heavy load (stress-ng beside the suite) 6 s
    // was lost now and then, reported as a run that lost its lock.
    let ttl = ctx
        .capabilities()
        .effective_ttl(Duration::from_secs(12))
        .unwrap_or(Duration::from_secs(12));
    let job = ScheduledJob::new(name.clone(), PERIOD)?.with_ttl(ttl);
    // Fire 0 is the next slot boundary of the true clock, at least 1.5
    // periods from now so early (skewed) instances are not yet late.
    let now_sys = SystemTime::now();
    let since_epoch = now_sys.duration_since(UNIX_EPOCH).unwrap_or_default();
    let period_ns = PERIOD.as_nanos();
    let first_slot = since_epoch.as_nanos() / period_ns + 2;
    let fire0_sys = UNIX_EPOCH + Duration::from_nanos((first_slot * period_ns) as u64);
    let fire0 = Instant::now() + fire0_sys.duration_since(now_sys).unwrap_or_default();
    let simulation = Arc::new(Mutex::new(Simulation::default()));
    let mut tasks = Vec::new();
    for instance in instances.iter().copied() {
        let locker = Locker::new(ctx.client().await?);
        let job = job.clone();
        let simulation = simulation.clone();
        let plain_key = distlock_core::LockKey::new(name.clone())?;
        tasks.push(tokio::spawn(async move {
            let mut failures = Vec::new();
            for fire in 0..FIRES {
                // The instance's clock reads fire k's time `skew` before
                // the true clock does; its ticker is `offset` late.
                let local_fire = fire0 + PERIOD * fire as u32 + instance.ticker_offset;
                let wake = shift(local_fire, -instance.skew_ms);
                tokio::time::sleep_until(wake.into()).await;
                let intended = fire0_sys + PERIOD * fire as u32;
                let slot = first_slot as u64 + fire;
                let body = |_| async move {
                    let start = Instant::now();
                    tokio::time::sleep(JOB).await;
                    let end = Instant::now();
                    Ran {
                        slot,
                        start,
                        end,
                        returned: end,
                    }
                };
                let asked = Instant::now();
                let result = match labels {
                    Labels::PlainLock => locker
                        .run_exclusive(
                            &plain_key,
                            &RunOptions::new(LockOptions::new(PERIOD * 5)),
                            body,
                        )
                        .await
                        .map(|o| match o {
                            distlock_core::RunOutcome::Completed { output, .. } => Some(output),
                            _ => None,
                        }),
                    Labels::SlotOfNow | Labels::Intended => {
                        let label = if labels == Labels::Intended {
                            Fire::At(intended)
                        } else {
                            Fire::Now
                        };
                        job.run(&locker, label, body).await.map(|o| match o {
                            ScheduledOutcome::Ran { output, .. } => Some(output),
                            ScheduledOutcome::Skipped(SkipReason::FireAlreadyTaken) => None,
                            ScheduledOutcome::Skipped(SkipReason::PreviousStillRunning) => {
                                simulation
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .still_running
                                    .push(StillRunning { slot, asked });
                                None
                            }
                            other => {
                                failures.push(format!("fire {fire}: unexpected outcome {other:?}"));
                                None
                            }
                        })
                    }
                };
                match result {
                    Ok(Some(ran)) => {
                        let ran = Ran {
                            returned: Instant::now(),
                            ..ran
                        };
                        simulation
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .runs
                            .push(ran);
                    }
                    Ok(None) => {}
                    Err(e) => failures.push(format!("fire {fire}: {e}")),
                }
            }
            failures
        }));
    }
    for task in tasks {
        let failures = task
            .await
            .map_err(|e| format!("instance task failed: {e}"))?;
        check!(
            failures.is_empty(),
            "instances reported failures: {failures:?}"
        );
    }
    let simulation = std::mem::take(&mut *simulation.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(simulation)
}

fn shift(at: Instant, ms: i64) -> Instant {
    if ms >= 0 {
        at + Duration::from_millis(ms as u64)
    } else {
        at.checked_sub(Duration::from_millis(ms.unsigned_abs()))
            .unwrap_or(at)
    }
}

/// Each fire ran exactly once, runs never overlapped, and a fire skipped
/// as "previous still running" was asked for before an earlier fire's run
/// had returned (on a loaded machine its release can take longer than the
/// period); such a fire has no run.
fn check_one_run_per_fire(simulation: &Simulation) -> CaseResult {
    let mut runs = simulation.runs.clone();
    runs.sort_by_key(|r| r.start);
    for skip in &simulation.still_running {
        check!(
            runs.iter()
                .any(|r| r.slot < skip.slot && skip.asked < r.returned),
            "fire slot {} was skipped as previous still running, yet every earlier run had returned: {skip:?}, {runs:?}",
            skip.slot
        );
    }
    let mut skipped: Vec<u64> = simulation.still_running.iter().map(|s| s.slot).collect();
    skipped.sort_unstable();
    skipped.dedup();
    let mut slots: Vec<u64> = runs.iter().map(|r| r.slot).collect();
    slots.dedup();
    check_eq!(
        slots.len(),
        runs.len(),
        "each fire ran at most once: {runs:?}"
    );
    check!(
        slots
            .iter()
            .all(|slot| skipped.binary_search(slot).is_err()),
        "a fire both ran and was skipped as previous still running: {runs:?}, {skipped:?}"
    );
    check_eq!(
        (runs.len() + skipped.len()) as u64,
        FIRES,
        "fires that ran or were skipped with the previous run still going: {runs:?}, {skipped:?}"
    );
    for pair in runs.windows(2) {
        check!(
            pair[1].start >= pair[0].end,
            "two runs overlapped: {pair:?}"
        );
    }
    Ok(())
}

fn shifted_tickers() -> Vec<Instance> {
    TICKER_OFFSETS_MS
        .iter()
        .map(|ms| Instance {
            ticker_offset: Duration::from_millis(*ms),
            skew_ms: 0,
        })
        .collect()
}

/// The problem: with a plain lock and a short job, shifted tickers take the
/// lock in turn and the job runs once per instance per fire.
pub async fn plain_lock_runs_once_per_instance(ctx: TestContext) -> CaseResult {
    let runs = simulate(&ctx, &shifted_tickers(), Labels::PlainLock)
        .await?
        .runs;
    check!(
        runs.len() as u64 > FIRES,
        "a plain lock lets shifted tickers run a fire more than once ({} runs for {FIRES} fires)",
        runs.len()
    );
    Ok(())
}

/// The fix: fire slots from the instances' clocks, keys kept after the run.
pub async fn one_run_per_fire_with_shifted_tickers(ctx: TestContext) -> CaseResult {
    let simulation = simulate(&ctx, &shifted_tickers(), Labels::SlotOfNow).await?;
    check_one_run_per_fire(&simulation)
}

/// Clocks up to one window (= the period) apart, labels from the schedule.
pub async fn one_run_per_fire_with_skewed_clocks(ctx: TestContext) -> CaseResult {
    let instances: Vec<Instance> = TICKER_OFFSETS_MS
        .iter()
        .zip([0i64, 1000, -1000])
        .map(|(ms, skew_ms)| Instance {
            ticker_offset: Duration::from_millis(*ms),
            skew_ms,
        })
        .collect();
    let simulation = simulate(&ctx, &instances, Labels::Intended).await?;
    check_one_run_per_fire(&simulation)
}

/// A run that outlasts its period makes the next fire skip as "previous
/// still running", never run concurrently.
pub async fn long_run_skips_next_fire(ctx: TestContext) -> CaseResult {
    let job = ScheduledJob::new(ctx.key("long").as_str(), Duration::from_millis(500))?
        .with_ttl(ctx.steady_ttl());
    let a = Locker::new(ctx.client().await?);
    let b = Locker::new(ctx.client().await?);
    let first = SystemTime::now();
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let long = {
        let job = job.clone();
        tokio::spawn(async move {
            job.run(&a, Fire::At(first), |_| async move {
                let _ = started_tx.send(());
                tokio::time::sleep(Duration::from_millis(1500)).await;
            })
            .await
        })
    };
    started_rx.await.map_err(|_| "the long run never started")?;
    let next = job
        .run(
            &b,
            Fire::At(first + Duration::from_millis(500)),
            |_| async {},
        )
        .await?;
    check_eq!(
        next,
        ScheduledOutcome::Skipped(SkipReason::PreviousStillRunning),
        "the next fire while the previous run is going"
    );
    let long = long
        .await
        .map_err(|e| format!("long run panicked: {e}"))??;
    check!(
        matches!(long, ScheduledOutcome::Ran { .. }),
        "the long run completed: {long:?}"
    );
    Ok(())
}

/// An error taking the `@running` key on the instance that took the
/// fire must not make every instance skip the fire: the fire key is
/// released, the next instance runs it, the one after skips.
pub async fn failed_run_start_frees_the_fire(ctx: TestContext) -> CaseResult {
    let job = ScheduledJob::new(ctx.key("failed-start").as_str(), Duration::from_secs(60))?;
    let faulty = Arc::new(ObservedLock::new(ctx.client().await?));
    faulty.fail_next(Call::Acquire, &job.running_key()?, ErrorKind::Unavailable);
    let fire = Fire::At(SystemTime::now());
    let first = job
        .run(&Locker::new(faulty.clone()), fire, |_| async { "first" })
        .await;
    expect_kind(
        first,
        ErrorKind::Unavailable,
        "the instance whose @running acquire failed",
    )?;
    next_instance_runs(&ctx, &job, fire, "the fire never ran").await?;
    let third = job
        .run(&ctx.locker().await?, fire, |_| async { "third" })
        .await?;
    check_eq!(
        third,
        ScheduledOutcome::Skipped(SkipReason::FireAlreadyTaken),
        "the instance after the run"
    );
    Ok(())
}

/// A run stopped because its lock was lost did not run the fire to
/// the end: the fire key is released so another instance can run it.
pub async fn lost_run_frees_the_fire(ctx: TestContext) -> CaseResult {
    let ttl = ctx.steady_ttl();
    let job =
        ScheduledJob::new(ctx.key("lost-run").as_str(), Duration::from_secs(60))?.with_ttl(ttl);
    let observed = Arc::new(ObservedLock::new(ctx.client().await?));
    let thief = ctx.client().await?;
    let fire = Fire::At(SystemTime::now());
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let first = {
        let (job, locker) = (job.clone(), Locker::new(observed.clone()));
        tokio::spawn(async move {
            job.run(&locker, fire, |_| async move {
                let _ = started_tx.send(());
                std::future::pending::<()>().await;
            })
            .await
        })
    };
    started_rx
        .await
        .map_err(|_| "the first run never started")?;
    // The @running lease (granted after the fire key's) is deleted behind
    // the guard's back and taken by someone else: the run is stopped.
    let running = observed.last_granted().ok_or("no lease was granted")?;
    check_eq!(
        running.key().clone(),
        job.running_key()?,
        "the last grant is the @running key"
    );
    observed.release_behind(&running).await?;
    let stolen = acquire(&thief, running.key(), ctx.long_ttl(), "thief").await?;
    let first = support::within(expiry_bound(ttl), first, "the stopped run")
        .await?
        .map_err(|e| format!("first run panicked: {e}"))??;
    check!(
        matches!(first, ScheduledOutcome::Lost { .. }),
        "expected Lost, got {first:?}"
    );
    thief.release(&stolen).await?;
    next_instance_runs(&ctx, &job, fire, "the stopped fire was not run again").await?;
    Ok(())
}

/// Another instance runs `fire` of `job` (it was not left taken).
async fn next_instance_runs(
    ctx: &TestContext,
    job: &ScheduledJob,
    fire: Fire,
    what: &str,
) -> CaseResult {
    let next = job
        .run(&ctx.locker().await?, fire, |_| async { "next" })
        .await?;
    check!(
        matches!(next, ScheduledOutcome::Ran { output: "next", .. }),
        "{what}: the next instance got {next:?}"
    );
    Ok(())
}
