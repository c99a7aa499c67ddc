//! Mapping etcd client errors to [`LockError`] kinds, and sending a request
//! again when it never reached a server.

use std::error::Error as StdError;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{ClientOptions, LockError};

use crate::health::Health;

/// gRPC status code `PERMISSION_DENIED` (from the gRPC spec).
const PERMISSION_DENIED: i32 = 7;
/// gRPC status code `UNAUTHENTICATED`.
const UNAUTHENTICATED: i32 = 16;

/// First pause before sending a request again that reached no server.
const FIRST_PAUSE: Duration = Duration::from_millis(10);
/// Longest such pause.
const MAX_PAUSE: Duration = Duration::from_millis(200);
/// A request that may be sent again gets this share of its time per try
/// (but at least [`MIN_ATTEMPT`]).
pub(crate) const ATTEMPTS: u32 = 3;
pub(crate) const MIN_ATTEMPT: Duration = Duration::from_millis(300);

/// Whether `error` says the user name or password was refused.
pub(crate) fn is_auth_failure(error: &etcd_client::Error) -> bool {
    match error {
        etcd_client::Error::GRpcStatus(status) => {
            status.code() as i32 == UNAUTHENTICATED
                || status.message().contains("authentication failed")
                || status.message().contains("invalid auth token")
                || status.message().contains("user name is empty")
        }
        _ => false,
    }
}

/// `error` and its causes, looking inside `io::Error`s (whose `source()`
/// skips the error they wrap, where rustls puts its verdict).
fn causes<'a>(error: &'a (dyn StdError + 'static)) -> Vec<&'a (dyn StdError + 'static)> {
    let mut found = Vec::new();
    let mut next = Some(error);
    while let Some(error) = next {
        found.push(error);
        next = match error
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn StdError + 'static)),
            None => error.source(),
        };
    }
    found
}

/// gRPC status code `CANCELLED` (a connection closed under a request).
const CANCELLED: i32 = 1;
/// gRPC status code `UNKNOWN` (a client-side transport failure).
const UNKNOWN: i32 = 2;
/// gRPC status code `UNAVAILABLE`.
const UNAVAILABLE: i32 = 14;

/// What a failed request tells about sending it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// It never left: the channel could not connect to the endpoint it
    /// picked (refused, unreachable, connect timeout). Another endpoint
    /// may take it.
    NeverSent,
    /// The member refused it before processing because it has no leader
    /// (the client sends etcd's require-leader flag): an election, or a
    /// member cut off from the others.
    NoLeader,
    /// It may or may not have taken effect: the connection broke under
    /// it, or the member answered "leader changed", "request timed out".
    Unknown,
    /// Anything else (refused certificates and TLS handshakes included):
    /// the same answer again.
    Final,
}

fn failure(error: &etcd_client::Error) -> Failure {
    let etcd_client::Error::GRpcStatus(status) = error else {
        return Failure::Final;
    };
    let code = status.code() as i32;
    let Some(source) = status.source() else {
        // An answer from a member.
        return if code == UNAVAILABLE && status.message().contains("etcdserver: no leader") {
            Failure::NoLeader
        } else if code == UNAVAILABLE {
            Failure::Unknown
        } else {
            Failure::Final
        };
    };
    let causes = causes(source);
    if causes.iter().any(|e| is_tls_failure(*e)) {
        Failure::Final
    } else if causes
        .iter()
        .any(|e| e.downcast_ref::<tonic::ConnectError>().is_some())
    {
        Failure::NeverSent
    } else if matches!(code, CANCELLED | UNKNOWN | UNAVAILABLE) {
        Failure::Unknown
    } else {
        Failure::Final
    }
}

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

/// Whether `error` is a TLS handshake failure (rustls' verdict, or the peer
/// closing the connection during the handshake).
fn is_tls_failure(error: &(dyn StdError + 'static)) -> bool {
    #[cfg(feature = "tls")]
    if error.downcast_ref::<rustls::Error>().is_some() {
        return true;
    }
    error.to_string().contains("tls handshake")
}

/// What a connection-level failure of `what` says about the setup, if
/// anything: a certificate verdict (a
/// [`Config`](distlock_core::ErrorKind::Config) error: trying again cannot
/// help), or a hint for a plaintext/TLS mismatch (`Unavailable`: the
/// server may only be restarting).
fn diagnosis(what: &str, error: &etcd_client::Error) -> Option<LockError> {
    let etcd_client::Error::GRpcStatus(status) = error else {
        return None;
    };
    let causes = causes(status.source()?);
    #[cfg(feature = "tls")]
    if let Some(tls) = causes
        .iter()
        .find_map(|e| e.downcast_ref::<rustls::Error>())
    {
        return Some(crate::tls::error(what, tls));
    }
    if causes
        .iter()
        .any(|e| e.to_string().contains("tls handshake eof"))
    {
        return Some(LockError::unavailable(format!(
            "{what}: the server closed the connection during the TLS handshake; it does not seem to serve TLS on this port (use etcd:// for a plaintext port)"
        )));
    }
    None
}

/// Whether `error` is a connection the peer closed (broken pipe, reset,
/// "connection closed"), with no gRPC status from the server. Against a TLS port this is what a plaintext client sees, and
/// against an etcd with `--client-cert-auth` what a TLS client sees whose
/// certificate the server refused after the handshake.
pub(crate) fn closed_by_peer(error: &etcd_client::Error) -> bool {
    let etcd_client::Error::GRpcStatus(status) = error else {
        return false;
    };
    let Some(source) = status.source() else {
        return false;
    };
    causes(source).iter().any(|e| {
        e.downcast_ref::<std::io::Error>().is_some_and(|io| {
            matches!(
                io.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            )
        }) || e.to_string() == "connection closed"
    })
}

/// Maps a driver error from the request `what` to a [`LockError`]:
/// authentication failures, refused permissions and refused certificates
/// are configuration errors that say what to check, bad arguments are
/// configuration errors, and everything about reaching the server is
/// `Unavailable`.
pub(crate) fn map(what: &str, error: etcd_client::Error) -> LockError {
    if is_auth_failure(&error) {
        let message = format!(
            "{what}: etcd authentication failed; check the user and password in the URL (etcd://user:password@host:port): {error}"
        );
        return LockError::config(message).with_source(error);
    }
    if let Some(diagnosed) = diagnosis(what, &error) {
        return diagnosed.with_source(error);
    }
    match &error {
        etcd_client::Error::GRpcStatus(status) if status.code() as i32 == PERMISSION_DENIED => {
            let message = format!(
                "{what}: etcd denied permission; grant the user's role readwrite on the lock namespace prefix: {error}"
            );
            LockError::config(message).with_source(error)
        }
        etcd_client::Error::InvalidArgs(_)
        | etcd_client::Error::InvalidUri(_)
        | etcd_client::Error::EndpointError(_)
        | etcd_client::Error::InvalidMetadataValue(_)
        | etcd_client::Error::TransportError(_) => LockError::config(format!(
            "{what}: invalid etcd client configuration: {error}"
        ))
        .with_source(error),
        _ => LockError::unavailable(format!("{what}: etcd request failed: {error}"))
            .with_source(error),
    }
}

/// A closure for `map_err` that maps errors of the request `what`.
pub(crate) fn mapper(what: &'static str) -> impl Fn(etcd_client::Error) -> LockError {
    move |error| map(what, error)
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
        }
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
                    Ok(Err(e)) => return Err(map(what, e)),
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
                    let error = LockError::timeout(format!(
                        "{what} got no answer within {:?} (last try: {error}); the etcd cluster may have no leader, or be down or overloaded",
                        millis(timeout)
                    ));
                    return Err(match last {
                        Some(last) => error.with_source(last),
                        None => error,
                    });
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
