//! Where the lock server is: one server, a primary found through
//! Sentinel, or a Redis Cluster; read from a URL's hosts, path and
//! credentials, and written back as a URL without password.

use std::fmt;
use std::path::PathBuf;

use distlock_core::{LockError, LockUrl, UrlHost};
use redis::{
    ConnectionAddr, ConnectionInfo, IntoConnectionInfo, ProtocolVersion, RedisConnectionInfo,
};

/// The port of a `redis://` or `redis+cluster://` host without one.
const DEFAULT_PORT: u16 = 6379;

/// The port of a `redis+sentinel://` host without one.
const DEFAULT_SENTINEL_PORT: u16 = 26379;

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

impl Server {
    /// The server of a parsed URL (`tls` for a `rediss…` scheme), its
    /// server parameters (`protocol`, `sentinel_user`, ...) taken.
    pub(crate) fn from_url(url: &mut LockUrl, tls: bool) -> Result<Self, LockError> {
        Ok(match url.scheme() {
            "redis+sentinel" | "rediss+sentinel" => Server::Sentinel(sentinel(url, tls)?),
            "redis+cluster" | "rediss+cluster" => Server::Cluster(cluster(url, tls)?),
            _ => Server::Single(connection_info(url)?),
        })
    }
}

impl fmt::Display for Server {
    /// The server's URL without password or parameters.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Server::Single(connection) => fmt_single(connection, f),
            Server::Sentinel(sentinel) => {
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
            Server::Cluster(cluster) => {
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
