//! A 3-member (or any size) etcd cluster on loopback: one
//! [`ServerProcess`] per member, each killable and restartable, with the
//! leader found from the members' metrics.

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::etcd::{http_get, member_command, wait_healthy, Timing};
use super::{free_port, ServerKind, ServerProcess};

/// Heartbeat 50 ms, election timeout 500 ms: a new leader within about a
/// second of the old one's death, while a member starved of CPU on a busy
/// test machine (the first version had 20/100) does not keep calling
/// elections; still short enough for 1-second leases.
const RAFT: Timing = Timing {
    heartbeat_ms: 50,
    election_ms: 500,
};

/// How long [`EtcdCluster::wait_for_leader`] waits by default.
const LEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// One member of an [`EtcdCluster`]: its name and peer port are fixed when
/// the cluster is planned, since every member's `--initial-cluster` lists
/// all peers; the client port is the harness's.
#[derive(Debug, Clone)]
struct Member {
    name: String,
    peer_port: u16,
    initial_cluster: String,
}

impl ServerKind for Member {
    fn name(&self) -> &'static str {
        "etcd-cluster-member"
    }

    fn url_env_var(&self) -> &'static str {
        "DISTLOCK_ETCD_CLUSTER_URL"
    }

    fn command(&self, dir: &Path, port: u16) -> Command {
        member_command(
            &self.name,
            dir,
            &format!("http://127.0.0.1:{port}"),
            &format!("http://127.0.0.1:{}", self.peer_port),
            &self.initial_cluster,
            RAFT,
        )
    }

    fn url(&self, addr: SocketAddr) -> String {
        format!("etcd://{addr}")
    }

    /// Healthy means the member sees a leader, which needs a quorum: start
    /// the members in parallel (as [`EtcdCluster::start`] does).
    fn wait_ready(&self, _dir: &Path, port: u16) -> io::Result<()> {
        wait_healthy(port)
    }
}

/// An etcd cluster of several members on loopback ports, each a
/// [`ServerProcess`] with its own data directory (heartbeat 50 ms,
/// election timeout 500 ms, so a new leader is elected about a second after
/// the old one died). Every member is killed and its directory removed on
/// drop.
///
/// Its [`url`](Self::url) lists every member:
/// `etcd://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3`.
///
/// ```no_run
/// use distlock_conformance::server::EtcdCluster;
/// let cluster = EtcdCluster::start(3)?;
/// let leader = cluster.wait_for_leader()?;
/// cluster.member(leader).kill();
/// let next = cluster.wait_for_leader()?;
/// assert_ne!(leader, next);
/// cluster.member(leader).restart()?;
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<Arc<ServerProcess>>,
}

impl EtcdCluster {
    /// Starts a new cluster of `size` members (all at once: a member is
    /// ready only when a quorum elected a leader).
    pub fn start(size: usize) -> io::Result<Self> {
        let mut peers = Vec::with_capacity(size);
        for i in 0..size {
            peers.push((format!("m{i}"), free_port()?));
        }
        let initial_cluster = peers
            .iter()
            .map(|(name, port)| format!("{name}=http://127.0.0.1:{port}"))
            .collect::<Vec<_>>()
            .join(",");
        let started: Vec<io::Result<ServerProcess>> = std::thread::scope(|scope| {
            let starts: Vec<_> = peers
                .iter()
                .map(|(name, peer_port)| {
                    let member = Member {
                        name: name.clone(),
                        peer_port: *peer_port,
                        initial_cluster: initial_cluster.clone(),
                    };
                    scope.spawn(move || ServerProcess::start(Arc::new(member)))
                })
                .collect();
            starts
                .into_iter()
                .map(|start| {
                    start
                        .join()
                        .unwrap_or_else(|_| Err(io::Error::other("member start panicked")))
                })
                .collect()
        });
        let members = started
            .into_iter()
            .collect::<io::Result<Vec<_>>>()?
            .into_iter()
            .map(Arc::new)
            .collect();
        Ok(Self { members })
    }

    /// The URL listing every member.
    pub fn url(&self) -> String {
        let addrs: Vec<String> = self.members.iter().map(|m| m.addr().to_string()).collect();
        format!("etcd://{}", addrs.join(","))
    }

    /// How many members the cluster has.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the cluster has no members (never, once started).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Member `i` (0-based), to kill, restart or pause.
    pub fn member(&self, i: usize) -> &Arc<ServerProcess> {
        &self.members[i]
    }

    /// Every member.
    pub fn members(&self) -> &[Arc<ServerProcess>] {
        &self.members
    }

    /// The member that reports itself leader (`etcd_server_is_leader 1` in
    /// its metrics), if a running one does now.
    pub fn leader(&self) -> Option<usize> {
        self.members.iter().position(|m| {
            m.is_running()
                && http_get(m.port(), "/metrics").is_ok_and(|metrics| {
                    metrics
                        .lines()
                        .any(|line| line.trim() == "etcd_server_is_leader 1")
                })
        })
    }

    /// Waits (up to 30 s) until a running member is leader and returns it.
    pub fn wait_for_leader(&self) -> io::Result<usize> {
        let deadline = Instant::now() + LEADER_TIMEOUT;
        loop {
            if let Some(leader) = self.leader() {
                return Ok(leader);
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no etcd member became leader within {LEADER_TIMEOUT:?}"),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills every member (SIGKILL).
    pub fn kill_all(&self) {
        for member in &self.members {
            member.kill();
        }
    }

    /// Restarts every member that is not running, all at once (each waits
    /// for a leader, which needs a quorum), with its data.
    pub fn restart_stopped(&self) -> io::Result<()> {
        std::thread::scope(|scope| {
            let restarts: Vec<_> = self
                .members
                .iter()
                .filter(|m| !m.is_running())
                .map(|m| scope.spawn(move || m.restart()))
                .collect();
            restarts.into_iter().try_for_each(|restart| {
                restart
                    .join()
                    .unwrap_or_else(|_| Err(io::Error::other("member restart panicked")))
            })
        })
    }
}
