//! [`RedisConfig`]: where the server is, namespace and timeouts, and the
//! fencing-counter retention.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use lock_core::{ClientOptions, LockError, LockUrl};
use redis::{
    ConnectionAddr, ConnectionInfo, IntoConnectionInfo, ProtocolVersion, RedisConnectionInfo,
};

/// How long a fencing counter outlives its last use, at least (see the crate
/// docs for why it may expire at all). Default one hour.
pub const DEFAULT_FENCE_RETENTION: Duration = Duration::from_secs(3600);

/// The port of a `redis://` URL without one.
const DEFAULT_PORT: u16 = 6379;

/// The URL schemes [`RedisConfig::from_url`] accepts: the facade's
/// [`SCHEMES`](crate::SCHEMES) and the Unix-socket ones.
const ACCEPTED_SCHEMES: &[&str] = &["redis", "rediss", "unix", "redis+unix"];

/// Settings of a [`RedisLock`](crate::RedisLock).
///
/// Built from a URL with [`RedisConfig::from_url`]:
///
/// - `redis://[[user]:password@]host[:port][/db]` (port 6379 by default,
///   database 0);
/// - `rediss://…` the same over TLS (cargo feature `tls`);
/// - `unix:///path/to/redis.sock` or `redis+unix:///path/to/redis.sock`,
///   with the database, user and password as the `db`, `user` and `pass`
///   parameters (or the password as `unix://:password@/path`).
///
/// Query parameters (anything else is a
/// [`Config`](lock_core::ErrorKind::Config) error naming it):
///
/// | parameter | meaning | default |
/// |---|---|---|
/// | `namespace` | prefix of every key and channel | `distlock` |
/// | `connect_timeout_ms` | connecting to the server | 5000 |
/// | `operation_timeout_ms` | one request's reply | 5000 |
/// | `fence_retention_ms` | minimum life of an idle fencing counter | 3600000 |
/// | `protocol` | `resp2` or `resp3` (the driver's RESP version) | `resp2` |
/// | `db`, `user`, `pass` | Unix sockets only, see above | |
///
/// `Debug` and `Display` never show the password.
///
/// ```
/// use std::time::Duration;
/// use lock_redis::RedisConfig;
/// let mut config = RedisConfig::from_url("redis://:pw@127.0.0.1:6379/0?namespace=jobs&operation_timeout_ms=250")?;
/// config.client.connect_timeout = Duration::from_secs(1);
/// assert_eq!(config.client.namespace, "jobs");
/// assert_eq!(config.client.operation_timeout, Duration::from_millis(250));
/// assert_eq!(config.to_string(), "redis://127.0.0.1:6379/0");
/// assert!(!format!("{config:?}").contains("pw"));
///
/// let typo = RedisConfig::from_url("redis://127.0.0.1/?namspace=jobs").unwrap_err();
/// assert!(typo.to_string().contains("namspace"));
/// # Ok::<(), lock_core::LockError>(())
/// ```
#[derive(Clone)]
pub struct RedisConfig {
    /// Namespace and timeouts.
    pub client: ClientOptions,
    /// The minimum time a fencing counter is kept after its last
    /// acquisition (it is always kept at least twice the lock's TTL).
    /// Tokens stay strictly increasing as long as the server's clock never
    /// steps back by more than this; see the crate docs.
    pub fence_retention: Duration,
    /// Where the server is; `None` for
    /// [`RedisLock::from_connection_manager`](crate::RedisLock::from_connection_manager).
    connection: Option<ConnectionInfo>,
}

impl Default for RedisConfig {
    /// No server (for [`RedisLock::from_connection_manager`](crate::RedisLock::from_connection_manager)),
    /// default options.
    fn default() -> Self {
        Self {
            client: ClientOptions::default(),
            fence_retention: DEFAULT_FENCE_RETENTION,
            connection: None,
        }
    }
}

impl RedisConfig {
    /// Parses `url`; see the type's documentation for the forms and
    /// parameters.
    pub fn from_url(url: &str) -> Result<Self, LockError> {
        let mut url = LockUrl::parse(url)?;
        url.expect_scheme("redis", ACCEPTED_SCHEMES)?;
        let client = url.take_client_options()?;
        let fence_retention = url
            .take_millis("fence_retention_ms")?
            .unwrap_or(DEFAULT_FENCE_RETENTION);
        let connection = connection_info(&mut url)?;
        url.finish()?;
        Ok(Self {
            client,
            fence_retention,
            connection: Some(connection),
        })
    }

    /// Sets the fencing-counter retention (see
    /// [`fence_retention`](Self::fence_retention)).
    pub fn fence_retention(mut self, retention: Duration) -> Self {
        self.fence_retention = retention;
        self
    }

    /// Sets where the server is, for settings built in code (the redis
    /// driver's own description: address, credentials, database, TLS).
    pub fn server(mut self, connection: ConnectionInfo) -> Self {
        self.connection = Some(connection);
        self
    }

    /// Where the server is, if set.
    pub fn connection_info(&self) -> Option<&ConnectionInfo> {
        self.connection.as_ref()
    }

    /// Checks namespace, timeouts and retention.
    pub fn validate(&self) -> Result<(), LockError> {
        self.client.validate()?;
        if self.fence_retention.is_zero() {
            return Err(LockError::config(
                "fence_retention must be greater than zero",
            ));
        }
        Ok(())
    }
}

impl fmt::Display for RedisConfig {
    /// The server's URL without password or parameters.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(connection) = &self.connection else {
            return f.write_str("(application connection)");
        };
        let settings = connection.redis_settings();
        let db = settings.db();
        let user = settings
            .username()
            .map(|u| format!("{u}@"))
            .unwrap_or_default();
        let host = |host: &str| {
            if host.contains(':') {
                format!("[{host}]")
            } else {
                host.to_owned()
            }
        };
        match connection.addr() {
            ConnectionAddr::Tcp(name, port) => {
                write!(f, "redis://{user}{}:{port}/{db}", host(name))
            }
            ConnectionAddr::TcpTls {
                host: name, port, ..
            } => {
                write!(f, "rediss://{user}{}:{port}/{db}", host(name))
            }
            ConnectionAddr::Unix(path) if db != 0 => {
                write!(f, "unix://{}?db={db}", path.display())
            }
            ConnectionAddr::Unix(path) => write!(f, "unix://{}", path.display()),
            other => write!(f, "{other}/{db}"),
        }
    }
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("server", &self.to_string())
            .field("client", &self.client)
            .field("fence_retention", &self.fence_retention)
            .finish()
    }
}

/// The redis driver's connection settings from the parsed URL (its
/// parameters taken): address, credentials, database, protocol.
fn connection_info(url: &mut LockUrl) -> Result<ConnectionInfo, LockError> {
    let protocol = match url.take("protocol").as_deref() {
        None | Some("resp2" | "2") => ProtocolVersion::RESP2,
        Some("resp3" | "3") => ProtocolVersion::RESP3,
        Some(other) => {
            return Err(LockError::config(format!(
                "URL parameter protocol={other:?} is not a RESP version; use resp2 or resp3"
            )))
        }
    };
    let unix = matches!(url.scheme(), "unix" | "redis+unix");
    let (addr, db, username, password) = if unix {
        if !url.hosts().is_empty() {
            return Err(LockError::config(format!(
                "{url}: a Unix-socket URL has no host; write unix:///path/to/redis.sock"
            )));
        }
        if url.path().is_empty() {
            return Err(LockError::config(format!(
                "{url} names no socket; write unix:///path/to/redis.sock"
            )));
        }
        let path = PathBuf::from(format!("/{}", url.path()));
        let db = url.take("db");
        let username = either(url.take("user"), url.username(), "the user name", "user")?;
        let password = either(url.take("pass"), url.password(), "the password", "pass")?;
        (ConnectionAddr::Unix(path), db, username, password)
    } else {
        let [host] = url.hosts() else {
            return Err(LockError::config(format!(
                "{url}: give exactly one host[:port] (Redis Cluster and Sentinel are not supported)"
            )));
        };
        let (name, port) = (host.name.clone(), host.port.unwrap_or(DEFAULT_PORT));
        let addr = if url.scheme() == "rediss" {
            if !cfg!(feature = "tls") {
                return Err(LockError::config(
                    "rediss:// (TLS) needs the `tls` cargo feature of lock-redis (the `redis-tls` feature of distlock); enable it or use redis://",
                ));
            }
            ConnectionAddr::TcpTls {
                host: name,
                port,
                insecure: false,
                tls_params: None,
            }
        } else {
            ConnectionAddr::Tcp(name, port)
        };
        let db = url.path().trim_matches('/');
        let db = (!db.is_empty()).then(|| db.to_owned());
        let username = url.username().map(str::to_owned);
        let password = url.password().map(str::to_owned);
        (addr, db, username, password)
    };
    let db = match db {
        None => 0,
        Some(db) => db
            .parse::<i64>()
            .ok()
            .filter(|db| *db >= 0)
            .ok_or_else(|| {
                LockError::config(format!(
                    "{url}: the database {db:?} is not a number; write redis://host:port/0"
                ))
            })?,
    };
    let mut settings = RedisConnectionInfo::default()
        .set_db(db)
        .set_protocol(protocol);
    if let Some(username) = username {
        settings = settings.set_username(username);
    }
    if let Some(password) = password {
        settings = settings.set_password(password);
    }
    let info = addr
        .into_connection_info()
        .map_err(|e| LockError::config(format!("{url}: {e}")))?;
    Ok(info.set_redis_settings(settings))
}

/// A credential given as a parameter or in the URL's user info, not both.
fn either(
    param: Option<String>,
    userinfo: Option<&str>,
    what: &str,
    name: &str,
) -> Result<Option<String>, LockError> {
    match (param, userinfo) {
        (Some(_), Some(_)) => Err(LockError::config(format!(
            "{what} is given twice (in the URL and as parameter {name}); give it once"
        ))),
        (param, userinfo) => Ok(param.or(userinfo.map(str::to_owned))),
    }
}

#[cfg(test)]
mod tests {
    use lock_core::ErrorKind;

    use super::*;

    #[test]
    fn parses_our_parameters_and_the_server() {
        let c = RedisConfig::from_url(
            "redis://u:p%40ss@127.0.0.1:1/2?namespace=x&fence_retention_ms=10&protocol=resp3",
        )
        .unwrap();
        assert_eq!(c.client.namespace, "x");
        assert_eq!(c.fence_retention, Duration::from_millis(10));
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
            let c =
                RedisConfig::from_url(&format!("{scheme}:///run/redis.sock?db=3&user=u&pass=pw"))
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
            "unix://:a@/s?pass=b",
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
