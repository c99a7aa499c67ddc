//! Taking a cluster member the client cannot use out of its channel, and
//! putting it back when it answers again.
//!
//! The gRPC channel spreads requests over every endpoint of the URL at
//! random and keeps a connection it has set up as long as HTTP/2 keep-alive
//! does not fail it: a member cut off from the client (its packets dropped)
//! goes on taking a share of the requests, each of which hangs until its
//! timeout, for as long as 15 s, and again after each reconnection (a
//! black-holed address still accepts TCP). So when a request fails in a
//! way that may be the member's fault (no answer in time, connection
//! broken, no connection at all), every endpoint is checked on a
//! connection of its own: one linearizable read within a short time, which
//! needs a member with a leader. Those that fail are removed from the
//! channel (their connections go with them) unless none would be left, and
//! are checked again every [`RECHECK`] until they answer, then put back.
//! Nothing runs while every member answers.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

/// How often removed endpoints are checked again.
const RECHECK: Duration = Duration::from_secs(1);

/// The endpoints of a client's channel and which of them are out.
pub(crate) struct Health {
    channel: Client,
    endpoints: Vec<String>,
    options: ConnectOptions,
    probe_key: Vec<u8>,
    probe_timeout: Duration,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Endpoints taken out of the channel.
    removed: HashSet<String>,
    /// Whether a check is running (at most one at a time).
    checking: bool,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("endpoints", &self.endpoints)
            .field("removed", &self.state().removed)
            .finish_non_exhaustive()
    }
}

impl Health {
    /// For `channel`, connected to `endpoints` with `options`; a member is
    /// healthy if it answers a read of `probe_key` within `probe_timeout`.
    pub(crate) fn new(
        channel: Client,
        endpoints: Vec<String>,
        options: ConnectOptions,
        probe_key: Vec<u8>,
        probe_timeout: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            channel,
            endpoints,
            options,
            probe_key,
            probe_timeout,
            state: Mutex::new(State::default()),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request failed in a way that may be a member's fault: checks every
    /// endpoint in the background, unless a check is running already.
    pub(crate) fn suspect(self: &Arc<Self>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        {
            let mut state = self.state();
            if state.checking {
                return;
            }
            state.checking = true;
        }
        runtime.spawn(check(Arc::downgrade(self)));
    }

    /// Whether `endpoint` answers a read on a connection of its own.
    async fn answers(&self, endpoint: &str) -> bool {
        let probe = async {
            let mut client = Client::connect([endpoint], Some(self.options.clone()))
                .await
                .ok()?;
            client.get(self.probe_key.clone(), None).await.ok()
        };
        matches!(
            tokio::time::timeout(self.probe_timeout, probe).await,
            Ok(Some(_))
        )
    }

    /// Checks every endpoint once (all at once) and updates the channel;
    /// returns whether some endpoint is still out.
    async fn check_once(self: &Arc<Self>) -> bool {
        let probes: Vec<_> = (0..self.endpoints.len())
            .map(|i| {
                let this = self.clone();
                tokio::spawn(async move { this.answers(&this.endpoints[i]).await })
            })
            .collect();
        let mut answers = Vec::with_capacity(probes.len());
        for probe in probes {
            answers.push(probe.await.unwrap_or(false));
        }
        let healthy: Vec<&String> = self
            .endpoints
            .iter()
            .zip(&answers)
            .filter_map(|(endpoint, ok)| ok.then_some(endpoint))
            .collect();
        let removed = self.state().removed.clone();
        // With nobody answering there is nothing better to send to: every
        // endpoint stays (or goes back) in.
        let out: HashSet<String> = if healthy.is_empty() {
            HashSet::new()
        } else {
            self.endpoints
                .iter()
                .filter(|e| !healthy.contains(e))
                .cloned()
                .collect()
        };
        let mut taken_out = HashSet::new();
        for endpoint in out.difference(&removed) {
            match self.channel.remove_endpoint(endpoint).await {
                Ok(()) => {
                    tracing::warn!(endpoint = %endpoint, "etcd member does not answer; not sending it requests until it does");
                    taken_out.insert(endpoint.clone());
                }
                Err(e) => {
                    tracing::debug!(endpoint = %endpoint, error = %e, "could not take an etcd endpoint out")
                }
            }
        }
        let mut put_back = HashSet::new();
        for endpoint in removed.difference(&out) {
            match self.channel.add_endpoint(endpoint).await {
                Ok(()) => {
                    tracing::info!(endpoint = %endpoint, "etcd member answers again; sending it requests");
                    put_back.insert(endpoint.clone());
                }
                Err(e) => {
                    tracing::debug!(endpoint = %endpoint, error = %e, "could not put an etcd endpoint back; trying again at the next check")
                }
            }
        }
        let removed = still_removed(&removed, &taken_out, &put_back);
        let any_out = !removed.is_empty();
        self.state().removed = removed;
        any_out
    }
}

/// What is out of the channel after a check: what was out, plus what it
/// took out, minus what it put back. An endpoint whose removal or re-adding
/// failed keeps its old place, so the next check (every [`RECHECK`] while
/// anything is out) tries again, instead of being counted as moved.
fn still_removed(
    removed: &HashSet<String>,
    taken_out: &HashSet<String>,
    put_back: &HashSet<String>,
) -> HashSet<String> {
    removed
        .union(taken_out)
        .filter(|endpoint| !put_back.contains(*endpoint))
        .cloned()
        .collect()
}

/// Checks until every endpoint is in again (or the client is gone).
async fn check(health: Weak<Health>) {
    loop {
        let Some(this) = health.upgrade() else {
            return;
        };
        if !this.check_once().await {
            this.state().checking = false;
            return;
        }
        drop(this);
        tokio::time::sleep(RECHECK).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(items: &[&str]) -> HashSet<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    /// An endpoint whose re-adding failed stays out (and so is checked and
    /// added again), and one whose removal failed is not counted as out.
    #[test]
    fn failed_moves_keep_their_place() {
        let removed = set(&["a", "b"]);
        // "a" and "b" answer again; only "a" was put back. "c" stopped
        // answering, and taking it out failed.
        let after = still_removed(&removed, &set(&[]), &set(&["a"]));
        assert_eq!(after, set(&["b"]), "b is still out of the channel");
        let after = still_removed(&set(&[]), &set(&[]), &set(&[]));
        assert!(after.is_empty(), "c was never taken out");
        let after = still_removed(&set(&[]), &set(&["c"]), &set(&[]));
        assert_eq!(after, set(&["c"]));
    }
}
