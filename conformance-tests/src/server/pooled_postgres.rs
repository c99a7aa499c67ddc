//! PostgreSQL behind PgBouncer as one server kind: the production topology
//! of many hosted platforms, for running the whole suite through a pooler.

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

use super::{PgBouncer, PoolMode, Postgres, ServerKind, ServerProcess};

/// A PgBouncer in front of a PostgreSQL server of its own, or the pooler
/// named by `DISTLOCK_POOLED_POSTGRES_URL`.
///
/// The PostgreSQL server is started once, when the first pooler of this
/// kind (or of a clone) starts, and shared by every pooler started from it
/// (the fault cases' dedicated servers are poolers; killing, restarting
/// or pausing one affects the pooler, not the database behind it). It
/// stops when the test process exits.
///
/// Its [`url`](ServerKind::url) is the pooler's, and in transaction mode
/// carries distlock-postgres's parameters for it: `pool_mode=transaction` and
/// `listen_url` pointing past the pooler at the database (waiters `LISTEN`
/// there).
///
/// ```no_run
/// use std::sync::Arc;
/// use distlock_conformance::server::{PoolMode, PooledPostgres, ServerProcess};
/// let pooler = ServerProcess::start(Arc::new(PooledPostgres::new(PoolMode::Transaction)))?;
/// assert!(pooler.url().contains("pool_mode=transaction&listen_url="));
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct PooledPostgres {
    mode: PoolMode,
    pool_size: u32,
    database: Arc<Mutex<Option<Arc<ServerProcess>>>>,
}

impl PooledPostgres {
    /// PgBouncer in `mode` with 20 server connections (its default).
    pub fn new(mode: PoolMode) -> Self {
        Self {
            mode,
            pool_size: 20,
            database: Arc::default(),
        }
    }

    /// Sets PgBouncer's `default_pool_size`.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// The PostgreSQL server behind the poolers, started if it is not yet.
    pub fn database(&self) -> io::Result<Arc<ServerProcess>> {
        let mut database = self.database.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(server) = database.as_ref() {
            return Ok(server.clone());
        }
        let server = Arc::new(ServerProcess::start(Arc::new(Postgres))?);
        *database = Some(server.clone());
        Ok(server)
    }

    fn bouncer(&self) -> io::Result<PgBouncer> {
        Ok(PgBouncer::new(self.database()?.addr(), self.mode).pool_size(self.pool_size))
    }
}

impl ServerKind for PooledPostgres {
    fn name(&self) -> &'static str {
        "postgres-pgbouncer"
    }

    fn url_env_var(&self) -> &'static str {
        "DISTLOCK_POOLED_POSTGRES_URL"
    }

    fn prepare(&self, dir: &Path) -> io::Result<()> {
        self.bouncer()?.prepare(dir)
    }

    fn command(&self, dir: &Path, port: u16) -> Command {
        match self.bouncer() {
            Ok(bouncer) => bouncer.command(dir, port),
            // `command` cannot fail; make the spawn fail with the reason.
            Err(e) => Command::new(format!("/nonexistent/cannot start PostgreSQL: {e}")),
        }
    }

    fn carries_every_connection(&self) -> bool {
        self.mode != PoolMode::Transaction
    }

    fn url(&self, addr: SocketAddr) -> String {
        let url = format!(
            "postgres://{}:{}@{addr}/postgres",
            super::postgres::SUPERUSER,
            super::postgres::SUPERUSER_PASSWORD
        );
        match (self.mode, self.database()) {
            (PoolMode::Transaction, Ok(database)) => {
                let direct = crate::url::percent_encode(&database.url());
                format!("{url}?pool_mode=transaction&listen_url={direct}")
            }
            _ => url,
        }
    }
}
