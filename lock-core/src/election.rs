//! Leader election: one candidate of a key leads at a time, the others
//! stand by, and everyone can see who leads.
//!
//! An election *is* a lock: the leader holds the lock `key`, labelled with
//! its [`HolderId`]; a candidate waits for that lock; the leadership's term
//! is the lock's fencing token (strictly increasing across leaders while
//! the server keeps its data). So a campaign has every lock rule for free
//! (renewal, [`lost`](Leadership::lost) before the server may expire the
//! lease, cancel-safety, the unknown-outcome rule), a resign wakes the next
//! candidate as a release wakes the next waiter, and `distlock status KEY`
//! shows the leader. Do not also take the lock `key` for other work: it is
//! the leadership.
//!
//! ```
//! use std::time::Duration;
//! use distlock_core::{HolderId, Locker, LockKey, LockOptions, MemoryLock};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), distlock_core::LockError> {
//! let server = MemoryLock::new();
//! let (a, b) = (Locker::new(server.client()), Locker::new(server.client()));
//! let key = LockKey::new("scheduler")?;
//! let options = LockOptions::new(Duration::from_secs(10));
//!
//! let mut watch = b.observe(&key);
//! assert_eq!(watch.changed().await?, None); // vacant
//!
//! let leading = a.campaign(&key, &HolderId::new("instance-a")?, &options).await?;
//! let seen = watch.changed().await?.expect("a leads");
//! assert_eq!(seen.identity.as_ref().map(|id| id.as_str()), Some("instance-a"));
//! assert_eq!(seen.term, leading.term());
//!
//! // b stands by; a's resign wakes it.
//! let standby = tokio::spawn({
//!     let (b, key, options) = (b.clone(), key.clone(), options.clone());
//!     async move { b.campaign(&key, &HolderId::new("instance-b")?, &options).await }
//! });
//! leading.resign().await?;
//! let next = standby.await.unwrap()?;
//! assert!(next.term() > seen.term);
//! assert_eq!(b.leader(&key).await?.map(|l| l.term), Some(next.term()));
//! # next.resign().await
//! # }
//! ```

use std::future::Future;
use std::time::{Duration, Instant};

use crate::lease::later;
use crate::wait::{BACKOFF_MAX, BACKOFF_MIN};
use crate::{
    FencingToken, HolderId, LockClient, LockError, LockGuard, LockKey, LockOptions, LockState,
    Locker, LostReason, LostSignal, ReleaseWatch,
};

/// Who leads an election, as the server says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leader {
    /// The leader's label, if it gave one (a backend without
    /// [`Capabilities::holder_ids`](crate::Capabilities::holder_ids) shows
    /// none). For people, not proof of anything.
    pub identity: Option<HolderId>,
    /// The leadership's term: its lock's fencing token, greater than every
    /// earlier leader's.
    pub term: FencingToken,
}

/// This candidate leads. Renews itself; [`lost`](Self::lost) fires before
/// another candidate can lead; [`resign`](Self::resign) (or dropping it)
/// hands over at once.
#[derive(Debug)]
pub struct Leadership {
    guard: LockGuard,
    identity: HolderId,
}

impl Leadership {
    /// The term: strictly greater than every earlier leader's. Pass it to
    /// what the leader writes, so a deposed leader's late writes can be
    /// refused.
    pub fn term(&self) -> FencingToken {
        self.guard.fencing_token()
    }

    /// The label this candidate campaigned with.
    pub fn identity(&self) -> &HolderId {
        &self.identity
    }

    /// The election's key.
    pub fn key(&self) -> LockKey {
        self.guard.key()
    }

    /// Whether leadership is known or assumed lost.
    pub fn is_lost(&self) -> bool {
        self.guard.is_lost()
    }

    /// Resolves when leadership is lost (renewal refused, the key deleted
    /// or taken, or the server unreachable until the stop moment: the stop
    /// margin before the earliest moment the server may expire the lease,
    /// so before another candidate can lead); never, if it resigns first.
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        self.guard.lost()
    }

    /// A clonable handle on the lost signal, for the leader's work.
    pub fn lost_signal(&self) -> LostSignal {
        self.guard.lost_signal()
    }

    /// Runs `work` while leading: it is dropped the moment leadership is
    /// lost (see [`LockGuard::while_held`]).
    pub async fn while_leading<F: Future>(&self, work: F) -> Result<F::Output, LostReason> {
        self.guard.while_held(work).await
    }

    /// Steps down: the lock is released and the next candidate woken.
    /// [`ErrorKind::NotHeld`](crate::ErrorKind::NotHeld) if leadership was
    /// already lost. Cancel-safe as [`LockGuard::release`]. Dropping a
    /// leadership resigns in the background.
    ///
    /// A resign whose outcome is unknown (a timeout, a lost connection:
    /// the server may or may not have applied it) is returned as that
    /// error, and sent again in the background, with backoff, until the
    /// server answers or the lease could have run out: a standby then
    /// takes over as soon as the server can be reached, not only after the
    /// TTL. Resending is safe: a release is conditional on this term's
    /// owner token, so a late one never frees a successor's leadership.
    pub async fn resign(self) -> Result<(), LockError> {
        let (client, lease) = (self.guard.client().clone(), self.guard.lease());
        let result = self.guard.release_now().await;
        if matches!(&result, Err(e) if e.is_transient()) {
            let retrying = client.clone();
            client.spawn_background(async move {
                let mut backoff = BACKOFF_MIN;
                while !lease.is_expired() {
                    tokio::time::sleep(backoff).await;
                    match retrying.release(&lease).await {
                        Err(e) if e.is_transient() => backoff = (backoff * 2).min(BACKOFF_MAX),
                        _ => return,
                    }
                }
            });
        }
        result
    }

    /// The lock guard underneath.
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }
}

impl Locker {
    /// Campaigns for leadership of `key` as `identity`: waits, however
    /// long, until this candidate leads. The options' TTL, renewal and stop
    /// margin apply to the leadership (its wait and permits are ignored).
    /// Transient errors are retried; drop the future to stop campaigning
    /// (cancel-safe: nothing stays held, as with [`Locker::acquire`]).
    pub async fn campaign(
        &self,
        key: &LockKey,
        identity: &HolderId,
        options: &LockOptions,
    ) -> Result<Leadership, LockError> {
        loop {
            let far = later(Instant::now(), Duration::MAX);
            if let Some(leadership) = self.campaign_until(key, identity, options, far).await? {
                return Ok(leadership);
            }
        }
    }

    /// As [`campaign`](Self::campaign), giving up at `deadline`:
    /// `Ok(None)` if another candidate still leads then.
    pub async fn campaign_until(
        &self,
        key: &LockKey,
        identity: &HolderId,
        options: &LockOptions,
        deadline: Instant,
    ) -> Result<Option<Leadership>, LockError> {
        let options = campaign_options(options, identity);
        let guard = self
            .lock_until(key, &options, Some(deadline), std::future::pending())
            .await?;
        Ok(guard.map(|guard| Leadership {
            guard,
            identity: identity.clone(),
        }))
    }

    /// Who leads `key` now, or `None` when nobody does. A read for people
    /// and dashboards: stale as soon as it arrives. Needs the backend's
    /// operator calls ([`ErrorKind::Unsupported`](crate::ErrorKind) without).
    pub async fn leader(&self, key: &LockKey) -> Result<Option<Leader>, LockError> {
        Ok(leader_of(self.client().inspect(key).await?))
    }

    /// Follows who leads `key`: see [`LeaderWatch`].
    pub fn observe(&self, key: &LockKey) -> LeaderWatch {
        LeaderWatch {
            client: self.client().clone(),
            key: key.clone(),
            reported: None,
            max_term: None,
            watch: None,
            poll: DEFAULT_OBSERVE_POLL,
        }
    }
}

fn campaign_options(options: &LockOptions, identity: &HolderId) -> LockOptions {
    let mut options = options.clone().with_holder(identity.clone());
    options.clear_permits();
    options
}

fn leader_of(state: LockState) -> Option<Leader> {
    match state {
        LockState::Free => None,
        LockState::Held {
            fencing_token,
            holder,
            ..
        } => Some(Leader {
            identity: holder,
            term: fencing_token,
        }),
    }
}

/// How often an observer reads who leads when the server does not notify
/// it of changes (and as a safety net when it does).
pub const DEFAULT_OBSERVE_POLL: Duration = Duration::from_secs(1);

/// Follows who leads an election ([`Locker::observe`]).
///
/// [`changed`](Self::changed) answers at once the first time (the leader,
/// or `None` for vacant), then each time who leads differs from what it
/// last answered. Terms only grow: a leader with an older term than one
/// already reported is never reported (a stale read), and a change is
/// never reported twice. Woken by the server where the backend notifies
/// changes ([`LockAdmin::watch_holder`](crate::LockAdmin::watch_holder):
/// memory, Redis, etcd, PostgreSQL); elsewhere by reading at the leader's expiry and every
/// [poll interval](Self::with_poll_interval). Changes between two reads
/// may be skipped: it reports states, not every transition.
#[derive(Debug)]
pub struct LeaderWatch {
    client: LockClient,
    key: LockKey,
    /// What was last answered: `Some(None)` vacant.
    reported: Option<Option<Leader>>,
    /// The newest term answered (kept across vacancies).
    max_term: Option<FencingToken>,
    watch: Option<ReleaseWatch>,
    poll: Duration,
}

impl LeaderWatch {
    /// Reads at least this often (default [`DEFAULT_OBSERVE_POLL`]); a zero
    /// interval is raised to 1 ms.
    pub fn with_poll_interval(mut self, every: Duration) -> Self {
        self.poll = every.max(Duration::from_millis(1));
        self
    }

    /// The next leader (or `None`: vacant) that differs from the last one
    /// answered. Errors (the server unreachable) are returned as they come;
    /// call again to go on. Cancel-safe: a change read by a dropped call is
    /// answered by the next one.
    pub async fn changed(&mut self) -> Result<Option<Leader>, LockError> {
        loop {
            // Before the read, so a change right after it is not missed;
            // only where the server notifies (else a call per poll).
            if self.watch.is_none() && self.client.capabilities().holder_watch {
                self.watch = self.client.watch_holder(&self.key).await?;
            }
            let now = self.client.inspect(&self.key).await?;
            let expires_in = match &now {
                LockState::Held { expires_in, .. } => *expires_in,
                LockState::Free => None,
            };
            let now = leader_of(now);
            if self.is_news(&now) {
                if let Some(leader) = &now {
                    self.max_term = Some(leader.term);
                }
                self.reported = Some(now.clone());
                return Ok(now);
            }
            let mut wake_in = self.poll;
            if let Some(left) = expires_in {
                // Just past the leader's expiry, where nobody notifies it.
                wake_in = wake_in.min(left.saturating_add(Duration::from_millis(5)));
            }
            let mut never = ReleaseWatch::never();
            let watch = self.watch.as_mut().unwrap_or(&mut never);
            tokio::select! {
                woke = watch.released() => {
                    if woke.is_err() {
                        // The subscription was lost: subscribe again.
                        self.watch = None;
                    }
                }
                () = tokio::time::sleep(wake_in) => {}
            }
        }
    }

    /// Whether `now` is a change worth answering: a first answer, a
    /// vacancy after a leader, or a leader of a newer term.
    fn is_news(&self, now: &Option<Leader>) -> bool {
        match (&self.reported, now) {
            (None, _) => true,
            (Some(Some(_)), None) => true,
            (Some(None), None) => false,
            (Some(_), Some(now)) => self.max_term.is_none_or(|last| now.term > last),
        }
    }
}
