//! The one place where the binding calls the distlock Rust API: connecting,
//! acquiring, the guard's signals, scheduled runs, job keys and leader
//! election. The rest of
//! the binding sees only the small types below, so a change of the Rust API
//! is a change of this file.

use std::future::Future;
use std::time::{Duration, Instant, SystemTime};

use distlock::{Fire, JobKey, LockKey, LockOptions, LockState, Locker, OnLost, ScheduledJob};

pub use distlock::{
    ErrorKind, LockError, LockGuard, LostReason, LostSignal, ScheduledOutcome, SkipReason,
};
pub use distlock_core::{HolderId, LeaderWatch, Leadership, MAX_HOLDER_BYTES};

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
#[derive(Debug, Clone, PartialEq)]
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
    /// The label stored with the lock, for people reading who holds it.
    pub holder: Option<HolderId>,
}

impl Acquire {
    /// A lease of `ttl` and nothing else (schedules, campaigns), for the
    /// same checks as a lock's.
    pub fn ttl_only(ttl: Duration) -> Self {
        Self {
            ttl,
            wait: Duration::ZERO,
            max_hold: None,
            hold_at_least: None,
            permits: None,
            holder: None,
        }
    }

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
        if let Some(holder) = &self.holder {
            options = options.with_holder(holder.clone());
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
#[derive(Debug, Clone)]
pub struct Holder {
    /// The holder's fencing token.
    pub fencing_token: u64,
    /// Time left on the holder's lease, if the backend tells.
    pub expires_in: Option<Duration>,
    /// The holder's label, if it gave one and the backend stores labels.
    pub holder: Option<String>,
}

/// One live permit of a semaphore, as the operator call read it.
pub struct Permit {
    /// Its holder, as a lock's.
    pub holder: Holder,
    /// The limit it was granted under.
    pub limit: u32,
}

/// Who leads an election, as the server says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leader {
    /// The leader's label (`None` where the backend stores no labels).
    pub identity: Option<String>,
    /// The leadership's term (its lock's fencing token).
    pub term: u64,
}

impl From<distlock_core::Leader> for Leader {
    fn from(leader: distlock_core::Leader) -> Self {
        Self {
            identity: leader.identity.map(|id| id.as_str().to_owned()),
            term: leader.term.get(),
        }
    }
}

/// What a guard or a leadership holds: released, or dropped to release in
/// the background, the same way.
#[derive(Debug)]
pub enum Holding {
    /// A lock or permit.
    Lock(LockGuard),
    /// A leadership (its lock underneath).
    Leadership(Leadership),
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
    /// The view of a guard or a leadership.
    pub fn of(holding: &Holding) -> Self {
        let guard = match holding {
            Holding::Lock(guard) => guard,
            Holding::Leadership(leadership) => leadership.guard(),
        };
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
                holder,
            } => Some(Holder {
                fencing_token: fencing_token.get(),
                expires_in,
                holder: holder.map(|id| id.as_str().to_owned()),
            }),
            LockState::Free => None,
        })
    }

    /// The live permits of the semaphore `key`, oldest first, by the
    /// operator call.
    pub async fn inspect_permits(&self, key: &str) -> Result<Vec<Permit>, LockError> {
        let key = LockKey::new(key)?;
        let permits = self.locker.client().inspect_permits(&key).await?;
        Ok(permits
            .into_iter()
            .map(|permit| Permit {
                holder: Holder {
                    fencing_token: permit.fencing_token.get(),
                    expires_in: permit.expires_in,
                    holder: permit.holder.map(|id| id.as_str().to_owned()),
                },
                limit: permit.limit,
            })
            .collect())
    }

    /// Campaigns for leadership of `key` as `identity` with leases of
    /// `ttl`, until `deadline` (`None`: however long it takes); `None` if
    /// another candidate still leads then.
    pub async fn campaign(
        &self,
        key: &str,
        identity: &HolderId,
        ttl: Duration,
        deadline: Option<Instant>,
    ) -> Result<Option<Leadership>, LockError> {
        let key = LockKey::new(key)?;
        let options = LockOptions::new(ttl);
        match deadline {
            Some(deadline) => {
                self.locker
                    .campaign_until(&key, identity, &options, deadline)
                    .await
            }
            None => self
                .locker
                .campaign(&key, identity, &options)
                .await
                .map(Some),
        }
    }

    /// Who leads `key` now (`None`: vacant).
    pub async fn leader(&self, key: &str) -> Result<Option<Leader>, LockError> {
        let key = LockKey::new(key)?;
        Ok(self.locker.leader(&key).await?.map(Leader::from))
    }

    /// Follows who leads `key`, reading at least every `poll`.
    pub fn observe(&self, key: &str, poll: Duration) -> Result<LeaderWatch, LockError> {
        let key = LockKey::new(key)?;
        Ok(self.locker.observe(&key).with_poll_interval(poll))
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

/// Stops renewal and releases (a lock is kept until its hold-at-least
/// time; a leadership resigns at once).
pub async fn release(holding: Holding) -> Result<(), LockError> {
    match holding {
        Holding::Lock(guard) => guard.release().await,
        Holding::Leadership(leadership) => leadership.resign().await,
    }
}

/// The next change of who leads (see `LeaderWatch::changed`).
pub async fn next_leader(watch: &mut LeaderWatch) -> Result<Option<Leader>, LockError> {
    Ok(watch.changed().await?.map(Leader::from))
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
