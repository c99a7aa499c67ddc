//! The command connection of each topology: one server (a self-reconnecting
//! [`ConnectionManager`]), the primary found through Sentinel (found again
//! after a failure), or a Redis Cluster (the driver routes each script to
//! the node of its keys' slot and follows `MOVED`/`ASK`).

use std::sync::Arc;

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
pub(crate) fn cluster_client(
    cluster: &ClusterServer,
    certificates: &Certificates,
    options: &ClientOptions,
    push: Option<tokio::sync::mpsc::UnboundedSender<PushInfo>>,
) -> RedisResult<ClusterClient> {
    let mut builder = ClusterClientBuilder::new(cluster.nodes.clone())
        .connection_timeout(options.connect_timeout)
        .response_timeout(options.operation_timeout)
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
    Single(ConnectionManager),
    /// The primary of a Sentinel group.
    Sentinel(Arc<SentinelPrimary>),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl Commands {
    /// A connection for one request. Report how the request went with
    /// [`Checkout::finish`]; a checkout dropped before (the request timed
    /// out or was cancelled) counts as failed.
    pub(crate) async fn checkout(&self) -> Result<Checkout<'_>, distlock_core::LockError> {
        Ok(match self {
            Commands::Single(manager) => Checkout::new(Conn::Manager(manager.clone()), None),
            Commands::Cluster(cluster) => Checkout::new(Conn::Cluster(cluster.clone()), None),
            Commands::Sentinel(primary) => {
                let (conn, generation) = primary.connection().await?;
                Checkout::new(Conn::Node(conn), Some((primary, generation)))
            }
        })
    }
}

/// A connection checked out of [`Commands`] for one request.
pub(crate) struct Checkout<'a> {
    /// The connection.
    pub(crate) conn: Conn,
    /// The Sentinel primary it goes to, and which of its connections.
    primary: Option<(&'a Arc<SentinelPrimary>, u64)>,
}

impl<'a> Checkout<'a> {
    fn new(conn: Conn, primary: Option<(&'a Arc<SentinelPrimary>, u64)>) -> Self {
        Self { conn, primary }
    }

    /// Reports the outcome: an error that means the primary may have
    /// moved (the connection failed or timed out, the server is a replica
    /// now) makes the next request find the primary again.
    pub(crate) fn finish<T>(mut self, result: &RedisResult<T>) {
        let moved = result
            .as_ref()
            .err()
            .is_some_and(errors::primary_may_have_moved);
        if !moved {
            self.primary = None;
        }
    }
}

impl Drop for Checkout<'_> {
    fn drop(&mut self) {
        if let Some((primary, generation)) = self.primary.take() {
            primary.forget(generation);
        }
    }
}

/// One of the driver's connections.
#[derive(Clone)]
pub(crate) enum Conn {
    /// One server, reconnecting by itself.
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
