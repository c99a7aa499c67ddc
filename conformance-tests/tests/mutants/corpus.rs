//! The mutants: one wrapper backend around `MemoryLock` (through a
//! simulated network [`Link`](conformance_tests::fault::Link) for the
//! clients of fault cases), forwarding everything except the one defect
//! its [`Defect`] names. Public API only, as a third party would write it.
//!
//! To add a mutant: add a [`Defect`] variant, give it its behaviour in the
//! `Mutant` methods below (everything else keeps forwarding), and list it
//! in [`CORPUS`] with a one-line description and the cases expected to
//! catch it (they run first; the rest of the suite still runs if they do
//! not).

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lock_core::{
    AcquireAttempt, Capabilities, DistributedLock, ErrorKind, FencingToken, Lease, LeaseIssuer,
    LockError, LockKey, LockState, ReleaseNotifier, ReleaseWatch,
};

/// The one thing a mutant does wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Defect {
    /// No defect: the control, which must pass every case.
    None,
    // The subtle classes of issue 21.
    ReleaseCheckThenDelete,
    ExtendCheckThenSet,
    GrantsBeforeExpiry,
    RenewingSessionTenTimesTtl,
    DeadlineFromReply,
    UnavailableAsHeld,
    // Cancellation and wake-up classes of issue 12.
    SetThenExpire,
    WatchDropBreaksChannel,
    SubscribeAfterTry,
    // The blunt ones.
    ReleaseWithoutOwnerCheck,
    ExtendResurrects,
    FencingPerClient,
    NoopRelease,
    NoopExtend,
    LowercasedKeys,
    TruncatedKeys,
    DoubleGrant,
    WatchNeverFires,
    LyingGranularity,
    IssuerNotChecked,
    ExpiryIgnored,
    RenewingNeverExpires,
    ExtendChangesToken,
    ExpiresInInflated,
    HeldAsError,
    AcquireIgnoresDeadline,
}

/// One mutant of the corpus.
#[derive(Debug, Clone, Copy)]
pub struct MutantSpec {
    /// Its test name (`mutant::<name>`).
    pub name: &'static str,
    /// What it injects.
    pub defect: Defect,
    /// What is wrong, in a line.
    pub what: &'static str,
    /// The cases expected to reject it (run first).
    pub killers: &'static [&'static str],
}

/// Every mutant.
pub const CORPUS: &[MutantSpec] = &[
    MutantSpec {
        name: "release_check_then_delete",
        defect: Defect::ReleaseCheckThenDelete,
        what: "release checks the holder, then deletes the key in a second step 5 ms later (not atomic)",
        killers: &["lease::release_atomic_against_expiry"],
    },
    MutantSpec {
        name: "extend_check_then_set",
        defect: Defect::ExtendCheckThenSet,
        what: "extend checks the holder, then sets the expiry 5 ms later and trusts the check (GET, then PEXPIRE)",
        killers: &["lease::extend_atomic_against_expiry"],
    },
    MutantSpec {
        name: "grants_before_expiry",
        defect: Defect::GrantsBeforeExpiry,
        what: "a held key with 100 ms or less left is granted to another client (expiry judged on a clock running ahead)",
        killers: &["lease::never_granted_before_holder_deadline"],
    },
    MutantSpec {
        name: "renewing_session_ten_times_ttl",
        defect: Defect::RenewingSessionTenTimesTtl,
        what: "a renewing acquire lives on a session of 10x the TTL (a holder that dies before renewing keeps it 10x too long)",
        killers: &["lease::renewing_holder_death_frees_key"],
    },
    MutantSpec {
        name: "deadline_from_reply",
        defect: Defect::DeadlineFromReply,
        what: "the lease's deadline is counted from when the reply arrived, not from before the request was sent",
        killers: &[
            "lease::holder_deadline_within_server_expiry",
            "lease::never_granted_before_holder_deadline",
        ],
    },
    MutantSpec {
        name: "unavailable_as_held",
        defect: Defect::UnavailableAsHeld,
        what: "an unreachable server is reported as a lock held by someone else (every job skips silently)",
        killers: &["fault::unreachable_is_an_error_not_held"],
    },
    MutantSpec {
        name: "set_then_expire",
        defect: Defect::SetThenExpire,
        what: "acquire takes the key for an hour, then shortens it to the TTL in a second call (SETNX, then EXPIRE): a call dropped in between leaves it held for an hour",
        killers: &["cancel::dropped_calls_leave_nothing_held"],
    },
    MutantSpec {
        name: "watch_drop_breaks_channel",
        defect: Defect::WatchDropBreaksChannel,
        what: "a watch dropped (or failing) while it subscribes stops every wake-up for that key on the client (one failed SUBSCRIBE unsubscribes every waiter)",
        killers: &["cancel::dropped_calls_leave_later_waiters_woken"],
    },
    MutantSpec {
        name: "subscribe_after_try",
        defect: Defect::SubscribeAfterTry,
        what: "a waiter's subscription starts 50 ms late (subscribe after trying): a release right after its first attempt is missed",
        killers: &[
            "wait::waiter_gets_lock_after_release",
            "wait::raw_acquire_waits_for_release",
        ],
    },
    MutantSpec {
        name: "release_without_owner_check",
        defect: Defect::ReleaseWithoutOwnerCheck,
        what: "release deletes the key whoever holds it",
        killers: &["basic::foreign_release_refused", "basic::stale_owner_release_refused"],
    },
    MutantSpec {
        name: "extend_resurrects",
        defect: Defect::ExtendResurrects,
        what: "extending a lock that is gone takes the key again",
        killers: &["basic::extend_after_expiry_fails", "basic::extend_after_release_fails"],
    },
    MutantSpec {
        name: "fencing_per_client",
        defect: Defect::FencingPerClient,
        what: "fencing tokens count per client, not per key",
        killers: &["fencing::increases_across_clients"],
    },
    MutantSpec {
        name: "noop_release",
        defect: Defect::NoopRelease,
        what: "release reports success and does nothing",
        killers: &["basic::release_frees_key_for_other_client"],
    },
    MutantSpec {
        name: "noop_extend",
        defect: Defect::NoopExtend,
        what: "extend reports success and does nothing",
        killers: &["basic::extend_pushes_expiry"],
    },
    MutantSpec {
        name: "lowercased_keys",
        defect: Defect::LowercasedKeys,
        what: "keys are lowercased on the server (A and a collide)",
        killers: &["basic::lookalike_keys_independent"],
    },
    MutantSpec {
        name: "truncated_keys",
        defect: Defect::TruncatedKeys,
        what: "keys are cut to 64 bytes on the server",
        killers: &["input::max_length_multibyte_key_works"],
    },
    MutantSpec {
        name: "double_grant",
        defect: Defect::DoubleGrant,
        what: "one refused attempt in ten is granted anyway",
        killers: &["exclusion::try_lock_never_overlaps", "exclusion::counter_is_exact"],
    },
    MutantSpec {
        name: "watch_never_fires",
        defect: Defect::WatchNeverFires,
        what: "waiters are never woken by a release (only by timers)",
        killers: &["wait::waiter_gets_lock_after_release"],
    },
    MutantSpec {
        name: "lying_granularity",
        defect: Defect::LyingGranularity,
        what: "declares millisecond TTLs but silently holds locks for whole seconds",
        killers: &["lease::renewing_holder_death_frees_key", "basic::ttl_expiry_frees_key"],
    },
    MutantSpec {
        name: "issuer_not_checked",
        defect: Defect::IssuerNotChecked,
        what: "a lease issued by another client is accepted",
        killers: &["input::lease_from_other_client"],
    },
    MutantSpec {
        name: "expiry_ignored",
        defect: Defect::ExpiryIgnored,
        what: "locks outlive their TTL a thousandfold",
        killers: &["basic::ttl_expiry_frees_key"],
    },
    MutantSpec {
        name: "renewing_never_expires",
        defect: Defect::RenewingNeverExpires,
        what: "a renewing acquire is held for the longest TTL until renewed",
        killers: &["lease::renewing_holder_death_frees_key"],
    },
    MutantSpec {
        name: "extend_changes_token",
        defect: Defect::ExtendChangesToken,
        what: "extend hands back a different fencing token",
        killers: &["fencing::unchanged_by_extend"],
    },
    MutantSpec {
        name: "expires_in_inflated",
        defect: Defect::ExpiresInInflated,
        what: "a refusal reports far more time left than the holder's TTL",
        killers: &["basic::held_reports_remaining_ttl"],
    },
    MutantSpec {
        name: "held_as_error",
        defect: Defect::HeldAsError,
        what: "a held key is reported as an unavailable server",
        killers: &["basic::held_key_is_refused"],
    },
    MutantSpec {
        name: "acquire_ignores_deadline",
        defect: Defect::AcquireIgnoresDeadline,
        what: "the raw waiting acquire ignores its deadline",
        killers: &["wait::deadline_respected"],
    },
];

/// How long the check-then-act mutants wait between their two steps.
const GAP: Duration = Duration::from_millis(5);

/// How much earlier than its holder's expiry `GrantsBeforeExpiry` grants.
const EARLY: Duration = Duration::from_millis(100);

/// A client that forwards to `inner` except for its defect.
pub struct Mutant {
    defect: Defect,
    inner: Arc<dyn DistributedLock>,
    /// Issuers of the leases it handed out (the mutants that bypass the
    /// inner client's lease checks keep the issuer check this way).
    issuers: Mutex<HashSet<LeaseIssuer>>,
    /// Per-client fencing counter (`FencingPerClient`).
    counter: AtomicU64,
    /// Keys whose wake-ups stopped (`WatchDropBreaksChannel`).
    broken: Arc<Mutex<HashSet<String>>>,
    /// Local fan-out for the mutants that reroute wake-ups.
    notifier: ReleaseNotifier,
}

impl fmt::Debug for Mutant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mutant")
            .field("defect", &self.defect)
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// The parts of a lease, to hand back a changed one.
struct Parts {
    key: LockKey,
    fencing: FencingToken,
    sent_at: Instant,
    ttl: Duration,
    issuer: LeaseIssuer,
}

fn parts(lease: &Lease) -> Parts {
    Parts {
        key: lease.key().clone(),
        fencing: lease.fencing_token(),
        sent_at: lease.sent_at(),
        ttl: lease.ttl(),
        issuer: lease.issuer(),
    }
}

fn relabel(lease: &Lease, change: impl FnOnce(&mut Parts)) -> Lease {
    let mut p = parts(lease);
    change(&mut p);
    Lease::new(p.key, lease.owner(), p.fencing, p.sent_at, p.ttl, p.issuer)
        .with_handle(lease.handle())
}

fn not_held(lease: &Lease) -> LockError {
    LockError::not_held(format!(
        "lock {:?} is not held by this lease",
        lease.key().as_str()
    ))
}

/// Marks a key's wake-ups broken if dropped while armed.
struct BreakOnDrop {
    broken: Arc<Mutex<HashSet<String>>>,
    key: String,
    armed: bool,
}

impl Drop for BreakOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.broken
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(self.key.clone());
        }
    }
}

impl Mutant {
    /// `inner` with `defect`.
    pub fn wrap(defect: Defect, inner: Arc<dyn DistributedLock>) -> Arc<dyn DistributedLock> {
        Arc::new(Mutant {
            defect,
            inner,
            issuers: Mutex::new(HashSet::new()),
            counter: AtomicU64::new(0),
            broken: Arc::new(Mutex::new(HashSet::new())),
            notifier: ReleaseNotifier::new(),
        })
    }

    fn is(&self, defect: Defect) -> bool {
        self.defect == defect
    }

    /// The key as the (broken) server stores it.
    fn server_key(&self, key: &LockKey) -> LockKey {
        let mapped = match self.defect {
            Defect::LowercasedKeys => key.as_str().to_lowercase(),
            Defect::TruncatedKeys => {
                let mut end = key.as_str().len().min(64);
                while !key.as_str().is_char_boundary(end) {
                    end -= 1;
                }
                key.as_str()[..end].to_owned()
            }
            _ => return key.clone(),
        };
        LockKey::new(mapped).unwrap_or_else(|_| key.clone())
    }

    /// A lease of ours as the inner client knows it (`IssuerNotChecked`:
    /// any client's lease passed off as ours).
    fn inner_lease(&self, lease: &Lease) -> Lease {
        let key = self.server_key(lease.key());
        let ours = self
            .issuers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .next()
            .copied();
        let issuer = match ours {
            Some(ours) if self.is(Defect::IssuerNotChecked) => ours,
            _ => lease.issuer(),
        };
        if &key == lease.key() && issuer == lease.issuer() {
            return lease.clone();
        }
        relabel(lease, |p| {
            p.key = key;
            p.issuer = issuer;
        })
    }

    fn known_issuer(&self, lease: &Lease) -> bool {
        self.issuers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&lease.issuer())
    }

    /// The inner client's lease handed out as ours.
    fn outer_lease(&self, key: &LockKey, lease: Lease, asked: Duration, renewed: bool) -> Lease {
        self.issuers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(lease.issuer());
        let counter = &self.counter;
        let defect = self.defect;
        relabel(&lease, |p| {
            p.key = key.clone();
            match defect {
                Defect::DeadlineFromReply => p.sent_at = Instant::now(),
                Defect::RenewingSessionTenTimesTtl
                | Defect::ExpiryIgnored
                | Defect::RenewingNeverExpires
                | Defect::LyingGranularity => p.ttl = asked,
                Defect::FencingPerClient if !renewed => {
                    p.fencing = FencingToken::new(counter.fetch_add(1, Ordering::SeqCst) + 1)
                }
                Defect::ExtendChangesToken if renewed => {
                    p.fencing = FencingToken::new(p.fencing.get() + 1)
                }
                _ => {}
            }
        })
    }

    /// The TTL the broken server really uses for a request of `ttl`.
    fn server_ttl(&self, ttl: Duration, renewing: bool) -> Duration {
        if ttl.is_zero() {
            // Invalid input stays invalid: the inner client reports it.
            return ttl;
        }
        let max = self.inner.capabilities().max_ttl;
        match self.defect {
            Defect::ExpiryIgnored => (ttl * 1000).min(max),
            Defect::RenewingSessionTenTimesTtl if renewing => (ttl * 10).min(max),
            Defect::RenewingNeverExpires if renewing => max,
            Defect::LyingGranularity => Duration::from_secs(ttl.as_secs_f64().ceil() as u64),
            _ => ttl,
        }
    }

    async fn attempt(
        &self,
        key: &LockKey,
        ttl: Duration,
        renewing: bool,
    ) -> Result<AcquireAttempt, LockError> {
        let server_key = self.server_key(key);
        let server_ttl = self.server_ttl(ttl, renewing);
        let result = if self.is(Defect::SetThenExpire) {
            self.set_then_expire(&server_key, ttl).await
        } else if renewing {
            self.inner
                .try_acquire_renewing(&server_key, server_ttl)
                .await
        } else {
            self.inner.try_acquire(&server_key, server_ttl).await
        };
        let result = match (self.defect, result) {
            (Defect::UnavailableAsHeld, Err(e)) if e.is_transient() => {
                Ok(AcquireAttempt::Held { expires_in: None })
            }
            (
                Defect::GrantsBeforeExpiry,
                Ok(AcquireAttempt::Held {
                    expires_in: Some(left),
                }),
            ) if left <= EARLY => {
                self.inner.force_release(&server_key).await?;
                self.inner.try_acquire(&server_key, server_ttl).await
            }
            (Defect::DoubleGrant, Ok(AcquireAttempt::Held { .. })) if rand::random_bool(0.1) => {
                self.inner.force_release(&server_key).await?;
                self.inner.try_acquire(&server_key, server_ttl).await
            }
            (Defect::HeldAsError, Ok(AcquireAttempt::Held { .. })) => {
                Err(LockError::unavailable("the lock server did not answer"))
            }
            (Defect::ExpiresInInflated, Ok(AcquireAttempt::Held { expires_in })) => {
                Ok(AcquireAttempt::Held {
                    expires_in: expires_in.map(|left| left * 100 + Duration::from_secs(3600)),
                })
            }
            (_, other) => other,
        }?;
        Ok(match result {
            AcquireAttempt::Acquired(lease) => {
                AcquireAttempt::Acquired(self.outer_lease(key, lease, ttl, false))
            }
            held => held,
        })
    }

    /// SETNX for an hour, then EXPIRE to the TTL: two calls.
    async fn set_then_expire(
        &self,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<AcquireAttempt, LockError> {
        self.inner.capabilities().effective_ttl(ttl)?;
        let hour = Duration::from_secs(3600).min(self.inner.capabilities().max_ttl);
        match self.inner.try_acquire(key, hour).await? {
            AcquireAttempt::Acquired(lease) => {
                let shortened = self.inner.extend(&lease, ttl).await?;
                Ok(AcquireAttempt::Acquired(shortened))
            }
            held => Ok(held),
        }
    }

    /// Whether the server shows `lease`'s acquisition at its key.
    async fn shows(&self, lease: &Lease) -> Result<bool, LockError> {
        Ok(matches!(
            self.inner.inspect(lease.key()).await?,
            LockState::Held { fencing_token, .. } if fencing_token == lease.fencing_token()
        ))
    }

    /// A watch through this client's own fan-out: the inner watch is
    /// taken after `late` (if any), and wake-ups for broken keys are
    /// swallowed.
    async fn rerouted_watch(
        &self,
        key: &LockKey,
        late: Option<Duration>,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        let server_key = self.server_key(key);
        let mut guard = BreakOnDrop {
            broken: self.broken.clone(),
            key: key.as_str().to_owned(),
            armed: self.is(Defect::WatchDropBreaksChannel),
        };
        let first = match late {
            Some(_) => None,
            None => match self.inner.watch(&server_key).await? {
                Some(watch) => Some(watch),
                None => return Ok(None),
            },
        };
        guard.armed = false;
        let (inner, notifier, broken) = (
            self.inner.clone(),
            self.notifier.clone(),
            self.broken.clone(),
        );
        let channel = key.as_str().to_owned();
        let watch = self
            .notifier
            .subscribe(key.as_str(), move || async move {
                let closed = notifier.closed(&channel);
                tokio::spawn(async move {
                    tokio::pin!(closed);
                    let mut watch = match first {
                        Some(watch) => watch,
                        None => {
                            tokio::select! {
                                _ = &mut closed => return,
                                _ = tokio::time::sleep(late.unwrap_or_default()) => {}
                            }
                            match inner.watch(&server_key).await {
                                Ok(Some(watch)) => watch,
                                _ => return,
                            }
                        }
                    };
                    loop {
                        tokio::select! {
                            _ = &mut closed => return,
                            woke = watch.released() => if woke.is_err() { return },
                        }
                        let is_broken = broken
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .contains(&channel);
                        if !is_broken {
                            notifier.notify(&channel);
                        }
                    }
                });
                Ok(())
            })
            .await?;
        Ok(Some(watch))
    }
}

#[lock_core::async_trait]
impl DistributedLock for Mutant {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<AcquireAttempt, LockError> {
        self.attempt(key, ttl, false).await
    }

    async fn try_acquire_renewing(
        &self,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<AcquireAttempt, LockError> {
        self.attempt(key, ttl, true).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease, LockError> {
        let inner = self.inner_lease(lease);
        let server_ttl = self.server_ttl(ttl, false);
        let result = match self.defect {
            Defect::NoopExtend => Ok(inner.renewed(Instant::now(), server_ttl)),
            Defect::ExtendCheckThenSet if self.known_issuer(lease) => {
                let sent_at = Instant::now();
                if !self.shows(&inner).await? {
                    return Err(not_held(lease));
                }
                tokio::time::sleep(GAP).await;
                match self.inner.extend(&inner, server_ttl).await {
                    // The check said it was ours: the expiry was set (on
                    // whoever holds the key now).
                    Err(e) if e.kind() == ErrorKind::NotHeld => {
                        Ok(inner.renewed(sent_at, server_ttl))
                    }
                    other => other,
                }
            }
            Defect::ExtendResurrects => match self.inner.extend(&inner, server_ttl).await {
                Err(e) if e.kind() == ErrorKind::NotHeld => {
                    match self.inner.try_acquire(inner.key(), server_ttl).await? {
                        AcquireAttempt::Acquired(again) => Ok(again),
                        AcquireAttempt::Held { .. } => Err(e),
                    }
                }
                other => other,
            },
            _ => self.inner.extend(&inner, server_ttl).await,
        }?;
        let renewed = self.outer_lease(lease.key(), result, ttl, true);
        Ok(if self.is(Defect::FencingPerClient) {
            // Keep the token this client handed out for the acquisition.
            relabel(&renewed, |p| p.fencing = lease.fencing_token())
        } else {
            renewed
        })
    }

    async fn release(&self, lease: &Lease) -> Result<(), LockError> {
        let inner = self.inner_lease(lease);
        match self.defect {
            Defect::NoopRelease => Ok(()),
            Defect::ReleaseWithoutOwnerCheck => {
                if self.inner.force_release(inner.key()).await? {
                    Ok(())
                } else {
                    Err(not_held(lease))
                }
            }
            Defect::ReleaseCheckThenDelete if self.known_issuer(lease) => {
                if !self.shows(&inner).await? {
                    return Err(not_held(lease));
                }
                tokio::time::sleep(GAP).await;
                self.inner.force_release(inner.key()).await?;
                Ok(())
            }
            _ => self.inner.release(&inner).await,
        }
    }

    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        self.inner.inspect(&self.server_key(key)).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        self.inner.force_release(&self.server_key(key)).await
    }

    async fn watch(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        match self.defect {
            Defect::WatchNeverFires => Ok(Some(ReleaseWatch::never())),
            Defect::SubscribeAfterTry => {
                self.rerouted_watch(key, Some(Duration::from_millis(50)))
                    .await
            }
            Defect::WatchDropBreaksChannel => self.rerouted_watch(key, None).await,
            _ => self.inner.watch(&self.server_key(key)).await,
        }
    }

    async fn acquire(
        &self,
        key: &LockKey,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<Option<Lease>, LockError> {
        let deadline = if self.is(Defect::AcquireIgnoresDeadline) {
            Instant::now() + Duration::from_secs(3600)
        } else {
            deadline
        };
        lock_core::wait::acquire_by_watching(self, key, ttl, deadline).await
    }
}
