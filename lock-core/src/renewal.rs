//! Renewing many guards in few requests.
//!
//! Where a client's backend batches extends (its
//! [`Capabilities::extend_batch`](crate::Capabilities::extend_batch) is
//! above one), guards queue their renewals instead of sending them alone.
//! The first renewal into an empty queue starts a short task that gathers
//! what arrives within one timer tick, groups it by TTL and sends each
//! group in calls of at most `extend_batch` locks
//! ([`LockBackend::extend_many`](crate::LockBackend::extend_many)); every
//! guard gets its own answer, dated from its batch's send time. No task
//! outlives its batch, and each runs on the runtime of a guard that renews.
//! Guards renew at moments on a shared grid (see [`on_grid`]), so those
//! acquired at different times still meet in one batch.

use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::{Lease, LockError};

/// How long renewals are gathered after the first one arrives, for the
/// others due at the same moment: one tick of tokio's timer.
const GATHER: Duration = Duration::from_millis(1);

/// Grid steps per renewal period: a guard renews at most this fraction of
/// its period early.
const GRID_STEPS: u32 = 8;

/// The answer to one renewal.
pub(crate) type Renewed = Result<Lease, LockError>;

/// One guard's renewal, waiting for its batch.
struct Renewal {
    lease: Lease,
    ttl: Duration,
    answer: oneshot::Sender<Renewed>,
}

/// A client's renewals waiting to be sent together.
#[derive(Default)]
pub(crate) struct Renewals {
    due: Arc<Mutex<Vec<Renewal>>>,
}

impl Renewals {
    /// Queues `lease`'s renewal for `ttl` and waits for its answer. The
    /// first renewal into an empty queue spawns a short task (on the
    /// current runtime) that waits one tick, takes the queue and has `send`
    /// renew each group (one TTL, at most `limit` leases) in one call.
    /// `None` if it could not be sent together (no runtime; the task was
    /// dropped with its runtime): the caller then extends alone.
    /// Cancel-safe: dropped, the renewal is still sent with its batch, and
    /// its answer is dropped.
    pub(crate) async fn renew<F, Fut>(
        &self,
        lease: &Lease,
        ttl: Duration,
        limit: usize,
        send: F,
    ) -> Option<Renewed>
    where
        F: Fn(Vec<Lease>, Duration) -> Fut + Send + 'static,
        Fut: Future<Output = Vec<Renewed>> + Send + 'static,
    {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let (answer, answered) = oneshot::channel();
        let first = {
            let mut due = self.due.lock().unwrap_or_else(|e| e.into_inner());
            due.push(Renewal {
                lease: lease.clone(),
                ttl,
                answer,
            });
            due.len() == 1
        };
        if first {
            let taken = TakeOnDrop(self.due.clone());
            runtime.spawn(async move {
                tokio::time::sleep(GATHER).await;
                for (leases, ttl, answers) in batches(taken.take(), limit) {
                    let call = send(leases, ttl);
                    // Batches run side by side: a slow one holds up no other.
                    tokio::spawn(async move {
                        for (answer, result) in answers.into_iter().zip(call.await) {
                            let _ = answer.send(result);
                        }
                    });
                }
            });
        }
        answered.await.ok()
    }
}

/// The queue, taken by the gathering task; taken on its drop too (its
/// runtime shut down), so no renewal waits for a task that is gone (their
/// answers are dropped, and their guards extend alone).
struct TakeOnDrop(Arc<Mutex<Vec<Renewal>>>);

impl TakeOnDrop {
    fn take(&self) -> Vec<Renewal> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for TakeOnDrop {
    fn drop(&mut self) {
        drop(self.take());
    }
}

/// `due` as calls: each of one TTL and at most `limit` leases, with the
/// answers to send back. Renewals whose guard stopped meanwhile are left
/// out.
fn batches(
    mut due: Vec<Renewal>,
    limit: usize,
) -> Vec<(Vec<Lease>, Duration, Vec<oneshot::Sender<Renewed>>)> {
    due.retain(|r| !r.answer.is_closed());
    due.sort_by_key(|r| r.ttl);
    let mut calls = Vec::new();
    while !due.is_empty() {
        let ttl = due[0].ttl;
        let same = due.iter().take_while(|r| r.ttl == ttl).count();
        let batch: Vec<Renewal> = due.drain(..same.min(limit.max(1))).collect();
        let (leases, answers) = batch.into_iter().map(|r| (r.lease, r.answer)).unzip();
        calls.push((leases, ttl, answers));
    }
    calls
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
