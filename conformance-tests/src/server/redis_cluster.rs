//! A Redis Cluster on loopback: three primaries with one replica each,
//! each node its own [`ServerProcess`], joined with
//! `redis-cli --cluster create ... --cluster-replicas 1`.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use super::redis_node::{info_field, wait_until, Access, Node, Role};
use super::{ServerProcess, TestPki};

/// Every node's password (`requirepass`, `masterauth`).
const PASSWORD: &str = "cluster-pw";

/// Primaries, and nodes in all.
const PRIMARIES: usize = 3;
const NODES: usize = 6;

/// How long the cluster may take to become healthy.
const HEALTHY_TIMEOUT: Duration = Duration::from_secs(60);

/// One primary as `CLUSTER NODES` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterPrimary {
    /// Its port.
    pub port: u16,
    /// The slot ranges it serves (inclusive).
    pub slots: Vec<(u16, u16)>,
}

/// A Redis Cluster of three primaries and three replicas, each replica
/// following one primary; a node is failed after 1 s
/// (`cluster-node-timeout`), so killing a primary promotes its replica
/// within a few seconds. Every node requires a password. Everything is
/// killed when the cluster is dropped.
///
/// ```no_run
/// use distlock_conformance::server::RedisCluster;
/// let cluster = RedisCluster::start()?;
/// assert!(cluster.url().starts_with("redis+cluster://"));
/// assert_eq!(cluster.primaries()?.len(), 3);
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<ServerProcess>,
    access: Access,
}

impl RedisCluster {
    /// Starts six nodes, creates the cluster and waits until every node
    /// sees all slots served and every primary has an in-sync replica.
    ///
    /// A node also listens on its port + 10000 (the cluster bus), which the
    /// harness cannot reserve: a node that finds it taken exits just after
    /// it started, and the whole cluster is started again on other ports.
    pub fn start() -> io::Result<Self> {
        Self::start_with(None)
    }

    /// The same cluster over TLS only (clients, replication and the
    /// cluster bus), with `pki`'s server certificate; its
    /// [`url`](Self::url) is `rediss+cluster://…?tls_ca_file=CA`.
    pub fn start_tls(pki: TestPki) -> io::Result<Self> {
        Self::start_with(Some(pki))
    }

    fn start_with(tls: Option<TestPki>) -> io::Result<Self> {
        let node = Arc::new(Node {
            role: Role::Cluster,
            password: PASSWORD.into(),
            tls,
        });
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::start_once(&node) {
                Ok(cluster) => return Ok(cluster),
                Err(e) if attempt < 3 && e.kind() != io::ErrorKind::NotFound => {
                    tracing::warn!("redis cluster start failed, trying other ports: {e}");
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn start_once(node: &Arc<Node>) -> io::Result<Self> {
        let mut nodes = Vec::new();
        for _ in 0..NODES {
            nodes.push(ServerProcess::start(node.clone())?);
        }
        let access = node.access();
        let addresses: Vec<String> = nodes.iter().map(|n| n.addr().to_string()).collect();
        let output = access
            .command()
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()?;
        if !output.status.success() {
            return Err(io::Error::other(format!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )));
        }
        let cluster = Self { nodes, access };
        cluster.wait_healthy()?;
        Ok(cluster)
    }

    /// `redis+cluster://:PASSWORD@` and every node's address
    /// (`rediss+cluster://…?tls_ca_file=CA` over TLS).
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(|n| n.addr().to_string()).collect();
        match &self.access.ca {
            Some(ca) => format!(
                "rediss+cluster://:{PASSWORD}@{}?tls_ca_file={}",
                nodes.join(","),
                ca.display()
            ),
            None => format!("redis+cluster://:{PASSWORD}@{}", nodes.join(",")),
        }
    }

    /// A URL of `node` (for the test's own commands): `redis://:PASSWORD@…`
    /// (`rediss://…?tls_ca_file=CA` over TLS).
    pub fn node_url(&self, node: &ServerProcess) -> String {
        self.access.url(node.addr())
    }

    /// The nodes.
    pub fn nodes(&self) -> &[ServerProcess] {
        &self.nodes
    }

    /// The node on `port`.
    pub fn node(&self, port: u16) -> Option<&ServerProcess> {
        self.nodes.iter().find(|n| n.port() == port)
    }

    /// The primaries that serve slots, as a running node sees them.
    pub fn primaries(&self) -> io::Result<Vec<ClusterPrimary>> {
        let node = self
            .nodes
            .iter()
            .find(|n| n.is_running())
            .ok_or_else(|| io::Error::other("no cluster node is running"))?;
        let text = self.access.cli(node.port(), &["CLUSTER", "NODES"])?;
        let mut primaries = Vec::new();
        for line in text.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 8 || !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            let port = fields[1]
                .split(['@', ','])
                .next()
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse().ok());
            let slots: Vec<(u16, u16)> = fields[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|n| (n, n)),
                })
                .collect();
            if let (Some(port), false) = (port, slots.is_empty()) {
                primaries.push(ClusterPrimary { port, slots });
            }
        }
        primaries.sort_by_key(|p| p.slots.first().copied());
        Ok(primaries)
    }

    /// The slot of `key` (`CLUSTER KEYSLOT`).
    pub fn key_slot(&self, key: &str) -> io::Result<u16> {
        let node = self
            .nodes
            .iter()
            .find(|n| n.is_running())
            .ok_or_else(|| io::Error::other("no cluster node is running"))?;
        let reply = self.access.cli(node.port(), &["CLUSTER", "KEYSLOT", key])?;
        reply
            .trim()
            .parse()
            .map_err(|_| io::Error::other(format!("unexpected CLUSTER KEYSLOT reply {reply:?}")))
    }

    /// Waits until every running node reports `cluster_state:ok`, three
    /// primaries serve all slots, and each has an in-sync replica among the
    /// running nodes (after a fault case restarted a killed node, this is
    /// when the cluster is whole again).
    pub fn wait_healthy(&self) -> io::Result<()> {
        wait_until(
            "the redis cluster did not become healthy",
            HEALTHY_TIMEOUT,
            || {
                for node in self.nodes.iter().filter(|n| n.is_running()) {
                    let info = self.access.cli(node.port(), &["CLUSTER", "INFO"])?;
                    if info_field(&info, "cluster_state").as_deref() != Some("ok") {
                        return Ok(false);
                    }
                }
                let primaries = self.primaries()?;
                let served: u32 = primaries
                    .iter()
                    .flat_map(|p| &p.slots)
                    .map(|(a, b)| u32::from(b - a) + 1)
                    .sum();
                if primaries.len() != PRIMARIES || served != 16384 {
                    return Ok(false);
                }
                let running = self.nodes.iter().filter(|n| n.is_running()).count();
                let mut in_sync = 0;
                for primary in &primaries {
                    let info = self.access.cli(primary.port, &["INFO", "replication"])?;
                    in_sync += info
                        .lines()
                        .filter(|l| l.starts_with("slave") && l.contains("state=online"))
                        .count();
                }
                Ok(in_sync == running - PRIMARIES)
            },
        )
    }

    /// Waits until a node other than `old` serves `slot` (after `old`, its
    /// primary, was killed) and returns its port.
    pub fn wait_failover(&self, old: &ServerProcess, slot: u16) -> io::Result<u16> {
        let mut port = old.port();
        wait_until("no replica was promoted", HEALTHY_TIMEOUT, || {
            let primaries = self.primaries()?;
            match primaries
                .iter()
                .find(|p| p.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
            {
                Some(p) if p.port != old.port() => {
                    port = p.port;
                    Ok(true)
                }
                _ => Ok(false),
            }
        })?;
        Ok(port)
    }
}
