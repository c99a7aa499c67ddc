//! The etcd server: a single-member cluster from the `etcd` binary (Debian
//! package `etcd-server`) on loopback ports, with its data in the harness's
//! temporary directory so a restart keeps every key and revision.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use super::{free_port, ServerKind};

/// File in the server directory that keeps the peer port, so a restart
/// reuses it (the member's advertised peer URL is stored in its data).
const PEER_PORT_FILE: &str = "peer-port";

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

fn peer_port(dir: &Path) -> io::Result<u16> {
    let text = std::fs::read_to_string(dir.join(PEER_PORT_FILE))?;
    text.trim().parse().map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad peer port file in {}: {e}", dir.display()),
        )
    })
}

/// One plain HTTP/1.1 `GET /health` on the client port; `Ok(true)` when the
/// member answers that it is healthy (it has a leader).
fn healthy(port: u16) -> io::Result<bool> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(2)))?;
    stream.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply)?;
    Ok(reply.starts_with("HTTP/1.1 200") && reply.contains("\"health\":\"true\""))
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
        let peer = peer_port(dir).unwrap_or(0);
        let client_url = format!("http://127.0.0.1:{port}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut command = Command::new("etcd");
        command
            .arg("--name")
            .arg("distlock")
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--listen-client-urls")
            .arg(&client_url)
            .arg("--advertise-client-urls")
            .arg(&client_url)
            .arg("--listen-peer-urls")
            .arg(&peer_url)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer_url)
            .arg("--initial-cluster")
            .arg(format!("distlock={peer_url}"))
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--heartbeat-interval")
            .arg("20")
            .arg("--election-timeout")
            .arg("100")
            .arg("--logger")
            .arg("zap")
            .arg("--log-level")
            .arg("warn");
        command
    }

    fn url(&self, addr: SocketAddr) -> String {
        format!("etcd://{addr}")
    }

    fn wait_ready(&self, _dir: &Path, port: u16) -> io::Result<()> {
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
                    format!(
                        "etcd on port {port} did not report healthy in {HEALTH_TIMEOUT:?}: {last}"
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
