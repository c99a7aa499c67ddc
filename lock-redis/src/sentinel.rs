//! Sentinel: finding the primary the sentinels monitor, and finding it
//! again after a failover.
//!
//! A small discovery of our own rather than the driver's `sentinel`
//! feature: every step here runs under the client's connect and operation
//! timeouts (the driver's lookups have none, so one black-holed sentinel
//! stalls them), the connection whose `ROLE` was checked is the one the
//! scripts then use (the driver checks on a connection it throws away), and
//! the sentinel that answered last is asked first next time.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use distlock_core::{with_timeout, ClientOptions, ErrorKind, LockError};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, ConnectionInfo, Role};

use crate::config::{host_port, tcp_addr, SentinelServer};
use crate::connection::connect_budget;
use crate::errors;
use crate::tls::{self, Certificates};

/// The primary of one Sentinel-monitored service, and the connection to it.
pub(crate) struct SentinelPrimary {
    settings: SentinelServer,
    certificates: Certificates,
    options: ClientOptions,
    /// The connection to the primary, once found, and its generation.
    current: Mutex<Option<Current>>,
    /// Serializes discovery: one lookup at a time, the others reuse it.
    finding: tokio::sync::Mutex<()>,
    generation: AtomicU64,
    /// The sentinel to ask first (the one that answered last).
    preferred: AtomicUsize,
}

#[derive(Clone)]
struct Current {
    conn: MultiplexedConnection,
    info: ConnectionInfo,
    generation: u64,
}

impl SentinelPrimary {
    /// The primary of `settings`; nothing is contacted yet.
    pub(crate) fn new(
        mut settings: SentinelServer,
        certificates: Certificates,
        options: ClientOptions,
    ) -> Result<Self, LockError> {
        settings.sentinels = settings
            .sentinels
            .into_iter()
            .map(|info| tls::with_certificates(info, &certificates))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            settings,
            certificates,
            options,
            current: Mutex::new(None),
            finding: tokio::sync::Mutex::new(()),
            generation: AtomicU64::new(0),
            preferred: AtomicUsize::new(0),
        })
    }

    /// The connection to the primary and its generation, finding the
    /// primary first if there is no connection.
    pub(crate) async fn connection(&self) -> Result<(MultiplexedConnection, u64), LockError> {
        let current = self.current().await?;
        Ok((current.conn, current.generation))
    }

    /// A client for the primary (for the pub/sub connection), finding it
    /// first if needed, and the generation of the command connection to
    /// the same server (to [`forget`](Self::forget) if the pub/sub
    /// connection finds it gone).
    pub(crate) async fn client(&self) -> Result<(Client, u64), LockError> {
        let current = self.current().await?;
        let client =
            Client::open(current.info).map_err(|e| errors::map(e, "opening the redis primary"))?;
        Ok((client, current.generation))
    }

    /// Forgets connection `generation` (it failed, or the server stopped
    /// being the primary): the next request finds the primary again.
    pub(crate) fn forget(&self, generation: u64) {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if current.as_ref().is_some_and(|c| c.generation == generation) {
            tracing::debug!(service = %self.settings.service, "redis primary connection dropped; asking the sentinels again");
            *current = None;
        }
    }

    fn cached(&self) -> Option<Current> {
        self.current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    async fn current(&self) -> Result<Current, LockError> {
        if let Some(current) = self.cached() {
            return Ok(current);
        }
        let _finding = self.finding.lock().await;
        if let Some(current) = self.cached() {
            return Ok(current);
        }
        let (conn, info) = self.find().await?;
        let current = Current {
            conn,
            info,
            generation: self.generation.fetch_add(1, Ordering::SeqCst) + 1,
        };
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(current.clone());
        Ok(current)
    }

    /// Asks the sentinels, in turn, for the primary's address and connects
    /// to the first one that confirms it is the primary (`ROLE`).
    async fn find(&self) -> Result<(MultiplexedConnection, ConnectionInfo), LockError> {
        let service = &self.settings.service;
        let count = self.settings.sentinels.len();
        let first = self.preferred.load(Ordering::Relaxed) % count;
        let mut problems = Vec::new();
        let mut unknown = 0;
        for i in 0..count {
            let index = (first + i) % count;
            let sentinel = &self.settings.sentinels[index];
            let name = address(sentinel);
            let addr = match self.ask(sentinel, &name).await {
                Ok(Some(addr)) => addr,
                Ok(None) => {
                    unknown += 1;
                    problems.push(format!("sentinel {name} monitors no {service:?}"));
                    continue;
                }
                Err(e) if e.kind() == ErrorKind::Config => return Err(e),
                Err(e) => {
                    problems.push(e.message().to_owned());
                    continue;
                }
            };
            match self.connect(addr.0, addr.1).await {
                Ok(found) => {
                    self.preferred.store(index, Ordering::Relaxed);
                    return Ok(found);
                }
                Err(e) if e.kind() == ErrorKind::Config => return Err(e),
                Err(e) => problems.push(e.message().to_owned()),
            }
        }
        if unknown == count {
            return Err(LockError::config(format!(
                "no sentinel monitors a primary named {service:?} (asked {}); check the service name in the URL (SENTINEL MASTERS lists them)",
                self.sentinel_list()
            )));
        }
        Err(LockError::unavailable(format!(
            "no redis primary for {service:?} found through the sentinels ({}); a failover may be under way",
            problems.join("; ")
        )))
    }

    /// One sentinel's answer: the primary's host and port, `None` if it
    /// monitors no such service.
    async fn ask(
        &self,
        sentinel: &ConnectionInfo,
        name: &str,
    ) -> Result<Option<(String, u16)>, LockError> {
        let what = format!("asking sentinel {name} for the primary");
        let mut conn = self.open(sentinel.clone(), &what).await?;
        self.options
            .timed(&what, async {
                redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(&self.settings.service)
                    .query_async::<Option<(String, u16)>>(&mut conn)
                    .await
                    .map_err(|e| {
                        if e.to_string().contains("unknown command") {
                            LockError::config(format!(
                                "{what}: {name} is not a sentinel ({e}); list the sentinels (port 26379 by default) in a redis+sentinel:// URL"
                            ))
                        } else {
                            errors::map(e, &what)
                        }
                    })
            })
            .await
    }

    /// Connects to the server at `host:port` and checks it is the primary.
    async fn connect(
        &self,
        host: String,
        port: u16,
    ) -> Result<(MultiplexedConnection, ConnectionInfo), LockError> {
        let name = host_port(&host, port);
        let what = format!(
            "connecting to the redis primary {name} of {:?}",
            self.settings.service
        );
        let info = redis::IntoConnectionInfo::into_connection_info(tcp_addr(
            host,
            port,
            self.settings.tls,
        ))
        .map_err(|e| errors::map(e, &what))?
        .set_redis_settings(self.settings.node.clone());
        let info = tls::with_certificates(info, &self.certificates)?;
        let mut conn = self.open(info.clone(), &what).await?;
        let role = self
            .options
            .timed(&what, async {
                redis::cmd("ROLE")
                    .query_async::<Role>(&mut conn)
                    .await
                    .map_err(|e| errors::map(e, &what))
            })
            .await?;
        match role {
            Role::Primary { .. } => Ok((conn, info)),
            _ => Err(LockError::unavailable(format!(
                "{what}: the sentinels name {name} as the primary, but it is not one (ROLE); a failover is under way"
            ))),
        }
    }

    /// A connection to `info` under the connect timeout, its requests
    /// under the operation timeout.
    async fn open(
        &self,
        info: ConnectionInfo,
        what: &str,
    ) -> Result<MultiplexedConnection, LockError> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.options.connect_timeout()))
            .set_response_timeout(Some(self.options.operation_timeout()));
        with_timeout(connect_budget(&self.options), what, async {
            let client = Client::open(info).map_err(|e| errors::map(e, what))?;
            client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .map_err(|e| errors::map(e, what))
        })
        .await
    }

    fn sentinel_list(&self) -> String {
        self.settings
            .sentinels
            .iter()
            .map(address)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn address(info: &ConnectionInfo) -> String {
    match info.addr() {
        redis::ConnectionAddr::Tcp(host, port)
        | redis::ConnectionAddr::TcpTls { host, port, .. } => host_port(host, *port),
        other => other.to_string(),
    }
}
