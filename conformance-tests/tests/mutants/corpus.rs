//! The mutants: one wrapper backend around `MemoryLock` (through a
//! simulated network [`Link`](distlock_conformance::fault::Link) for the
//! clients of fault cases), forwarding everything except the one defect
//! its [`Defect`] names. Public API only, as a third party would write it:
//! each mutant is a raw `LockBackend`, so it can break exactly what a
//! backend author could break.
//!
//! Some defects of the first corpus cannot be written any more since
//! distlock-core owns every lease rule: an issuer check a backend
//! skips, a waiting loop that ignores its deadline, a lease dated from the
//! reply (a backend can only report the TTL the server applied; the
//! closest it can get is to inflate it, `deadline_from_reply` below).
//!
//! To add a mutant: add a [`Defect`] variant, give it its behaviour in the
//! `Mutant` methods below (everything else keeps forwarding), and list it
//! in [`CORPUS`] with a one-line description and the cases expected to
//! catch it (they run first; the rest of the suite still runs if they do
//! not).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock_core::{
    AcquireReply, AcquireRequest, Capabilities, ExtendReply, FencingToken, Grant, HeldLock,
    LockAdmin, LockBackend, LockClient, LockError, LockKey, LockState, OwnerToken, PermitReply,
    PermitRequest, PermitState, ReleaseNotifier, ReleaseReply, ReleaseWatch, SemaphoreBackend,
};

/// The one thing a mutant does wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Defect {
    /// No defect: the control, which must pass every case.
    None,
    // The subtle ones: check-then-write races, expiry judged on a fast
    // clock, leases that outlive their TTL, an outage reported as held.
    ReleaseCheckThenDelete,
    ExtendCheckThenSet,
    GrantsBeforeExpiry,
    RenewingSessionTenTimesTtl,
    /// Reports the TTL counted from when the reply arrived (TTL + the round
    /// trip), so the client's deadline outlives the server's.
    DeadlineFromReply,
    UnavailableAsHeld,
    // Cancellation and wake-up: a window without expiry, a waiter's
    // channel broken by a dropped watch, a subscription after the try.
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
    ExpiryIgnored,
    RenewingNeverExpires,
    ExtendChangesToken,
    ExpiresInInflated,
    HeldAsError,
    // Look-alikes, wake-ups per key shape, reported TTLs, outages, time left.
    SemaphoreSharesLockState,
    RenewingPermitTenTimesTtl,
    AcquireTtlFewMsLong,
    ExtendTtlFewMsLong,
    GlobKeysNeverWoken,
    FullwidthFolded,
    InvisibleStripped,
    /// A batched renewal extends its first lock and reports every other
    /// one extended without touching it.
    BatchExtendsFirstOnly,
    /// Every namespace on one server (the factory in `main.rs` gives each
    /// namespace its own in-memory server otherwise).
    NamespacesShared,
    ExtendErrorAsNotHeld,
    ReleaseErrorAsReleased,
    PermitExtendErrorAsExtended,
    HeldNoTimeLeft,
    // The unknown-outcome rule: an acquire by the owner token that holds
    // the key must adopt that lock (same fencing token, TTL reset).
    RefusesOwnOwner,
    AdoptsWithoutTtlReset,
    SecondLockInsteadOfAdopting,
    SecondPermitInsteadOfAdopting,
    // Holder labels and observers.
    /// `inspect` shows the last label any holder of the key gave, not the
    /// current holder's (a label not bound to its lock).
    LabelOutlivesLock,
    /// An observer's change notice is a place in the waiter line: a
    /// release wakes the observer instead of the next candidate.
    ObserverQueues,
    /// Declares that the server tells observers of changes, but the watch
    /// it gives them never fires: observers wait for their poll.
    SilentObserver,
}

/// The last label given per server key, across every client of the
/// process (`LabelOutlivesLock`: what a server that keeps labels apart from
/// locks would show).
static LAST_LABELS: std::sync::LazyLock<Mutex<HashMap<String, distlock_core::HolderId>>> =
    std::sync::LazyLock::new(Default::default);

impl Defect {
    /// Whether the mutant sits below the simulated network, as a broken
    /// server would: its defect is in how the server applies a request
    /// whose reply the network may then lose. The others sit above it, in
    /// the client's backend, and see the network's faults as errors.
    pub fn below_link(self) -> bool {
        matches!(
            self,
            Defect::RefusesOwnOwner
                | Defect::AdoptsWithoutTtlReset
                | Defect::SecondLockInsteadOfAdopting
                | Defect::SecondPermitInsteadOfAdopting
        )
    }
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
        what: "the grant's TTL is counted from when the reply arrived (TTL + round trip reported), not from before the request was sent",
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
        what: "extend hands back a different fencing token (distlock-core reports it as corrupted data)",
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
        name: "semaphore_shares_lock_state",
        defect: Defect::SemaphoreSharesLockState,
        what: "a semaphore counts the lock of the same name as one of its holders (one key space for both)",
        killers: &["semaphore::lock_and_semaphore_of_one_name_independent"],
    },
    MutantSpec {
        name: "renewing_permit_ten_times_ttl",
        defect: Defect::RenewingPermitTenTimesTtl,
        what: "a renewing permit lives on a session of 10x the TTL (a holder that dies before renewing keeps it 10x too long)",
        killers: &["semaphore::renewing_permit_holder_death_frees_permit"],
    },
    MutantSpec {
        name: "acquire_ttl_few_ms_long",
        defect: Defect::AcquireTtlFewMsLong,
        what: "a grant reports a TTL 5 ms longer than the server set",
        killers: &["lease::reported_ttl_within_server_expiry"],
    },
    MutantSpec {
        name: "extend_ttl_few_ms_long",
        defect: Defect::ExtendTtlFewMsLong,
        what: "an extend reports a TTL 5 ms longer than the server set",
        killers: &["lease::reported_ttl_within_server_expiry"],
    },
    MutantSpec {
        name: "glob_keys_never_woken",
        defect: Defect::GlobKeysNeverWoken,
        what: "waiters on keys with glob characters (* ? [ ] \\) are never woken (the channel is subscribed as an unescaped pattern)",
        killers: &["wait::waiters_woken_for_every_key_shape"],
    },
    MutantSpec {
        name: "fullwidth_folded",
        defect: Defect::FullwidthFolded,
        what: "fullwidth letters are folded to ASCII on the server (a compatibility normalisation: \u{ff41} and a collide)",
        killers: &["basic::unicode_lookalike_keys_independent"],
    },
    MutantSpec {
        name: "invisible_stripped",
        defect: Defect::InvisibleStripped,
        what: "zero-width and other invisible characters are stripped from keys on the server (a\u{200b}b and ab collide)",
        killers: &["basic::unicode_lookalike_keys_independent"],
    },
    MutantSpec {
        name: "batch_extends_first_only",
        defect: Defect::BatchExtendsFirstOnly,
        what: "a batched renewal extends only its first lock and reports the others extended: their guards hold nothing once the TTL runs out",
        killers: &["guard::renewed_together_each_learns_alone"],
    },
    MutantSpec {
        name: "namespaces_shared",
        defect: Defect::NamespacesShared,
        what: "the namespace= of the URL is accepted and ignored: every namespace sees every lock",
        killers: &["basic::namespaces_independent"],
    },
    MutantSpec {
        name: "extend_error_as_not_held",
        defect: Defect::ExtendErrorAsNotHeld,
        what: "an extend that could not reach the server is answered NotHeld (a brief outage loses the guard)",
        killers: &[
            "fault::renewal_outage_keeps_guard",
            "fault::unreachable_extend_and_release_are_errors",
        ],
    },
    MutantSpec {
        name: "permit_extend_error_as_extended",
        defect: Defect::PermitExtendErrorAsExtended,
        what: "a permit renewal that could not reach the server is answered Extended (a cut-off holder's guard keeps believing it holds while the server hands its permit on)",
        killers: &["fault::late_reply_permit_extend"],
    },
    MutantSpec {
        name: "release_error_as_released",
        defect: Defect::ReleaseErrorAsReleased,
        what: "a release that could not reach the server is answered Released (the lock stays held, the caller thinks it free)",
        killers: &["fault::unreachable_extend_and_release_are_errors"],
    },
    MutantSpec {
        name: "held_no_time_left",
        defect: Defect::HeldNoTimeLeft,
        what: "a refusal reports no time left on the holder's lease (waiters retry at once, over and over)",
        killers: &["basic::held_reports_time_left"],
    },
    MutantSpec {
        name: "label_outlives_lock",
        defect: Defect::LabelOutlivesLock,
        what: "inspect shows the last label given for the key, also when the holder now gave none (a stale identity shown for another holder)",
        killers: &["holder::label_round_trips"],
    },
    MutantSpec {
        name: "observer_queues",
        defect: Defect::ObserverQueues,
        what: "an observer's change notice takes a place in the waiter line, so a resign wakes the observer, not the standby candidate",
        killers: &["election::resign_hands_over"],
    },
    MutantSpec {
        name: "silent_observer",
        defect: Defect::SilentObserver,
        what: "the backend declares holder_watch, but an observer's watch never fires: a new leader or a vacancy is seen only at the next poll, which may be an hour away",
        killers: &["election::observers_woken_by_the_server"],
    },
    MutantSpec {
        name: "refuses_own_owner",
        defect: Defect::RefusesOwnOwner,
        what: "an acquire by the owner token that holds the key is refused as held (SET NX without adoption): a retry whose earlier attempt was applied unseen waits on its own orphan",
        killers: &[
            "lease::same_owner_acquire_adopts",
            "fault::late_reply_waiting_acquire",
        ],
    },
    MutantSpec {
        name: "adopts_without_ttl_reset",
        defect: Defect::AdoptsWithoutTtlReset,
        what: "an acquire by the owner token that holds the key is granted it without resetting its TTL, so the adopted lease's deadline outlives the server's expiry",
        killers: &["lease::same_owner_acquire_adopts"],
    },
    MutantSpec {
        name: "second_lock_instead_of_adopting",
        defect: Defect::SecondLockInsteadOfAdopting,
        what: "an acquire by the owner token that holds the key replaces that lock with a new one (new fencing token) instead of adopting it",
        killers: &["lease::same_owner_acquire_adopts"],
    },
    MutantSpec {
        name: "second_permit_instead_of_adopting",
        defect: Defect::SecondPermitInsteadOfAdopting,
        what: "a permit attempt by an owner token that holds a permit takes a second permit (or is refused as full) instead of adopting its own",
        killers: &[
            "lease::same_owner_permit_adopts",
            "fault::late_reply_permit_waiting_acquire",
        ],
    },
];

/// How much longer than the server's TTL the `*TtlFewMsLong` mutants report.
const FEW_MS: Duration = Duration::from_millis(5);

/// Characters a channel pattern treats specially (`GlobKeysNeverWoken`).
const GLOB: &[char] = &['*', '?', '[', ']', '\\'];

/// Characters nobody sees (`InvisibleStripped`).
const INVISIBLE: &[char] = &[
    '\u{ad}', '\u{200b}', '\u{200c}', '\u{200d}', '\u{200e}', '\u{200f}', '\u{202a}', '\u{202b}',
    '\u{202c}', '\u{202d}', '\u{202e}', '\u{2060}', '\u{feff}', '\u{fe0f}',
];

/// Whether the factory ignores `namespace=` for `defect`.
pub fn shares_namespaces(defect: Defect) -> bool {
    defect == Defect::NamespacesShared
}

/// How long the check-then-act mutants wait between their two steps.
const GAP: Duration = Duration::from_millis(5);

/// How much earlier than its holder's expiry `GrantsBeforeExpiry` grants.
const EARLY: Duration = Duration::from_millis(100);

/// A backend that forwards to `inner` except for its defect.
pub struct Mutant {
    defect: Defect,
    inner: Arc<dyn LockBackend>,
    /// Per-client fencing counter (`FencingPerClient`), and the server's
    /// token behind each token it handed out, by owner.
    counter: AtomicU64,
    server_tokens: Mutex<HashMap<OwnerToken, FencingToken>>,
    /// Keys whose wake-ups stopped (`WatchDropBreaksChannel`).
    broken: Arc<Mutex<HashSet<String>>>,
    /// Local fan-out for the mutants that reroute wake-ups.
    notifier: ReleaseNotifier,
    /// The owner token the server really stores behind each lock or permit
    /// (key, fencing token) for the mutants that never adopt: every attempt
    /// reaches the server under a token of its own.
    inner_owners: Mutex<HashMap<(String, FencingToken), OwnerToken>>,
    /// The last lock granted per key (owner, token), for the mutants that
    /// adopt wrongly.
    grants: Mutex<HashMap<String, (OwnerToken, FencingToken)>>,
}

impl fmt::Debug for Mutant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mutant")
            .field("defect", &self.defect)
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
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
    /// `inner`'s backend with `defect`, in a client of its own.
    pub fn wrap(defect: Defect, inner: LockClient) -> LockClient {
        LockClient::new(Mutant {
            defect,
            inner: inner.backend().clone(),
            counter: AtomicU64::new(0),
            server_tokens: Mutex::new(HashMap::new()),
            broken: Arc::new(Mutex::new(HashSet::new())),
            notifier: ReleaseNotifier::new(),
            inner_owners: Mutex::new(HashMap::new()),
            grants: Mutex::new(HashMap::new()),
        })
    }

    /// The owner token the server stores for `lock`.
    fn inner_owner(&self, lock: &HeldLock<'_>) -> OwnerToken {
        self.inner_owners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(lock.key.as_str().to_owned(), lock.fencing))
            .copied()
            .unwrap_or(lock.owner)
    }

    /// A fresh owner token for the server, remembered behind the grant.
    async fn under_fresh_owner<R>(
        &self,
        key: &LockKey,
        send: impl std::future::Future<Output = Result<R, LockError>>,
        granted: impl Fn(&R) -> Option<FencingToken>,
        fresh: OwnerToken,
    ) -> Result<R, LockError> {
        let reply = send.await?;
        if let Some(fencing) = granted(&reply) {
            self.inner_owners
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert((key.as_str().to_owned(), fencing), fresh);
        }
        Ok(reply)
    }

    /// The lock `owner` was last granted at `key`, if the server still
    /// shows it.
    async fn own_live_lock(
        &self,
        key: &LockKey,
        owner: OwnerToken,
    ) -> Result<Option<FencingToken>, LockError> {
        let last = self
            .grants
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key.as_str())
            .copied();
        match last {
            Some((holder, fencing)) if holder == owner && self.shows(key, fencing).await? => {
                Ok(Some(fencing))
            }
            _ => Ok(None),
        }
    }

    fn is(&self, defect: Defect) -> bool {
        self.defect == defect
    }

    fn admin_of_inner(&self) -> Result<&dyn LockAdmin, LockError> {
        self.inner
            .admin()
            .ok_or_else(|| LockError::unsupported("the mutant's inner backend has no admin calls"))
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
            Defect::FullwidthFolded => key
                .as_str()
                .chars()
                .map(|c| match c {
                    '\u{ff01}'..='\u{ff5e}' => char::from_u32(c as u32 - 0xfee0).unwrap_or(c),
                    c => c,
                })
                .collect(),
            Defect::InvisibleStripped => key
                .as_str()
                .chars()
                .filter(|c| !INVISIBLE.contains(c))
                .collect(),
            _ => return key.clone(),
        };
        LockKey::new(mapped).unwrap_or_else(|_| key.clone())
    }

    /// The server's fencing token behind one the mutant handed out.
    fn server_token(&self, lock: &HeldLock<'_>) -> FencingToken {
        self.server_tokens
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&lock.owner)
            .copied()
            .unwrap_or(lock.fencing)
    }

    /// `lock` as the inner server knows it (its key and token).
    fn server_lock<'a>(&self, lock: &HeldLock<'_>, key: &'a LockKey) -> HeldLock<'a> {
        HeldLock {
            key,
            owner: self.inner_owner(lock),
            fencing: self.server_token(lock),
            handle: lock.handle,
        }
    }

    /// The TTL the broken server really uses for a request of `ttl`.
    fn server_ttl(&self, ttl: Duration, renewing: bool) -> Duration {
        let max = self.inner.capabilities().max_ttl;
        match self.defect {
            Defect::ExpiryIgnored => (ttl * 1000).min(max),
            Defect::RenewingSessionTenTimesTtl if renewing => (ttl * 10).min(max),
            Defect::RenewingNeverExpires if renewing => max,
            Defect::LyingGranularity => {
                Duration::from_secs(ttl.as_secs_f64().ceil() as u64).min(max)
            }
            _ => ttl,
        }
    }

    /// The grant as the mutant reports it.
    fn reported(&self, request: &AcquireRequest<'_>, grant: Grant, started: Instant) -> Grant {
        let mut grant = grant;
        // The client asked for `request.ttl`; a lying server says it applied that.
        grant.ttl = request.ttl;
        match self.defect {
            Defect::DeadlineFromReply => grant.ttl = request.ttl + started.elapsed(),
            Defect::AcquireTtlFewMsLong => grant.ttl = request.ttl + FEW_MS,
            Defect::FencingPerClient => {
                let mine = FencingToken::new(self.counter.fetch_add(1, Ordering::SeqCst) + 1);
                self.server_tokens
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(request.owner, grant.fencing);
                grant.fencing = mine;
            }
            _ => {}
        }
        grant
    }

    async fn take(
        &self,
        request: AcquireRequest<'_>,
        key: &LockKey,
    ) -> Result<AcquireReply, LockError> {
        let server_ttl = self.server_ttl(request.ttl, request.renewing);
        let server = AcquireRequest {
            key,
            ttl: server_ttl,
            ..request
        };
        if !self.is(Defect::SetThenExpire) {
            return self.inner.acquire(server).await;
        }
        // SETNX for an hour, then EXPIRE to the TTL: two calls.
        let hour = Duration::from_secs(3600).min(self.inner.capabilities().max_ttl);
        match self
            .inner
            .acquire(AcquireRequest {
                ttl: hour,
                ..server
            })
            .await?
        {
            AcquireReply::Granted(grant) => {
                let held = HeldLock {
                    key,
                    owner: request.owner,
                    fencing: grant.fencing,
                    handle: grant.handle,
                };
                match self.inner.extend(held, server_ttl).await? {
                    ExtendReply::Extended(grant) => Ok(AcquireReply::Granted(grant)),
                    ExtendReply::NotHeld => Ok(AcquireReply::Held { expires_in: None }),
                }
            }
            held => Ok(held),
        }
    }

    /// Whether the server shows `fencing` at `key`.
    async fn shows(&self, key: &LockKey, fencing: FencingToken) -> Result<bool, LockError> {
        Ok(matches!(
            self.admin_of_inner()?.inspect(key).await?,
            LockState::Held { fencing_token, .. } if fencing_token == fencing
        ))
    }

    /// A watch through this backend's own fan-out: the inner watch is
    /// taken after `late` (if any), and wake-ups for broken keys are
    /// swallowed.
    async fn rerouted_watch(
        &self,
        key: &LockKey,
        waiter: OwnerToken,
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
            None => match self.inner.watch(&server_key, waiter).await? {
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
                            match inner.watch(&server_key, waiter).await {
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

#[distlock_core::async_trait]
impl LockBackend for Mutant {
    fn name(&self) -> &'static str {
        "mutant"
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<AcquireReply, LockError> {
        match self.defect {
            Defect::RefusesOwnOwner => {
                let fresh = OwnerToken::random();
                let send = self.inner.acquire(AcquireRequest {
                    owner: fresh,
                    ..request
                });
                let granted = |reply: &AcquireReply| match reply {
                    AcquireReply::Granted(grant) => Some(grant.fencing),
                    AcquireReply::Held { .. } => None,
                };
                return self
                    .under_fresh_owner(request.key, send, granted, fresh)
                    .await;
            }
            Defect::AdoptsWithoutTtlReset | Defect::SecondLockInsteadOfAdopting => {
                if let Some(fencing) = self.own_live_lock(request.key, request.owner).await? {
                    if self.is(Defect::AdoptsWithoutTtlReset) {
                        return Ok(AcquireReply::Granted(Grant::new(fencing, request.ttl)));
                    }
                    self.admin_of_inner()?.force_release(request.key).await?;
                }
                let reply = self.inner.acquire(request).await?;
                if let AcquireReply::Granted(grant) = &reply {
                    self.grants
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(
                            request.key.as_str().to_owned(),
                            (request.owner, grant.fencing),
                        );
                }
                return Ok(reply);
            }
            _ => {}
        }
        let started = Instant::now();
        let key = self.server_key(request.key);
        if let (Defect::LabelOutlivesLock, Some(label)) = (self.defect, request.holder) {
            LAST_LABELS
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key.as_str().to_owned(), label.clone());
        }
        let reply = match (self.defect, self.take(request, &key).await) {
            (Defect::UnavailableAsHeld, Err(e)) if e.is_transient() => {
                Ok(AcquireReply::Held { expires_in: None })
            }
            (
                Defect::GrantsBeforeExpiry,
                Ok(AcquireReply::Held {
                    expires_in: Some(left),
                }),
            ) if left <= EARLY => {
                self.admin_of_inner()?.force_release(&key).await?;
                self.take(request, &key).await
            }
            (Defect::DoubleGrant, Ok(AcquireReply::Held { .. })) if rand::random_bool(0.1) => {
                self.admin_of_inner()?.force_release(&key).await?;
                self.take(request, &key).await
            }
            (Defect::HeldAsError, Ok(AcquireReply::Held { .. })) => {
                Err(LockError::unavailable("the lock server did not answer"))
            }
            (Defect::HeldNoTimeLeft, Ok(AcquireReply::Held { .. })) => Ok(AcquireReply::Held {
                expires_in: Some(Duration::ZERO),
            }),
            (Defect::ExpiresInInflated, Ok(AcquireReply::Held { expires_in })) => {
                Ok(AcquireReply::Held {
                    expires_in: expires_in.map(|left| left * 100 + Duration::from_secs(3600)),
                })
            }
            (_, other) => other,
        }?;
        Ok(match reply {
            AcquireReply::Granted(grant) => {
                AcquireReply::Granted(self.reported(&request, grant, started))
            }
            held => held,
        })
    }

    async fn extend(&self, lock: HeldLock<'_>, ttl: Duration) -> Result<ExtendReply, LockError> {
        let key = self.server_key(lock.key);
        let server = self.server_lock(&lock, &key);
        let server_ttl = self.server_ttl(ttl, false);
        let reported = |grant: Grant| {
            let mut grant = grant;
            grant.ttl = ttl;
            if self.is(Defect::ExtendTtlFewMsLong) {
                grant.ttl = ttl + FEW_MS;
            }
            // The token this backend handed out for the acquisition.
            grant.fencing = lock.fencing;
            if self.is(Defect::ExtendChangesToken) {
                grant.fencing = FencingToken::new(lock.fencing.get() + 1);
            }
            ExtendReply::Extended(grant)
        };
        match self.defect {
            Defect::NoopExtend => Ok(reported(Grant::new(lock.fencing, ttl))),
            Defect::ExtendCheckThenSet => {
                if !self.shows(&key, server.fencing).await? {
                    return Ok(ExtendReply::NotHeld);
                }
                tokio::time::sleep(GAP).await;
                // The check said it was ours: the expiry was set (on
                // whoever holds the key now).
                let _ = self.inner.extend(server, server_ttl).await?;
                Ok(reported(Grant::new(lock.fencing, ttl)))
            }
            Defect::ExtendResurrects => match self.inner.extend(server, server_ttl).await? {
                ExtendReply::NotHeld => {
                    let again = AcquireRequest {
                        key: &key,
                        owner: lock.owner,
                        ttl: server_ttl,
                        renewing: false,
                        settling: false,
                        holder: None,
                    };
                    match self.inner.acquire(again).await? {
                        AcquireReply::Granted(grant) => {
                            self.server_tokens
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .insert(lock.owner, grant.fencing);
                            Ok(reported(grant))
                        }
                        AcquireReply::Held { .. } => Ok(ExtendReply::NotHeld),
                    }
                }
                ExtendReply::Extended(grant) => Ok(reported(grant)),
            },
            _ => Ok(match self.inner.extend(server, server_ttl).await {
                Ok(ExtendReply::Extended(grant)) => reported(grant),
                Ok(ExtendReply::NotHeld) => ExtendReply::NotHeld,
                Err(e) if e.is_transient() && self.is(Defect::ExtendErrorAsNotHeld) => {
                    ExtendReply::NotHeld
                }
                Err(e) => return Err(e),
            }),
        }
    }

    async fn extend_many(
        &self,
        locks: &[HeldLock<'_>],
        ttl: Duration,
    ) -> Result<Vec<Result<ExtendReply, LockError>>, LockError> {
        let mut replies = Vec::with_capacity(locks.len());
        for (i, lock) in locks.iter().enumerate() {
            replies.push(match self.is(Defect::BatchExtendsFirstOnly) && i > 0 {
                true => Ok(ExtendReply::Extended(Grant::new(lock.fencing, ttl))),
                false => self.extend(*lock, ttl).await,
            });
        }
        Ok(replies)
    }

    async fn release(&self, lock: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let key = self.server_key(lock.key);
        let server = self.server_lock(&lock, &key);
        match self.defect {
            Defect::NoopRelease => Ok(ReleaseReply::Released),
            Defect::ReleaseWithoutOwnerCheck => {
                if self.admin_of_inner()?.force_release(&key).await? {
                    Ok(ReleaseReply::Released)
                } else {
                    Ok(ReleaseReply::NotHeld)
                }
            }
            Defect::ReleaseCheckThenDelete => {
                if !self.shows(&key, server.fencing).await? {
                    return Ok(ReleaseReply::NotHeld);
                }
                tokio::time::sleep(GAP).await;
                self.admin_of_inner()?.force_release(&key).await?;
                Ok(ReleaseReply::Released)
            }
            _ => match self.inner.release(server).await {
                Err(e) if e.is_transient() && self.is(Defect::ReleaseErrorAsReleased) => {
                    Ok(ReleaseReply::Released)
                }
                other => other,
            },
        }
    }

    async fn watch(
        &self,
        key: &LockKey,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        match self.defect {
            Defect::WatchNeverFires => Ok(Some(ReleaseWatch::never())),
            Defect::GlobKeysNeverWoken if key.as_str().contains(GLOB) => {
                Ok(Some(ReleaseWatch::never()))
            }
            Defect::SubscribeAfterTry => {
                self.rerouted_watch(key, waiter, Some(Duration::from_millis(50)))
                    .await
            }
            Defect::WatchDropBreaksChannel => self.rerouted_watch(key, waiter, None).await,
            _ => self.inner.watch(&self.server_key(key), waiter).await,
        }
    }

    fn admin(&self) -> Option<&dyn LockAdmin> {
        self.inner.admin().map(|_| self as &dyn LockAdmin)
    }

    // Permits are forwarded unchanged but for the permit defects.
    fn semaphore(&self) -> Option<&dyn SemaphoreBackend> {
        self.inner
            .semaphore()
            .map(|_| self as &dyn SemaphoreBackend)
    }
}

impl Mutant {
    fn inner_semaphore(&self) -> Result<&dyn SemaphoreBackend, LockError> {
        self.inner
            .semaphore()
            .ok_or_else(|| LockError::unsupported("the mutant's inner backend has no semaphores"))
    }

    /// `permit` as the server stores it.
    fn server_permit<'a>(&self, permit: &HeldLock<'a>) -> HeldLock<'a> {
        HeldLock {
            owner: self.inner_owner(permit),
            ..*permit
        }
    }
}

#[distlock_core::async_trait]
impl SemaphoreBackend for Mutant {
    async fn acquire_permit(&self, request: PermitRequest<'_>) -> Result<PermitReply, LockError> {
        if self.is(Defect::SemaphoreSharesLockState) {
            if let LockState::Held { expires_in, .. } =
                self.admin_of_inner()?.inspect(request.key).await?
            {
                return Ok(PermitReply::Full { expires_in });
            }
        }
        let mut request = request;
        if self.is(Defect::RenewingPermitTenTimesTtl) && request.renewing {
            request.ttl = (request.ttl * 10).min(self.inner.capabilities().max_ttl);
        }
        let semaphore = self.inner_semaphore()?;
        if !self.is(Defect::SecondPermitInsteadOfAdopting) {
            return semaphore.acquire_permit(request).await;
        }
        let fresh = OwnerToken::random();
        let send = semaphore.acquire_permit(PermitRequest {
            owner: fresh,
            ..request
        });
        let granted = |reply: &PermitReply| match reply {
            PermitReply::Granted(grant) => Some(grant.fencing),
            _ => None,
        };
        self.under_fresh_owner(request.key, send, granted, fresh)
            .await
    }

    async fn extend_permit(
        &self,
        permit: HeldLock<'_>,
        ttl: Duration,
    ) -> Result<ExtendReply, LockError> {
        match self
            .inner_semaphore()?
            .extend_permit(self.server_permit(&permit), ttl)
            .await
        {
            Err(e) if e.is_transient() && self.is(Defect::PermitExtendErrorAsExtended) => Ok(
                ExtendReply::Extended(Grant::new(permit.fencing, ttl).with_handle(permit.handle)),
            ),
            other => other,
        }
    }

    async fn release_permit(&self, permit: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        self.inner_semaphore()?
            .release_permit(self.server_permit(&permit))
            .await
    }

    async fn watch_permits(
        &self,
        key: &LockKey,
        limit: u32,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        self.inner_semaphore()?
            .watch_permits(key, limit, waiter)
            .await
    }
}

// Every call, provided ones too, reaches the inner backend.
#[deny(clippy::missing_trait_methods)]
#[distlock_core::async_trait]
impl LockAdmin for Mutant {
    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        let key = self.server_key(key);
        let state = self.admin_of_inner()?.inspect(&key).await?;
        Ok(match (self.defect, state) {
            (
                Defect::LabelOutlivesLock,
                LockState::Held {
                    expires_in,
                    fencing_token,
                    ..
                },
            ) => LockState::Held {
                expires_in,
                fencing_token,
                holder: LAST_LABELS
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(key.as_str())
                    .cloned(),
            },
            (_, state) => state,
        })
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        self.admin_of_inner()?
            .force_release(&self.server_key(key))
            .await
    }

    async fn inspect_permits(&self, key: &LockKey) -> Result<Vec<PermitState>, LockError> {
        self.admin_of_inner()?
            .inspect_permits(&self.server_key(key))
            .await
    }

    async fn watch_holder(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        if self.is(Defect::SilentObserver) {
            return Ok(Some(ReleaseWatch::never()));
        }
        if self.is(Defect::ObserverQueues) {
            // Joins the line as a waiter does: subscribed, then refused.
            let (key, owner) = (self.server_key(key), OwnerToken::random());
            let watch = self.inner.watch(&key, owner).await?;
            let attempt = AcquireRequest {
                key: &key,
                owner,
                ttl: Duration::from_secs(60),
                renewing: false,
                settling: false,
                holder: None,
            };
            if let AcquireReply::Granted(grant) = self.inner.acquire(attempt).await? {
                let taken = HeldLock {
                    key: &key,
                    owner,
                    fencing: grant.fencing,
                    handle: grant.handle,
                };
                self.inner.release(taken).await?;
            }
            return Ok(watch);
        }
        self.admin_of_inner()?
            .watch_holder(&self.server_key(key))
            .await
    }
}
