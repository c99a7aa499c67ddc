//! `RedisConfig`: server URL, namespace, timeouts, fencing-counter retention.

use std::fmt;
use std::time::Duration;

use lock_core::{ClientOptions, LockError};

/// How long a fencing counter outlives its last use, at least (see the crate
/// docs for why it may expire at all). Default one hour.
pub const DEFAULT_FENCE_RETENTION: Duration = Duration::from_secs(3600);

/// Settings of a [`RedisLock`](crate::RedisLock).
///
/// Built from a URL with [`RedisConfig::from_url`]; distlock's own query
/// parameters are taken off before the URL reaches the redis driver:
///
/// | parameter | meaning | default |
/// |---|---|---|
/// | `namespace` | prefix of every key and channel | `distlock` |
/// | `connect_timeout_ms` | connecting to the server | 5000 |
/// | `operation_timeout_ms` | one request's reply | 5000 |
/// | `fence_retention_ms` | minimum life of an idle fencing counter | 3600000 |
///
/// The URL itself is the redis crate's: `redis://[[user]:password@]host[:port][/db]`,
/// `rediss://…` for TLS (cargo feature `tls`), `unix:///path/to/redis.sock`.
///
/// ```
/// use std::time::Duration;
/// use lock_redis::RedisConfig;
/// let config = RedisConfig::from_url("redis://:pw@127.0.0.1:6379/0?namespace=jobs&operation_timeout_ms=250")?
///     .connect_timeout(Duration::from_secs(1));
/// assert_eq!(config.options().namespace, "jobs");
/// assert_eq!(config.options().operation_timeout, Duration::from_millis(250));
/// // The password never shows in Debug output.
/// assert!(!format!("{config:?}").contains("pw"));
/// # Ok::<(), lock_core::LockError>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    url: Option<String>,
    options: ClientOptions,
    fence_retention: Duration,
}

impl Default for RedisConfig {
    /// No URL (for [`RedisLock::from_connection_manager`](crate::RedisLock::from_connection_manager)),
    /// default options.
    fn default() -> Self {
        Self {
            url: None,
            options: ClientOptions::default(),
            fence_retention: DEFAULT_FENCE_RETENTION,
        }
    }
}

impl RedisConfig {
    /// Settings without a URL, for
    /// [`RedisLock::from_connection_manager`](crate::RedisLock::from_connection_manager).
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses `url`: checks the scheme and takes distlock's query parameters off.
    pub fn from_url(url: &str) -> Result<Self, LockError> {
        let (rest, options) = ClientOptions::from_url(url)?;
        let mut fence_retention = DEFAULT_FENCE_RETENTION;
        let driver_url = match rest.split_once('?') {
            None => rest,
            Some((base, query)) => {
                let mut kept = Vec::new();
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    match pair.split_once('=') {
                        Some(("fence_retention_ms", value)) => {
                            fence_retention = value.parse::<u64>().map(Duration::from_millis).map_err(|_| {
                                LockError::config(format!(
                                    "URL parameter fence_retention_ms={value:?} is not a whole number of milliseconds"
                                ))
                            })?;
                        }
                        _ => kept.push(pair),
                    }
                }
                if kept.is_empty() {
                    base.to_owned()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
        };
        check_scheme(&driver_url)?;
        Ok(Self {
            url: Some(driver_url),
            options,
            fence_retention,
        })
    }

    /// Sets the namespace (prefix of every key and channel).
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.options.namespace = namespace.into();
        self
    }

    /// Sets the connect timeout.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.options.connect_timeout = timeout;
        self
    }

    /// Sets the operation timeout (one request's reply).
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.options.operation_timeout = timeout;
        self
    }

    /// Sets the minimum time a fencing counter is kept after its last
    /// acquisition (it is always kept at least twice the lock's TTL). Tokens
    /// stay strictly increasing as long as the server's clock never steps
    /// back by more than this; see the crate docs.
    pub fn fence_retention(mut self, retention: Duration) -> Self {
        self.fence_retention = retention;
        self
    }

    /// Replaces namespace and timeouts.
    pub fn with_options(mut self, options: ClientOptions) -> Self {
        self.options = options;
        self
    }

    /// Namespace and timeouts.
    pub fn options(&self) -> &ClientOptions {
        &self.options
    }

    /// The fencing-counter retention.
    pub fn fence_retention_value(&self) -> Duration {
        self.fence_retention
    }

    /// The URL handed to the redis driver (distlock's parameters removed), if any.
    pub(crate) fn driver_url(&self) -> Option<&str> {
        self.url.as_deref()
    }

    /// Checks namespace, timeouts and retention.
    pub fn validate(&self) -> Result<(), LockError> {
        self.options.validate()?;
        if self.fence_retention.is_zero() {
            return Err(LockError::config(
                "fence_retention must be greater than zero",
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &self.url.as_deref().map(redact))
            .field("options", &self.options)
            .field("fence_retention", &self.fence_retention)
            .finish()
    }
}

/// The URL with its user info (user and password) replaced by `***`.
pub(crate) fn redact(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.rfind('@') {
            Some(at) if !rest[..at].contains('/') => format!("{scheme}://***@{}", &rest[at + 1..]),
            _ => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

fn check_scheme(url: &str) -> Result<(), LockError> {
    let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or("");
    match scheme {
        "redis" | "unix" | "redis+unix" => Ok(()),
        "rediss" if cfg!(feature = "tls") => Ok(()),
        "rediss" => Err(LockError::config(
            "rediss:// (TLS) needs the `tls` cargo feature of lock-redis (the `redis-tls` feature of distlock); enable it or use redis://",
        )),
        _ => Err(LockError::config(format!(
            "{} is not a redis URL; use redis://[user:password@]host[:port][/db], rediss://… or unix:///path",
            redact(url)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_strips_our_parameters() {
        let c = RedisConfig::from_url(
            "redis://u:p@127.0.0.1:1/2?namespace=x&fence_retention_ms=10&protocol=resp2",
        )
        .unwrap();
        assert_eq!(
            c.driver_url(),
            Some("redis://u:p@127.0.0.1:1/2?protocol=resp2")
        );
        assert_eq!(c.options().namespace, "x");
        assert_eq!(c.fence_retention_value(), Duration::from_millis(10));
        assert!(RedisConfig::from_url("http://h").is_err());
        assert!(RedisConfig::from_url("redis://h/?fence_retention_ms=x").is_err());
        #[cfg(not(feature = "tls"))]
        assert!(RedisConfig::from_url("rediss://h").is_err());
    }

    #[test]
    fn redacts_user_info() {
        assert_eq!(redact("redis://user:pw@h:1/0"), "redis://***@h:1/0");
        assert_eq!(redact("redis://h:1/0"), "redis://h:1/0");
    }
}
