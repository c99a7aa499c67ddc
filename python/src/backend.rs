//! The one place where the binding calls the distlock Rust API: connecting,
//! acquiring, the guard's signals, scheduled runs and job keys. The rest of
//! the binding sees only the small types below, so a change of the Rust API
//! is a change of this file.

use std::future::Future;
use std::time::{Duration, SystemTime};

use distlock::{Fire, JobKey, LockKey, LockOptions, Locker, OnLost, ScheduledJob};

pub use distlock::{ErrorKind, LockError, LockGuard, LostSignal, ScheduledOutcome, SkipReason};

/// A connected lock client.
#[derive(Debug, Clone)]
pub struct Client {
    locker: Locker,
}

/// Opens a client for `url` (the facade's URL syntax and parameters).
pub async fn connect(url: &str) -> Result<Client, LockError> {
    Ok(Client {
        locker: Locker::new(distlock::connect(url).await?),
    })
}

/// How to take one lock.
#[derive(Debug, Clone, Copy)]
pub struct Acquire {
    /// TTL of each lease (the guard renews it every third).
    pub ttl: Duration,
    /// How long to wait for a held lock; zero tries once.
    pub wait: Duration,
    /// Stop renewing this long after acquisition.
    pub max_hold: Option<Duration>,
    /// On release, keep the lock until this long after acquisition.
    pub hold_at_least: Option<Duration>,
}

/// A job's view of the lock it runs under.
#[derive(Debug, Clone)]
pub struct Held {
    /// The key.
    pub key: String,
    /// The fencing token of the acquisition.
    pub fencing_token: u64,
    /// Fires when the lock is lost.
    pub lost: LostSignal,
}

impl Held {
    /// The view of a guard.
    pub fn of(guard: &LockGuard) -> Self {
        Self {
            key: guard.key().as_str().to_owned(),
            fencing_token: guard.fencing_token().get(),
            lost: guard.lost_signal(),
        }
    }
}

/// Why a lock was lost, in words.
pub fn lost_reason(lost: &LostSignal) -> Option<String> {
    lost.reason().map(|reason| reason.to_string())
}

impl Client {
    /// Takes `key`, waiting up to `how.wait`; `None` if it stayed held.
    pub async fn acquire(&self, key: &str, how: Acquire) -> Result<Option<LockGuard>, LockError> {
        let key = LockKey::new(key)?;
        let mut options = LockOptions::new(how.ttl).wait(how.wait);
        if let Some(max) = how.max_hold {
            options = options.max_hold(max);
        }
        if let Some(min) = how.hold_at_least {
            options = options.hold_at_least(min);
        }
        self.locker.acquire(&key, &options).await
    }

    /// Runs `job` once for the fire of `job_name` at `fire_time` (`None`:
    /// now) unless another instance took that fire or the previous run is
    /// still going. The job is not stopped if the lock is lost (a Python
    /// function cannot be interrupted); the outcome then says so.
    pub async fn run_once_per_fire<F, Fut, T>(
        &self,
        job_name: &str,
        period: Duration,
        fire_time: Option<SystemTime>,
        job: F,
    ) -> Result<ScheduledOutcome<T>, LockError>
    where
        F: FnOnce(Held) -> Fut,
        Fut: Future<Output = T>,
    {
        let job_spec = ScheduledJob::new(job_name, period)?.on_lost(OnLost::Continue);
        let fire = fire_time.map_or(Fire::Now, Fire::At);
        job_spec
            .run(&self.locker, fire, |context| {
                job(Held {
                    key: context.key.as_str().to_owned(),
                    fencing_token: context.fencing_token.get(),
                    lost: context.lost,
                })
            })
            .await
    }
}

/// Stops renewal and releases (or keeps the lock until its hold-at-least
/// time).
pub async fn release(guard: LockGuard) -> Result<(), LockError> {
    guard.release().await
}

/// The key `JobKey::new(name).args(&args).only(&only)` derives; without
/// `args`, `JobKey::new(name).key()`.
pub fn job_key(
    name: &str,
    args: Option<serde_json::Value>,
    only: Option<Vec<String>>,
) -> Result<String, LockError> {
    let mut key = JobKey::new(name);
    if let Some(args) = args {
        key = key.args(&args)?;
    }
    if let Some(only) = only {
        let only: Vec<&str> = only.iter().map(String::as_str).collect();
        key = key.only(&only);
    }
    Ok(key.key()?.as_str().to_owned())
}
