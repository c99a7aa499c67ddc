//! Sending a request under the client's timeouts, and again when that rides
//! out a member's death or an election (what a failure says about that is
//! [`crate::errors`]' business).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{request_message, ClientOptions, LockError};

use crate::errors::{failure, map, Failure};
use crate::health::Health;

/// First pause before sending a request again that reached no server.
const FIRST_PAUSE: Duration = Duration::from_millis(10);
/// Longest such pause.
const MAX_PAUSE: Duration = Duration::from_millis(200);
/// A request that may be sent again gets this share of its time per try
/// (but at least [`MIN_ATTEMPT`]).
pub(crate) const ATTEMPTS: u32 = 3;
pub(crate) const MIN_ATTEMPT: Duration = Duration::from_millis(300);

/// Whether a request may be sent again after a failure that left its
/// outcome unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Repeat {
    /// Sending it twice does no harm: reads, compare-only transactions,
    /// deletes, moving a lock to a lease, an acquire (a second one that
    /// finds our own owner token knows the first won), a release (a second
    /// one may say "not held" of a lock the first released), a lease grant
    /// (a lease granted twice leaves one, without keys, to its TTL).
    Safe,
    /// Only when it certainly did not take effect (never sent, or refused
    /// for want of a leader): a waiter's queue entry (written twice, it
    /// would move behind waiters that queued in between while they wait
    /// for it).
    IfUnapplied,
}

/// How a client sends its requests: under its timeouts, and again when
/// that rides out a member's death or an election.
#[derive(Debug, Clone)]
pub(crate) struct Requests {
    pub(crate) options: ClientOptions,
    /// Whether the channel has other endpoints to try.
    failover: bool,
    /// Told when a member may be at fault (clients with several endpoints
    /// that [`EtcdLock`](crate::EtcdLock) connected itself).
    health: Option<Arc<Health>>,
    /// Requests sent again after a try whose outcome was unknown, which
    /// may still be applied after the one that answered.
    sent_again: Arc<AtomicU64>,
}

impl Requests {
    /// For a client with `endpoints` endpoints.
    pub(crate) fn new(
        options: ClientOptions,
        endpoints: usize,
        health: Option<Arc<Health>>,
    ) -> Self {
        Self {
            options,
            failover: endpoints > 1,
            health,
            sent_again: Arc::default(),
        }
    }

    /// How many requests this client sent again after a try whose outcome
    /// was unknown, so far: a call that saw this move may have a request
    /// that is still applied after its answer.
    pub(crate) fn sent_again(&self) -> u64 {
        self.sent_again.load(Ordering::Acquire)
    }

    /// Counts a request sent again, as a try that went unanswered does.
    #[cfg(test)]
    pub(crate) fn count_sent_again(&self) {
        self.sent_again.fetch_add(1, Ordering::AcqRel);
    }

    /// Something failed that may be a member's fault: check the members.
    pub(crate) fn suspect(&self) {
        if let Some(health) = &self.health {
            health.suspect();
        }
    }

    /// Sends a request (`send` makes a new one each time) under the
    /// operation timeout, and again after a short pause (until near the
    /// timeout, then the last error is returned) when that rides out a
    /// member's death or an election:
    ///
    /// - it reached no server, and the URL lists other endpoints (the
    ///   channel picks another; with one endpoint it fails at once, and
    ///   waiting calls retry by themselves);
    /// - the member had no leader (an election: nothing happened);
    /// - its outcome is unknown (connection broken under it, "leader
    ///   changed") and `repeat` says a second one is harmless.
    ///
    /// Cancel safe: dropping it drops the request in flight, as dropping
    /// a single request would.
    pub(crate) async fn send<T, F, Fut>(
        &self,
        what: &str,
        repeat: Repeat,
        send: F,
    ) -> Result<T, LockError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.send_until(self.deadline(), what, repeat, send).await
    }

    /// When an operation that starts now must end: its operation timeout
    /// from now. An operation of several requests (a lease grant and a
    /// transaction) sends each with [`send_until`](Self::send_until) that
    /// one deadline, so the whole ends within one operation timeout.
    pub(crate) fn deadline(&self) -> Instant {
        Instant::now() + self.options.operation_timeout()
    }

    /// [`send`](Self::send) with what is left until `deadline` (a request
    /// sent past it fails at once with a timeout).
    pub(crate) async fn send_until<T, F, Fut>(
        &self,
        deadline: Instant,
        what: &str,
        repeat: Repeat,
        send: F,
    ) -> Result<T, LockError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let left = deadline.saturating_duration_since(Instant::now());
        self.send_within(left, what, repeat, send, |_| false).await
    }

    fn again(&self, error: &etcd_client::Error, repeat: Repeat) -> bool {
        let failure = failure(error);
        if matches!(failure, Failure::NeverSent | Failure::Unknown) {
            self.suspect();
        }
        match failure {
            Failure::NeverSent => self.failover,
            Failure::NoLeader => true,
            Failure::Unknown => repeat == Repeat::Safe,
            Failure::Final => false,
        }
    }

    /// [`send`](Self::send) with its own time limit (the connect timeout
    /// for the connection probe), returning at once an error `stop` picks
    /// out. An error after the last try carries the last driver error as
    /// its source.
    pub(crate) async fn send_within<T, F, Fut>(
        &self,
        timeout: Duration,
        what: &str,
        repeat: Repeat,
        mut send: F,
        stop: impl Fn(&etcd_client::Error) -> bool,
    ) -> Result<T, LockError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let deadline = Instant::now() + timeout;
        // A request a follower forwarded to a leader that died is lost
        // without an answer (etcd's own timeout is longer than ours): a
        // request that may be sent again gets a share of the time, so a
        // second one can reach the new leader.
        let attempt = match repeat {
            Repeat::Safe => (timeout / ATTEMPTS).max(MIN_ATTEMPT),
            Repeat::IfUnapplied => timeout,
        };
        distlock_core::with_timeout(timeout, what, async {
            let mut pause = FIRST_PAUSE;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let last = match tokio::time::timeout(attempt.min(left), send()).await {
                    Ok(Ok(reply)) => return Ok(reply),
                    Ok(Err(e)) if !stop(&e) && self.again(&e, repeat) => Some(e),
                    Ok(Err(e)) => return Err(map(e, what)),
                    Err(_) => {
                        self.suspect();
                        None
                    }
                };
                let error = last.as_ref().map_or_else(
                    || format!("no answer within {:?}", millis(attempt)),
                    ToString::to_string,
                );
                if Instant::now() + pause >= deadline {
                    let error = LockError::timeout(request_message(
                        what,
                        format_args!(
                            "no answer within {:?} (last try: {error}); the etcd cluster may have no leader, or be down or overloaded",
                            millis(timeout)
                        ),
                    ));
                    return Err(match last {
                        Some(last) => error.with_source(last),
                        None => error,
                    });
                }
                if last.as_ref().is_none_or(|e| failure(e) == Failure::Unknown) {
                    self.sent_again.fetch_add(1, Ordering::AcqRel);
                }
                tracing::debug!(request = what, error = %error, "etcd request failed on the way; sending it again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_PAUSE);
            }
        })
        .await
    }
}

/// `duration` to whole milliseconds, for messages.
fn millis(duration: Duration) -> Duration {
    Duration::from_millis(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A try that got no answer may still be applied: sending the request
    /// again is counted, so a caller can tell its answer may not be the
    /// last word.
    #[tokio::test]
    async fn a_request_sent_again_after_no_answer_is_counted() {
        let requests = Requests::new(ClientOptions::default(), 1, None);
        let mut tries = 0;
        let reply = requests
            .send_within(
                Duration::from_secs(3),
                "test request",
                Repeat::Safe,
                || {
                    tries += 1;
                    let first = tries == 1;
                    async move {
                        if first {
                            // Past the try's share of the time (1 s).
                            tokio::time::sleep(Duration::from_secs(5)).await;
                        }
                        Ok::<_, etcd_client::Error>(tries)
                    }
                },
                |_| false,
            )
            .await
            .expect("the second try answers");
        assert_eq!(reply, 2);
        assert_eq!(requests.sent_again(), 1);
    }
}
