//! The one place where the binding calls the distlock Rust API: connecting,
//! acquiring, the guard's signals, scheduled runs and job keys. The rest of
//! the binding sees only the small types below, so a change of the Rust API
//! is a change of this file.

use std::future::Future;
use std::time::{Duration, SystemTime};

use distlock::{Fire, JobKey, LockKey, LockOptions, LockState, Locker, OnLost, ScheduledJob};

pub use distlock::{
    ErrorKind, LockError, LockGuard, LostReason, LostSignal, ScheduledOutcome, SkipReason,
};

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
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Acquire {
    /// TTL of each lease (the guard renews it every third).
    pub ttl: Duration,
    /// How long to wait for a held lock; zero tries once.
    pub wait: Duration,
    /// Stop renewing this long after acquisition.
    pub max_hold: Option<Duration>,
    /// On release, keep the lock until this long after acquisition.
    pub hold_at_least: Option<Duration>,
    /// Take one of this many permits of the key's semaphore instead of
    /// the lock.
    pub permits: Option<u32>,
}

impl Acquire {
    fn options(&self) -> LockOptions {
        let mut options = LockOptions::new(self.ttl).with_wait(self.wait);
        if let Some(max) = self.max_hold {
            options = options.with_max_hold(max);
        }
        if let Some(min) = self.hold_at_least {
            options = options.with_hold_at_least(min);
        }
        if let Some(permits) = self.permits {
            options = options.with_permits(permits);
        }
        options
    }

    /// Whether the Rust API accepts these durations (the binding words
    /// the refusal for Python itself).
    pub fn is_valid(&self) -> bool {
        self.options().validate().is_ok()
    }
}

/// Who holds a key, as an operator reads it.
#[derive(Debug, Clone, Copy)]
pub struct Holder {
    /// The holder's fencing token.
    pub fencing_token: u64,
    /// Time left on the holder's lease, if the backend tells.
    pub expires_in: Option<Duration>,
}

/// The longest key a schedule name may have: the fire key adds
/// `@fire:` and a 20-digit slot number.
pub const SCHEDULE_SUFFIX_BYTES: usize = "@fire:".len() + 20;

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

/// Why a lock was lost.
pub fn lost_reason(lost: &LostSignal) -> Option<LostReason> {
    lost.reason()
}

impl Client {
    /// The longest TTL (and hold-at-least time) the backend accepts.
    pub fn max_ttl(&self) -> Duration {
        self.locker.client().capabilities().max_ttl
    }

    /// Takes `key`, waiting up to `how.wait`; `None` if it stayed held.
    pub async fn acquire(&self, key: &str, how: Acquire) -> Result<Option<LockGuard>, LockError> {
        let key = LockKey::new(key)?;
        self.locker.acquire(&key, &how.options()).await
    }

    /// Who holds `key` (`None`: nobody), by the operator call.
    pub async fn inspect(&self, key: &str) -> Result<Option<Holder>, LockError> {
        let key = LockKey::new(key)?;
        Ok(match self.locker.client().inspect(&key).await? {
            LockState::Held {
                expires_in,
                fencing_token,
                ..
            } => Some(Holder {
                fencing_token: fencing_token.get(),
                expires_in,
            }),
            LockState::Free => None,
        })
    }

    /// Deletes the lock at `key` whoever holds it; whether one was held.
    pub async fn force_release(&self, key: &str) -> Result<bool, LockError> {
        let key = LockKey::new(key)?;
        self.locker.client().force_release(&key).await
    }

    /// Runs `job` once for the fire of `job_name` at `fire_time` (`None`:
    /// now) unless another instance took that fire or the previous run is
    /// still going. The job is not stopped if the lock is lost (a Python
    /// function cannot be interrupted); the outcome then says so.
    /// `ttl` is the running lock's (renewed while the job runs; `None`:
    /// the Rust default, min(30 s, period)).
    pub async fn run_once_per_fire<F, Fut, T>(
        &self,
        job_name: &str,
        period: Duration,
        ttl: Option<Duration>,
        fire_time: Option<SystemTime>,
        job: F,
    ) -> Result<ScheduledOutcome<T>, LockError>
    where
        F: FnOnce(Held) -> Fut,
        Fut: Future<Output = T>,
    {
        let mut job_spec = ScheduledJob::new(job_name, period)?.with_on_lost(OnLost::Continue);
        if let Some(ttl) = ttl {
            job_spec = job_spec.with_ttl(ttl);
        }
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
