//! A Redis Sentinel group on loopback: a primary, one replica and three
//! sentinels (`redis-server --sentinel`), each its own [`ServerProcess`].

use std::io;
use std::sync::Arc;
use std::time::Duration;

use super::redis_node::{info_field, wait_until, Access, Node, Role};
use super::{ServerProcess, TestPki};

/// The name the sentinels monitor the primary under.
pub const SENTINEL_SERVICE: &str = "distlock-primary";

/// The data nodes' password (`requirepass`, `masterauth`).
const DATA_PASSWORD: &str = "data-pw";

/// The sentinels' own password (`requirepass`, `sentinel-pass`).
const SENTINEL_PASSWORD: &str = "sentinel-pw";

/// How long the group may take to become healthy.
const HEALTHY_TIMEOUT: Duration = Duration::from_secs(60);

/// A Sentinel group: data node 0 starts as the primary, node 1 as its
/// replica; three sentinels monitor it as [`SENTINEL_SERVICE`] (quorum 2,
/// a node is down after 1 s), so killing the primary promotes the replica
/// within a few seconds. The data nodes and the sentinels each require a
/// password. Everything is killed when the group is dropped.
///
/// ```no_run
/// use distlock_conformance::server::RedisSentinel;
/// let group = RedisSentinel::start()?;
/// assert!(group.url().starts_with("redis+sentinel://"));
/// let primary = group.primary()?;
/// primary.kill(); // the replica takes over within a few seconds
/// group.rejoin(primary)?; // the old primary is back, as a replica
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug)]
pub struct RedisSentinel {
    data: Vec<ServerProcess>,
    sentinels: Vec<ServerProcess>,
    /// The data nodes' password and CA.
    data_access: Access,
    /// The sentinels' password and CA.
    access: Access,
}

impl RedisSentinel {
    /// Starts the group and waits until the sentinels agree on the primary
    /// and the replica is in sync.
    pub fn start() -> io::Result<Self> {
        Self::start_with(None)
    }

    /// The same group over TLS only (clients, replication and sentinels),
    /// with `pki`'s server certificate; its [`url`](Self::url) is
    /// `rediss+sentinel://…&tls_ca_file=CA`.
    pub fn start_tls(pki: TestPki) -> io::Result<Self> {
        Self::start_with(Some(pki))
    }

    fn start_with(tls: Option<TestPki>) -> io::Result<Self> {
        let data = |replica_of| Node {
            role: Role::Data { replica_of },
            password: DATA_PASSWORD.into(),
            tls: tls.clone(),
        };
        let primary_node = data(None);
        let data_access = primary_node.access();
        let primary = ServerProcess::start(Arc::new(primary_node))?;
        let replica = ServerProcess::start(Arc::new(data(Some(primary.port()))))?;
        let sentinel = Node {
            role: Role::Sentinel {
                data_password: DATA_PASSWORD.into(),
                service: SENTINEL_SERVICE.into(),
                primary: primary.port(),
            },
            password: SENTINEL_PASSWORD.into(),
            tls: tls.clone(),
        };
        let access = sentinel.access();
        let sentinel = Arc::new(sentinel);
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            sentinels.push(ServerProcess::start(sentinel.clone())?);
        }
        let group = Self {
            data: vec![primary, replica],
            sentinels,
            data_access,
            access,
        };
        group.wait_healthy()?;
        Ok(group)
    }

    /// `redis+sentinel://:PASSWORD@127.0.0.1:S1,127.0.0.1:S2,127.0.0.1:S3/SERVICE?sentinel_password=...`
    /// (`rediss+sentinel://…&tls_ca_file=CA` over TLS).
    pub fn url(&self) -> String {
        let sentinels: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| s.addr().to_string())
            .collect();
        let (scheme, ca) = match &self.access.ca {
            Some(ca) => ("rediss", format!("&tls_ca_file={}", ca.display())),
            None => ("redis", String::new()),
        };
        format!(
            "{scheme}+sentinel://:{DATA_PASSWORD}@{}/{SENTINEL_SERVICE}?sentinel_password={SENTINEL_PASSWORD}{ca}",
            sentinels.join(",")
        )
    }

    /// The data nodes (node 0 started as the primary).
    pub fn nodes(&self) -> &[ServerProcess] {
        &self.data
    }

    /// The sentinels.
    pub fn sentinels(&self) -> &[ServerProcess] {
        &self.sentinels
    }

    /// A URL of data node `node` (for the test's own commands):
    /// `redis://:PASSWORD@…` (`rediss://…?tls_ca_file=CA` over TLS).
    pub fn node_url(&self, node: &ServerProcess) -> String {
        self.data_access.url(node.addr())
    }

    /// A URL of `sentinel` (for the test's own commands), as
    /// [`node_url`](Self::node_url).
    pub fn sentinel_url(&self, sentinel: &ServerProcess) -> String {
        self.access.url(sentinel.addr())
    }

    /// The data node the sentinels name as the primary now.
    pub fn primary(&self) -> io::Result<&ServerProcess> {
        let port = self.primary_port()?;
        self.data.iter().find(|n| n.port() == port).ok_or_else(|| {
            io::Error::other(format!(
                "the sentinels name port {port}, not a node of the group"
            ))
        })
    }

    /// The port of the primary, as the first sentinel that answers says.
    fn primary_port(&self) -> io::Result<u16> {
        let mut last = None;
        for sentinel in self.sentinels.iter().filter(|s| s.is_running()) {
            match self.access.cli(
                sentinel.port(),
                &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_SERVICE],
            ) {
                Ok(reply) => {
                    if let Some(port) = reply.lines().nth(1).and_then(|p| p.trim().parse().ok()) {
                        return Ok(port);
                    }
                    last = Some(io::Error::other(format!("unexpected reply {reply:?}")));
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no sentinel is running")))
    }

    /// Waits until the sentinels name another primary than `old` (after
    /// `old` was killed) and returns it.
    pub fn wait_failover(&self, old: &ServerProcess) -> io::Result<&ServerProcess> {
        wait_until(
            "the sentinels did not promote a replica",
            HEALTHY_TIMEOUT,
            || Ok(self.primary_port()? != old.port()),
        )?;
        self.primary()
    }

    /// Starts a killed data node again as a replica of the current primary
    /// (what Sentinel would tell it within about 10 s, told at once) and
    /// waits until the group is healthy.
    pub fn rejoin(&self, node: &ServerProcess) -> io::Result<()> {
        node.restart()?;
        let primary = self.primary_port()?;
        self.data_access.cli(
            node.port(),
            &["REPLICAOF", "127.0.0.1", &primary.to_string()],
        )?;
        self.wait_healthy()
    }

    /// Waits until every running sentinel names the same running primary,
    /// which has every other running data node as an in-sync replica and
    /// is known to all three sentinels. After a fault case restarted a
    /// killed node, this is when the group is whole again.
    pub fn wait_healthy(&self) -> io::Result<()> {
        wait_until(
            "the sentinel group did not become healthy",
            HEALTHY_TIMEOUT,
            || {
                let mut named = Vec::new();
                for sentinel in self.sentinels.iter().filter(|s| s.is_running()) {
                    let reply = self
                        .access
                        .cli(sentinel.port(), &["SENTINEL", "MASTER", SENTINEL_SERVICE])?;
                    let fields: Vec<&str> = reply.lines().collect();
                    let field = |name: &str| {
                        fields
                            .chunks(2)
                            .find(|pair| pair[0] == name)
                            .and_then(|pair| pair.get(1).copied())
                            .unwrap_or("")
                    };
                    let running_sentinels =
                        self.sentinels.iter().filter(|s| s.is_running()).count();
                    if field("flags") != "master"
                        || field("num-other-sentinels").parse::<usize>().ok()
                            != Some(running_sentinels - 1)
                    {
                        return Ok(false);
                    }
                    named.push(field("port").to_owned());
                }
                let Some(port) = named.first() else {
                    return Ok(false);
                };
                if named.iter().any(|p| p != port) {
                    return Ok(false);
                }
                let Some(primary) = self
                    .data
                    .iter()
                    .find(|n| n.port().to_string() == *port && n.is_running())
                else {
                    return Ok(false);
                };
                let info = self
                    .data_access
                    .cli(primary.port(), &["INFO", "replication"])?;
                let replicas = self.data.iter().filter(|n| n.is_running()).count() - 1;
                let online = info
                    .lines()
                    .filter(|l| l.starts_with("slave") && l.contains("state=online"))
                    .count();
                Ok(info_field(&info, "role").as_deref() == Some("master") && online == replicas)
            },
        )
    }
}
