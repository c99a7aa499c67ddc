//! Mapping etcd client errors to [`LockError`] kinds, and telling what a
//! failed request says about sending it again (see [`crate::requests`]).

use std::error::Error as StdError;

use distlock_core::{request_message, LockError};

/// gRPC status code `PERMISSION_DENIED` (from the gRPC spec).
const PERMISSION_DENIED: i32 = 7;
/// gRPC status code `UNAUTHENTICATED`.
const UNAUTHENTICATED: i32 = 16;
/// gRPC status code `INVALID_ARGUMENT`.
const INVALID_ARGUMENT: i32 = 3;
/// gRPC status code `RESOURCE_EXHAUSTED`.
const RESOURCE_EXHAUSTED: i32 = 8;

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
pub(crate) enum Failure {
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

pub(crate) fn failure(error: &etcd_client::Error) -> Failure {
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
        return Some(LockError::unavailable(request_message(
            what,
            "the server closed the connection during the TLS handshake; it does not seem to serve TLS on this port (use etcd:// for a plaintext port)",
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

/// Maps a driver error from the request `what` (empty inside a lock call,
/// see [`request_message`]) to a [`LockError`]:
/// authentication failures, refused permissions and refused certificates
/// are configuration errors that say what to check, bad arguments are
/// configuration errors, and everything about reaching the server is
/// `Unavailable`.
pub(crate) fn map(error: etcd_client::Error, what: &str) -> LockError {
    if is_auth_failure(&error) {
        let message = format!(
            "etcd authentication failed; check the user and password in the URL (etcd://user:password@host:port): {error}"
        );
        return LockError::config(request_message(what, message)).with_source(error);
    }
    if let Some(diagnosed) = diagnosis(what, &error) {
        return diagnosed.with_source(error);
    }
    if is_out_of_space(&error) {
        // Unavailable: waits go on, and succeed once an operator freed
        // space (releases, which only delete, still go through).
        let message = format!(
            "etcd's database is full (it reached its space quota, --quota-backend-bytes, and raised the NOSPACE alarm), so it refuses every write that adds data until an operator frees space: compact its history (etcdctl compact <revision>), defragment it (etcdctl defrag) and disarm the alarm (etcdctl alarm disarm); run etcd with --auto-compaction-retention so the old revisions every lock and wait leaves are reclaimed ({error})"
        );
        return LockError::unavailable(request_message(what, message)).with_source(error);
    }
    if is_too_many_ops(&error) {
        // Final, not transient: the same transaction is refused again.
        let message = format!(
            "etcd refused a transaction with more operations than its --max-txn-ops allows; distlock needs at least {MIN_TXN_OPS} (etcd's default is 128): raise --max-txn-ops on the server ({error})"
        );
        return LockError::config(request_message(what, message)).with_source(error);
    }
    let (kind, message): (fn(String) -> LockError, String) = match &error {
        etcd_client::Error::GRpcStatus(status) if status.code() as i32 == PERMISSION_DENIED => (
            LockError::config,
            format!("etcd denied permission; grant the user's role readwrite on the lock namespace prefix: {error}"),
        ),
        etcd_client::Error::InvalidArgs(_)
        | etcd_client::Error::InvalidUri(_)
        | etcd_client::Error::EndpointError(_)
        | etcd_client::Error::InvalidMetadataValue(_)
        | etcd_client::Error::TransportError(_) => (
            LockError::config,
            format!("invalid etcd client configuration: {error}"),
        ),
        _ => (
            LockError::unavailable,
            format!("etcd request failed: {error}"),
        ),
    };
    kind(request_message(what, message)).with_source(error)
}

/// The fewest operations per transaction (etcd's `--max-txn-ops`) that
/// every distlock request fits in.
pub(crate) const MIN_TXN_OPS: usize = 8;

/// Whether `error` is etcd refusing a transaction of more operations than
/// its `--max-txn-ops`.
pub(crate) fn is_too_many_ops(error: &etcd_client::Error) -> bool {
    matches!(error, etcd_client::Error::GRpcStatus(status)
        if status.code() as i32 == INVALID_ARGUMENT
            && status.message().contains("too many operations in txn request"))
}

/// Whether `error` is etcd refusing a write because its database is
/// full (the `NOSPACE` alarm: "mvcc: database space exceeded").
pub(crate) fn is_out_of_space(error: &etcd_client::Error) -> bool {
    matches!(error, etcd_client::Error::GRpcStatus(status)
        if status.code() as i32 == RESOURCE_EXHAUSTED
            && status.message().contains("database space exceeded"))
}

/// A closure for `map_err` that maps errors of the request `what`.
pub(crate) fn mapper(what: &'static str) -> impl Fn(etcd_client::Error) -> LockError {
    move |error| map(error, what)
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlock_core::{ErrorKind, IN_LOCK_CALL};

    /// A transaction above the server's `--max-txn-ops` is a
    /// configuration error (refused again if resent), naming the setting.
    #[test]
    fn too_many_operations_names_the_server_setting() {
        let refused = etcd_client::Error::GRpcStatus(tonic::Status::new(
            tonic::Code::InvalidArgument,
            "etcdserver: too many operations in txn request",
        ));
        assert!(is_too_many_ops(&refused));
        assert_eq!(failure(&refused), Failure::Final);
        let mapped = map(refused, IN_LOCK_CALL);
        assert_eq!(mapped.kind(), ErrorKind::Config);
        assert!(mapped.message().contains("--max-txn-ops"), "{mapped}");
        let other = etcd_client::Error::GRpcStatus(tonic::Status::new(
            tonic::Code::InvalidArgument,
            "etcdserver: key is not provided",
        ));
        assert!(!is_too_many_ops(&other));
    }

    /// A full database (etcd's `NOSPACE` alarm) says what an operator
    /// does about it; the request was refused, not applied.
    #[test]
    fn a_full_database_names_what_frees_space() {
        let full = etcd_client::Error::GRpcStatus(tonic::Status::new(
            tonic::Code::ResourceExhausted,
            "etcdserver: mvcc: database space exceeded",
        ));
        assert!(is_out_of_space(&full));
        assert_eq!(failure(&full), Failure::Final);
        let mapped = map(full, IN_LOCK_CALL);
        assert_eq!(mapped.kind(), ErrorKind::Unavailable);
        for needed in [
            "--quota-backend-bytes",
            "compact",
            "alarm disarm",
            "--auto-compaction-retention",
        ] {
            assert!(mapped.message().contains(needed), "{needed}: {mapped}");
        }
        let other = etcd_client::Error::GRpcStatus(tonic::Status::new(
            tonic::Code::ResourceExhausted,
            "grpc: received message larger than max",
        ));
        assert!(!is_out_of_space(&other));
    }

    /// Inside a lock call the message is the failure alone (the client
    /// names the call); elsewhere it starts with the request.
    #[test]
    fn only_requests_outside_lock_calls_are_named() {
        let bad = || etcd_client::Error::InvalidArgs("no endpoints".to_owned());
        let in_call = map(bad(), IN_LOCK_CALL);
        assert_eq!(in_call.kind(), ErrorKind::Config);
        assert!(
            in_call
                .message()
                .starts_with("invalid etcd client configuration"),
            "{in_call}"
        );
        let other = map(bad(), "granting a lease");
        assert!(
            other
                .message()
                .starts_with("granting a lease: invalid etcd client configuration"),
            "{other}"
        );
    }
}
