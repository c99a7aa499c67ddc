//! PgBouncer in front of a PostgreSQL server: `pgbouncer` in the foreground
//! on a loopback port with a generated ini in the harness's temp dir.
//!
//! The binary is `/usr/sbin/pgbouncer` (Debian's package installs it there,
//! outside a normal user's `PATH`) or `pgbouncer` on `PATH`. PgBouncer refuses
//! to run as root, so as root it is started with `-u postgres` (it drops
//! privileges itself; the temp dir is made writable for its pid file).
//!
//! Clients authenticate to PgBouncer with `auth_type = trust` and a userlist
//! holding the harness's superuser; PgBouncer logs in to PostgreSQL as that
//! user, which the harness's PostgreSQL trusts on loopback.

use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use super::postgres::{SUPERUSER, SUPERUSER_PASSWORD};
use super::{reap_when_process_exits, PidFile, ServerKind};

/// PgBouncer's `pool_mode`: when a server connection goes back to the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// After the client disconnects.
    Session,
    /// After each transaction (the mode of many hosted platforms): no
    /// session state survives a transaction, LISTEN included.
    Transaction,
}

impl PoolMode {
    fn as_str(self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        }
    }
}

/// A PgBouncer pooling the harness's PostgreSQL at `upstream` (start that
/// first, e.g. with [`Postgres`](super::Postgres)), or the pooler named by
/// `DISTLOCK_PGBOUNCER_URL`.
///
/// Its [`url`](ServerKind::url) is the harness superuser's
/// `postgres://postgres:postgres@127.0.0.1:PORT/postgres`; every database
/// name is passed through to the upstream server.
///
/// ```no_run
/// use std::sync::Arc;
/// use distlock_conformance::server::{PgBouncer, Postgres, PoolMode, ServerProcess};
/// let postgres = ServerProcess::start(Arc::new(Postgres))?;
/// let pooler = ServerProcess::start(Arc::new(PgBouncer::new(postgres.addr(), PoolMode::Transaction)))?;
/// assert!(pooler.url().starts_with("postgres://"));
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgBouncer {
    upstream: SocketAddr,
    pool_mode: PoolMode,
    pool_size: u32,
}

impl PgBouncer {
    /// A pooler for the PostgreSQL server at `upstream` in `pool_mode`, with
    /// PgBouncer's default of 20 server connections per database and user.
    pub fn new(upstream: SocketAddr, pool_mode: PoolMode) -> Self {
        Self {
            upstream,
            pool_mode,
            pool_size: 20,
        }
    }

    /// Sets `default_pool_size`, the server connections per database and
    /// user. With 1, every client shares one server session, which makes
    /// the effects of transaction pooling deterministic.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// The PostgreSQL server it pools.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    fn program() -> PathBuf {
        let debian = Path::new("/usr/sbin/pgbouncer");
        if debian.is_file() {
            debian.to_path_buf()
        } else {
            PathBuf::from("pgbouncer")
        }
    }

    fn is_root() -> bool {
        // The owner of /proc/self is this process's effective user.
        std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
    }

    fn ini(&self, dir: &Path, port: u16) -> String {
        format!(
            "[databases]\n\
             * = host={host} port={upstream_port}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {dir}/userlist.txt\n\
             pool_mode = {mode}\n\
             default_pool_size = {size}\n\
             max_client_conn = 500\n\
             pidfile = {dir}/pgbouncer.pid\n\
             ignore_startup_parameters = extra_float_digits\n",
            host = self.upstream.ip(),
            upstream_port = self.upstream.port(),
            dir = dir.display(),
            mode = self.pool_mode.as_str(),
            size = self.pool_size,
        )
    }
}

impl ServerKind for PgBouncer {
    fn name(&self) -> &'static str {
        "pgbouncer"
    }

    fn url_env_var(&self) -> &'static str {
        "DISTLOCK_PGBOUNCER_URL"
    }

    fn prepare(&self, dir: &Path) -> io::Result<()> {
        // PgBouncer writes its pid file after dropping root.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777))?;
        std::fs::write(
            dir.join("userlist.txt"),
            format!("\"{SUPERUSER}\" \"{SUPERUSER_PASSWORD}\"\n"),
        )?;
        // PgBouncer does not exit when its parent dies.
        reap_when_process_exits(
            dir,
            Some(PidFile {
                path: "pgbouncer.pid",
                program: "pgbouncer",
                graceful: None,
            }),
        )
    }

    fn command(&self, dir: &Path, port: u16) -> Command {
        let ini = dir.join("pgbouncer.ini");
        if let Err(e) = std::fs::write(&ini, self.ini(dir, port)) {
            // `command` cannot fail; make the spawn fail with the reason.
            tracing::error!("cannot write {}: {e}", ini.display());
            return Command::new(format!("/nonexistent/cannot write pgbouncer.ini: {e}"));
        }
        let mut command = Command::new(Self::program());
        if Self::is_root() {
            command.args(["-u", "postgres"]);
        }
        command.arg(&ini).current_dir(dir);
        command
    }

    fn url(&self, addr: SocketAddr) -> String {
        format!("postgres://{SUPERUSER}:{SUPERUSER_PASSWORD}@{addr}/postgres")
    }
}
