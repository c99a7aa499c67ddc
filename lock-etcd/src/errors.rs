//! Mapping etcd client errors to [`LockError`] kinds.

use lock_core::LockError;

/// gRPC status code `PERMISSION_DENIED` (from the gRPC spec; read through
/// `etcd_client`'s error so no direct `tonic` dependency is needed).
const PERMISSION_DENIED: i32 = 7;
/// gRPC status code `UNAUTHENTICATED`.
const UNAUTHENTICATED: i32 = 16;

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

/// Maps a driver error from the request `what` to a [`LockError`]:
/// authentication failures and refused permissions are configuration errors
/// that say what to check, bad arguments are configuration errors, and
/// everything about reaching the server is `Unavailable`.
pub(crate) fn map(what: &str, error: etcd_client::Error) -> LockError {
    if is_auth_failure(&error) {
        let message = format!(
            "{what}: etcd authentication failed; check the user and password in the URL (etcd://user:password@host:port): {error}"
        );
        return LockError::config(message).with_source(error);
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
        | etcd_client::Error::InvalidMetadataValue(_) => LockError::config(format!(
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
