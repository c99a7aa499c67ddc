//! What the Sentinel group and the cluster share: a `redis-server` process
//! kind with the options they need, and `redis-cli` to ask and configure
//! them (the harness has no Redis client library of its own).

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::{ServerKind, TestPki};

/// A `redis-server` on 127.0.0.1 with persistence off, requiring
/// `password` (also used to authenticate to its primary), over TLS only
/// (with the PKI's server certificate, for clients and between members) if
/// `tls` is set.
#[derive(Debug, Clone)]
pub(super) struct Node {
    pub(super) role: Role,
    pub(super) password: String,
    pub(super) tls: Option<TestPki>,
}

/// What a [`Node`] is.
#[derive(Debug, Clone)]
pub(super) enum Role {
    /// A data node, replicating `replica_of` if set.
    Data { replica_of: Option<u16> },
    /// A Redis Cluster node (`cluster-enabled yes`, node timeout 1 s).
    Cluster,
    /// A sentinel monitoring the primary on `primary` as `service`, with
    /// quorum 2 and a down-after time of 1 s.
    Sentinel {
        data_password: String,
        service: String,
        primary: u16,
    },
}

/// How long a failed node takes to be declared down, in milliseconds:
/// short, so fault cases see failovers within a few seconds.
pub(super) const DOWN_AFTER_MS: u64 = 1000;

impl Node {
    /// How `redis-cli` reaches nodes like this one.
    pub(super) fn access(&self) -> Access {
        Access {
            password: self.password.clone(),
            ca: self.tls.as_ref().map(|pki| pki.ca.clone()),
        }
    }

    /// The TLS settings as `(name, value)` pairs (command-line options
    /// without their `--`, or configuration-file lines).
    fn tls_settings(&self, port: u16) -> Vec<(&'static str, String)> {
        let Some(pki) = &self.tls else {
            return vec![("port", port.to_string())];
        };
        let mut settings = vec![
            ("port", "0".to_owned()),
            ("tls-port", port.to_string()),
            ("tls-cert-file", pki.server.cert.display().to_string()),
            ("tls-key-file", pki.server.key.display().to_string()),
            ("tls-ca-cert-file", pki.ca.display().to_string()),
            ("tls-auth-clients", "no".to_owned()),
            ("tls-replication", "yes".to_owned()),
        ];
        if matches!(self.role, Role::Cluster) {
            settings.push(("tls-cluster", "yes".to_owned()));
        }
        settings
    }
}

impl ServerKind for Node {
    fn name(&self) -> &'static str {
        match self.role {
            Role::Data { .. } => "redis-node",
            Role::Cluster => "redis-cluster-node",
            Role::Sentinel { .. } => "redis-sentinel",
        }
    }

    fn url_env_var(&self) -> &'static str {
        // A group is one unit: it is never replaced by an external server
        // node by node.
        "DISTLOCK_REDIS_NODE_URL_UNUSED"
    }

    fn command(&self, dir: &Path, port: u16) -> Command {
        let mut command = Command::new("redis-server");
        let password = &self.password;
        if let Role::Sentinel {
            data_password,
            service,
            primary,
        } = &self.role
        {
            // Sentinel rewrites its configuration file: it must be its own,
            // written once per port (a restart keeps what it learnt; a
            // start retried on another port starts afresh).
            let conf = dir.join("sentinel.conf");
            let written = std::fs::read_to_string(&conf).unwrap_or_default();
            let listens =
                |line: &str| line == format!("port {port}") || line == format!("tls-port {port}");
            if !written.lines().any(listens) {
                let mut text = String::new();
                for (name, value) in self.tls_settings(port) {
                    text.push_str(&format!("{name} {value}\n"));
                }
                text.push_str(&format!(
                    "bind 127.0.0.1\ndir {dir}\n\
                     requirepass {password}\nsentinel sentinel-pass {password}\n\
                     sentinel monitor {service} 127.0.0.1 {primary} 2\n\
                     sentinel auth-pass {service} {data_password}\n\
                     sentinel down-after-milliseconds {service} {DOWN_AFTER_MS}\n\
                     sentinel failover-timeout {service} 5000\n\
                     sentinel parallel-syncs {service} 1\n",
                    dir = dir.display()
                ));
                if let Err(e) = std::fs::write(&conf, text) {
                    return Command::new(format!("/nonexistent/cannot write sentinel.conf: {e}"));
                }
            }
            command.arg(conf).arg("--sentinel");
            return command;
        }
        for (name, value) in self.tls_settings(port) {
            command.arg(format!("--{name}")).arg(value);
        }
        command
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir)
            .args(["--requirepass", password])
            .args(["--masterauth", password]);
        match &self.role {
            Role::Data {
                replica_of: Some(primary),
            } => {
                command
                    .args(["--replicaof", "127.0.0.1"])
                    .arg(primary.to_string());
            }
            Role::Cluster => {
                command
                    .args(["--cluster-enabled", "yes"])
                    .args(["--cluster-config-file", "nodes.conf"])
                    .args(["--cluster-node-timeout", &DOWN_AFTER_MS.to_string()]);
            }
            _ => {}
        }
        command
    }

    fn url(&self, addr: SocketAddr) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://:{}@{addr}", self.password)
    }
}

/// How `redis-cli` reaches the members of a group: their password, and
/// the CA to trust if they speak TLS.
#[derive(Debug, Clone)]
pub(super) struct Access {
    pub(super) password: String,
    pub(super) ca: Option<PathBuf>,
}

impl Access {
    /// `redis-cli` with the password and TLS options, without a port.
    pub(super) fn command(&self) -> Command {
        let mut command = Command::new("redis-cli");
        command.args(["-a", &self.password, "--no-auth-warning"]);
        if let Some(ca) = &self.ca {
            command.arg("--tls").arg("--cacert").arg(ca);
        }
        command
    }

    /// Runs `redis-cli -p PORT ARGS...` and returns its output.
    pub(super) fn cli(&self, port: u16, args: &[&str]) -> io::Result<String> {
        let output = self
            .command()
            .args(["-h", "127.0.0.1", "-p"])
            .arg(port.to_string())
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

    /// A client URL for `addr` with this password (and the CA, over TLS).
    pub(super) fn url(&self, addr: SocketAddr) -> String {
        match &self.ca {
            Some(ca) => format!(
                "rediss://:{}@{addr}/?tls_ca_file={}",
                self.password,
                ca.display()
            ),
            None => format!("redis://:{}@{addr}", self.password),
        }
    }
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
