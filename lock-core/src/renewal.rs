//! Renewing many guards in few requests.
//!
//! Where a client's backend batches extends (its
//! [`Capabilities::extend_batch`](crate::Capabilities::extend_batch) is
//! above one), guards hand their renewals to the client's batcher instead
//! of sending them alone. The batcher gathers what arrives within one timer
//! tick, groups it by TTL and sends each group in calls of at most
//! `extend_batch` locks ([`LockBackend::extend_many`](crate::LockBackend::extend_many));
//! every guard gets its own answer, dated from its batch's send time.
//! Guards renew at moments on a shared grid (see [`on_grid`]), so those
//! acquired at different times still meet in one batch.

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::{Lease, LockError};

/// How long the batcher waits after a renewal arrives for the others due
/// at the same moment: one tick of tokio's timer.
const GATHER: Duration = Duration::from_millis(1);

/// Grid steps per renewal period: a guard renews at most this fraction of
/// its period early.
const GRID_STEPS: u32 = 8;

/// The answer to one renewal.
pub(crate) type Renewed = Result<Lease, LockError>;

/// One guard's renewal, waiting for its batch.
pub(crate) struct Renewal {
    pub(crate) lease: Lease,
    pub(crate) ttl: Duration,
    pub(crate) answer: oneshot::Sender<Renewed>,
}

/// A client's way into its batcher (started on first use).
#[derive(Default)]
pub(crate) struct Renewals {
    sender: Mutex<Option<mpsc::UnboundedSender<Renewal>>>,
}

impl Renewals {
    /// Hands `lease`'s renewal for `ttl` to the batcher, starting one with
    /// `start` if there is none (or the runtime that ran it is gone), and
    /// waits for the answer. `None` if no batcher could take it (`start`
    /// found no runtime) or it went away before answering: the caller then
    /// extends alone. Cancel-safe: dropped, the renewal is still sent with
    /// its batch, and its answer is dropped.
    pub(crate) async fn renew(
        &self,
        lease: &Lease,
        ttl: Duration,
        start: impl FnOnce(mpsc::UnboundedReceiver<Renewal>) -> bool,
    ) -> Option<Renewed> {
        let (answer, answered) = oneshot::channel();
        let renewal = Renewal {
            lease: lease.clone(),
            ttl,
            answer,
        };
        let sent = {
            let mut sender = self.sender.lock().unwrap_or_else(|e| e.into_inner());
            let unsent = match sender.as_ref() {
                Some(live) => live.send(renewal).err().map(|e| e.0),
                None => Some(renewal),
            };
            match unsent {
                None => true,
                // None yet, or its runtime shut down: start one here.
                Some(renewal) => {
                    let (fresh, requests) = mpsc::unbounded_channel();
                    *sender = None;
                    let sent = start(requests) && fresh.send(renewal).is_ok();
                    if sent {
                        *sender = Some(fresh);
                    }
                    sent
                }
            }
        };
        if !sent {
            return None;
        }
        answered.await.ok()
    }
}

/// The batcher: gathers renewals and has `send` renew each group (one TTL,
/// at most `limit` leases) in one call, answering every guard. Ends when
/// the client (every sender) is gone.
pub(crate) async fn gather<F, Fut>(
    mut requests: mpsc::UnboundedReceiver<Renewal>,
    limit: usize,
    send: F,
) where
    F: Fn(Vec<Lease>, Duration) -> Fut,
    Fut: std::future::Future<Output = Vec<Renewed>> + Send + 'static,
{
    let limit = limit.max(1);
    while let Some(first) = requests.recv().await {
        tokio::time::sleep(GATHER).await;
        let mut due = vec![first];
        while let Ok(next) = requests.try_recv() {
            due.push(next);
        }
        // A guard that stopped meanwhile (released, dropped) is not renewed.
        due.retain(|r| !r.answer.is_closed());
        due.sort_by_key(|r| r.ttl);
        while !due.is_empty() {
            let ttl = due[0].ttl;
            let same = due.iter().take_while(|r| r.ttl == ttl).count().min(limit);
            let batch: Vec<Renewal> = due.drain(..same).collect();
            let (leases, answers): (Vec<Lease>, Vec<_>) =
                batch.into_iter().map(|r| (r.lease, r.answer)).unzip();
            let call = send(leases, ttl);
            // Batches run side by side: a slow one holds up no other.
            tokio::spawn(async move {
                let results = call.await;
                for (answer, result) in answers.into_iter().zip(results) {
                    let _ = answer.send(result);
                }
            });
        }
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
