//! Settings every backend client shares: namespace and timeouts, from code or
//! from the URL's query string.
//!
//! Naming rule of every config and options type in distlock (this one, the
//! backends' `RedisConfig`, `EtcdConfig`, `PostgresConfig`, and
//! `LockOptions`): fields are private; a getter is named after its setting,
//! without `get_` (`namespace()`); a setter consumes and returns the value
//! and is named `with_` and the setting (`with_namespace(..)`). The same
//! setting has the same name in every backend and in the URL parameter
//! (`retry_interval` and `retry_interval_ms`, `user` and `password`).

use std::future::Future;
use std::time::Duration;

use crate::LockError;

/// The namespace every backend uses unless told otherwise.
pub const DEFAULT_NAMESPACE: &str = "distlock";

/// The longest connect or operation timeout a client accepts (one hour):
/// far above any real need, and far below what deadline arithmetic on
/// `Instant` can overflow on.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

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
///     .with_namespace("jobs")
///     .with_operation_timeout(Duration::from_millis(250));
/// options.validate()?;
/// assert_eq!(options.namespace(), "jobs");
/// assert_eq!(options.connect_timeout(), Duration::from_secs(5));
/// # Ok::<(), distlock_core::LockError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions {
    namespace: String,
    connect_timeout: Duration,
    operation_timeout: Duration,
    tls: crate::TlsFiles,
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
    /// Prefix of every key, table row or channel the client touches; nothing
    /// outside it is read or written. Default `distlock`.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// How long to wait for a connection to the server. Default 5 s.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// How long to wait for one request's reply. Default 5 s.
    pub fn operation_timeout(&self) -> Duration {
        self.operation_timeout
    }

    /// Extra trusted CA and client certificate for TLS connections (used
    /// by TLS URLs only; see [`TlsFiles`](crate::TlsFiles)).
    pub fn tls(&self) -> &crate::TlsFiles {
        &self.tls
    }

    /// Sets the [namespace](Self::namespace).
    pub fn with_namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// Sets the [connect timeout](Self::connect_timeout).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets the [operation timeout](Self::operation_timeout).
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// Sets the [TLS files](Self::tls).
    pub fn with_tls(mut self, tls: crate::TlsFiles) -> Self {
        self.tls = tls;
        self
    }

    /// Checks the namespace (non-empty, at most 64 bytes of ASCII letters,
    /// digits, `_`, `-`, `.`) and the timeouts (non-zero, at most
    /// [`MAX_TIMEOUT`]); a [`ErrorKind::Config`](crate::ErrorKind) error
    /// names the setting.
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
        for (name, timeout) in [
            ("connect_timeout", self.connect_timeout),
            ("operation_timeout", self.operation_timeout),
        ] {
            if timeout.is_zero() {
                return Err(LockError::config(format!(
                    "{name} must be greater than zero (URL parameter {name}_ms)"
                )));
            }
            if timeout > MAX_TIMEOUT {
                return Err(LockError::config(format!(
                    "{name} of {timeout:?} is above the maximum of {MAX_TIMEOUT:?}; use at most {} ms (URL parameter {name}_ms)",
                    MAX_TIMEOUT.as_millis()
                )));
            }
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
/// [`ErrorKind::Timeout`](crate::ErrorKind) error naming `what` (see
/// [`request_message`](crate::request_message)).
pub async fn with_timeout<T>(
    timeout: Duration,
    what: &str,
    request: impl Future<Output = Result<T, LockError>>,
) -> Result<T, LockError> {
    match tokio::time::timeout(timeout, request).await {
        Ok(result) => result,
        Err(_) => Err(LockError::timeout(crate::request_message(
            what,
            format_args!("no reply within {timeout:?}; the server may be down or overloaded"),
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ErrorKind, LockUrl};

    /// Zero and huge timeouts, set in code or in the URL, are Config errors
    /// naming the setting; the largest accepted one works.
    #[test]
    fn timeouts_are_bounded_and_named() {
        let huge = Duration::from_secs(u64::MAX);
        for (options, name) in [
            (
                ClientOptions::default().with_connect_timeout(huge),
                "connect_timeout",
            ),
            (
                ClientOptions::default().with_operation_timeout(huge),
                "operation_timeout",
            ),
            (
                ClientOptions::default()
                    .with_connect_timeout(MAX_TIMEOUT + Duration::from_millis(1)),
                "connect_timeout",
            ),
            (
                ClientOptions::default().with_operation_timeout(Duration::ZERO),
                "operation_timeout",
            ),
        ] {
            let err = options.validate().unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config);
            assert!(err.to_string().contains(name), "{err}");
        }
        ClientOptions::default()
            .with_connect_timeout(MAX_TIMEOUT)
            .with_operation_timeout(MAX_TIMEOUT)
            .validate()
            .unwrap();
        for (url, name) in [
            (
                "redis://h?connect_timeout_ms=18446744073709551615",
                "connect_timeout",
            ),
            (
                "redis://h?operation_timeout_ms=3600001",
                "operation_timeout",
            ),
            ("redis://h?connect_timeout_ms=0", "connect_timeout"),
        ] {
            let err = LockUrl::parse(url)
                .unwrap()
                .take_client_options()
                .unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{url}");
            assert!(err.to_string().contains(name), "{url}: {err}");
        }
    }

    /// A call under the largest timeout starts and finishes (no `Instant`
    /// overflow anywhere on the way).
    #[tokio::test]
    async fn largest_timeout_runs() {
        let options = ClientOptions::default().with_operation_timeout(MAX_TIMEOUT);
        assert_eq!(options.timed("a call", async { Ok(7) }).await.unwrap(), 7);
        assert_eq!(
            with_timeout(Duration::MAX, "a call", async { Ok(8) })
                .await
                .unwrap(),
            8
        );
    }
}
