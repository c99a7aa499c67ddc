//! Settings every backend client shares: namespace and timeouts, from code or
//! from the URL's query string.

use std::future::Future;
use std::time::Duration;

use crate::LockError;

/// The namespace every backend uses unless told otherwise.
pub const DEFAULT_NAMESPACE: &str = "distlock";

/// Namespace and timeouts of a backend client.
///
/// Every backend accepts them in its URL's query string, so a URL alone
/// configures a client: `namespace=NAME`, `connect_timeout_ms=N`,
/// `operation_timeout_ms=N`. Other parameters are left for the driver.
///
/// ```
/// use std::time::Duration;
/// use lock_core::ClientOptions;
/// let (url, options) = ClientOptions::from_url("redis://127.0.0.1:6379/0?namespace=jobs&operation_timeout_ms=250")?;
/// assert_eq!(url, "redis://127.0.0.1:6379/0");
/// assert_eq!(options.namespace, "jobs");
/// assert_eq!(options.operation_timeout, Duration::from_millis(250));
/// # Ok::<(), lock_core::LockError>(())
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
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            namespace: DEFAULT_NAMESPACE.to_owned(),
            connect_timeout: Duration::from_secs(5),
            operation_timeout: Duration::from_secs(5),
        }
    }
}

impl ClientOptions {
    /// Splits distlock's own query parameters off `url`; returns the URL the
    /// driver should see and the options.
    pub fn from_url(url: &str) -> Result<(String, Self), LockError> {
        let mut options = Self::default();
        let Some((base, query)) = url.split_once('?') else {
            return Ok((url.to_owned(), options));
        };
        let mut rest = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            match name {
                "namespace" => options.namespace = value.to_owned(),
                "connect_timeout_ms" => options.connect_timeout = parse_ms(name, value)?,
                "operation_timeout_ms" => options.operation_timeout = parse_ms(name, value)?,
                _ => rest.push(pair),
            }
        }
        options.validate()?;
        let url = if rest.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", rest.join("&"))
        };
        Ok((url, options))
    }

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

fn parse_ms(name: &str, value: &str) -> Result<Duration, LockError> {
    value
        .parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|_| {
            LockError::config(format!(
                "URL parameter {name}={value:?} is not a whole number of milliseconds"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_driver_parameters() {
        let (url, options) =
            ClientOptions::from_url("postgres://u@h/db?sslmode=disable&namespace=x").unwrap();
        assert_eq!(url, "postgres://u@h/db?sslmode=disable");
        assert_eq!(options.namespace, "x");
        assert!(ClientOptions::from_url("redis://h/?namespace=a:b").is_err());
        assert!(ClientOptions::from_url("redis://h/?connect_timeout_ms=soon").is_err());
    }
}
