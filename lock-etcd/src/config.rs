//! [`EtcdConfig`]: endpoints, credentials, namespace and timeouts, from a URL
//! or from code.

use std::fmt;
use std::time::Duration;

use lock_core::{ClientOptions, LockError};

/// The port used when an endpoint in the URL has none.
pub const DEFAULT_PORT: u16 = 2379;

/// How a [`EtcdLock`](crate::EtcdLock) reaches etcd.
///
/// Built from a URL with [`EtcdConfig::from_url`]:
///
/// `etcd://[user:password@]host[:port][,host[:port]...][?namespace=N&connect_timeout_ms=N&operation_timeout_ms=N]`
///
/// User and password may be percent-encoded (`%40` for `@`, `%3A` for `:`).
/// Several endpoints of one cluster are separated by commas; the client
/// balances between them. The port defaults to 2379. TLS (`etcds://`) is not
/// supported by this build.
///
/// ```
/// use std::time::Duration;
/// use lock_etcd::EtcdConfig;
///
/// let config = EtcdConfig::from_url("etcd://locker:s3cret@10.0.0.1:2379,10.0.0.2?namespace=jobs")?;
/// assert_eq!(config.endpoints(), ["http://10.0.0.1:2379", "http://10.0.0.2:2379"]);
/// assert_eq!(config.user_name(), Some("locker"));
/// assert_eq!(config.options().namespace, "jobs");
///
/// let config = EtcdConfig::new(["127.0.0.1:2379"]).operation_timeout(Duration::from_secs(2));
/// assert_eq!(config.options().operation_timeout, Duration::from_secs(2));
/// # Ok::<(), lock_core::LockError>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    endpoints: Vec<String>,
    user: Option<(String, String)>,
    options: ClientOptions,
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("user", &self.user.as_ref().map(|(name, _)| name))
            .field("options", &self.options)
            .finish()
    }
}

impl EtcdConfig {
    /// A config for the given endpoints (`host:port` or `http://host:port`),
    /// no authentication, default namespace and timeouts.
    pub fn new<I, S>(endpoints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            endpoints: endpoints
                .into_iter()
                .map(|e| {
                    let e = e.into();
                    if e.contains("://") {
                        e
                    } else {
                        format!("http://{e}")
                    }
                })
                .collect(),
            user: None,
            options: ClientOptions::default(),
        }
    }

    /// Parses an `etcd://` URL (see the type's documentation).
    pub fn from_url(url: &str) -> Result<Self, LockError> {
        let (url, options) = ClientOptions::from_url(url)?;
        let Some(rest) = url.strip_prefix("etcd://") else {
            let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or("");
            return Err(LockError::config(format!(
                "unsupported URL scheme {scheme:?} for etcd; use etcd://host:port[,host:port...] (TLS is not supported by this build)"
            )));
        };
        if let Some((_, query)) = rest.split_once('?') {
            return Err(LockError::config(format!(
                "unknown etcd URL parameter(s) {query:?}; supported: namespace, connect_timeout_ms, operation_timeout_ms"
            )));
        }
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        let (user, hosts) = match rest.rsplit_once('@') {
            Some((userinfo, hosts)) => {
                let (name, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
                let name = percent_decode(name)?;
                let password = percent_decode(password)?;
                if name.is_empty() {
                    return Err(LockError::config(
                        "the etcd URL has credentials but an empty user name; use etcd://user:password@host:port",
                    ));
                }
                (Some((name, password)), hosts)
            }
            None => (None, rest),
        };
        let mut endpoints = Vec::new();
        for host in hosts.split(',') {
            endpoints.push(parse_endpoint(host)?);
        }
        Ok(Self {
            endpoints,
            user,
            options,
        })
    }

    /// Authenticates as `name` with `password`.
    pub fn user(mut self, name: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some((name.into(), password.into()));
        self
    }

    /// Sets the namespace (the key prefix; default `distlock`).
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.options = self.options.namespace(namespace);
        self
    }

    /// Sets how long connecting (and authenticating) may take.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.options = self.options.connect_timeout(timeout);
        self
    }

    /// Sets how long one request may take.
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.options = self.options.operation_timeout(timeout);
        self
    }

    /// Replaces namespace and timeouts at once.
    pub fn with_options(mut self, options: ClientOptions) -> Self {
        self.options = options;
        self
    }

    /// The endpoints, as `http://host:port`.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The user name, if the client authenticates.
    pub fn user_name(&self) -> Option<&str> {
        self.user.as_ref().map(|(name, _)| name.as_str())
    }

    pub(crate) fn credentials(&self) -> Option<&(String, String)> {
        self.user.as_ref()
    }

    /// Namespace and timeouts.
    pub fn options(&self) -> &ClientOptions {
        &self.options
    }

    /// Checks endpoints and options.
    pub fn validate(&self) -> Result<(), LockError> {
        self.options.validate()?;
        if self.endpoints.is_empty() {
            return Err(LockError::config(
                "no etcd endpoint given; use etcd://host:port",
            ));
        }
        Ok(())
    }
}

fn parse_endpoint(host: &str) -> Result<String, LockError> {
    if host.is_empty() {
        return Err(LockError::config(
            "the etcd URL has an empty host; use etcd://host:port[,host:port...]",
        ));
    }
    if host.contains('/') || host.contains('@') {
        return Err(LockError::config(format!(
            "invalid etcd endpoint {host:?}; use host:port without a path"
        )));
    }
    // `[::1]:2379`, `[::1]`, `host:2379` or `host`.
    let (name, port) = if let Some(v6) = host.strip_prefix('[') {
        match v6.split_once(']') {
            Some((addr, "")) => (format!("[{addr}]"), None),
            Some((addr, port)) => match port.strip_prefix(':') {
                Some(port) => (format!("[{addr}]"), Some(port)),
                None => return Err(LockError::config(format!("invalid etcd endpoint {host:?}"))),
            },
            None => {
                return Err(LockError::config(format!(
                    "invalid etcd endpoint {host:?}: unclosed '['"
                )))
            }
        }
    } else {
        match host.split_once(':') {
            Some((name, port)) => (name.to_owned(), Some(port)),
            None => (host.to_owned(), None),
        }
    };
    if name.is_empty() || name == "[]" {
        return Err(LockError::config(format!(
            "invalid etcd endpoint {host:?}: empty host name"
        )));
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(port) => port
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| {
                LockError::config(format!("invalid port {port:?} in etcd endpoint {host:?}"))
            })?,
    };
    Ok(format!("http://{name}:{port}"))
}

fn percent_decode(text: &str) -> Result<String, LockError> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    LockError::config("bad percent-encoding in the etcd URL's user or password")
                })?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| {
        LockError::config("the etcd URL's user or password is not UTF-8 after percent-decoding")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use lock_core::ErrorKind;

    #[test]
    fn parses_urls() {
        let c = EtcdConfig::from_url("etcd://127.0.0.1:2380").unwrap();
        assert_eq!(c.endpoints(), ["http://127.0.0.1:2380"]);
        assert_eq!(c.user_name(), None);

        let c =
            EtcdConfig::from_url("etcd://u%40x:p%3Aw:d@h1,h2:1,[::1]:5/?operation_timeout_ms=9")
                .unwrap();
        assert_eq!(
            c.endpoints(),
            ["http://h1:2379", "http://h2:1", "http://[::1]:5"]
        );
        assert_eq!(
            c.credentials(),
            Some(&("u@x".to_owned(), "p:w:d".to_owned()))
        );
        assert_eq!(c.options().operation_timeout, Duration::from_millis(9));
        assert!(!format!("{c:?}").contains("p:w"));
    }

    #[test]
    fn rejects_bad_urls() {
        for url in [
            "redis://h:1",
            "etcd://",
            "etcd://h:0",
            "etcd://h:x",
            "etcd://h,,g",
            "etcd://h/path",
            "etcd://h?foo=1",
            "etcd://:pw@h",
            "etcd://u:%zz@h",
            "etcd://h?namespace=a/b",
        ] {
            let err = EtcdConfig::from_url(url).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{url}");
        }
    }
}
