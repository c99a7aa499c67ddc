//! Exactly one run per schedule fire, across instances whose tickers are
//! shifted and whose clocks are skewed.
//!
//! A plain lock is not enough for scheduled jobs: when the job is short and
//! the instances' tickers are not aligned, each instance takes and releases
//! the lock in turn and the job runs once *per instance* per fire. Here every
//! fire has its own key, derived from the fire time the scheduler intended,
//! and the key is kept after the run so any instance that wakes late for the
//! same fire skips it. A second key per job keeps runs of consecutive fires
//! from overlapping when a run outlasts its period.

use std::future::Future;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::lease::later;
use crate::{
    AcquireAttempt, ErrorKind, FencingToken, LockError, LockKey, LockOptions, Locker, LostReason,
    OnLost, RunOptions, RunOutcome,
};

/// How long a run that failed to start waits, at most, for its client's
/// background give-backs before it frees the fire.
const SETTLE_WAIT: Duration = Duration::from_secs(5);

/// Which fire of the schedule a call is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fire {
    /// The fire time the scheduler intended (a cron's "12:00:00"), by its own
    /// clock: instances label the same fire alike whatever their skew.
    At(SystemTime),
    /// The fire slot that contains this instance's current time.
    Now,
}

/// Why a scheduled run did not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// Another instance ran (or is running) this fire.
    FireAlreadyTaken,
    /// The run of an earlier fire is still going.
    PreviousStillRunning,
}

/// How one scheduled fire ended on this instance; log it as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum ScheduledOutcome<T> {
    /// This instance ran the fire.
    Ran {
        /// What the job returned.
        output: T,
        /// How long it ran.
        duration: Duration,
        /// The fencing token it ran under.
        fencing_token: FencingToken,
    },
    /// This instance skipped the fire.
    Skipped(SkipReason),
    /// The lock was lost mid-run (the job was stopped unless
    /// [`OnLost::Continue`]).
    Lost {
        /// The output, if the job was allowed to finish.
        output: Option<T>,
        /// The fencing token it ran under.
        fencing_token: FencingToken,
        /// Why.
        reason: LostReason,
    },
}

/// A job that fires every `period`, run at most once per fire across all
/// instances.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::{Fire, Locker, MemoryLock, ScheduledJob, ScheduledOutcome};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock_core::LockError> {
/// let server = MemoryLock::new();
/// let job = ScheduledJob::new("nightly-report", Duration::from_secs(60))?;
/// let fire = Fire::At(std::time::SystemTime::now());
/// let a = job.run(&Locker::new(server.client()), fire, |_| async { "done" }).await?;
/// let b = job.run(&Locker::new(server.client()), fire, |_| async { "done" }).await?;
/// assert!(matches!(a, ScheduledOutcome::Ran { .. }));
/// assert!(matches!(b, ScheduledOutcome::Skipped(_)));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct ScheduledJob {
    name: String,
    period: Duration,
    window: Duration,
    ttl: Duration,
    on_lost: OnLost,
}

impl ScheduledJob {
    /// A job called `name` that fires every `period`. The fire key is kept
    /// for one period after the run plus twice the skew window (default: one
    /// period), so instances whose tickers are up to a period late or whose
    /// clocks are up to a window apart skip the fire.
    pub fn new(name: impl Into<String>, period: Duration) -> Result<Self, LockError> {
        let name = name.into();
        if period.is_zero() {
            return Err(LockError::invalid_input("schedule period is zero"));
        }
        // Validate the longest key we derive now, not at the first fire.
        LockKey::new(format!("{name}@fire:{}", u64::MAX))?;
        Ok(Self {
            name,
            period,
            window: period,
            ttl: Duration::from_secs(30).min(period.max(Duration::from_secs(1))),
            on_lost: OnLost::Stop,
        })
    }

    /// Sets the [skew window](Self::window).
    pub fn with_window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// Sets the [TTL](Self::ttl) of the running lock.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Sets [what to do](Self::on_lost) if the lock is lost mid-run.
    pub fn with_on_lost(mut self, on_lost: OnLost) -> Self {
        self.on_lost = on_lost;
        self
    }

    /// The job's name, the prefix of its fire keys.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How often the job fires.
    pub fn period(&self) -> Duration {
        self.period
    }

    /// The clock skew (and ticker lateness) tolerated between instances
    /// (default: one period).
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The TTL of the running lock, renewed while the job runs (default
    /// the period, between 1 s and 30 s).
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// What to do if the lock is lost mid-run (default [`OnLost::Stop`]).
    pub fn on_lost(&self) -> OnLost {
        self.on_lost
    }

    /// The fire slot number of `fire`: whole periods since the Unix epoch.
    pub fn slot(&self, fire: Fire) -> u64 {
        let at = match fire {
            Fire::At(at) => at,
            Fire::Now => SystemTime::now(),
        };
        let since_epoch = at.duration_since(UNIX_EPOCH).unwrap_or_default();
        (since_epoch.as_nanos() / self.period.as_nanos().max(1)) as u64
    }

    /// The key of one fire.
    pub fn fire_key(&self, fire: Fire) -> Result<LockKey, LockError> {
        LockKey::new(format!("{}@fire:{}", self.name, self.slot(fire)))
    }

    /// The key held while a run of this job is going.
    pub fn running_key(&self) -> Result<LockKey, LockError> {
        LockKey::new(format!("{}@running", self.name))
    }

    /// How long a fire key is kept after its run: one period plus twice the
    /// skew window. Refused if that does not fit in a `Duration`.
    fn keep_fire_for(&self) -> Result<Duration, LockError> {
        self.window
            .checked_mul(2)
            .and_then(|skew| skew.checked_add(self.period))
            .ok_or_else(|| {
                LockError::invalid_input(format!(
                    "schedule of {:?}: period {:?} plus twice the window {:?} is too long; use a shorter period or window",
                    self.name, self.period, self.window
                ))
            })
    }

    /// The fire key's lease ran out during the run (its renewal failed): take
    /// it again, owned by nobody, so it still lasts to the end of the window
    /// and late instances skip this fire.
    async fn retake_fire_key(
        &self,
        locker: &Locker,
        fire_key: &LockKey,
        keep_until: Instant,
        error: LockError,
    ) {
        let remaining = keep_until.saturating_duration_since(Instant::now());
        if error.kind() != ErrorKind::NotHeld || remaining.is_zero() {
            tracing::warn!(job = %self.name, key = %fire_key, %error, "could not keep the fire key; late instances may run this fire");
            return;
        }
        match locker.client().try_acquire(fire_key, remaining).await {
            Ok(AcquireAttempt::Acquired(_)) => {
                tracing::debug!(job = %self.name, key = %fire_key, "fire key taken again until the end of its window");
            }
            Ok(AcquireAttempt::Held { .. }) => {
                tracing::warn!(job = %self.name, key = %fire_key, "the fire key ran out during the run and another instance took this fire");
            }
            Err(e) => {
                tracing::warn!(job = %self.name, key = %fire_key, error = %e, "could not take the fire key again; late instances may run this fire");
            }
        }
    }

    /// Runs `job` for `fire` unless another instance took this fire or the
    /// previous run is still going.
    ///
    /// The fire key is kept after a completed run (and after a skip because
    /// the previous run is still going: that fire is skipped, not run late).
    /// If the run did not start (an error taking the `@running` key, which
    /// is returned) or was stopped because its lock was lost, the fire key
    /// is released at once so another instance can run the fire.
    ///
    /// Durations that cannot work (a window or period so long that the fire
    /// key could not be kept) are an [`ErrorKind::InvalidInput`] error.
    pub async fn run<F, Fut, T>(
        &self,
        locker: &Locker,
        fire: Fire,
        job: F,
    ) -> Result<ScheduledOutcome<T>, LockError>
    where
        F: FnOnce(crate::JobContext) -> Fut,
        Fut: Future<Output = T>,
    {
        let fire_key = self.fire_key(fire)?;
        let running_key = self.running_key()?;
        let keep_fire_for = self.keep_fire_for()?;
        let fire_options = LockOptions::new(self.ttl).with_hold_at_least(keep_fire_for);
        let Some(fire_guard) = locker.try_lock(&fire_key, &fire_options).await? else {
            tracing::info!(job = %self.name, key = %fire_key, "fire already taken by another instance; skipping");
            return Ok(ScheduledOutcome::Skipped(SkipReason::FireAlreadyTaken));
        };
        // The fire key is held at least `keep_fire_for` from here (see
        // `LockOptions::with_hold_at_least`); its lease may be dated earlier.
        let started = Instant::now();
        let run_options = RunOptions::new(LockOptions::new(self.ttl)).with_on_lost(self.on_lost);
        let outcome = locker.run_exclusive(&running_key, &run_options, job).await;
        let keep_until = later(started, keep_fire_for);
        match &outcome {
            // The fire ran (or is deliberately skipped while the previous
            // run goes on): keep its key until the hold-at-least time, so
            // late instances skip it.
            Ok(RunOutcome::Completed { .. } | RunOutcome::Skipped) => {
                if let Err(e) = fire_guard.release().await {
                    self.retake_fire_key(locker, &fire_key, keep_until, e).await;
                }
            }
            // The run never started (taking @running failed) or was stopped
            // (lost lock): free the fire so another instance can run it.
            Err(_) | Ok(RunOutcome::Lost { .. }) => {
                if outcome.is_err() {
                    // Taking @running failed, perhaps with an unknown
                    // outcome: the client settles that attempt in the
                    // background (taking and giving back what it finds).
                    // Freeing the fire only after that keeps the next
                    // instance from finding @running held by the settling
                    // attempt and skipping the fire as still running.
                    let _ = tokio::time::timeout(SETTLE_WAIT, locker.client().idle()).await;
                }
                tracing::info!(job = %self.name, key = %fire_key, "the run did not complete; releasing the fire for another instance");
                if let Err(e) = fire_guard.release_now().await {
                    tracing::debug!(job = %self.name, key = %fire_key, error = %e, "releasing the fire key failed; it expires after its TTL");
                }
            }
        }
        Ok(match outcome? {
            RunOutcome::Completed {
                output,
                fencing_token,
                ..
            } => ScheduledOutcome::Ran {
                output,
                duration: started.elapsed(),
                fencing_token,
            },
            RunOutcome::Skipped => {
                tracing::info!(job = %self.name, "previous run still going; skipping this fire");
                ScheduledOutcome::Skipped(SkipReason::PreviousStillRunning)
            }
            RunOutcome::Lost {
                output,
                fencing_token,
                reason,
            } => ScheduledOutcome::Lost {
                output,
                fencing_token,
                reason,
            },
        })
    }
}
