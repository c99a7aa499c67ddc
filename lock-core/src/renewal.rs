//! Renewing many guards with one task per client, in few requests.
//!
//! A held guard is no task of its own: its small schedule lives in the
//! guard, and its client's [`Renewals`] queue holds it by its next wake-up
//! (its renewal moment, or its stop moment while a renewal is in flight).
//! A driver task sleeps until the earliest of them, takes every guard due
//! and has each one step ([`Shared::step`]): renew, or be lost by the
//! clock. A guard queued on a runtime where the client has no driver
//! starts one there, so a client used from several runtimes has one
//! driver on each, all serving the one queue. A guard belongs to the
//! runtime it was last queued from, and its renewals are sent from there:
//! a driver takes another runtime's guard only once it is [`STEAL_AFTER`]
//! overdue (that runtime is not being driven: a current-thread runtime
//! between two `block_on`s), so an idle runtime holds up no other
//! runtime's guards, and a runtime driven only for a moment does not take
//! a renewal that would then sit there unsent. A driver ends once the
//! queue has stayed empty for [`LINGER`], so a client that takes short
//! locks one after another (each released before the next) starts no task
//! per lock, and no task outlives the guards it serves by more than that.
//!
//! Renewals due together are sent together where the backend batches
//! extends (its [`Capabilities::extend_batch`](crate::Capabilities::extend_batch)
//! is above one): grouped by TTL, in calls of at most `extend_batch`
//! locks ([`LockBackend::extend_many`](crate::LockBackend::extend_many)),
//! one short task per call; every guard gets its own answer, dated from
//! its batch's send time. Other renewals (permits; backends without
//! batching) are one short task each. Guards renew at moments on a shared
//! grid (see [`on_grid`]), so those acquired at different times still
//! meet in one batch.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use tokio::runtime::{Handle, Id as RuntimeId};
use tokio::sync::Notify;

use crate::guard::Shared;
use crate::lease::later;
use crate::Lease;

/// How long renewals are gathered after the first one falls due, for the
/// others due about then; also the shortest grid step. One tick of
/// tokio's timer.
const GATHER: Duration = Duration::from_millis(1);

/// How long a driver waits, its queue empty, for another guard before it
/// ends. It holds no client meanwhile (only the queue).
const LINGER: Duration = Duration::from_secs(1);

/// How long a guard may be overdue, its own runtime's driver not taking
/// it, before another runtime's driver does. Longer than a driven
/// runtime's timer is late under load, short against a renewal period.
const STEAL_AFTER: Duration = Duration::from_millis(50);

/// Grid steps per renewal period: a guard renews at most this fraction of
/// its period early.
const GRID_STEPS: u32 = 8;

/// One queued guard: its wake-up moment and its number (unique per client).
type Slot = (Instant, u64);

/// A client's held guards, by next wake-up, and its drivers.
#[derive(Default)]
pub(crate) struct Renewals {
    queue: Mutex<Queue>,
}

#[derive(Default)]
struct Queue {
    guards: BTreeMap<Slot, Queued>,
    /// The drivers that run (or are about to), at most one per runtime.
    drivers: Vec<Driver>,
    /// Drivers started so far (each one's number).
    started: u64,
    /// Since when the queue has been empty, while drivers linger.
    empty_since: Option<Instant>,
    next_id: u64,
}

/// A queued guard and the runtime it was queued from (none: outside a
/// runtime, any driver takes it when due).
struct Queued {
    guard: Arc<Shared>,
    home: Option<RuntimeId>,
}

/// One driver task, on one runtime.
struct Driver {
    number: u64,
    runtime: RuntimeId,
    /// Wakes it when a guard is queued before its planned wake-up.
    wake: Arc<Notify>,
    /// When it sleeps until; `None` while it is awake.
    planned: Option<Instant>,
}

/// A renewal the driver sends: the guard, its lease and the TTL asked.
pub(crate) struct Due {
    pub(crate) guard: Arc<Shared>,
    pub(crate) lease: Lease,
    pub(crate) ttl: Duration,
}

impl Renewals {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A number for a new guard, unique in this client's queue.
    pub(crate) fn next_id(&self) -> u64 {
        let mut queue = self.queue();
        queue.next_id += 1;
        queue.next_id
    }

    /// Queues `guard` (number `id`) to step at `at`, starting a driver on
    /// the current runtime if the client has none there (outside a
    /// runtime nothing starts: the guard is then stepped by a driver on
    /// another runtime, or lost by the clock alone). Called with the
    /// guard's schedule locked (locks are taken guard first, queue
    /// second, never the other way).
    pub(crate) fn insert(self: &Arc<Self>, guard: &Arc<Shared>, id: u64, at: Instant) {
        let runtime = Handle::try_current().ok();
        let home = runtime.as_ref().map(Handle::id);
        let start = {
            let mut queue = self.queue();
            let guard = guard.clone();
            queue.guards.insert((at, id), Queued { guard, home });
            // The linger counts from the queue's last guard.
            queue.empty_since = None;
            // The others step in if this runtime stops being driven.
            let stolen_at = later(at, STEAL_AFTER);
            for driver in queue.drivers.iter().filter(|d| Some(d.runtime) != home) {
                if driver.planned.is_some_and(|planned| stolen_at < planned) {
                    driver.wake.notify_one();
                }
            }
            let (Some(runtime), Some(here)) = (runtime, home) else {
                return;
            };
            match queue.drivers.iter().find(|d| d.runtime == here) {
                // The driver on this runtime, which runs: this guard is
                // queued from it.
                Some(driver) => {
                    if driver.planned.is_some_and(|planned| at < planned) {
                        driver.wake.notify_one();
                    }
                    None
                }
                None => {
                    queue.started += 1;
                    let (number, wake) = (queue.started, Arc::new(Notify::new()));
                    queue.drivers.push(Driver {
                        number,
                        runtime: here,
                        wake: wake.clone(),
                        planned: None,
                    });
                    Some((runtime, number, wake))
                }
            }
        };
        // Outside the lock: a runtime shutting down drops the task at once.
        if let Some((runtime, number, wake)) = start {
            runtime.spawn(drive(Running(self.clone(), number), wake));
        }
    }

    /// The earliest wake-up queued.
    #[cfg(test)]
    pub(crate) fn first_wake(&self) -> Option<Instant> {
        self.queue()
            .guards
            .first_key_value()
            .map(|(slot, _)| slot.0)
    }

    /// Takes guard `id`'s slot at `at` out of the queue.
    pub(crate) fn remove(&self, id: u64, at: Instant) {
        // Dropped once the queue is unlocked, as every guard state the
        // queue lets go of.
        let removed = self
            .queue()
            .guards
            .remove(&(at, id))
            .map(|queued| queued.guard);
        drop(removed);
    }

    /// For driver `number`: the guards due by `now` (taken out of the
    /// queue; another runtime's only once [`STEAL_AFTER`] overdue), and
    /// the next wake-up (while the queue is empty, the end of the
    /// [`LINGER`]); `None` (and the driver struck off) once the queue has
    /// been empty that long.
    fn take_due(&self, number: u64, now: Instant) -> Option<(Vec<Arc<Shared>>, Option<Instant>)> {
        let mut queue = self.queue();
        let here = queue
            .drivers
            .iter()
            .find(|d| d.number == number)
            .map(|d| d.runtime);
        let mut taken = Vec::new();
        let mut next: Option<Instant> = None;
        for (slot, queued) in &queue.guards {
            // Sorted by wake-up, and nothing is taken before its own.
            if next.is_some_and(|next| slot.0 >= next) {
                break;
            }
            let at = match queued.home {
                Some(home) if Some(home) != here => later(slot.0, STEAL_AFTER),
                _ => slot.0,
            };
            if at <= now {
                taken.push(*slot);
            } else {
                next = Some(next.map_or(at, |next| next.min(at)));
            }
        }
        let due: Vec<Arc<Shared>> = taken
            .iter()
            .filter_map(|slot| queue.guards.remove(slot))
            .map(|queued| queued.guard)
            .collect();
        if due.is_empty() && next.is_none() {
            let since = *queue.empty_since.get_or_insert(now);
            let until = later(since, LINGER);
            if now >= until {
                queue.drivers.retain(|d| d.number != number);
                return None;
            }
            next = Some(until);
        }
        let planned = if due.is_empty() { next } else { None };
        if let Some(driver) = queue.drivers.iter_mut().find(|d| d.number == number) {
            driver.planned = planned;
        }
        Some((due, next))
    }
}

/// A running driver (by its number); strikes it off the queue's drivers
/// when the task ends, also when it is dropped with its runtime (the next
/// guard queued on that runtime then starts another).
struct Running(Arc<Renewals>, u64);

impl Drop for Running {
    fn drop(&mut self) {
        let mut queue = self.0.queue();
        queue.drivers.retain(|d| d.number != self.1);
    }
}

/// The driver: steps every guard when it is due, until none is queued.
/// Renewals that fall due are gathered for one timer tick after the
/// first, for the others due about then (guards whose lease arrived at
/// slightly different moments), and sent together.
async fn drive(running: Running, wake: Arc<Notify>) {
    let (renewals, number) = (&running.0, running.1);
    let sleep = tokio::time::sleep_until(Instant::now().into());
    tokio::pin!(sleep);
    let mut gathered: Vec<Due> = Vec::new();
    let mut send_at: Option<Instant> = None;
    loop {
        let now = Instant::now();
        let Some((due, next)) = renewals.take_due(number, now) else {
            send(gathered);
            return;
        };
        if !due.is_empty() {
            let before = gathered.len();
            gathered.extend(due.into_iter().filter_map(|guard| guard.step(now)));
            if gathered.len() > before && send_at.is_none() {
                send_at = Some(later(now, GATHER));
            }
            continue;
        }
        if send_at.is_some_and(|at| now >= at) {
            send(std::mem::take(&mut gathered));
            send_at = None;
            continue;
        }
        let Some(until) = [next, send_at].into_iter().flatten().min() else {
            return;
        };
        sleep.as_mut().reset(until.into());
        tokio::select! {
            () = &mut sleep => {}
            () = wake.notified() => {}
        }
    }
}

/// Sends `renew`: together where the backend batches extends (one call
/// per TTL and at most `extend_batch` locks), one call each otherwise.
/// Renewals of guards given back meanwhile are left out.
fn send(mut renew: Vec<Due>) {
    renew.retain(|r| r.guard.renewing());
    let Some(first) = renew.first() else {
        return;
    };
    let client = first.guard.client().clone();
    let limit = client.capabilities().extend_batch;
    let (mut together, alone): (Vec<Due>, Vec<Due>) = renew
        .into_iter()
        .partition(|r| limit > 1 && r.lease.permit_limit().is_none());
    for r in alone {
        let client = client.clone();
        tokio::spawn(async move {
            let result = client.extend(&r.lease, r.ttl).await;
            r.guard.renewed(result);
        });
    }
    together.sort_by_key(|r| r.ttl);
    while !together.is_empty() {
        let ttl = together[0].ttl;
        let same = together.iter().take_while(|r| r.ttl == ttl).count();
        let batch: Vec<Due> = together.drain(..same.min(limit)).collect();
        let client = client.clone();
        // Batches run side by side: a slow one holds up no other.
        tokio::spawn(async move {
            let leases: Vec<Lease> = batch.iter().map(|r| r.lease.clone()).collect();
            let results = client.extend_together(&leases, ttl).await;
            for (r, result) in batch.into_iter().zip(results) {
                r.guard.renewed(result);
            }
        });
    }
}

/// The latest moment on the renewal grid of `period` that is not after
/// `at`: guards that share a period renew at the same moments, up to
/// `period / GRID_STEPS` earlier than each would alone.
pub(crate) fn on_grid(at: Instant, period: Duration) -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    let step = (period / GRID_STEPS).max(GATHER);
    let Some(since) = at.checked_duration_since(epoch) else {
        return at;
    };
    let steps = since.as_nanos() / step.as_nanos();
    let back = since.as_nanos() - steps * step.as_nanos();
    at - Duration::from_nanos(back as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::{current_thread_runtime, one_worker_runtime};
    use crate::{LockKey, LockOptions, Locker, MemoryLock};

    /// How many drivers `locker`'s client has started so far.
    fn drivers(locker: &Locker) -> u64 {
        locker.client().renewals().queue().started
    }

    #[tokio::test(flavor = "current_thread")]
    async fn short_locks_one_after_another_share_one_driver() {
        let locker = Locker::new(MemoryLock::new());
        let options = LockOptions::new(Duration::from_secs(30));
        for i in 0..20 {
            let key = LockKey::new(format!("one-after-another-{i}")).expect("a valid key");
            let guard = locker.try_lock(&key, &options).await.expect("no error");
            let guard = guard.expect("a fresh key is free");
            guard.release().await.expect("released");
            // The driver runs, finding the queue empty, before the next
            // guard (as when a release waits for its reply).
            tokio::task::yield_now().await;
        }
        assert_eq!(
            drivers(&locker),
            1,
            "twenty locks taken and released one after another started a renewal driver each"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_idle_driver_ends_after_its_linger() {
        let locker = Locker::new(MemoryLock::new());
        let options = LockOptions::new(Duration::from_secs(30));
        let key = LockKey::new("idle-driver").expect("a valid key");
        let guard = locker.try_lock(&key, &options).await.expect("no error");
        guard.expect("free").release().await.expect("released");
        tokio::task::yield_now().await;
        let running = || !locker.client().renewals().queue().drivers.is_empty();
        assert!(running(), "the driver lingers for the next guard");
        // Ends after its linger; the bound is for a loaded machine.
        let started = Instant::now();
        while running() {
            assert!(
                started.elapsed() < LINGER * 30,
                "a driver with nothing queued ran on for {:?}",
                started.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The next guard starts another.
        let guard = locker.try_lock(&key, &options).await.expect("no error");
        assert_eq!(drivers(&locker), 2);
        guard.expect("free").release().await.expect("released");
    }

    /// A guard taken on one runtime while the client's driver lingers on
    /// another that nobody drives (a current-thread runtime between two
    /// `block_on`s) is renewed all the same.
    #[test]
    fn a_driver_on_an_idle_runtime_holds_up_no_other_runtimes_guards() {
        let (idle, busy) = (current_thread_runtime(), current_thread_runtime());
        let locker = Locker::new(MemoryLock::new());
        let short = LockOptions::new(Duration::from_secs(2));
        idle.block_on(async {
            let key = LockKey::new("on-the-idle-runtime").expect("a valid key");
            let guard = locker.try_lock(&key, &short).await.expect("no error");
            guard.expect("free").release().await.expect("released");
            // Its driver runs, finds the queue empty, and lingers.
            tokio::task::yield_now().await;
        });
        assert_eq!(drivers(&locker), 1);
        // `idle` is not driven from here on, and not dropped.
        busy.block_on(async {
            let key = LockKey::new("on-the-busy-runtime").expect("a valid key");
            let guard = locker.try_lock(&key, &short).await.expect("no error");
            let guard = guard.expect("free");
            // Two and a half TTLs: still held only if renewed.
            tokio::time::sleep(Duration::from_secs(5)).await;
            assert!(!guard.is_lost(), "the guard was lost");
            guard.release().await.expect(
                "a guard queued while the driver lingered on an idle runtime was not renewed",
            );
        });
        assert_eq!(drivers(&locker), 2, "one driver on each runtime");
        drop(idle);
    }

    /// A guard whose runtime stops being driven right after it was taken
    /// is renewed by the client's driver on another runtime, even one
    /// asleep until a far later renewal of its own.
    #[test]
    fn a_guard_whose_runtime_stops_is_renewed_from_another() {
        let locker = Locker::new(MemoryLock::new());
        let (driven, stopped) = (one_worker_runtime(), current_thread_runtime());
        // A driver on `driven`, asleep until this guard's renewal, about
        // half a minute from now.
        let long = driven.block_on(async {
            let key = LockKey::new("long").expect("a valid key");
            let options = LockOptions::new(Duration::from_secs(60));
            let guard = locker.try_lock(&key, &options).await;
            let guard = guard.expect("no error").expect("free");
            // Until its driver has planned that.
            while locker.client().renewals().queue().drivers[0]
                .planned
                .is_none()
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            guard
        });
        let guard = stopped.block_on(async {
            let key = LockKey::new("on-a-runtime-that-stops").expect("a valid key");
            let options = LockOptions::new(Duration::from_secs(2));
            let guard = locker.try_lock(&key, &options).await;
            guard.expect("no error").expect("free")
        });
        // `stopped` is not driven from here on, and not dropped.
        driven.block_on(async {
            // Two and a half TTLs: still held only if renewed.
            tokio::time::sleep(Duration::from_secs(5)).await;
            assert!(!guard.is_lost(), "the guard was lost");
            guard.release().await.expect("held, so released");
            long.release().await.expect("held, so released");
        });
        drop(stopped);
    }

    #[test]
    fn grid_moments_are_shared_and_never_late() {
        let period = Duration::from_secs(8);
        let step = period / GRID_STEPS;
        let at = Instant::now() + Duration::from_millis(2_345);
        let moment = on_grid(at, period);
        assert!(moment <= at && at - moment < step, "at most one step early");
        assert_eq!(
            on_grid(moment + step / 2, period),
            moment,
            "one step, one moment"
        );
        assert_eq!(on_grid(moment + step, period), moment + step);
    }
}
