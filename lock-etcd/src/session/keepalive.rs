//! The keep-alive and expiry task of one session lease: keeps the lease
//! alive on one keep-alive stream, records the send time of every
//! keep-alive the server confirmed, deletes attached locks and permits
//! their holders stopped renewing, and gives the session up (revoking the
//! lease) when no keep-alive was confirmed within the TTL.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{LeaseKeepAliveStream, LeaseKeeper};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::state::{Session, Undo};
use crate::connection::{self, Etcd};
use crate::errors;
use crate::requests::Repeat;
use crate::txn;

/// Shortest pause before reopening a failed keep-alive stream.
const REOPEN_PAUSE: Duration = Duration::from_millis(100);

/// The least time a keep-alive's answer (or opening the stream) is given
/// before the stream is reopened.
const MIN_PATIENCE: Duration = Duration::from_millis(200);

/// The keep-alive and expiry task of one session.
pub(crate) struct Task {
    pub(crate) session: Arc<Session>,
    /// The session's client (its lease client, and its kv client for the
    /// undos).
    pub(crate) etcd: Etcd,
    pub(crate) shutdown: watch::Receiver<()>,
    /// Revoke the lease when the client is dropped (a session of queue
    /// entries alone; see [`Sessions::for_queue_entries`](super::Sessions::for_queue_entries)).
    pub(crate) revoke_at_shutdown: bool,
}

enum Opened {
    Stream((LeaseKeeper, LeaseKeepAliveStream)),
    Shutdown,
    LeaseGone,
    Failed(distlock_core::LockError),
}

enum Stop {
    /// The client was dropped.
    Shutdown,
    /// The lease is gone, or must be assumed gone.
    Lost(&'static str),
}

impl Task {
    pub(crate) async fn run(mut self) {
        let stop = self.keep_alive().await;
        let lease_id = self.session.lease_id();
        self.session.kill();
        let revoke = match stop {
            Stop::Shutdown => {
                tracing::debug!(lease_id, "etcd session stopped with its client");
                self.revoke_at_shutdown
            }
            Stop::Lost(why) => {
                tracing::warn!(
                    lease_id,
                    reason = why,
                    "etcd session lease lost; its locks are gone"
                );
                // Make the server agree at once if it still has the lease.
                true
            }
        };
        if revoke {
            let _ =
                connection::revoke(self.etcd.leases.clone(), &self.etcd.requests, lease_id).await;
        }
    }

    async fn keep_alive(&mut self) -> Stop {
        let ttl = self.session.ttl();
        let period = (ttl / 3).max(Duration::from_millis(100));
        // How long an answer (or opening the stream) may take.
        let patience = (period / 2)
            .max(MIN_PATIENCE)
            .min(self.etcd.requests.options.operation_timeout());
        let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
        // Send times of the keep-alives not answered yet, oldest first
        // (etcd answers in order on one stream).
        let mut in_flight: VecDeque<Instant> = VecDeque::new();
        // The first keep-alive goes out at once: it opens the stream.
        let mut next_send = Instant::now();
        loop {
            let now = Instant::now();
            let confirmed = match self.session.confirmed_sent_at() {
                Some(at) => at,
                None => return Stop::Lost("session marked dead"),
            };
            let lease_end = confirmed + ttl;
            if now >= lease_end {
                return Stop::Lost("no keep-alive confirmed within the lease TTL");
            }
            let next_expiry = self.sweep(now);
            // A keep-alive unanswered for half a period went to a member
            // that cannot answer (cut off, or its leader died with the
            // request forwarded): reopen, so the channel may pick another
            // member, while the lease has time left for that.
            if in_flight
                .front()
                .is_some_and(|sent| now >= *sent + patience)
            {
                tracing::debug!(
                    lease_id = self.session.lease_id(),
                    "etcd keep-alive unanswered for a period; reopening the stream"
                );
                self.etcd.requests.suspect();
                stream = None;
                in_flight.clear();
                next_send = now;
            }
            if now >= next_send {
                if let Some((keeper, _)) = stream.as_mut() {
                    in_flight.push_back(Instant::now());
                    if let Err(e) = keeper.keep_alive().await {
                        tracing::debug!(lease_id = self.session.lease_id(), error = %e, "etcd keep-alive send failed; reopening the stream");
                        stream = None;
                        in_flight.clear();
                    }
                }
                if stream.is_none() {
                    // Opening the stream sends the first keep-alive and
                    // waits for its answer.
                    let sent_at = Instant::now();
                    match self.open(patience).await {
                        Opened::Stream(opened) => {
                            stream = Some(opened);
                            in_flight.clear();
                            self.session.confirm(sent_at);
                        }
                        Opened::Shutdown => return Stop::Shutdown,
                        Opened::LeaseGone => {
                            return Stop::Lost("etcd reports the session lease expired")
                        }
                        Opened::Failed(e) => {
                            tracing::debug!(lease_id = self.session.lease_id(), error = %e, "could not open the etcd keep-alive stream; retrying");
                        }
                    }
                }
                next_send = if stream.is_some() {
                    Instant::now() + period
                } else {
                    Instant::now() + REOPEN_PAUSE.min(period)
                };
            }
            let stale = in_flight.front().map(|sent| *sent + patience);
            let wake = [Some(next_send), Some(lease_end), next_expiry, stale]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(next_send);
            let message = async {
                match stream.as_mut() {
                    Some((_, responses)) => responses.message().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = self.shutdown.changed() => return Stop::Shutdown,
                _ = tokio::time::sleep_until(wake.into()) => {}
                message = message => match message {
                    Ok(Some(reply)) => {
                        let sent_at = in_flight.pop_front();
                        if reply.ttl() <= 0 {
                            return Stop::Lost("etcd reports the session lease expired");
                        }
                        if let Some(sent_at) = sent_at {
                            self.session.confirm(sent_at);
                        }
                    }
                    Ok(None) | Err(_) => {
                        tracing::debug!(lease_id = self.session.lease_id(), "etcd keep-alive stream ended; reopening");
                        stream = None;
                        in_flight.clear();
                        next_send = next_send.min(Instant::now() + REOPEN_PAUSE.min(period));
                    }
                }
            }
        }
    }

    /// Opens the keep-alive stream (which sends one keep-alive and reads
    /// its answer).
    async fn open(&mut self, timeout: Duration) -> Opened {
        let mut leases = self.etcd.leases.clone();
        let lease_id = self.session.lease_id();
        // Short (half a period): a member that does not answer must leave
        // time for another try before the lease runs out.
        let open = distlock_core::with_timeout(timeout, "etcd lease keep-alive", async {
            Ok(leases.keep_alive(lease_id).await)
        });
        tokio::select! {
            _ = self.shutdown.changed() => Opened::Shutdown,
            opened = open => match opened {
                Ok(Ok(opened)) => Opened::Stream(opened),
                // etcd-client's way of saying the answer had TTL 0.
                Ok(Err(etcd_client::Error::LeaseKeepAliveError(message)))
                    if message.contains("not found") =>
                {
                    Opened::LeaseGone
                }
                Ok(Err(e)) => Opened::Failed(errors::map(e, "etcd lease keep-alive")),
                Err(e) => {
                    self.etcd.requests.suspect();
                    Opened::Failed(e)
                }
            },
        }
    }

    /// Deletes, in the background, the attached locks and permits not
    /// renewed for the TTL; returns the next such deadline.
    fn sweep(&self, now: Instant) -> Option<Instant> {
        let (expired, next) = self.session.take_expired(now);
        for undo in expired {
            drop(undo_later(&self.etcd, &self.session, undo));
        }
        next
    }
}

/// Runs `undo` of a lock or permit attached to `session` in the
/// background; if it fails, the key is put back to be undone again. The
/// handle ends once it was answered (or put back).
pub(crate) fn undo_later(etcd: &Etcd, session: &Arc<Session>, undo: Undo) -> JoinHandle<()> {
    let session = session.clone();
    let kv = etcd.kv.clone();
    let requests = etcd.requests.clone();
    tokio::spawn(async move {
        let Undo {
            tracked,
            fence,
            raise,
        } = undo;
        let attached = &tracked.attached;
        let txn = txn::undo_session_lock(
            attached.key(),
            attached.value(),
            attached.label_key(),
            session.lease_id(),
            tracked.fencing,
            &fence,
            &raise,
            attached.marker(),
        );
        let result = requests
            .send("etcd expire session lock", Repeat::Safe, || {
                let mut kv = kv.clone();
                let txn = txn.clone();
                async move { kv.txn(txn).await }
            })
            .await;
        match result {
            Ok(reply) => {
                session.settled(attached.id(), &raise, &fence);
                tracing::debug!(
                    fencing = ?tracked.fencing,
                    deleted = reply.succeeded(),
                    "etcd session lock or permit not renewed within its TTL, or given back; expired"
                );
            }
            Err(e) => {
                tracing::debug!(error = %e, "could not expire an etcd session lock or permit; retrying");
                session.put_back(tracked);
            }
        }
    })
}
