//! `run_exclusive`: run a job only if nobody else is running it.

use std::future::Future;
use std::time::{Duration, Instant};

use crate::{
    ErrorKind, FencingToken, LockError, LockKey, LockOptions, Locker, LostReason, LostSignal,
};

/// What to do with a job whose lock is lost mid-run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnLost {
    /// Drop the job's future as soon as the lock is lost or reaches its stop
    /// moment (the default): no further step of it runs, and another
    /// instance may soon be running it.
    #[default]
    Stop,
    /// Let the job finish; it must watch [`JobContext::lost`] itself and
    /// stop within the stop margin ([`LockOptions::with_stop_margin`]).
    Continue,
}

/// Options for [`run_exclusive`].
///
/// ```
/// use std::time::Duration;
/// use distlock_core::{LockOptions, OnLost, RunOptions};
/// let options = RunOptions::new(LockOptions::new(Duration::from_secs(60))).with_on_lost(OnLost::Continue);
/// assert_eq!(options.lock_options().ttl(), Duration::from_secs(60));
/// assert_eq!(options.on_lost(), OnLost::Continue);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunOptions {
    lock: LockOptions,
    on_lost: OnLost,
}

impl RunOptions {
    /// Lock with `lock`, stop the job if the lock is lost.
    pub fn new(lock: LockOptions) -> Self {
        Self {
            lock,
            on_lost: OnLost::Stop,
        }
    }

    /// Sets what to do when the lock is lost mid-run (default
    /// [`OnLost::Stop`]).
    pub fn with_on_lost(mut self, on_lost: OnLost) -> Self {
        self.on_lost = on_lost;
        self
    }

    /// What to do when the lock is lost mid-run.
    pub fn on_lost(&self) -> OnLost {
        self.on_lost
    }

    /// The lock options.
    pub fn lock_options(&self) -> &LockOptions {
        &self.lock
    }
}

/// What a job learns about its lock.
#[derive(Debug, Clone)]
pub struct JobContext {
    /// The key held.
    pub key: LockKey,
    /// The fencing token of this run; pass it to the resource you write.
    pub fencing_token: FencingToken,
    /// Resolves if the lock is lost while the job runs, at the latest the
    /// stop margin before the lease may run out.
    pub lost: LostSignal,
}

/// How a [`run_exclusive`] call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum RunOutcome<T> {
    /// The job ran to completion while holding the lock.
    Completed {
        /// What the job returned.
        output: T,
        /// The fencing token it ran under.
        fencing_token: FencingToken,
        /// How long the job ran.
        duration: Duration,
    },
    /// Another holder had the lock; the job did not run.
    Skipped,
    /// The lock was lost while the job ran.
    Lost {
        /// The job's output if it was allowed to finish ([`OnLost::Continue`]),
        /// `None` if it was stopped.
        output: Option<T>,
        /// The fencing token it ran under.
        fencing_token: FencingToken,
        /// Why the lock was lost.
        reason: LostReason,
    },
}

impl<T> RunOutcome<T> {
    /// Whether the job ran to completion under the lock.
    pub fn is_completed(&self) -> bool {
        matches!(self, RunOutcome::Completed { .. })
    }

    /// Whether the job was skipped because the lock was held.
    pub fn is_skipped(&self) -> bool {
        matches!(self, RunOutcome::Skipped)
    }

    /// Whether the lock was lost mid-run.
    pub fn is_lost(&self) -> bool {
        matches!(self, RunOutcome::Lost { .. })
    }
}

/// Runs `job` under the lock `key`: skips if held, hands the job its fencing
/// token and lost signal, stops it (by default) if the lock is lost, and
/// always releases.
///
/// The job never starts on a lease that is already expired or inside its
/// stop margin when granted (the lease is released and the call fails with
/// [`ErrorKind::Timeout`]); with [`OnLost::Stop`] it is dropped at the stop
/// moment ([`LockOptions::with_stop_margin`]) at the latest, before any further
/// step runs.
///
/// A failure to release after the job ran is logged, not returned, so the
/// job's output is never lost; the lock then expires after its TTL.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::{run_exclusive, Locker, LockKey, LockOptions, MemoryLock, RunOptions, RunOutcome};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock_core::LockError> {
/// let locker = Locker::new(MemoryLock::new());
/// let key = LockKey::new("nightly-report")?;
/// let options = RunOptions::new(LockOptions::new(Duration::from_secs(30)));
/// let outcome = run_exclusive(&locker, &key, &options, |ctx| async move {
///     format!("report written with token {}", ctx.fencing_token)
/// })
/// .await?;
/// assert!(matches!(outcome, RunOutcome::Completed { .. }));
/// # Ok(()) }
/// ```
pub async fn run_exclusive<F, Fut, T>(
    locker: &Locker,
    key: &LockKey,
    options: &RunOptions,
    job: F,
) -> Result<RunOutcome<T>, LockError>
where
    F: FnOnce(JobContext) -> Fut,
    Fut: Future<Output = T>,
{
    let Some(guard) = locker.acquire(key, &options.lock).await? else {
        tracing::info!(key = %key, "lock held elsewhere; skipping job");
        return Ok(RunOutcome::Skipped);
    };
    let fencing_token = guard.fencing_token();
    let context = JobContext {
        key: key.clone(),
        fencing_token,
        lost: guard.lost_signal(),
    };
    let started = Instant::now();
    let stopped = match options.on_lost {
        // Lost is polled first: once it fired, no further step of the job runs.
        OnLost::Stop => guard.while_held(job(context)).await.inspect_err(|reason| {
            tracing::warn!(key = %key, fencing = %fencing_token, %reason, "lock lost; job stopped");
        }),
        OnLost::Continue => Ok(job(context).await),
    };
    let outcome = match stopped {
        Err(reason) => RunOutcome::Lost {
            output: None,
            fencing_token,
            reason,
        },
        // A job that returned after (or as) the lock was lost did not run
        // exclusively to the end, whatever it returned.
        Ok(output) => match guard.lost_signal().reason() {
            Some(reason) => RunOutcome::Lost {
                output: Some(output),
                fencing_token,
                reason,
            },
            None => RunOutcome::Completed {
                output,
                fencing_token,
                duration: started.elapsed(),
            },
        },
    };
    if let Err(e) = guard.release().await {
        if e.kind() != ErrorKind::NotHeld || outcome.is_completed() {
            tracing::warn!(key = %key, fencing = %fencing_token, error = %e, "release after job failed; the lock expires after its TTL");
        }
    }
    Ok(outcome)
}
