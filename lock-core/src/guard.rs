//! A held lock that renews itself, says when it is lost, and releases.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::lease::later;
use crate::renewal;
use crate::{
    instrument, ErrorKind, FencingToken, Lease, LockClient, LockError, LockKey, LockOptions,
};

/// Why a guard stopped holding its lock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostReason {
    /// The server refused a renewal: the key is gone, has another owner, or
    /// holds data distlock did not write ([`ErrorKind::NotHeld`] or
    /// [`ErrorKind::Corrupted`]; any other failed renewal is retried until
    /// the stop moment).
    Refused,
    /// The lease reached its stop moment (the stop margin before it may
    /// run out, see [`LockOptions::with_stop_margin`]) without a successful
    /// renewal: the server was unreachable or slow, or renewal was off or
    /// stopped by the max hold time.
    Expired,
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LostReason::Refused => {
                "the server refused renewal (key deleted, taken over or overwritten)"
            }
            LostReason::Expired => {
                "the lease was about to run out (within its stop margin) and could not be renewed"
            }
        })
    }
}

/// Resolves when a guard no longer holds its lock, or must stop using it: at
/// the latest the stop margin before the lease may run out. Cheap to clone;
/// hand it to the job so it can stop writing.
///
/// Past the current lease's stop moment it reads as lost by the clock
/// alone, also before the guard's renewal driver has run: a job whose
/// runtime was starved or frozen past that moment sees `lost` first when
/// it runs again, never a late renewal's success.
#[derive(Debug, Clone, Default)]
pub struct LostSignal {
    /// One allocation per held guard.
    inner: Arc<LostInner>,
}

#[derive(Debug, Default)]
struct LostInner {
    /// Woken when the signal fires (a reason is set).
    fired: Notify,
    state: Mutex<LostState>,
}

#[derive(Debug, Default)]
struct LostState {
    /// Set when the signal fires, for good.
    reason: Option<LostReason>,
    /// The current lease's stop moment. Moved only while not yet reached,
    /// so once lost by the clock, lost for good; cleared for good when the
    /// guard is given back.
    stop_at: StopMoment,
}

#[derive(Debug, Clone, Copy, Default)]
enum StopMoment {
    /// Not a guard's signal (or not set yet).
    #[default]
    Unset,
    At(Instant),
    /// The guard was given back before its stop moment.
    Retired,
}

impl LostSignal {
    /// Whether the lock is known or assumed lost.
    pub fn is_lost(&self) -> bool {
        self.is_fired() || self.past_stop()
    }

    /// Why the lock was lost, once it was.
    pub fn reason(&self) -> Option<LostReason> {
        let reason = self.state().reason.clone();
        reason.or_else(|| self.past_stop().then_some(LostReason::Expired))
    }

    /// Waits until the lock is lost. Cancel-safe.
    pub async fn wait(&self) -> LostReason {
        // Checked before waiting: a timer already due fires only at the
        // timer driver's next turn, after the job's next step.
        loop {
            // Registered before the check, so a fire in between wakes it.
            let fired = self.inner.fired.notified();
            tokio::pin!(fired);
            fired.as_mut().enable();
            if self.is_lost() {
                break;
            }
            let stop_at = self.stop_at();
            tokio::select! {
                biased;
                () = fired => {}
                () = sleep_until_opt(stop_at) => {}
            }
        }
        self.reason().unwrap_or(LostReason::Expired)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, LostState> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the signal fired (not only the clock's say).
    fn is_fired(&self) -> bool {
        self.state().reason.is_some()
    }

    fn stop_at(&self) -> Option<Instant> {
        match self.state().stop_at {
            StopMoment::At(at) => Some(at),
            StopMoment::Unset | StopMoment::Retired => None,
        }
    }

    fn past_stop(&self) -> bool {
        self.stop_at().is_some_and(|at| Instant::now() >= at)
    }

    /// The guard is given back: no stop moment any more (a released lock
    /// is not lost), unless it was already reached.
    fn retire(&self) {
        let mut state = self.state();
        match state.stop_at {
            StopMoment::At(at) if Instant::now() >= at => {}
            _ => state.stop_at = StopMoment::Retired,
        }
    }

    /// Moves the stop moment to `at` (a renewed lease's); refused once
    /// the current one is reached: the lock was lost by then.
    fn move_stop(&self, at: Instant) -> bool {
        let mut state = self.state();
        match state.stop_at {
            StopMoment::At(reached) if Instant::now() >= reached => false,
            StopMoment::Retired => true,
            _ => {
                state.stop_at = StopMoment::At(at);
                true
            }
        }
    }

    fn fire(&self, reason: LostReason) {
        self.state().reason.get_or_insert(reason);
        self.inner.fired.notify_waiters();
    }
}

#[derive(Debug)]
pub(crate) struct Shared {
    client: LockClient,
    lease: Mutex<Lease>,
    lost: LostSignal,
    /// When the guard learnt it holds the lock: a minimum hold is dated
    /// from here. The lease's start can be much earlier (a lock on an etcd
    /// session lease is dated from the session's last keep-alive), which
    /// would cut a hold-at-least short.
    granted_at: Instant,
    hold_at_least: Option<Duration>,
    stop_margin: Duration,
    /// This guard in the held-locks gauge: ended on release or loss, and at
    /// the latest when the last owner of `Shared` drops it.
    holding: instrument::Holding,
    /// Its number in its client's renewal queue.
    id: u64,
    /// When and how it renews (see [`crate::renewal`]).
    schedule: Mutex<Schedule>,
}

/// A guard's renewal schedule. A held guard is no task of its own (a
/// tokio task per guard cost about 640 bytes each): its client's renewal
/// driver ([`crate::renewal`]) steps it by this.
#[derive(Debug)]
struct Schedule {
    /// How often to renew; `None`: never (renewal off).
    period: Option<Duration>,
    /// No renewal from then on (the max hold time).
    renew_until: Option<Instant>,
    /// When the next renewal is due.
    next_renewal: Option<Instant>,
    /// When the current lease arrived.
    got_at: Instant,
    /// Whether renewals are sent together on this client (see [`due`]).
    batched: bool,
    /// Where the guard waits in its client's queue, if it does.
    queued: Option<Instant>,
    /// A renewal was sent and not answered yet.
    in_flight: bool,
    /// The guard was given back or lost: no more renewals.
    done: bool,
}

impl Schedule {
    /// When a renewal on the grid is due, `period` after `from`.
    fn due(&self, from: Instant, period: Duration) -> Instant {
        // Where the client renews guards together, each renews on the
        // shared grid (a little early), so guards acquired apart still
        // meet in a batch.
        let at = later(from, period);
        let moment = renewal::on_grid(at, period);
        match self.batched && moment > later(Instant::now(), MIN_RENEW_GAP) {
            true => moment,
            false => at,
        }
    }

    /// When the next renewal is due, if one is: every period, but at the
    /// latest halfway from the lease's arrival to its stop moment, so a
    /// renewal always has time to be retried. A lease may be valid for
    /// less than a period past its arrival: etcd dates a session lock
    /// from the session's last keep-alive, up to a third of the TTL back.
    fn renew_at(&self, stop_at: Instant) -> Option<Instant> {
        let got_at = self.got_at;
        let halfway = later(got_at, stop_at.saturating_duration_since(got_at) / 2)
            .max(later(got_at, MIN_RENEW_GAP));
        self.next_renewal
            .map(|at| at.min(halfway))
            .filter(|at| self.renew_until.is_none_or(|until| *at < until))
    }

    /// When the guard must next step: its renewal, or its stop moment
    /// (while a renewal is in flight, only that).
    fn wake_at(&self, stop_at: Instant) -> Instant {
        match self.in_flight {
            true => stop_at,
            false => self.renew_at(stop_at).map_or(stop_at, |at| at.min(stop_at)),
        }
    }
}

impl Shared {
    fn lease(&self) -> Lease {
        self.lease.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The client that holds the lock.
    pub(crate) fn client(&self) -> &LockClient {
        &self.client
    }

    fn schedule(&self) -> std::sync::MutexGuard<'_, Schedule> {
        self.schedule.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues the guard in its client's renewal queue for its next step.
    fn queue(self: &Arc<Self>, schedule: &mut Schedule) {
        let at = schedule.wake_at(self.stop_moment(&self.lease()));
        if let Some(old) = schedule.queued.replace(at) {
            self.client.renewals().remove(self.id, old);
        }
        self.client.renewals().insert(self, self.id, at);
    }

    /// No more renewals: the guard was given back or lost. Its slot in the
    /// queue goes; a renewal in flight is answered into the void.
    fn stop_renewal(&self, schedule: &mut Schedule) {
        schedule.done = true;
        if let Some(at) = schedule.queued.take() {
            self.client.renewals().remove(self.id, at);
        }
    }

    /// Whether the guard still renews (not given back, not lost).
    pub(crate) fn renewing(&self) -> bool {
        !self.schedule().done
    }

    /// One step, when the guard's wake-up came (the driver took it out of
    /// the queue): fires the lost signal at the stop moment, else returns
    /// the renewal to send if one is due, and queues the guard again.
    pub(crate) fn step(self: &Arc<Self>, now: Instant) -> Option<renewal::Due> {
        let mut schedule = self.schedule();
        if schedule.done {
            return None;
        }
        schedule.queued = None;
        let lease = self.lease();
        let stop_at = self.stop_moment(&lease);
        // At the stop moment, or woken for a renewal after it (the runtime
        // starved or froze): lost, as the stop moment's own wake-up would
        // say.
        if now >= stop_at {
            if schedule.in_flight {
                instrument::renewal(self.client.name(), false);
            }
            self.stop_renewal(&mut schedule);
            drop(schedule);
            self.mark_lost(LostReason::Expired);
            return None;
        }
        let due = !schedule.in_flight && schedule.renew_at(stop_at).is_some_and(|at| now >= at);
        if !due {
            self.queue(&mut schedule);
            return None;
        }
        // Never extend beyond the max hold time.
        let mut ttl = lease.ttl();
        if let Some(until) = schedule.renew_until {
            ttl = ttl.min(until.saturating_duration_since(now));
        }
        if ttl.is_zero() {
            schedule.next_renewal = None;
            self.queue(&mut schedule);
            return None;
        }
        schedule.in_flight = true;
        self.queue(&mut schedule);
        Some(renewal::Due {
            guard: self.clone(),
            lease,
            ttl,
        })
    }

    /// The answer to the renewal [`step`](Self::step) returned.
    pub(crate) fn renewed(self: &Arc<Self>, result: Result<Lease, LockError>) {
        let mut schedule = self.schedule();
        if schedule.done || !schedule.in_flight {
            return;
        }
        schedule.in_flight = false;
        instrument::renewal(self.client.name(), result.is_ok());
        let lost = match result {
            Ok(renewed) => {
                tracing::trace!(key = %renewed.key(), fencing = %renewed.fencing_token(), "lock renewed");
                if self.lost.move_stop(self.stop_moment(&renewed)) {
                    *self.lease.lock().unwrap_or_else(|e| e.into_inner()) = renewed;
                    schedule.got_at = Instant::now();
                    schedule.next_renewal =
                        schedule.period.map(|p| schedule.due(schedule.got_at, p));
                    None
                } else {
                    // Renewed, but only after the stop moment: the job was
                    // told to stop already.
                    Some(LostReason::Expired)
                }
            }
            // A refusal, or data at the key that distlock did not write
            // (the lock was overwritten), means the lock is gone now. Any
            // other failure is retried until the stop moment: a renewal
            // that cannot be confirmed is lost by the clock, never on a
            // guess (a misread transport failure is not a refusal).
            Err(e) if matches!(e.kind(), ErrorKind::NotHeld | ErrorKind::Corrupted) => {
                if e.kind() != ErrorKind::NotHeld {
                    let lease = self.lease();
                    tracing::warn!(key = %lease.key(), fencing = %lease.fencing_token(), error = %e, kind = ?e.kind(), "lock renewal failed for good");
                }
                Some(LostReason::Refused)
            }
            Err(e) => {
                // Transient: retry soon, well before the stop moment.
                let lease = self.lease();
                let left = self
                    .stop_moment(&lease)
                    .saturating_duration_since(Instant::now());
                let retry = (left / 4).max(MIN_RENEW_GAP);
                tracing::warn!(key = %lease.key(), fencing = %lease.fencing_token(), error = %e, retry_in = ?retry, "lock renewal failed; retrying");
                schedule.next_renewal = Some(later(Instant::now(), retry));
                None
            }
        };
        match lost {
            None => self.queue(&mut schedule),
            Some(reason) => {
                self.stop_renewal(&mut schedule);
                drop(schedule);
                self.mark_lost(reason);
            }
        }
    }

    fn mark_lost(&self, reason: LostReason) {
        // Fired, not `is_lost`: a loss by the clock is logged here too.
        if !self.lost.is_fired() {
            let lease = self.lease();
            tracing::warn!(backend = self.client.name(), key = %lease.key(), fencing = %lease.fencing_token(), %reason, "lock lost");
            instrument::lost(
                self.client.name(),
                match reason {
                    LostReason::Refused => "refused",
                    LostReason::Expired => "expired",
                },
            );
            self.holding.end();
            self.lost.fire(reason);
        }
    }

    /// When the job must stop if `lease` is not renewed by then.
    fn stop_moment(&self, lease: &Lease) -> Instant {
        lease
            .valid_until()
            .checked_sub(self.stop_margin)
            .unwrap_or_else(Instant::now)
    }

    /// Releases, or, with hold-at-least (unless `now`), shortens the lease
    /// so it ends when the minimum hold time is over.
    async fn release(&self, now: bool) -> Result<(), LockError> {
        let result = self.give_back(now).await;
        // Whatever the answer: the guard is done with the lock.
        self.holding.end();
        result
    }

    async fn give_back(&self, now: bool) -> Result<(), LockError> {
        let lease = self.lease();
        if let Some(min) = self.hold_at_least.filter(|_| !now) {
            let keep_until = later(self.granted_at, min);
            let remaining = keep_until.saturating_duration_since(Instant::now());
            if !remaining.is_zero() {
                self.client.extend(&lease, remaining).await?;
                tracing::debug!(key = %lease.key(), fencing = %lease.fencing_token(), ?remaining, "lock kept until hold-at-least time");
                return Ok(());
            }
        }
        let result = self.client.release(&lease).await;
        match &result {
            Ok(()) => {
                tracing::debug!(key = %lease.key(), fencing = %lease.fencing_token(), "lock released")
            }
            Err(e) => {
                tracing::warn!(key = %lease.key(), fencing = %lease.fencing_token(), error = %e, "lock release failed")
            }
        }
        result
    }
}

/// A held lock.
///
/// While it lives, its client's renewal driver (one task per client and
/// runtime, not one per guard) renews the lease (by default every third
/// of the TTL) until the optional max hold time. [`lost`](Self::lost)
/// resolves as soon as the guard knows or must assume it no longer holds the
/// lock — renewal refused — and at the latest at the stop moment: the stop
/// margin ([`LockOptions::with_stop_margin`], default a third of the TTL) before
/// the earliest moment the server may expire a lease that was not renewed.
/// [`release`](Self::release) releases and reports; dropping the guard
/// releases in the background on the current tokio runtime.
///
/// Renewals are sent from the runtime the guard was taken on. If that
/// runtime stops being driven (a current-thread runtime between two
/// `block_on`s), the client's driver on another runtime it is used from
/// takes over within 50 ms; with no other, nothing renews the guard until
/// its runtime runs again, and `lost` says so at the stop moment.
pub struct LockGuard {
    shared: Arc<Shared>,
    released: bool,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("lease", &self.shared.lease())
            .field("lost", &self.shared.lost.is_lost())
            .finish()
    }
}

impl LockGuard {
    /// Wraps a freshly acquired lease and starts renewing it per `options`.
    /// Must be called within a tokio runtime. A lease already at its stop
    /// moment gives a guard whose lost signal has fired; [`Locker`](crate::Locker)
    /// never hands out such a guard (it releases the lease and reports).
    pub fn new(client: LockClient, lease: Lease, options: &LockOptions) -> Self {
        let acquired_at = lease.sent_at();
        let renew_period = options.renew_period(lease.ttl());
        // A huge max hold means no limit.
        let renew_until = options
            .max_hold()
            .and_then(|max| acquired_at.checked_add(max));
        let stop_margin = options.stop_margin_for(lease.ttl());
        // Where the client renews guards together, each renews on the
        // shared grid (see [`Schedule::due`]).
        let batched = client.capabilities().extend_batch > 1 && lease.permit_limit().is_none();
        let mut schedule = Schedule {
            period: renew_period,
            renew_until,
            next_renewal: None,
            got_at: Instant::now(),
            batched,
            queued: None,
            in_flight: false,
            done: false,
        };
        schedule.next_renewal = renew_period.map(|p| schedule.due(acquired_at, p));
        let shared = Arc::new(Shared {
            holding: instrument::Holding::start(client.name(), acquired_at),
            id: client.renewals().next_id(),
            client,
            lease: Mutex::new(lease),
            lost: LostSignal::default(),
            granted_at: Instant::now(),
            hold_at_least: options.hold_at_least(),
            stop_margin,
            schedule: Mutex::new(schedule),
        });
        shared.lost.move_stop(shared.stop_moment(&shared.lease()));
        if Instant::now() >= shared.stop_moment(&shared.lease()) {
            // Fired before anyone can poll the job, not later from the driver.
            shared.mark_lost(LostReason::Expired);
        } else {
            shared.queue(&mut shared.schedule());
        }
        Self {
            shared,
            released: false,
        }
    }

    /// The key held.
    pub fn key(&self) -> LockKey {
        self.shared.lease().key().clone()
    }

    /// The fencing token of this acquisition; pass it to the resource you
    /// protect.
    pub fn fencing_token(&self) -> FencingToken {
        self.shared.lease().fencing_token()
    }

    /// The current lease (renewals replace it).
    pub fn lease(&self) -> Lease {
        self.shared.lease()
    }

    /// Whether the lock is known or assumed lost.
    pub fn is_lost(&self) -> bool {
        self.shared.lost.is_lost()
    }

    /// Resolves when the lock is lost; never, if it is released first.
    pub fn lost(&self) -> impl std::future::Future<Output = LostReason> + Send + 'static {
        let signal = self.shared.lost.clone();
        async move { signal.wait().await }
    }

    /// A clonable handle on the lost signal, for the job.
    pub fn lost_signal(&self) -> LostSignal {
        self.shared.lost.clone()
    }

    /// When the job must stop unless the lease is renewed before: the stop
    /// margin before the lease's conservative expiry.
    pub fn stop_moment(&self) -> Instant {
        self.shared.stop_moment(&self.shared.lease())
    }

    /// Polls `work` until it completes or the lock is lost, whichever comes
    /// first. The lost signal is checked first at every poll, so once it
    /// has fired `work` is dropped and never polled again (no further step
    /// of the job runs); `Err` carries the reason.
    ///
    /// Cancel-safe as far as `work` is: dropping this future drops `work`.
    pub async fn while_held<F: std::future::Future>(
        &self,
        work: F,
    ) -> Result<F::Output, LostReason> {
        let lost = self.lost();
        tokio::select! {
            biased;
            reason = lost => Err(reason),
            output = work => Ok(output),
        }
    }

    /// Stops renewal and releases the lock (or, with hold-at-least, lets it
    /// run out at the minimum hold time). Reports
    /// [`ErrorKind::NotHeld`] if the lock was no longer held.
    ///
    /// Cancel-safe: if this future is dropped before the server answered,
    /// the lock is released in the background as if the guard was dropped.
    pub async fn release(self) -> Result<(), LockError> {
        self.release_with(false).await
    }

    /// The client that holds the lock.
    pub(crate) fn client(&self) -> &LockClient {
        &self.shared.client
    }

    /// Releases at once, ignoring hold-at-least (the work it protected did
    /// not happen, so late instances must not skip it).
    pub(crate) async fn release_now(self) -> Result<(), LockError> {
        self.release_with(true).await
    }

    async fn release_with(mut self, now: bool) -> Result<(), LockError> {
        self.shared.stop_renewal(&mut self.shared.schedule());
        self.shared.lost.retire();
        let result = self.shared.release(now).await;
        // Only now: a drop before the answer must still release (Drop).
        self.released = true;
        result
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        self.shared.stop_renewal(&mut self.shared.schedule());
        self.shared.lost.retire();
        if self.released {
            return;
        }
        let shared = self.shared.clone();
        let lease = shared.lease();
        let client = shared.client.clone();
        let release = client.spawn_background(async move {
            let _ = shared.release(false).await;
        });
        if release.is_none() {
            tracing::warn!(key = %lease.key(), fencing = %lease.fencing_token(),
                "lock guard dropped outside a tokio runtime; the lock expires after its TTL");
        }
    }
}

/// The shortest time between two renewal attempts of one guard.
const MIN_RENEW_GAP: Duration = Duration::from_millis(5);

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
