//! The command connection of each topology: one server (a
//! [`ConnectionManager`], replaced after a failure or timeout), the primary
//! found through Sentinel (found again after one), or a Redis Cluster (the
//! driver routes each script to the node of its keys' slot and follows
//! `MOVED`/`ASK`; the whole cluster connection is replaced after a failure
//! or timeout).

use std::sync::{Arc, Mutex};

use distlock_core::ClientOptions;
use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, PushInfo, RedisFuture, RedisResult, Value};

use crate::config::ClusterServer;
use crate::errors;
use crate::sentinel::SentinelPrimary;
use crate::tls::Certificates;

/// A driver client for `cluster` under the client's timeouts; with `push`,
/// on RESP3 with pushes (pub/sub messages) sent there.
///
/// The driver resends a request whose connection dropped, or that got
/// `MOVED`/`ASK`/`TRYAGAIN`, within the operation timeout: the scripts are
/// safe to resend (a resent acquire adopts the lock the first one took, a
/// resent release finds its released-by marker, extend is idempotent).
pub(crate) fn cluster_client(
    cluster: &ClusterServer,
    certificates: &Certificates,
    options: &ClientOptions,
    push: Option<tokio::sync::mpsc::UnboundedSender<PushInfo>>,
) -> RedisResult<ClusterClient> {
    let mut builder = ClusterClientBuilder::new(cluster.nodes.clone())
        .connection_timeout(options.connect_timeout())
        .response_timeout(options.operation_timeout())
        .min_retry_wait(50)
        .max_retry_wait(1000);
    if let Some(push) = push {
        builder = builder
            .use_protocol(redis::ProtocolVersion::RESP3)
            .push_sender(push);
    }
    #[cfg(feature = "tls")]
    if let Some(certificates) = certificates {
        builder = builder.certs(certificates.clone());
    }
    let _ = certificates;
    builder.build()
}

/// Where lock scripts are sent.
pub(crate) enum Commands {
    /// One server.
    Single(Replaceable<ConnectionManager>),
    /// The primary of a Sentinel group.
    Sentinel(Arc<SentinelPrimary>),
    /// A Redis Cluster.
    Cluster(Replaceable<ClusterConnection>),
}

impl Commands {
    /// A connection for one request. Report how the request went with
    /// [`Checkout::finish`] or [`Checkout::timed_out`]; a checkout dropped
    /// without either (its caller cancelled it: a guard released during a
    /// renewal, say) says nothing about the connection and changes nothing.
    pub(crate) async fn checkout(&self) -> Result<Checkout<'_>, distlock_core::LockError> {
        Ok(match self {
            Commands::Single(manager) => {
                let (conn, generation) = manager.current();
                Checkout::new(Conn::Manager(conn), Origin::Single(manager, generation))
            }
            Commands::Cluster(cluster) => {
                let (conn, generation) = cluster.current();
                Checkout::new(Conn::Cluster(conn), Origin::Cluster(cluster, generation))
            }
            Commands::Sentinel(primary) => {
                // Boxed: finding the primary is a future of several KB,
                // which every request's future (and each move of it, a
                // memcpy) would otherwise carry on every topology.
                let (conn, generation) = Box::pin(primary.connection()).await?;
                Checkout::new(Conn::Node(conn), Origin::Sentinel(primary, generation))
            }
        })
    }
}

/// A connection that is replaced by a new one when a request on it fails
/// or times out. The driver reconnects only once a connection closes; one
/// that stays open but never answers (a peer gone without a reset, a
/// half-open TCP connection, a stalled path) would otherwise fail every
/// request for as long as the operating system keeps it.
pub(crate) struct Replaceable<C> {
    current: Mutex<(C, u64)>,
    /// Makes the replacement, without I/O: it connects on first use, within
    /// that request's operation timeout.
    renew: Box<dyn Fn() -> RedisResult<C> + Send + Sync>,
    what: &'static str,
}

impl<C: Clone> Replaceable<C> {
    /// Starts with `first`; `renew` makes each replacement.
    pub(crate) fn new(
        first: C,
        what: &'static str,
        renew: impl Fn() -> RedisResult<C> + Send + Sync + 'static,
    ) -> Self {
        Self {
            current: Mutex::new((first, 0)),
            renew: Box::new(renew),
            what,
        }
    }

    /// The connection now, and its generation.
    pub(crate) fn current(&self) -> (C, u64) {
        self.current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Replaces connection `generation`, unless that happened already.
    fn replace(&self, generation: u64) {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if current.1 != generation {
            return;
        }
        match (self.renew)() {
            Ok(conn) => {
                tracing::debug!(
                    connection = self.what,
                    "redis connection failed or timed out; replaced by a new one"
                );
                *current = (conn, generation.wrapping_add(1));
            }
            Err(e) => {
                tracing::warn!(connection = self.what, error = %e, "redis connection failed or timed out, and no new one could be made");
            }
        }
    }
}

/// Where a checked-out connection came from, and which one it is.
enum Origin<'a> {
    Single(&'a Replaceable<ConnectionManager>, u64),
    Cluster(&'a Replaceable<ClusterConnection>, u64),
    Sentinel(&'a Arc<SentinelPrimary>, u64),
}

/// A connection checked out of [`Commands`] for one request.
pub(crate) struct Checkout<'a> {
    /// The connection.
    pub(crate) conn: Conn,
    /// Where it came from.
    origin: Origin<'a>,
}

impl<'a> Checkout<'a> {
    fn new(conn: Conn, origin: Origin<'a>) -> Self {
        Self { conn, origin }
    }

    /// Reports the outcome: an error that means the connection may be dead
    /// (it failed or timed out) or the Sentinel primary may have moved (the
    /// server is a replica now) replaces the connection (finds the primary
    /// again) for the next request.
    pub(crate) fn finish<T>(self, result: &RedisResult<T>) {
        if result
            .as_ref()
            .err()
            .is_some_and(errors::connection_suspect)
        {
            self.replace();
        }
    }

    /// The request got no reply within the operation timeout: the
    /// connection is replaced (found again) for the next request.
    pub(crate) fn timed_out(self) {
        self.replace();
    }

    fn replace(self) {
        match self.origin {
            Origin::Single(manager, generation) => manager.replace(generation),
            Origin::Cluster(cluster, generation) => cluster.replace(generation),
            Origin::Sentinel(primary, generation) => primary.forget(generation),
        }
    }
}

/// One of the driver's connections.
#[derive(Clone)]
pub(crate) enum Conn {
    /// One server.
    Manager(ConnectionManager),
    /// A plain connection to one server.
    Node(MultiplexedConnection),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Manager(c) => c.req_packed_command(cmd),
            Conn::Node(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Manager(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Node(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Manager(c) => c.get_db(),
            Conn::Node(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// A new connection to `cluster`'s nodes that connects in the background
/// (no I/O here), under the client's timeouts.
pub(crate) fn pending_cluster(
    client: &ClusterClient,
    options: &ClientOptions,
) -> ClusterConnection {
    let config = redis::cluster::ClusterConfig::new()
        .set_connection_timeout(options.connect_timeout())
        .set_response_timeout(options.operation_timeout());
    client.get_pending_async_connection_with_config(config)
}

/// How long connecting and a first request may take together (saturating:
/// a timeout too long to add is as good as none).
pub(crate) fn connect_budget(options: &ClientOptions) -> std::time::Duration {
    options
        .connect_timeout()
        .saturating_add(options.operation_timeout())
}
