//! [`RedisConfig`]: where the server is (one server, a primary found
//! through Sentinel, or a Redis Cluster: [`server`]), namespace and
//! timeouts, the fencing-counter retention and the replica acknowledgement.
//!
//! Naming rule, as for every config type in distlock (see
//! [`ClientOptions`]): fields are private, a getter is named after its
//! setting (`min_replicas()`), a setter consumes and returns the config and
//! is named `with_` and the setting (`with_min_replicas(1)`).

mod server;

use std::fmt;
use std::time::Duration;

use distlock_core::{check_fence_retention as check_retention, ClientOptions, LockError, LockUrl};
use redis::ConnectionInfo;

pub(crate) use self::server::{host_port, tcp_addr, ClusterServer, SentinelServer, Server};

/// The fencing-counter retention's default (one hour) and upper bound (365
/// days), shared with the PostgreSQL backend; see
/// [`RedisConfig::fence_retention`] and the crate docs,
/// [Fencing tokens](crate#fencing-tokens-without-a-key-per-lock-name-forever).
pub use distlock_core::{DEFAULT_FENCE_RETENTION, MAX_FENCE_RETENTION};

/// The Unix-socket schemes, which [`RedisConfig::from_url`] accepts beside
/// the facade's [`SCHEMES`](crate::SCHEMES).
const UNIX_SCHEMES: &[&str] = &["unix", "redis+unix"];

/// Settings of a [`RedisLock`](crate::RedisLock).
///
/// Built from a URL with [`RedisConfig::from_url`]:
///
/// - `redis://[[user]:password@]host[:port][/db]` (port 6379 by default,
///   database 0): one server;
/// - `redis+sentinel://[[user]:password@]sentinel[:port][,sentinel[:port]...]/SERVICE[/db]`
///   (sentinel port 26379 by default): the primary the sentinels monitor
///   as `SERVICE`, found again after a failover; the user and password are
///   the primary's;
/// - `redis+cluster://[[user]:password@]host[:port][,host[:port]...]`: a
///   Redis Cluster, reached through any of the listed nodes (database 0
///   only, as Redis Cluster has no other);
/// - `rediss://…`, `rediss+sentinel://…`, `rediss+cluster://…`: the same
///   over TLS (cargo feature `tls`), to the sentinels too;
/// - `unix:///path/to/redis.sock` or `redis+unix:///path/to/redis.sock`,
///   with the database, user and password as the `db`, `user` and
///   `password` parameters (or the password as `unix://:password@/path`).
///
/// Query parameters (anything else is a
/// [`Config`](distlock_core::ErrorKind::Config) error naming it):
///
/// | parameter | meaning | default |
/// |---|---|---|
/// | `namespace` | prefix of every key and channel | `distlock` |
/// | `connect_timeout_ms` | connecting to the server | 5000 |
/// | `operation_timeout_ms` | one request's reply | 5000 |
/// | `fence_retention_ms` | minimum life of an idle fencing counter, 1 ms to 365 days | 3600000 |
/// | `min_replicas` | replicas that must acknowledge each acquire and extend (`WAIT`) | 0 (off) |
/// | `allow_eviction` | connect to a server whose `maxmemory-policy` may evict keys (with a warning) | `false` |
/// | `protocol` | `resp2` or `resp3` (the driver's RESP version) | `resp2` |
/// | `tls_ca_file` | PEM CA to trust in addition to the platform's roots (TLS URLs) | |
/// | `tls_cert_file`, `tls_key_file` | PEM client certificate and key (TLS URLs) | |
/// | `sentinel_user`, `sentinel_password` | the sentinels' own credentials (Sentinel URLs) | none |
/// | `db`, `user`, `password` | Unix sockets only, see above | |
///
/// `Debug` and `Display` never show a password.
///
/// ```
/// use std::time::Duration;
/// use distlock_redis::RedisConfig;
/// let config = RedisConfig::from_url("redis://:pw@127.0.0.1:6379/0?namespace=jobs&operation_timeout_ms=250")?;
/// let client = config.client().clone().with_connect_timeout(Duration::from_secs(1));
/// let config = config.with_client(client);
/// assert_eq!(config.client().namespace(), "jobs");
/// assert_eq!(config.client().operation_timeout(), Duration::from_millis(250));
/// assert_eq!(config.client().connect_timeout(), Duration::from_secs(1));
/// assert_eq!(config.to_string(), "redis://127.0.0.1:6379/0");
/// assert!(!format!("{config:?}").contains("pw"));
///
/// let sentinel = RedisConfig::from_url("redis+sentinel://:pw@10.0.0.1,10.0.0.2:5000/jobs-primary/2?min_replicas=1")?;
/// assert_eq!(sentinel.to_string(), "redis+sentinel://10.0.0.1:26379,10.0.0.2:5000/jobs-primary/2");
/// assert_eq!(sentinel.min_replicas(), 1);
///
/// let typo = RedisConfig::from_url("redis://127.0.0.1/?namspace=jobs").unwrap_err();
/// assert!(typo.to_string().contains("namspace"));
/// # Ok::<(), distlock_core::LockError>(())
/// ```
#[derive(Clone)]
pub struct RedisConfig {
    client: ClientOptions,
    fence_retention: Duration,
    min_replicas: u32,
    allow_eviction: bool,
    /// Where the server is; `None` for
    /// [`RedisLock::from_connection_manager`](crate::RedisLock::from_connection_manager).
    server: Option<Server>,
}

impl Default for RedisConfig {
    /// No server (for [`RedisLock::from_connection_manager`](crate::RedisLock::from_connection_manager)),
    /// default options.
    fn default() -> Self {
        Self {
            client: ClientOptions::default(),
            fence_retention: DEFAULT_FENCE_RETENTION,
            min_replicas: 0,
            allow_eviction: false,
            server: None,
        }
    }
}

impl RedisConfig {
    /// Parses `url`; see the type's documentation for the forms and
    /// parameters.
    pub fn from_url(url: &str) -> Result<Self, LockError> {
        let mut url = LockUrl::parse(url)?;
        let accepted: Vec<&str> = crate::SCHEMES.iter().chain(UNIX_SCHEMES).copied().collect();
        url.expect_scheme("redis", &accepted)?;
        let client = url.take_client_options()?;
        let fence_retention = url
            .take_millis("fence_retention_ms")?
            .unwrap_or(DEFAULT_FENCE_RETENTION);
        check_retention(fence_retention, "URL parameter fence_retention_ms")?;
        let allow_eviction = url.take_bool("allow_eviction")?.unwrap_or(false);
        let min_replicas = match url.take_u64("min_replicas")? {
            None => 0,
            Some(n) => u32::try_from(n).map_err(|_| {
                LockError::config(format!(
                    "URL parameter min_replicas={n} is more replicas than Redis can have"
                ))
            })?,
        };
        let tls = url.scheme().starts_with("rediss");
        if tls && !cfg!(feature = "tls") {
            return Err(LockError::config(format!(
                "{}:// (TLS) needs the `tls` cargo feature of distlock-redis (the `tls` or `redis-tls` feature of distlock); enable it or use {}://",
                url.scheme(),
                url.scheme().replacen("rediss", "redis", 1)
            )));
        }
        if !tls && !client.tls().is_empty() {
            return Err(LockError::config(format!(
                "tls_ca_file, tls_cert_file and tls_key_file apply to TLS connections, but {}:// is not TLS; use {}://",
                url.scheme(),
                url.scheme().replacen("redis", "rediss", 1)
            )));
        }
        let server = Server::from_url(&mut url, tls)?;
        url.finish()?;
        let config = Self {
            client,
            fence_retention,
            min_replicas,
            allow_eviction,
            server: Some(server),
        };
        config.validate()?;
        Ok(config)
    }

    /// Namespace, timeouts and TLS files.
    pub fn client(&self) -> &ClientOptions {
        &self.client
    }

    /// The minimum time a fencing counter is kept after its last
    /// acquisition (it is always kept at least twice the lock's TTL).
    /// Tokens stay strictly increasing as long as the server's clock never
    /// steps back by more than this; see the crate docs,
    /// [Fencing tokens](crate#fencing-tokens-without-a-key-per-lock-name-forever).
    /// Default [`DEFAULT_FENCE_RETENTION`].
    pub fn fence_retention(&self) -> Duration {
        self.fence_retention
    }

    /// How many replicas must acknowledge each acquisition and extension
    /// (`WAIT`, bounded by half the operation timeout) before it counts; an
    /// acquisition they do not acknowledge is released and reported as
    /// [`Unavailable`](distlock_core::ErrorKind::Unavailable). 0 (the default)
    /// waits for none. See the crate docs, [Topologies](crate#topologies).
    pub fn min_replicas(&self) -> u32 {
        self.min_replicas
    }

    /// Whether to connect to a server whose `maxmemory-policy` is not
    /// `noeviction` (logging a warning) instead of refusing it with
    /// [`Config`](distlock_core::ErrorKind::Config): such a server may evict
    /// a held lock when its memory is full, letting a second holder in. See
    /// the crate docs, [Eviction](crate#eviction). Default `false`.
    pub fn allow_eviction(&self) -> bool {
        self.allow_eviction
    }

    /// Sets the [namespace, timeouts and TLS files](Self::client).
    pub fn with_client(mut self, client: ClientOptions) -> Self {
        self.client = client;
        self
    }

    /// Sets the [fencing-counter retention](Self::fence_retention).
    pub fn with_fence_retention(mut self, retention: Duration) -> Self {
        self.fence_retention = retention;
        self
    }

    /// Sets [how many replicas](Self::min_replicas) must acknowledge each
    /// acquisition and extension.
    pub fn with_min_replicas(mut self, replicas: u32) -> Self {
        self.min_replicas = replicas;
        self
    }

    /// Sets [whether a server that may evict keys](Self::allow_eviction) is
    /// used anyway, with a warning.
    pub fn with_allow_eviction(mut self, allow: bool) -> Self {
        self.allow_eviction = allow;
        self
    }

    /// Sets where the server is, for settings built in code: one server
    /// (the redis driver's own description: address, credentials,
    /// database, TLS); read back with [`connection_info`](Self::connection_info).
    pub fn with_server(mut self, connection: ConnectionInfo) -> Self {
        self.server = Some(Server::Single(connection));
        self
    }

    /// Where the server is, if it is one server (not Sentinel or Cluster).
    pub fn connection_info(&self) -> Option<&ConnectionInfo> {
        match &self.server {
            Some(Server::Single(info)) => Some(info),
            _ => None,
        }
    }

    /// Where the server is, if set.
    pub(crate) fn server_settings(&self) -> Option<&Server> {
        self.server.as_ref()
    }

    /// Checks namespace, timeouts and retention (more than zero, at most
    /// [`MAX_FENCE_RETENTION`]).
    pub fn validate(&self) -> Result<(), LockError> {
        self.client.validate()?;
        check_retention(self.fence_retention, "fence_retention")
    }

    /// How long a `WAIT` for [`min_replicas`](Self::min_replicas) may
    /// block: half the operation timeout, so releasing an unacknowledged
    /// acquisition still fits in the rest.
    pub(crate) fn replica_wait(&self) -> Duration {
        (self.client.operation_timeout() / 2).max(Duration::from_millis(1))
    }
}

impl fmt::Display for RedisConfig {
    /// The server's URL without password or parameters.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.server {
            None => f.write_str("(application connection)"),
            Some(server) => server.fmt(f),
        }
    }
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("server", &self.to_string())
            .field("client", &self.client)
            .field("fence_retention", &self.fence_retention)
            .field("min_replicas", &self.min_replicas)
            .field("allow_eviction", &self.allow_eviction)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use distlock_core::ErrorKind;
    use redis::{ConnectionAddr, ProtocolVersion};

    use super::*;

    #[test]
    fn parses_our_parameters_and_the_server() {
        let c = RedisConfig::from_url(
            "redis://u:p%40ss@127.0.0.1:1/2?namespace=x&fence_retention_ms=10&protocol=resp3",
        )
        .unwrap();
        assert_eq!(c.client().namespace(), "x");
        assert_eq!(c.fence_retention(), Duration::from_millis(10));
        let info = c.connection_info().unwrap();
        assert_eq!(info.addr(), &ConnectionAddr::Tcp("127.0.0.1".into(), 1));
        let settings = info.redis_settings();
        assert_eq!(settings.db(), 2);
        assert_eq!(settings.username(), Some("u"));
        assert_eq!(settings.password(), Some("p@ss"));
        assert_eq!(settings.protocol(), ProtocolVersion::RESP3);
        assert_eq!(c.to_string(), "redis://u@127.0.0.1:1/2");

        let c = RedisConfig::from_url("redis://:pw@[::1]").unwrap();
        let info = c.connection_info().unwrap();
        assert_eq!(info.addr(), &ConnectionAddr::Tcp("::1".into(), 6379));
        assert_eq!(info.redis_settings().username(), None);
        assert_eq!(info.redis_settings().password(), Some("pw"));
        assert_eq!(info.redis_settings().db(), 0);
    }

    #[test]
    fn unix_sockets() {
        for scheme in ["unix", "redis+unix"] {
            let c = RedisConfig::from_url(&format!(
                "{scheme}:///run/redis.sock?db=3&user=u&password=pw"
            ))
            .unwrap();
            let info = c.connection_info().unwrap();
            assert_eq!(
                info.addr(),
                &ConnectionAddr::Unix(PathBuf::from("/run/redis.sock"))
            );
            assert_eq!(info.redis_settings().db(), 3);
            assert_eq!(info.redis_settings().username(), Some("u"));
            assert_eq!(info.redis_settings().password(), Some("pw"));
            assert_eq!(c.to_string(), "unix:///run/redis.sock?db=3");
            assert!(!format!("{c:?}").contains("pw"));
        }
        let c = RedisConfig::from_url("unix://:pw@/run/redis.sock").unwrap();
        let info = c.connection_info().unwrap();
        assert_eq!(info.redis_settings().password(), Some("pw"));
        for bad in [
            "unix://host/run/redis.sock",
            "unix://",
            "unix://:a@/s?password=b",
            "unix:///s?pass=b",
        ] {
            let err = RedisConfig::from_url(bad).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{bad}");
        }
    }

    #[test]
    fn bad_urls_are_config_errors_naming_the_problem() {
        let cases: &[(&str, &str)] = &[
            ("http://h", "not a redis URL"),
            ("redis://h/?fence_retention_ms=x", "fence_retention_ms"),
            ("redis://h/?fence_retention_ms=0", "fence_retention_ms"),
            (
                "redis://h/?fence_retention_ms=31536000001",
                "fence_retention_ms",
            ),
            ("redis://h/?allow_eviction=maybe", "allow_eviction"),
            ("redis://h/?namespace=a/b", "namespace"),
            ("redis://h/?operation_timeout_ms=0", "operation_timeout"),
            ("redis://h/?colour=blue&db=1", "colour"),
            ("redis://h/x", "database"),
            ("redis://h/?protocol=resp4", "protocol"),
            ("redis://a,b", "one host"),
            ("redis:///", "one host"),
            #[cfg(not(feature = "tls"))]
            ("rediss://h", "`tls` cargo feature"),
        ];
        for (url, named) in cases {
            let err = RedisConfig::from_url(url).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{url}: {err}");
            assert!(err.message().contains(named), "{url}: {err}");
        }
        let err = RedisConfig::from_url("redis://u:secret@h/x").unwrap_err();
        assert!(!err.to_string().contains("secret"), "{err}");
    }

    #[cfg(feature = "tls")]
    #[test]
    fn rediss_is_tls() {
        let c = RedisConfig::from_url("rediss://h:7000").unwrap();
        assert!(matches!(
            c.connection_info().unwrap().addr(),
            ConnectionAddr::TcpTls {
                insecure: false,
                port: 7000,
                ..
            }
        ));
        assert_eq!(c.to_string(), "rediss://h:7000/0");
    }
}
