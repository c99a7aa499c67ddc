//! Settings every backend client shares: namespace and timeouts, from code or
//! from the URL's query string.

use std::future::Future;
use std::time::Duration;

use crate::LockError;

/// The namespace every backend uses unless told otherwise.
pub const DEFAULT_NAMESPACE: &str = "distlock";

/// Namespace and timeouts of a backend client.
///
/// Every backend config embeds them, and every backend accepts them in its
/// URL's query string (see [`LockUrl::take_client_options`](crate::LockUrl::take_client_options)):
/// `namespace=NAME`, `connect_timeout_ms=N`, `operation_timeout_ms=N`.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::ClientOptions;
/// let options = ClientOptions::default()
///     .namespace("jobs")
///     .operation_timeout(Duration::from_millis(250));
/// options.validate()?;
/// assert_eq!(options.connect_timeout, Duration::from_secs(5));
/// # Ok::<(), distlock_core::LockError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions {
    /// Prefix of every key, table row or channel the client touches; nothing
    /// outside it is read or written. Default `distlock`.
    pub namespace: String,
    /// How long to wait for a connection to the server. Default 5 s.
    pub connect_timeout: Duration,
    /// How long to wait for one request's reply. Default 5 s.
    pub operation_timeout: Duration,
    /// Extra trusted CA and client certificate for TLS connections (used
    /// by TLS URLs only; see [`TlsFiles`](crate::TlsFiles)).
    pub tls: crate::TlsFiles,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            namespace: DEFAULT_NAMESPACE.to_owned(),
            connect_timeout: Duration::from_secs(5),
            operation_timeout: Duration::from_secs(5),
            tls: crate::TlsFiles::default(),
        }
    }
}

impl ClientOptions {
    /// Sets the namespace.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// Sets the connect timeout.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets the operation timeout.
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// Checks the namespace (non-empty, at most 64 bytes of ASCII letters,
    /// digits, `_`, `-`, `.`) and the timeouts (non-zero).
    pub fn validate(&self) -> Result<(), LockError> {
        let ns = &self.namespace;
        if ns.is_empty()
            || ns.len() > 64
            || !ns
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        {
            return Err(LockError::config(format!(
                "namespace {ns:?} is invalid: use 1 to 64 ASCII letters, digits, '_', '-' or '.'"
            )));
        }
        if self.connect_timeout.is_zero() || self.operation_timeout.is_zero() {
            return Err(LockError::config("timeouts must be greater than zero"));
        }
        self.tls.validate()?;
        Ok(())
    }

    /// Runs one server request under the operation timeout.
    pub async fn timed<T>(
        &self,
        what: &str,
        request: impl Future<Output = Result<T, LockError>>,
    ) -> Result<T, LockError> {
        with_timeout(self.operation_timeout, what, request).await
    }
}

/// Runs `request`, turning an overrun of `timeout` into an
/// [`ErrorKind::Timeout`](crate::ErrorKind) error naming `what`.
pub async fn with_timeout<T>(
    timeout: Duration,
    what: &str,
    request: impl Future<Output = Result<T, LockError>>,
) -> Result<T, LockError> {
    match tokio::time::timeout(timeout, request).await {
        Ok(result) => result,
        Err(_) => Err(LockError::timeout(format!(
            "{what} got no reply within {timeout:?}; the server may be down or overloaded"
        ))),
    }
}
