//! What the Sentinel group and the cluster share: a `redis-server` process
//! kind with the options they need, and `redis-cli` to ask and configure
//! them (the harness has no Redis client library of its own).

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use super::ServerKind;

/// A `redis-server` on 127.0.0.1 with persistence off, requiring
/// `password` (also used to authenticate to its primary).
#[derive(Debug, Clone)]
pub(super) enum Node {
    /// A data node, replicating `replica_of` if set.
    Data {
        password: String,
        replica_of: Option<u16>,
    },
    /// A Redis Cluster node (`cluster-enabled yes`, node timeout 1 s).
    Cluster { password: String },
    /// A sentinel monitoring the primary on `primary` as `service`, with
    /// quorum 2 and a down-after time of 1 s.
    Sentinel {
        password: String,
        data_password: String,
        service: String,
        primary: u16,
    },
}

/// How long a failed node takes to be declared down, in milliseconds:
/// short, so fault cases see failovers within a few seconds.
pub(super) const DOWN_AFTER_MS: u64 = 1000;

impl ServerKind for Node {
    fn name(&self) -> &'static str {
        match self {
            Node::Data { .. } => "redis-node",
            Node::Cluster { .. } => "redis-cluster-node",
            Node::Sentinel { .. } => "redis-sentinel",
        }
    }

    fn url_env_var(&self) -> &'static str {
        // A group is one unit: it is never replaced by an external server
        // node by node (see the groups' own environment variables).
        "DISTLOCK_REDIS_NODE_URL_UNUSED"
    }

    fn command(&self, dir: &Path, port: u16) -> Command {
        let mut command = Command::new("redis-server");
        if let Node::Sentinel {
            password,
            data_password,
            service,
            primary,
        } = self
        {
            // Sentinel rewrites its configuration file: it must be its own,
            // written once per port (a restart keeps what it learnt; a
            // start retried on another port starts afresh).
            let conf = dir.join("sentinel.conf");
            let written = std::fs::read_to_string(&conf).unwrap_or_default();
            if !written.lines().any(|l| l == format!("port {port}")) {
                let text = format!(
                    "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                     requirepass {password}\nsentinel sentinel-pass {password}\n\
                     sentinel monitor {service} 127.0.0.1 {primary} 2\n\
                     sentinel auth-pass {service} {data_password}\n\
                     sentinel down-after-milliseconds {service} {DOWN_AFTER_MS}\n\
                     sentinel failover-timeout {service} 5000\n\
                     sentinel parallel-syncs {service} 1\n",
                    dir = dir.display()
                );
                if let Err(e) = std::fs::write(&conf, text) {
                    return Command::new(format!("/nonexistent/cannot write sentinel.conf: {e}"));
                }
            }
            command.arg(conf).arg("--sentinel");
            return command;
        }
        command
            .arg("--port")
            .arg(port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir);
        match self {
            Node::Data {
                password,
                replica_of,
            } => {
                command
                    .args(["--requirepass", password])
                    .args(["--masterauth", password]);
                if let Some(primary) = replica_of {
                    command
                        .args(["--replicaof", "127.0.0.1"])
                        .arg(primary.to_string());
                }
            }
            Node::Cluster { password } => {
                command
                    .args(["--requirepass", password])
                    .args(["--masterauth", password])
                    .args(["--cluster-enabled", "yes"])
                    .args(["--cluster-config-file", "nodes.conf"])
                    .args(["--cluster-node-timeout", &DOWN_AFTER_MS.to_string()]);
            }
            Node::Sentinel { .. } => {}
        }
        command
    }

    fn url(&self, addr: SocketAddr) -> String {
        match self {
            Node::Data { password, .. } | Node::Cluster { password } => {
                format!("redis://:{password}@{addr}")
            }
            Node::Sentinel { password, .. } => format!("redis://:{password}@{addr}"),
        }
    }
}

/// Runs `redis-cli -p PORT -a PASSWORD ARGS...` and returns its output.
pub(super) fn cli(port: u16, password: &str, args: &[&str]) -> io::Result<String> {
    let output = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p"])
        .arg(port.to_string())
        .args(["-a", password, "--no-auth-warning"])
        .args(args)
        .output()
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot run redis-cli (installed with redis-server): {e}"),
            )
        })?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        return Err(io::Error::other(format!(
            "redis-cli -p {port} {}: {}{}",
            args.join(" "),
            text,
            String::from_utf8_lossy(&output.stderr)
        )));
    }
    Ok(text)
}

/// The value of `field` in an `INFO`-style reply (`field:value` lines).
pub(super) fn info_field(info: &str, field: &str) -> Option<String> {
    info.lines().find_map(|line| {
        line.trim_end()
            .strip_prefix(field)
            .and_then(|rest| rest.strip_prefix(':'))
            .map(str::to_owned)
    })
}

/// Polls `check` every 50 ms until it returns `Ok(true)` or `timeout`
/// passes; the error names `what` and the last answer.
pub(super) fn wait_until(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> io::Result<bool>,
) -> io::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match check() {
            Ok(true) => return Ok(()),
            Ok(false) => "not yet".to_owned(),
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{what} within {timeout:?} ({last})"),
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
