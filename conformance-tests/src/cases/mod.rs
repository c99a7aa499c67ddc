//! Every case of the suite, by group, and [`support`]: the helpers the
//! cases use, public so a backend's own cases (added with
//! [`Suite::case`](crate::Suite::case)) can use them too.

use std::future::Future;
use std::pin::Pin;

use crate::context::{CaseResult, TestContext};

mod admin;
mod basic;
mod cancel;
mod election;
mod exclusion;
mod fault;
mod fencing;
mod guard;
mod handoff;
mod holder;
mod input;
mod lease;
mod run;
mod schedule;
mod semaphore;
pub mod support;
mod unknown_outcome;
mod wait;

/// What a case needs from the backend beyond the core contract; a case whose
/// need is not met shows as `ignored` with the reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// Only the core contract.
    Nothing,
    /// The operator calls `inspect` and `force_release` (`LockBackend::admin`
    /// returns `Some`).
    Admin,
    /// Counting semaphores (`LockBackend::semaphore`).
    Semaphore,
    /// Server-driven wake-up of waiters (`Capabilities::native_wait`).
    NativeWait,
    /// One waiter woken per release (`Capabilities::wakes_one_waiter`).
    OneWake,
    /// A released key goes to the line's first waiter alone
    /// (`Capabilities::fair_handoff`).
    FairHandoff,
    /// Lock data survives a server restart (`Capabilities::durable`).
    Durable,
    /// Holder labels stored with locks and shown by `inspect`
    /// (`Capabilities::holder_ids`, and the operator calls).
    HolderIds,
    /// Observers woken by the server when the holder changes
    /// (`Capabilities::holder_watch`), with holder labels.
    HolderWatch,
    /// Semaphores whose permits store holder labels, listed by
    /// `inspect_permits` (`Capabilities::permit_holder_ids`, semaphores and
    /// the operator calls).
    PermitHolderIds,
    /// A lock server in another process, reachable by URL (a holder in a
    /// child process can share it; an in-process backend cannot).
    Server,
    /// Servers the harness runs itself (a `ServerKind` and no external URL
    /// override): the case starts its own to kill and restart, or puts a
    /// fault proxy in front of one.
    ServerProcess,
    /// Faults between a client and the server
    /// ([`TestContext::fault_path`]): a server the harness runs (a proxy
    /// goes in front of it), or an in-process backend over a simulated
    /// network ([`Suite::simulated_network`](crate::Suite::simulated_network)).
    Faults,
    /// Clients in namespaces of their own
    /// ([`TestContext::client_in_namespace`]): a backend with a server, or
    /// an in-process one whose factory honours `namespace=`
    /// ([`Suite::namespaces`](crate::Suite::namespaces)).
    Namespaces,
    /// A fault path that carries every connection of a client
    /// ([`TestContext::cuts_whole_clients`]): cutting it is a killed client.
    WholeClientCut,
    /// Every one of these (`Needs::All(&[Needs::Faults, Needs::Semaphore])`).
    All(&'static [Needs]),
}

impl Needs {
    /// Why the case cannot run here, if it cannot.
    pub fn missing(self, context: &TestContext) -> Option<String> {
        let caps = context.capabilities();
        match self {
            Needs::Nothing => None,
            Needs::Semaphore => (!context.has_semaphore()).then(|| {
                "backend has no semaphores (LockBackend::semaphore is None)".into()
            }),
            Needs::Admin => (!context.has_admin()).then(|| {
                "backend has no operator calls inspect/force_release (LockBackend::admin is None)".into()
            }),
            Needs::NativeWait => (!caps.native_wait)
                .then(|| "backend declares no server-driven wake-up (native_wait = false)".into()),
            Needs::OneWake => (!caps.wakes_one_waiter).then(|| {
                "backend declares that a release wakes every waiter (wakes_one_waiter = false)".into()
            }),
            Needs::FairHandoff => (!caps.fair_handoff).then(|| {
                "backend declares that a free key goes to whoever asks first (fair_handoff = false)".into()
            }),
            Needs::HolderIds => Needs::Admin.missing(context).or_else(|| {
                (!caps.holder_ids).then(|| {
                    "backend declares it stores no holder labels (holder_ids = false)".into()
                })
            }),
            Needs::HolderWatch => Needs::HolderIds.missing(context).or_else(|| {
                (!caps.holder_watch).then(|| {
                    "backend declares the server does not tell observers of a change of holder (holder_watch = false): observers poll".into()
                })
            }),
            Needs::PermitHolderIds => Needs::Semaphore
                .missing(context)
                .or_else(|| Needs::Admin.missing(context))
                .or_else(|| {
                    (!caps.permit_holder_ids).then(|| {
                        "backend declares it stores no permit holder labels (permit_holder_ids = false)".into()
                    })
                }),
            Needs::Durable => (!caps.durable)
                .then(|| "backend declares its lock data does not survive a restart (durable = false)".into()),
            Needs::Server => context.server().is_none().then(|| {
                "in-process backend: no server that another process could share".into()
            }),
            Needs::ServerProcess => (!context.controls_servers()).then(|| match context.server() {
                None => "in-process backend: no server process to kill, restart or cut off".into(),
                Some(_) => "the suite runs against an external server (URL in the environment): the harness cannot kill, restart or proxy it".into(),
            }),
            Needs::Faults => (!context.can_inject_faults()).then(|| match context.server() {
                None => "in-process backend without a simulated network (Suite::simulated_network): no faults can be put between client and server".into(),
                Some(_) => "the suite runs against an external server (URL in the environment): the harness cannot proxy it".into(),
            }),
            Needs::Namespaces => (!context.has_namespaces()).then(|| {
                "in-process backend whose factory does not honour namespace= (Suite::namespaces): no second namespace to open a client in".into()
            }),
            Needs::WholeClientCut => (!context.cuts_whole_clients()).then(|| {
                "no fault path carries every connection of a client here (an external server, an in-process backend without a simulated network, or a server kind whose clients also connect past the proxy, as PgBouncer's listen_url)".into()
            }),
            Needs::All(needs) => needs.iter().find_map(|need| need.missing(context)),
        }
    }
}

/// The future a case returns.
pub type CaseFuture = Pin<Box<dyn Future<Output = CaseResult> + Send>>;

/// One conformance case.
#[derive(Clone, Copy)]
pub struct Case {
    /// Its group (`basic`, `input`, ...).
    pub group: &'static str,
    /// Its name within the group.
    pub name: &'static str,
    /// What it needs from the backend.
    pub needs: Needs,
    /// The case itself.
    pub run: fn(TestContext) -> CaseFuture,
}

impl Case {
    /// A case of your own: `Case::new("mine", "name", Needs::Nothing, |ctx|
    /// Box::pin(my_case(ctx)))`, added with [`Suite::case`](crate::Suite::case).
    pub fn new(
        group: &'static str,
        name: &'static str,
        needs: Needs,
        run: fn(TestContext) -> CaseFuture,
    ) -> Self {
        Self {
            group,
            name,
            needs,
            run,
        }
    }
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Case")
            .field("group", &self.group)
            .field("name", &self.name)
            .field("needs", &self.needs)
            .finish_non_exhaustive()
    }
}

/// Declares cases of one group module: `cases!(basic: acquire_release, ...)`;
/// a case may carry `=> Needs::X`. `cases!(fault in unknown_outcome: ...)` puts
/// the cases of module `unknown_outcome` in group `fault`.
macro_rules! cases {
    ($group:ident in $module:ident : $($name:ident $(=> $needs:expr)?),+ $(,)?) => {
        vec![$(Case {
            group: stringify!($group),
            name: stringify!($name),
            needs: { #[allow(unused_mut, unused_assignments)] let mut n = Needs::Nothing; $(n = $needs;)? n },
            run: |ctx| Box::pin($module::$name(ctx)),
        }),+]
    };
    ($group:ident : $($rest:tt)+) => {
        cases!($group in $group : $($rest)+)
    };
}

/// Every case, in a stable order.
pub fn all() -> Vec<Case> {
    let mut all = Vec::new();
    all.extend(cases!(basic:
        acquire_then_release,
        held_key_is_refused,
        held_key_is_refused_to_same_client,
        held_reports_remaining_ttl,
        release_frees_key_for_other_client,
        release_twice_is_not_held,
        extend_keeps_lock,
        extend_pushes_expiry,
        ttl_expiry_frees_key,
        renewing_acquire_expires_without_renewal,
        stale_owner_release_refused,
        stale_owner_extend_refused,
        foreign_release_refused,
        foreign_extend_refused,
        release_after_expiry_keeps_next_holder,
        extend_after_expiry_fails,
        extend_after_expiry_keeps_next_holder,
        extend_after_release_fails,
        lookalike_keys_independent,
        many_keys_per_client,
        unicode_lookalike_keys_independent,
        namespaces_independent => Needs::Namespaces,
        held_reports_time_left,
    ));
    all.extend(cases!(holder:
        label_round_trips => Needs::HolderIds,
        label_is_not_ownership => Needs::HolderIds,
        permit_labels_round_trip => Needs::PermitHolderIds,
    ));
    all.extend(cases!(election:
        one_leader_at_a_time => Needs::HolderIds,
        observers_see_each_change => Needs::HolderIds,
        observers_woken_by_the_server => Needs::HolderWatch,
        resign_hands_over => Needs::HolderIds,
        crash_hands_over_after_ttl => Needs::HolderIds,
        vacancy_reported => Needs::HolderIds,
    ));
    all.extend(cases!(input:
        empty_key_rejected,
        oversized_key_rejected,
        nul_key_rejected,
        max_length_multibyte_key_works,
        zero_ttl_rejected,
        ttl_above_max_rejected,
        short_ttl_rounded_up,
        lease_used_after_release,
        lease_from_other_client,
        lease_from_other_backend,
        past_deadline_is_one_attempt,
        keys_used_verbatim,
    ));
    all.extend(cases!(fencing:
        increases_across_release,
        increases_across_expiry,
        increases_across_clients,
        unchanged_by_extend,
        unchanged_by_guard_renewal,
        increases_per_key_interleaved,
        increases_for_successive_waiters,
    ));
    all.extend(cases!(wait:
        waiter_gets_lock_after_release,
        raw_acquire_waits_for_release,
        waiter_gets_lock_after_crashed_holder,
        deadline_respected,
        cancelled_waiters_leave_nothing_held,
        sixteen_waiters_each_once,
        waiter_on_free_key_not_blocked_by_other_key,
        cancel_at_grant_leaves_nothing_held,
        waiters_woken_for_every_key_shape,
    ));
    all.extend(cases!(handoff:
        one_attempt_per_release => Needs::OneWake,
        arrival_order => Needs::OneWake,
        no_cut_in => Needs::All(&[Needs::OneWake, Needs::FairHandoff]),
        wake_up_during_a_held_reply_is_kept => Needs::OneWake,
        a_timed_out_wait_gives_up_its_place => Needs::All(&[Needs::OneWake, Needs::FairHandoff, Needs::Faults]),
        cancelled_waiter_passes_the_turn_on => Needs::OneWake,
        permits_returned_together_wake_as_many => Needs::All(&[Needs::OneWake, Needs::Semaphore]),
        gone_waiter_is_passed_over => Needs::All(&[Needs::OneWake, Needs::ServerProcess, Needs::WholeClientCut]),
    ));
    all.extend(cases!(guard:
        renewal_keeps_lock_past_ttl,
        renewal_every_period,
        renewed_together_each_learns_alone,
        renewal_off_expires,
        lost_fires_when_taken,
        lost_fires_when_deleted,
        max_hold_stops_renewal,
        drop_releases,
        hold_at_least_keeps_key,
        hold_at_least_counts_from_the_grant,
        hold_at_least_elapsed_releases,
        try_lock_and_accessors,
        release_is_not_loss,
        dropped_release_future_still_releases,
        short_max_hold_ends_lock_early,
        huge_durations_rejected_or_saturated,
        lost_fires_a_stop_margin_before_expiry,
        unworkable_stop_margin_rejected,
        cancel_returns_at_once_and_late_grant_is_released,
    ));
    all.extend(cases!(exclusion:
        counter_is_exact,
        try_lock_never_overlaps,
        run_exclusive_never_overlaps,
        distinct_keys_run_concurrently,
    ));
    all.extend(cases!(run:
        completed_returns_output_and_token,
        completed_releases_lock,
        skipped_when_held,
        waits_then_runs,
        hold_at_least_skips_next_tick,
        lost_stops_job,
        lost_continue_lets_job_finish,
        job_finishing_after_loss_is_not_completed,
        dyn_job_code_runs_unchanged,
        sequential_runs_grow_tokens,
        expired_grant_never_runs_job,
        late_grant_inside_margin_never_runs_job,
        no_job_step_after_lost,
        grant_inside_margin_is_released,
    ));
    all.extend(cases!(semaphore:
        at_most_n_holders => Needs::Semaphore,
        never_more_than_n => Needs::Semaphore,
        crashed_holder_returns_permit => Needs::Semaphore,
        waiter_woken_by_release => Needs::Semaphore,
        cancelled_waiters_leave_nothing_held => Needs::Semaphore,
        foreign_and_stale_permits_refused => Needs::Semaphore,
        fencing_grows_across_permits => Needs::Semaphore,
        limit_disagreement => Needs::Semaphore,
        one_permit_is_a_mutex => Needs::Semaphore,
        guards_and_run_exclusive => Needs::Semaphore,
        lock_and_semaphore_of_one_name_independent => Needs::Semaphore,
        renewing_permit_holder_death_frees_permit => Needs::Semaphore,
    ));
    all.extend(cases!(admin:
        inspect_reports_holder => Needs::Admin,
        force_release_frees_key => Needs::Admin,
        force_release_wakes_waiter => Needs::Admin,
    ));
    all.extend(cases!(schedule:
        plain_lock_runs_once_per_instance,
        one_run_per_fire_with_shifted_tickers,
        one_run_per_fire_with_skewed_clocks,
        long_run_skips_next_fire,
        failed_run_start_frees_the_fire,
        lost_run_frees_the_fire,
    ));
    all.extend(cases!(lease:
        never_granted_before_holder_deadline,
        holder_deadline_within_server_expiry,
        renewing_holder_death_frees_key,
        release_atomic_against_expiry,
        extend_atomic_against_expiry,
        reported_ttl_within_server_expiry,
    ));
    all.extend(cases!(cancel:
        dropped_calls_leave_nothing_held,
        dropped_calls_leave_later_waiters_woken,
    ));
    all.extend(cases!(fault:
        killed_holder_process_expires => Needs::Server,
        black_holed_holder_loses_first => Needs::Faults,
        partitioned_leader_loses_first => Needs::All(&[Needs::Faults, Needs::HolderIds]),
        held_renewal_replies_lose_first => Needs::Faults,
        resets_during_operations => Needs::Faults,
        server_restart_with_holders_and_waiters => Needs::ServerProcess,
        server_down_at_acquire => Needs::ServerProcess,
        dropped_waiters_leave_nothing_held,
        run_exclusive_lost_to_partition => Needs::Faults,
        exclusion_torture,
        permit_torture => Needs::Semaphore,
        unreachable_is_an_error_not_held => Needs::Faults,
        stalled_server_waiters_recover => Needs::Faults,
        unreachable_extend_and_release_are_errors => Needs::Faults,
        renewal_outage_keeps_guard => Needs::Faults,
    ));
    all.extend(cases!(fault in unknown_outcome:
        late_reply_acquire => Needs::Faults,
        late_reply_renewing_acquire => Needs::Faults,
        late_reply_extend => Needs::Faults,
        late_reply_release => Needs::Faults,
        late_reply_waiting_acquire => Needs::Faults,
        late_reply_campaign_and_resign => Needs::All(&[Needs::Faults, Needs::HolderIds]),
        late_reply_waiter_queue => Needs::Faults,
        late_reply_permit_acquire => Needs::All(&[Needs::Faults, Needs::Semaphore]),
        late_reply_permit_waiting_acquire => Needs::All(&[Needs::Faults, Needs::Semaphore]),
        late_reply_permit_extend => Needs::All(&[Needs::Faults, Needs::Semaphore]),
        late_reply_permit_release => Needs::All(&[Needs::Faults, Needs::Semaphore]),
    ));
    all.extend(cases!(lease in unknown_outcome:
        same_owner_acquire_adopts,
        same_owner_permit_adopts => Needs::Semaphore,
    ));
    all
}
