//! [`EtcdConfig`]: endpoints, credentials and the shared client options,
//! from a URL or from code.
//!
//! Naming rule, as for every config type in distlock (see
//! [`ClientOptions`]): fields are private, a getter is named after its
//! setting (`user()`), a setter consumes and returns the config and is
//! named `with_` and the setting (`with_credentials(..)`).

use std::fmt;
use std::time::Duration;

use distlock_core::{ClientOptions, LockError, LockUrl};

use crate::SCHEMES;

/// The port used when an endpoint in the URL has none.
pub const DEFAULT_PORT: u16 = 2379;

/// The smallest lease etcd grants with its default settings is 2 s
/// (1.5 × the 1 s election timeout, rounded up); a server tuned for short
/// election timeouts grants 1 s. We ask for what the caller wants, rounded up
/// to whole seconds, and use the TTL the server reports.
pub(crate) const MIN_TTL: Duration = Duration::from_secs(1);

/// The TTL of the session lease a client's queue entries (its waiting
/// calls' places in line) go on. A client that froze or died keeps its
/// places this long at most, as a woken waiter's turn on the other backends
/// (5 s). The lease is kept alive every third of it whatever the handoff
/// rate, so each waiting client costs etcd 0.6 keep-alives a second (3
/// with a 1 s lease, which also needs an etcd tuned for short election
/// timeouts: a default one grants 2 s at least).
pub(crate) const WAITER_TTL: Duration = Duration::from_secs(5);

/// etcd's largest lease TTL (`MaxLeaseTTL`, 9 000 000 000 s); we cap lower,
/// at distlock-core's default of a year.
pub(crate) const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// How an [`EtcdLock`](crate::EtcdLock) reaches etcd.
///
/// Built from a URL with [`EtcdConfig::from_url`]:
///
/// - `etcd://[user:password@]host[:port][,host[:port]...][?parameters]`;
/// - `etcds://…`: the same over TLS, for every endpoint (cargo feature
///   `tls`). The server certificate must name the host as written in the
///   URL (DNS name or IP address).
///
/// User and password may be percent-encoded (`%40` for `@`, `%3A` for `:`).
/// Several endpoints of one cluster are separated by commas; the client
/// balances between them and fails over when one is unreachable. The port
/// defaults to 2379.
///
/// Query parameters (anything else, or a path, is a
/// [`Config`](distlock_core::ErrorKind::Config) error naming it):
///
/// | parameter | meaning | default |
/// |---|---|---|
/// | `namespace` | prefix of every key | `distlock` |
/// | `connect_timeout_ms` | connecting to the server | 5000 |
/// | `operation_timeout_ms` | one request's reply | 5000 |
/// | `tls_ca_file` | PEM CA certificates to trust in addition to the platform's roots (`etcds://` only) | |
/// | `tls_cert_file`, `tls_key_file` | PEM client certificate and its key, for etcd's `--client-cert-auth` (`etcds://` only) | |
///
/// `Debug` and `Display` never show the password.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::ClientOptions;
/// use distlock_etcd::EtcdConfig;
///
/// let config = EtcdConfig::from_url("etcd://locker:s3cret@10.0.0.1:2379,10.0.0.2?namespace=jobs")?;
/// assert_eq!(config.endpoints(), ["http://10.0.0.1:2379", "http://10.0.0.2:2379"]);
/// assert_eq!(config.user(), Some("locker"));
/// assert_eq!(config.client().namespace(), "jobs");
/// assert!(!config.to_string().contains("s3cret"));
///
/// let config = EtcdConfig::new(["127.0.0.1:2379"])
///     .with_credentials("locker", "s3cret")
///     .with_client(ClientOptions::default().with_operation_timeout(Duration::from_secs(2)));
/// assert_eq!(config.client().operation_timeout(), Duration::from_secs(2));
/// # Ok::<(), distlock_core::LockError>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    client: ClientOptions,
    endpoints: Vec<String>,
    credentials: Option<(String, String)>,
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("client", &self.client)
            .field("endpoints", &self.endpoints)
            .field("user", &self.user())
            .finish()
    }
}

impl fmt::Display for EtcdConfig {
    /// The URL without password or parameters.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.uses_tls() {
            "etcds://"
        } else {
            "etcd://"
        })?;
        if let Some(user) = self.user() {
            write!(f, "{user}:***@")?;
        }
        let hosts: Vec<&str> = self
            .endpoints
            .iter()
            .map(|e| e.split_once("://").map_or(e.as_str(), |(_, host)| host))
            .collect();
        f.write_str(&hosts.join(","))
    }
}

impl EtcdConfig {
    /// A config for the given endpoints (`host:port`, `http://host:port`, or
    /// `https://host:port` for TLS, with the files in
    /// [`ClientOptions::tls`]), no
    /// authentication, default namespace and timeouts.
    pub fn new<I, S>(endpoints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            client: ClientOptions::default(),
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
            credentials: None,
        }
    }

    /// Parses an `etcd://` or `etcds://` URL (see the type's
    /// documentation).
    pub fn from_url(url: &str) -> Result<Self, LockError> {
        let mut url = LockUrl::parse(url)?;
        url.expect_scheme("etcd", SCHEMES)?;
        let scheme = if url.scheme() == "etcds" {
            "https"
        } else {
            "http"
        };
        let client = url.take_client_options()?;
        if !url.path().is_empty() {
            return Err(LockError::config(format!(
                "{url} has a path; etcd URLs have none: etcd://host:port[,host:port...]"
            )));
        }
        if url.hosts().is_empty() {
            return Err(LockError::config(
                "no etcd endpoint given; use etcd://host:port[,host:port...]",
            ));
        }
        let credentials = match (url.username(), url.password()) {
            (None, None) => None,
            (Some(user), password) => Some((user.to_owned(), password.unwrap_or("").to_owned())),
            (None, Some(_)) => return Err(LockError::config(
                "the etcd URL has a password but no user name; use etcd://user:password@host:port",
            )),
        };
        let endpoints = url
            .hosts()
            .iter()
            .map(|host| format!("{scheme}://{}", host.address(DEFAULT_PORT)))
            .collect();
        url.finish()?;
        let config = Self {
            client,
            endpoints,
            credentials,
        };
        config.validate()?;
        Ok(config)
    }

    /// Namespace, timeouts and TLS files.
    pub fn client(&self) -> &ClientOptions {
        &self.client
    }

    /// Sets the [namespace, timeouts and TLS files](Self::client).
    pub fn with_client(mut self, client: ClientOptions) -> Self {
        self.client = client;
        self
    }

    /// Authenticates as `user` with `password` (read back with
    /// [`user`](Self::user); the password is never shown).
    pub fn with_credentials(
        mut self,
        user: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        self.credentials = Some((user.into(), password.into()));
        self
    }

    /// The endpoints, as `http://host:port` (`https://` with TLS).
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Whether the client speaks TLS (`etcds://`, `https://` endpoints).
    pub fn uses_tls(&self) -> bool {
        self.endpoints.iter().any(|e| e.starts_with("https://"))
    }

    /// The user name, if the client authenticates.
    pub fn user(&self) -> Option<&str> {
        self.credentials.as_ref().map(|(name, _)| name.as_str())
    }

    pub(crate) fn credentials(&self) -> Option<&(String, String)> {
        self.credentials.as_ref()
    }

    /// Checks endpoints, TLS settings and client options.
    pub fn validate(&self) -> Result<(), LockError> {
        self.client.validate()?;
        if self.endpoints.is_empty() {
            return Err(LockError::config(
                "no etcd endpoint given; use etcd://host:port",
            ));
        }
        if self.uses_tls() {
            if self.endpoints.iter().any(|e| !e.starts_with("https://")) {
                return Err(LockError::config(format!(
                    "etcd endpoints {} mix TLS and plaintext; use https:// for every endpoint (etcds://) or for none",
                    self.endpoints.join(",")
                )));
            }
            if !cfg!(feature = "tls") {
                return Err(LockError::config(
                    "etcds:// (TLS) needs the `tls` cargo feature of distlock-etcd (the `tls` feature of distlock); enable it or use etcd://",
                ));
            }
        } else if !self.client.tls().is_empty() {
            return Err(LockError::config(
                "tls_ca_file, tls_cert_file and tls_key_file are for TLS connections; use etcds://host:port (TLS for every endpoint)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlock_core::ErrorKind;
    use std::time::Duration;

    #[test]
    fn parses_urls() {
        let c = EtcdConfig::from_url("etcd://127.0.0.1:2380").unwrap();
        assert_eq!(c.endpoints(), ["http://127.0.0.1:2380"]);
        assert_eq!(c.user(), None);

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
        assert_eq!(c.client().operation_timeout(), Duration::from_millis(9));
        assert!(!format!("{c:?}").contains("p:w"));
        assert!(!c.to_string().contains("p:w"));
        assert_eq!(c.to_string(), "etcd://u@x:***@h1:2379,h2:1,[::1]:5");
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
        let err = EtcdConfig::from_url("etcd://h?namspace=x").unwrap_err();
        assert!(err.to_string().contains("namspace"), "{err}");
        // TLS files belong to etcds:// URLs.
        let err = EtcdConfig::from_url("etcd://h?tls_ca_file=/ca.pem").unwrap_err();
        assert!(err.to_string().contains("etcds://"), "{err}");
        // TLS for every endpoint or none.
        let err = EtcdConfig::new(["https://h1:1", "http://h2:2"])
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("mix TLS and plaintext"), "{err}");
    }

    #[cfg(feature = "tls")]
    #[test]
    fn etcds_is_tls_for_every_endpoint() {
        let c = EtcdConfig::from_url(
            "etcds://u:pw@h1,h2:1?tls_ca_file=/ca.pem&tls_cert_file=/c.pem&tls_key_file=/k.pem",
        )
        .unwrap();
        assert_eq!(c.endpoints(), ["https://h1:2379", "https://h2:1"]);
        assert!(c.uses_tls());
        assert_eq!(
            c.client().tls().ca_file(),
            Some(std::path::Path::new("/ca.pem"))
        );
        assert_eq!(c.to_string(), "etcds://u:***@h1:2379,h2:1");
        let err = EtcdConfig::from_url("etcds://h?tls_cert_file=/c.pem").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("tls_key_file"), "{err}");
    }

    #[cfg(not(feature = "tls"))]
    #[test]
    fn etcds_needs_the_tls_feature() {
        let err = EtcdConfig::from_url("etcds://h").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("`tls` cargo feature"), "{err}");
    }
}
