//! Real lock servers for the suite: started from the binaries on PATH on a
//! free loopback port in a temporary directory, killable and restartable for
//! fault cases; or an existing server named by an environment variable.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

mod etcd;
mod postgres;
mod redis;

pub use self::etcd::Etcd;
pub use self::postgres::Postgres;
pub use self::redis::Redis;

/// A kind of lock server the harness knows how to run.
///
/// Implementations only say how to launch the process and what URL reaches
/// it; [`ServerProcess`] does the rest (ports, temp dir, readiness, restart).
pub trait ServerKind: Send + Sync + 'static {
    /// Short name (`redis`), used in messages.
    fn name(&self) -> &'static str;

    /// The environment variable that names an existing server to use instead
    /// of starting one (`DISTLOCK_REDIS_URL`).
    fn url_env_var(&self) -> &'static str;

    /// One-time preparation of `dir` before the first start (e.g. `initdb`).
    fn prepare(&self, dir: &Path) -> io::Result<()> {
        let _ = dir;
        Ok(())
    }

    /// The command that runs the server in the foreground on `port`, with its
    /// data in `dir`. Restarts reuse the same port and directory.
    fn command(&self, dir: &Path, port: u16) -> Command;

    /// The client URL for a server listening on `addr` (`127.0.0.1:port`;
    /// the fault proxy passes its own address here).
    fn url(&self, addr: SocketAddr) -> String;

    /// Extra readiness check after the port accepts connections (default: none).
    fn wait_ready(&self, dir: &Path, port: u16) -> io::Result<()> {
        let _ = (dir, port);
        Ok(())
    }
}

/// A server process owned by the harness. Killed when dropped.
#[derive(Debug)]
pub struct ServerProcess {
    kind_name: &'static str,
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
    command: fn(&Self) -> Command,
}

/// Where the suite's server is: one the harness runs, or an external one.
#[derive(Debug)]
pub enum ServerHandle {
    /// Started by the harness; fault cases may kill and restart it.
    Owned(ServerProcess),
    /// Named by an environment variable; fault cases that need to control
    /// the process are ignored.
    External(String),
}

/// Picks a free loopback port (bind to port 0, read it, close).
pub fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Waits until something accepts TCP connections on `port`.
pub fn wait_for_port(port: u16, timeout: Duration) -> io::Result<()> {
    let deadline = Instant::now() + timeout;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("server on port {port} did not come up in {timeout:?}: {e}"),
                ))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}
