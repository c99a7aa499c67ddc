//! Real lock servers for the suite: started from the binaries on PATH on a
//! free loopback port in a temporary directory, killable and restartable for
//! fault cases; or an existing server named by an environment variable.

use std::collections::BTreeSet;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod etcd;
mod etcd_cluster;
mod etcd_tls;
mod pgbouncer;
mod pki;
mod pooled_postgres;
mod postgres;
mod postgres_tls;
mod reaper;
mod redis;
mod redis_cluster;
mod redis_node;
mod redis_sentinel;
mod redis_tls;

pub use self::etcd::{
    etcd_grpc_received, etcd_grpc_started, etcd_metric, Etcd, EtcdMaxTxnOps, EtcdSpaceQuota,
};
pub use self::etcd_cluster::EtcdCluster;
pub use self::etcd_tls::EtcdTls;
pub use self::pgbouncer::{PgBouncer, PoolMode};
pub use self::pki::{CertFiles, TestPki};
pub use self::pooled_postgres::PooledPostgres;
pub use self::postgres::Postgres;
pub use self::postgres_tls::{PostgresTls, CERT_USER};
pub use self::reaper::{reap_when_process_exits, PidFile};
pub use self::redis::Redis;
pub use self::redis_cluster::{ClusterPrimary, RedisCluster};
pub use self::redis_sentinel::{RedisSentinel, SENTINEL_SERVICE};
pub use self::redis_tls::{RedisTls, RedisTlsAuth};

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

    /// Whether a client of [`url`](Self::url)`(addr)` reaches the server
    /// only through `addr`, so that a fault proxy there cuts off all of
    /// it (default: yes). PgBouncer in transaction mode says no: its
    /// URL sends the client's listener past the pooler (`listen_url`).
    fn carries_every_connection(&self) -> bool {
        true
    }

    /// Extra readiness check after the port accepts connections (default: none).
    fn wait_ready(&self, dir: &Path, port: u16) -> io::Result<()> {
        let _ = (dir, port);
        Ok(())
    }
}

/// A server process owned by the harness, in its own temporary directory on
/// its own loopback port. Killed and its directory removed when dropped.
pub struct ServerProcess {
    kind: Arc<dyn ServerKind>,
    dir: PathBuf,
    port: u16,
    child: Mutex<Option<Child>>,
}

impl std::fmt::Debug for ServerProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerProcess")
            .field("kind", &self.kind.name())
            .field("port", &self.port)
            .field("dir", &self.dir)
            .finish()
    }
}

/// How often a start is tried on fresh ports before giving up.
const START_ATTEMPTS: u32 = 5;

/// The start error that means "try another port".
const EXITED_DURING_STARTUP: &str = "the server process exited during startup";

/// How long a server may take to start.
const START_TIMEOUT: Duration = Duration::from_secs(60);

impl ServerProcess {
    /// Starts a server of `kind` on a free loopback port. Fails with a clear
    /// message if the binary is missing (never a silent pass).
    pub fn start(kind: Arc<dyn ServerKind>) -> io::Result<Self> {
        // The pid says which test process left a directory behind.
        let dir = std::env::temp_dir().join(crate::naming::unique_name(&format!(
            "distlock-{}-{}",
            kind.name(),
            std::process::id()
        )));
        std::fs::create_dir_all(&dir)?;
        let mut server = Self {
            kind,
            dir,
            port: free_port()?,
            child: Mutex::new(None),
        };
        server.kind.prepare(&server.dir)?;
        // A server that exits at once usually found its port taken (another
        // process bound it after we chose it): try another port.
        let mut attempts = 0;
        loop {
            attempts += 1;
            match server.spawn() {
                Ok(()) => return Ok(server),
                Err(e) if e.kind() == io::ErrorKind::NotFound || attempts >= START_ATTEMPTS => {
                    return Err(e)
                }
                Err(e) if e.to_string().contains(EXITED_DURING_STARTUP) => {
                    server.port = free_port()?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn spawn(&self) -> io::Result<()> {
        let mut command = self.kind.command(&self.dir, self.port);
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(
                self.dir.join("server.log"),
            )?));
        let program = command.get_program().to_string_lossy().into_owned();
        let child = command.spawn().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot start the {} server `{program}`: {e}. Install it (the README's test command does) or set {} to an existing server",
                    self.kind.name(),
                    self.kind.url_env_var()
                ),
            )
        })?;
        *self.child.lock().unwrap_or_else(|e| e.into_inner()) = Some(child);
        let ready = self
            .wait_for_port_while_running(START_TIMEOUT)
            .and_then(|()| self.wait_ready_while_running());
        if let Err(e) = ready {
            let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
            self.kill();
            return Err(io::Error::new(
                e.kind(),
                format!("{} server did not start: {e}\n{log}", self.kind.name()),
            ));
        }
        Ok(())
    }

    /// As [`wait_for_port`], but fails at once if the process exits (a
    /// server refusing to start, e.g. while its old instance's children
    /// still hold resources) instead of waiting out the timeout.
    fn wait_for_port_while_running(&self, timeout: Duration) -> io::Result<()> {
        let deadline = Instant::now() + timeout;
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        loop {
            self.still_running()?;
            match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() >= deadline => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "server on port {} did not come up in {timeout:?}: {e}",
                            self.port
                        ),
                    ))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// The kind's readiness check, failing at once if the process exits
    /// meanwhile: a server may open its port and exit after (PostgreSQL
    /// listens before it finds its killed instance's children still holding
    /// the shared memory), and the check would wait out its own timeout.
    fn wait_ready_while_running(&self) -> io::Result<()> {
        let (tx, rx) = std::sync::mpsc::channel();
        let (kind, dir, port) = (Arc::clone(&self.kind), self.dir.clone(), self.port);
        // Detached: after an exit it ends at its own timeout, unread.
        std::thread::spawn(move || {
            let _ = tx.send(kind.wait_ready(&dir, port));
        });
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(ready) => return ready,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => self.still_running()?,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(io::Error::other("the readiness check panicked"))
                }
            }
        }
    }

    /// An error if the process has exited.
    fn still_running(&self) -> io::Result<()> {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        match child.as_mut().map(Child::try_wait) {
            Some(Ok(Some(status))) => Err(io::Error::other(format!(
                "{EXITED_DURING_STARTUP} ({status})"
            ))),
            _ => Ok(()),
        }
    }

    /// The kind of server.
    pub fn kind(&self) -> &Arc<dyn ServerKind> {
        &self.kind
    }

    /// The loopback port it listens on (kept across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:port`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The client URL of this server.
    pub fn url(&self) -> String {
        self.kind.url(self.addr())
    }

    /// The server's data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Kills the process and every process it started with SIGKILL, and
    /// reaps it. Idempotent.
    pub fn kill(&self) {
        if let Some(mut child) = self.child.lock().unwrap_or_else(|e| e.into_inner()).take() {
            // Its children too: a PostgreSQL backend outlives a killed
            // postmaster for a moment and would still answer a request
            // sent to a server the case believes down.
            let children = descendants(child.id());
            let _ = child.kill();
            if !children.is_empty() {
                let _ = Command::new("kill")
                    .arg("-KILL")
                    .args(children.iter().map(u32::to_string))
                    .status();
            }
            let _ = child.wait();
        }
    }

    /// Kills (if running) and starts the server again on the same port with
    /// the same data directory.
    pub fn restart(&self) -> io::Result<()> {
        self.kill();
        // The port may linger briefly after the kill, and a server's own
        // children may take a moment to notice their parent died (PostgreSQL
        // backends); retry the start.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.spawn() {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// Freezes the server with SIGSTOP — the process and every process it
    /// started (PostgreSQL serves each connection from a child) — as a hung
    /// machine would: connections stay open and nothing answers, while the
    /// server's clock keeps running. Undone by [`resume`](Self::resume).
    pub fn pause(&self) -> io::Result<()> {
        self.signal_tree("STOP")
    }

    /// Lets a [`pause`](Self::pause)d server run again (SIGCONT).
    pub fn resume(&self) -> io::Result<()> {
        self.signal_tree("CONT")
    }

    fn signal_tree(&self, signal: &str) -> io::Result<()> {
        let pid = self
            .child
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(Child::id)
            .ok_or_else(|| io::Error::other("the server is not running"))?;
        // The server itself must take the signal; a child may exit between
        // listing and signalling (a connection closing), which is no error.
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()?;
        if !status.success() {
            return Err(io::Error::other(format!(
                "kill -{signal} {pid} failed ({status})"
            )));
        }
        let children = descendants(pid);
        if !children.is_empty() {
            let _ = Command::new("kill")
                .arg(format!("-{signal}"))
                .args(children.iter().map(u32::to_string))
                .status();
        }
        Ok(())
    }

    /// Whether the process is running (as far as the harness knows).
    pub fn is_running(&self) -> bool {
        self.child
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
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

impl ServerHandle {
    /// The server named by `kind`'s environment variable, or a new one.
    pub fn from_env_or_start(kind: Arc<dyn ServerKind>) -> io::Result<Self> {
        match std::env::var(kind.url_env_var()) {
            Ok(url) if !url.is_empty() => Ok(ServerHandle::External(url)),
            _ => ServerProcess::start(kind).map(ServerHandle::Owned),
        }
    }

    /// The client URL.
    pub fn url(&self) -> String {
        match self {
            ServerHandle::Owned(server) => server.url(),
            ServerHandle::External(url) => url.clone(),
        }
    }

    /// The owned process, if the harness runs it.
    pub fn process(&self) -> Option<&ServerProcess> {
        match self {
            ServerHandle::Owned(server) => Some(server),
            ServerHandle::External(_) => None,
        }
    }
}

/// Every process descended from `root`, from `/proc/<pid>/stat`.
fn descendants(root: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // `pid (comm) state ppid ...`; comm may hold spaces and parens.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if let Some(ppid) = ppid {
                parents.push((pid, ppid));
            }
        }
    }
    let mut found = Vec::new();
    let mut frontier = vec![root];
    while let Some(parent) = frontier.pop() {
        for &(pid, ppid) in &parents {
            if ppid == parent && !found.contains(&pid) {
                found.push(pid);
                frontier.push(pid);
            }
        }
    }
    found
}

/// Picks a free loopback port (bind to port 0, read it, close).
///
/// Ports come from 20000–29999, below Linux's ephemeral range (32768 and
/// up), so an outgoing connection cannot take the port between the choice
/// and the server's bind; and no port is handed out twice by one process,
/// so servers started at once by parallel tests never collide. A Redis
/// Cluster node also binds its port + 10000 (the cluster bus, 30000 and
/// up here), so a node's bus never takes, or answers on, the port of
/// another test's server.
pub fn free_port() -> io::Result<u16> {
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..1000 {
        let port = rand::random_range(20000..30000);
        if !handed_out.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            handed_out.insert(port);
            return Ok(port);
        }
    }
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    handed_out.insert(port);
    Ok(port)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that opens its port, then exits without ever being ready
    /// (as PostgreSQL does when its killed instance's children still hold
    /// its shared memory).
    struct ListensThenExits;

    impl ServerKind for ListensThenExits {
        fn name(&self) -> &'static str {
            "listens-then-exits"
        }

        fn url_env_var(&self) -> &'static str {
            "DISTLOCK_UNUSED_URL"
        }

        fn command(&self, _: &Path, port: u16) -> Command {
            let mut command = Command::new("python3");
            command.args([
                "-c",
                &format!(
                    "import socket, time\n\
                     s = socket.socket()\n\
                     s.bind(('127.0.0.1', {port}))\n\
                     s.listen()\n\
                     time.sleep(1)\n"
                ),
            ]);
            command
        }

        fn url(&self, addr: SocketAddr) -> String {
            format!("none://{addr}")
        }

        fn wait_ready(&self, _: &Path, _: u16) -> io::Result<()> {
            std::thread::sleep(Duration::from_secs(20));
            Err(io::Error::other("never ready"))
        }
    }

    /// The start notices the exit instead of waiting out the readiness
    /// check (which a restart's deadline would not outlast).
    #[test]
    fn a_server_that_exits_after_opening_its_port_is_noticed() {
        let err = ServerProcess::start(Arc::new(ListensThenExits)).unwrap_err();
        assert!(
            err.to_string().contains(EXITED_DURING_STARTUP),
            "expected the exit to be noticed, got: {err}"
        );
    }
}
