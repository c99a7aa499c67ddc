//! [`RedisConfig`]: where the server is (one server, a primary found
//! through Sentinel, or a Redis Cluster), namespace and timeouts, the
//! fencing-counter retention and the replica acknowledgement.
//!
//! Naming rule, as for every config type in distlock (see
//! [`ClientOptions`]): fields are private, a getter is named after its
//! setting (`min_replicas()`), a setter consumes and returns the config and
//! is named `with_` and the setting (`with_min_replicas(1)`).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use distlock_core::{ClientOptions, LockError, LockUrl, UrlHost};
use redis::{
    ConnectionAddr, ConnectionInfo, IntoConnectionInfo, ProtocolVersion, RedisConnectionInfo,
};

/// How long a fencing counter outlives its last use, at least (see the crate
/// docs, [Fencing tokens](crate#fencing-tokens-without-a-key-per-lock-name-forever),
/// for why it may expire at all). Default one hour.
pub const DEFAULT_FENCE_RETENTION: Duration = Duration::from_secs(3600);

/// The longest [`fence_retention`](RedisConfig::fence_retention) accepted:
/// 365 days, the longest TTL. (A longer one was accepted once and failed
/// inside the acquire script.)
pub const MAX_FENCE_RETENTION: Duration = Duration::from_secs(365 * 24 * 3600);

/// The port of a `redis://` or `redis+cluster://` host without one.
const DEFAULT_PORT: u16 = 6379;

/// The port of a `redis+sentinel://` host without one.
const DEFAULT_SENTINEL_PORT: u16 = 26379;

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

/// Where the lock server is.
#[derive(Clone)]
pub(crate) enum Server {
    /// One server (TCP, TLS or a Unix socket).
    Single(ConnectionInfo),
    /// The primary that Sentinel monitors under a name.
    Sentinel(SentinelServer),
    /// A Redis Cluster.
    Cluster(ClusterServer),
}

/// A primary found through Sentinel.
#[derive(Clone)]
pub(crate) struct SentinelServer {
    /// The sentinels (address, TLS, their own credentials), in URL order.
    pub(crate) sentinels: Vec<ConnectionInfo>,
    /// The name the sentinels monitor the primary under.
    pub(crate) service: String,
    /// Whether the primary (and the sentinels) are reached over TLS.
    pub(crate) tls: bool,
    /// Database, credentials and protocol for the primary.
    pub(crate) node: RedisConnectionInfo,
}

/// A Redis Cluster.
#[derive(Clone)]
pub(crate) struct ClusterServer {
    /// The nodes to start from (the others are found from them).
    pub(crate) nodes: Vec<ConnectionInfo>,
    /// Whether the nodes are reached over TLS.
    pub(crate) tls: bool,
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
        let server = match url.scheme() {
            "redis+sentinel" | "rediss+sentinel" => Server::Sentinel(sentinel(&mut url, tls)?),
            "redis+cluster" | "rediss+cluster" => Server::Cluster(cluster(&mut url, tls)?),
            _ => Server::Single(connection_info(&mut url)?),
        };
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
            Some(Server::Single(connection)) => fmt_single(connection, f),
            Some(Server::Sentinel(sentinel)) => {
                let scheme = if sentinel.tls { "rediss" } else { "redis" };
                write!(
                    f,
                    "{scheme}+sentinel://{}{}/{}/{}",
                    user_prefix(&sentinel.node),
                    hosts(&sentinel.sentinels),
                    sentinel.service,
                    sentinel.node.db()
                )
            }
            Some(Server::Cluster(cluster)) => {
                let scheme = if cluster.tls { "rediss" } else { "redis" };
                let user = cluster
                    .nodes
                    .first()
                    .map(|n| user_prefix(n.redis_settings()))
                    .unwrap_or_default();
                write!(f, "{scheme}+cluster://{user}{}", hosts(&cluster.nodes))
            }
        }
    }
}

fn fmt_single(connection: &ConnectionInfo, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let settings = connection.redis_settings();
    let db = settings.db();
    let user = user_prefix(settings);
    match connection.addr() {
        ConnectionAddr::Tcp(name, port) => {
            write!(f, "redis://{user}{}/{db}", host_port(name, *port))
        }
        ConnectionAddr::TcpTls {
            host: name, port, ..
        } => {
            write!(f, "rediss://{user}{}/{db}", host_port(name, *port))
        }
        ConnectionAddr::Unix(path) if db != 0 => {
            write!(f, "unix://{}?db={db}", path.display())
        }
        ConnectionAddr::Unix(path) => write!(f, "unix://{}", path.display()),
        other => write!(f, "{other}/{db}"),
    }
}

/// `user@` for a connection with a user name, else empty.
fn user_prefix(settings: &RedisConnectionInfo) -> String {
    settings
        .username()
        .map(|u| format!("{u}@"))
        .unwrap_or_default()
}

/// `host:port`, IPv6 in brackets.
pub(crate) fn host_port(host: &str, port: u16) -> String {
    UrlHost {
        name: host.to_owned(),
        port: Some(port),
    }
    .address(port)
}

/// The addresses of `nodes`, comma-separated.
fn hosts(nodes: &[ConnectionInfo]) -> String {
    nodes
        .iter()
        .map(|n| match n.addr() {
            ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
                host_port(host, *port)
            }
            other => other.to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
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

/// A fencing retention (`name` says where it was given) within its bounds.
fn check_retention(retention: Duration, name: &str) -> Result<(), LockError> {
    if retention.is_zero() {
        return Err(LockError::config(format!(
            "{name} must be greater than zero"
        )));
    }
    if retention > MAX_FENCE_RETENTION {
        return Err(LockError::config(format!(
            "{name} of {retention:?} is longer than the longest accepted, {} days ({} ms)",
            MAX_FENCE_RETENTION.as_secs() / 86_400,
            MAX_FENCE_RETENTION.as_millis()
        )));
    }
    Ok(())
}

/// A TCP address, over TLS or not (the certificates are added at connect,
/// when the files are read).
pub(crate) fn tcp_addr(host: String, port: u16, tls: bool) -> ConnectionAddr {
    if tls {
        ConnectionAddr::TcpTls {
            host,
            port,
            insecure: false,
            tls_params: None,
        }
    } else {
        ConnectionAddr::Tcp(host, port)
    }
}

/// The `protocol` parameter.
fn protocol(url: &mut LockUrl) -> Result<ProtocolVersion, LockError> {
    match url.take("protocol").as_deref() {
        None | Some("resp2" | "2") => Ok(ProtocolVersion::RESP2),
        Some("resp3" | "3") => Ok(ProtocolVersion::RESP3),
        Some(other) => Err(LockError::config(format!(
            "URL parameter protocol={other:?} is not a RESP version; use resp2 or resp3"
        ))),
    }
}

/// A database number from the URL.
fn database(url: &LockUrl, db: Option<&str>) -> Result<i64, LockError> {
    match db {
        None => Ok(0),
        Some(db) => db.parse::<i64>().ok().filter(|db| *db >= 0).ok_or_else(|| {
            LockError::config(format!(
                "{url}: the database {db:?} is not a number; write redis://host:port/0"
            ))
        }),
    }
}

/// Credentials, database and protocol.
fn settings(
    db: i64,
    username: Option<String>,
    password: Option<String>,
    protocol: ProtocolVersion,
) -> RedisConnectionInfo {
    let mut settings = RedisConnectionInfo::default()
        .set_db(db)
        .set_protocol(protocol);
    if let Some(username) = username {
        settings = settings.set_username(username);
    }
    if let Some(password) = password {
        settings = settings.set_password(password);
    }
    settings
}

fn into_info(url: &LockUrl, addr: ConnectionAddr) -> Result<ConnectionInfo, LockError> {
    addr.into_connection_info()
        .map_err(|e| LockError::config(format!("{url}: {e}")))
}

/// The redis driver's connection settings for one server from the parsed
/// URL (its parameters taken): address, credentials, database, protocol.
fn connection_info(url: &mut LockUrl) -> Result<ConnectionInfo, LockError> {
    let protocol = protocol(url)?;
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
        let password = either(
            url.take("password"),
            url.password(),
            "the password",
            "password",
        )?;
        (ConnectionAddr::Unix(path), db, username, password)
    } else {
        let [host] = url.hosts() else {
            return Err(LockError::config(format!(
                "{url}: give exactly one host[:port]; for several, use redis+sentinel:// (Sentinel) or redis+cluster:// (Redis Cluster)"
            )));
        };
        let addr = tcp_addr(
            host.name.clone(),
            host.port.unwrap_or(DEFAULT_PORT),
            url.scheme() == "rediss",
        );
        let db = url.path().trim_matches('/');
        let db = (!db.is_empty()).then(|| db.to_owned());
        let username = url.username().map(str::to_owned);
        let password = url.password().map(str::to_owned);
        (addr, db, username, password)
    };
    let db = database(url, db.as_deref())?;
    let info = into_info(url, addr)?;
    Ok(info.set_redis_settings(settings(db, username, password, protocol)))
}

/// `redis+sentinel://[user:pw@]sentinel[:port],.../SERVICE[/db]`.
fn sentinel(url: &mut LockUrl, tls: bool) -> Result<SentinelServer, LockError> {
    let protocol = protocol(url)?;
    if url.hosts().is_empty() {
        return Err(LockError::config(format!(
            "{url} names no sentinel; write redis+sentinel://sentinel:26379[,sentinel:26379...]/SERVICE_NAME"
        )));
    }
    let path = url.path().trim_matches('/').to_owned();
    let (service, db) = match path.split_once('/') {
        Some((service, db)) => (service.to_owned(), Some(db)),
        None => (path.clone(), None),
    };
    if service.is_empty() {
        return Err(LockError::config(format!(
            "{url} names no service; write redis+sentinel://sentinel:26379/SERVICE_NAME[/db] with the name the sentinels monitor the primary under"
        )));
    }
    let db = database(url, db)?;
    let sentinel_user = url.take("sentinel_user");
    let sentinel_password = url.take("sentinel_password");
    let mut sentinels = Vec::new();
    for host in url.hosts() {
        let addr = tcp_addr(
            host.name.clone(),
            host.port.unwrap_or(DEFAULT_SENTINEL_PORT),
            tls,
        );
        let info = into_info(url, addr)?.set_redis_settings(settings(
            0,
            sentinel_user.clone(),
            sentinel_password.clone(),
            ProtocolVersion::RESP2,
        ));
        sentinels.push(info);
    }
    Ok(SentinelServer {
        sentinels,
        service,
        tls,
        node: settings(
            db,
            url.username().map(str::to_owned),
            url.password().map(str::to_owned),
            protocol,
        ),
    })
}

/// `redis+cluster://[user:pw@]host[:port],...`.
fn cluster(url: &mut LockUrl, tls: bool) -> Result<ClusterServer, LockError> {
    let protocol = protocol(url)?;
    if url.hosts().is_empty() {
        return Err(LockError::config(format!(
            "{url} names no node; write redis+cluster://host:port[,host:port...]"
        )));
    }
    if !matches!(url.path().trim_matches('/'), "" | "0") {
        return Err(LockError::config(format!(
            "{url}: Redis Cluster has only database 0; remove the path"
        )));
    }
    let node = settings(
        0,
        url.username().map(str::to_owned),
        url.password().map(str::to_owned),
        protocol,
    );
    let mut nodes = Vec::new();
    for host in url.hosts() {
        let addr = tcp_addr(host.name.clone(), host.port.unwrap_or(DEFAULT_PORT), tls);
        nodes.push(into_info(url, addr)?.set_redis_settings(node.clone()));
    }
    Ok(ClusterServer { nodes, tls })
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
    use distlock_core::ErrorKind;

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
