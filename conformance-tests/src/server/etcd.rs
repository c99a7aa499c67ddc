//! The etcd server: a single-member cluster from the `etcd` binary (Debian
//! package `etcd-server`) on loopback ports, with its data in the harness's
//! temporary directory so a restart keeps every key and revision.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use super::{free_port, ServerKind};

/// File in the server directory that keeps the peer port, so a restart
/// reuses it (the member's advertised peer URL is stored in its data).
pub(super) const PEER_PORT_FILE: &str = "peer-port";

/// How long to wait for `/health` to report a leader after the client port
/// accepts connections.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(30);

/// etcd, started as `etcd --name distlock ...` on `127.0.0.1`.
///
/// Heartbeat 20 ms and election timeout 100 ms make startup fast and let the
/// server honour 1-second leases (etcd's minimum lease TTL is
/// 1.5 × election timeout, rounded up to whole seconds).
///
/// The URL is `etcd://127.0.0.1:PORT`; set `DISTLOCK_ETCD_URL` to run
/// against an existing cluster instead.
#[derive(Debug, Clone, Copy, Default)]
pub struct Etcd;

/// A port kept in the file `name` of the server directory.
pub(super) fn port_file(dir: &Path, name: &str) -> io::Result<u16> {
    let text = std::fs::read_to_string(dir.join(name))?;
    text.trim().parse().map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad port file {name} in {}: {e}", dir.display()),
        )
    })
}

/// One plain HTTP/1.1 `GET /health` on the client port; `Ok(true)` when the
/// member answers that it is healthy (it has a leader).
fn healthy(port: u16) -> io::Result<bool> {
    Ok(http_get(port, "/health")?.contains("\"health\":\"true\""))
}

/// One plain HTTP `GET path` on `127.0.0.1:port`: the whole reply if its
/// status is 200, else an error. HTTP/1.0, so the body is never chunked.
pub(super) fn http_get(port: u16, path: &str) -> io::Result<String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(2)))?;
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply)?;
    if reply.split_whitespace().nth(1) == Some("200") {
        Ok(reply)
    } else {
        Err(io::Error::other(format!(
            "GET {path} on port {port}: {}",
            reply.lines().next().unwrap_or("no reply")
        )))
    }
}

/// etcd's gRPC requests started so far on the member whose client port is
/// `port`, by method (`Range`, `Txn`, `LeaseGrant`, ...): its
/// `grpc_server_started_total` counters, read from the Prometheus endpoint
/// `/metrics` on the client port. Tests count a call's requests as the
/// difference of two readings. A stream (`Watch`, `LeaseKeepAlive`)
/// counts once however many requests it carries: see
/// [`etcd_grpc_received`].
pub fn etcd_grpc_started(port: u16) -> io::Result<BTreeMap<String, u64>> {
    grpc_counters(port, "grpc_server_started_total")
}

/// etcd's gRPC request messages received so far on the member whose client
/// port is `port`, by method: its `grpc_server_msg_received_total`
/// counters. A unary call is one message; a stream counts each request it
/// carries (a watch created or cancelled, a lease keep-alive), which
/// [`etcd_grpc_started`] counts once per stream.
pub fn etcd_grpc_received(port: u16) -> io::Result<BTreeMap<String, u64>> {
    grpc_counters(port, "grpc_server_msg_received_total")
}

/// The per-method counters `metric` in etcd's `/metrics`.
fn grpc_counters(port: u16, metric: &str) -> io::Result<BTreeMap<String, u64>> {
    let body = http_get(port, "/metrics")?;
    let mut by_method = BTreeMap::new();
    let prefix = format!("{metric}{{");
    for line in body.lines() {
        let Some(rest) = line.strip_prefix(prefix.as_str()) else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let method = labels
            .split(',')
            .find_map(|l| l.strip_prefix("grpc_method=\""))
            .map(|m| m.trim_end_matches('"').to_owned())
            .ok_or_else(|| io::Error::other(format!("no grpc_method label in {line:?}")))?;
        let value: f64 = value
            .trim()
            .parse()
            .map_err(|e| io::Error::other(format!("bad counter in {line:?}: {e}")))?;
        *by_method.entry(method).or_insert(0) += value as u64;
    }
    Ok(by_method)
}

/// The value of the unlabelled metric `name` (a gauge such as
/// `etcd_debugging_mvcc_watcher_total`, the watches open on the member)
/// on the member whose client port is `port`, from `/metrics`.
pub fn etcd_metric(port: u16, name: &str) -> io::Result<f64> {
    let body = http_get(port, "/metrics")?;
    body.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .ok_or_else(|| io::Error::other(format!("no metric {name} in etcd's /metrics")))?
        .trim()
        .parse()
        .map_err(|e| io::Error::other(format!("bad value of {name}: {e}")))
}

impl ServerKind for Etcd {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn url_env_var(&self) -> &'static str {
        "DISTLOCK_ETCD_URL"
    }

    fn prepare(&self, dir: &Path) -> io::Result<()> {
        let port = free_port()?;
        std::fs::write(dir.join(PEER_PORT_FILE), port.to_string())
    }

    fn command(&self, dir: &Path, port: u16) -> Command {
        // `prepare` wrote the file; if it is unreadable the server cannot
        // start with its old identity, so fall back to a port that fails
        // loudly (etcd refuses port 0 as a peer URL) rather than guessing.
        let peer = port_file(dir, PEER_PORT_FILE).unwrap_or(0);
        let peer_url = format!("http://127.0.0.1:{peer}");
        member_command(
            "distlock",
            dir,
            &format!("http://127.0.0.1:{port}"),
            &peer_url,
            &format!("distlock={peer_url}"),
            SINGLE,
        )
    }

    fn url(&self, addr: SocketAddr) -> String {
        format!("etcd://{addr}")
    }

    fn wait_ready(&self, _dir: &Path, port: u16) -> io::Result<()> {
        wait_healthy(port)
    }
}

/// `ServerKind` for `$kind`: [`Etcd`] with the command-line setting
/// `$flag` at the kind's value. Its URL variable `$env` is one nobody
/// sets: the setting is this server's, so the harness always starts it.
macro_rules! etcd_with_setting {
    ($kind:ty, $name:literal, $env:literal, $flag:literal) => {
        impl ServerKind for $kind {
            fn name(&self) -> &'static str {
                $name
            }

            fn url_env_var(&self) -> &'static str {
                $env
            }

            fn prepare(&self, dir: &Path) -> io::Result<()> {
                Etcd.prepare(dir)
            }

            fn command(&self, dir: &Path, port: u16) -> Command {
                let mut command = Etcd.command(dir, port);
                command.arg($flag).arg(self.0.to_string());
                command
            }

            fn url(&self, addr: SocketAddr) -> String {
                Etcd.url(addr)
            }

            fn wait_ready(&self, dir: &Path, port: u16) -> io::Result<()> {
                Etcd.wait_ready(dir, port)
            }
        }
    };
}

/// `etcd` as [`Etcd`], taking at most this many operations in one
/// transaction (`--max-txn-ops`; etcd's default is 128): for a backend's
/// handling of a server configured below the default.
#[derive(Debug, Clone, Copy)]
pub struct EtcdMaxTxnOps(pub u32);

etcd_with_setting!(
    EtcdMaxTxnOps,
    "etcd-max-txn-ops",
    "DISTLOCK_ETCD_MAX_TXN_OPS_URL",
    "--max-txn-ops"
);

/// `etcd` as [`Etcd`] with a backend space quota of this many bytes
/// (`--quota-backend-bytes`; etcd's default is 2 GiB): for a backend's
/// handling of a server whose database is full (etcd then raises its
/// `NOSPACE` alarm and refuses every write that adds data).
#[derive(Debug, Clone, Copy)]
pub struct EtcdSpaceQuota(pub u64);

etcd_with_setting!(
    EtcdSpaceQuota,
    "etcd-space-quota",
    "DISTLOCK_ETCD_SPACE_QUOTA_URL",
    "--quota-backend-bytes"
);

/// Raft timing of a member, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timing {
    pub(super) heartbeat_ms: u32,
    pub(super) election_ms: u32,
}

/// A single member never waits for peers, so it can be quick: heartbeat
/// 20 ms, election timeout 100 ms.
pub(super) const SINGLE: Timing = Timing {
    heartbeat_ms: 20,
    election_ms: 100,
};

/// `etcd` for one member `name` with its data in `dir/data`, serving
/// clients on `client_url` and peers on `peer_url`, in a cluster of
/// `initial_cluster` (`name=peer_url,...`). A data directory that exists
/// already keeps its identity (etcd ignores the initial-cluster flags
/// then), so restarts reuse it.
///
/// `timing` is the Raft heartbeat interval and election timeout in ms;
/// short ones make startup and elections fast, and etcd honours 1-second
/// leases with an election timeout up to 666 ms (its minimum lease TTL is
/// 1.5 × election timeout, rounded up to whole seconds).
pub(super) fn member_command(
    name: &str,
    dir: &Path,
    client_url: &str,
    peer_url: &str,
    initial_cluster: &str,
    timing: Timing,
) -> Command {
    let mut command = Command::new("etcd");
    command
        .arg("--name")
        .arg(name)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--listen-client-urls")
        .arg(client_url)
        .arg("--advertise-client-urls")
        .arg(client_url)
        .arg("--listen-peer-urls")
        .arg(peer_url)
        .arg("--initial-advertise-peer-urls")
        .arg(peer_url)
        .arg("--initial-cluster")
        .arg(initial_cluster)
        .arg("--initial-cluster-state")
        .arg("new")
        .arg("--heartbeat-interval")
        .arg(timing.heartbeat_ms.to_string())
        .arg("--election-timeout")
        .arg(timing.election_ms.to_string())
        .arg("--logger")
        .arg("zap")
        .arg("--log-level")
        .arg("warn");
    command
}

/// Waits until `GET /health` on the plain-HTTP `port` reports a leader.
pub(super) fn wait_healthy(port: u16) -> io::Result<()> {
    let deadline = Instant::now() + HEALTH_TIMEOUT;
    loop {
        let last = match healthy(port) {
            Ok(true) => return Ok(()),
            Ok(false) => "not healthy yet".to_owned(),
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("etcd on port {port} did not report healthy in {HEALTH_TIMEOUT:?}: {last}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
