//! When the sweep of idle rows runs (what it deletes, and how, is
//! [`crate::sql::Sweep`]): at most once per interval per client, from an
//! acquisition, on a task of its own that the acquisition does not wait
//! for, and that ends when the client is dropped.
//!
//! The interval is half the fencing retention, between 1 s and 60 s, so a
//! row nobody holds goes within the retention plus about one interval of
//! any acquisition in its namespace (and at the first acquisition of a
//! new client: a process that runs one job and exits sweeps too).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool};
use sqlx::Connection;
use sqlx::Row;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::config::TlsSettings;
use crate::errors;
use crate::sql::{self, Arg, Call, Protocol, Sql, BATCH};

/// The shortest and longest pause between two sweeps of one client.
const INTERVAL: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(60));

/// One table the sweep deletes from.
#[derive(Debug, Clone)]
pub(crate) struct SweptTable {
    /// Its name, for the logs.
    pub(crate) name: String,
    pub(crate) delete: Arc<Sql>,
    /// Set once the server refused the delete for want of a privilege:
    /// this client stops sweeping the table.
    pub(crate) refused: Arc<AtomicBool>,
}

impl SweptTable {
    pub(crate) fn new(name: String, delete: &Arc<Sql>) -> Self {
        Self {
            name,
            delete: delete.clone(),
            refused: Arc::default(),
        }
    }
}

/// What a sweep needs, owned, to run on its own task.
pub(crate) struct SweepJob {
    /// How the client's pool connects: the sweep opens one connection of
    /// its own, so it never holds one a lock call is waiting for (which
    /// would then open another, a round trip more, or wait).
    pub(crate) connect: PgConnectOptions,
    /// The TLS files `connect` names, read by the sweep itself.
    pub(crate) tls: TlsSettings,
    /// The client's pool, if `tls` are its files: its new connections get
    /// them as this sweep read them (renewed certificates are picked up
    /// within a sweep interval).
    pub(crate) pool: Option<PgPool>,
    /// The client's protocol switch (see `PostgresLock::protocol`).
    pub(crate) simple: Arc<AtomicBool>,
    pub(crate) namespace: String,
    pub(crate) retention: Duration,
    pub(crate) timeout: Duration,
    pub(crate) tables: Vec<SweptTable>,
}

/// When this client's next sweep may start, and the one running.
#[derive(Debug)]
pub(crate) struct Sweeper {
    interval: Duration,
    /// `next` counts milliseconds from here.
    start: Instant,
    next: AtomicU64,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Sweeper {
    /// A sweeper for rows kept `retention`; the first sweep is due at once.
    pub(crate) fn new(retention: Duration) -> Self {
        Self {
            interval: (retention / 2).clamp(INTERVAL.0, INTERVAL.1),
            start: Instant::now(),
            next: AtomicU64::new(0),
            task: Mutex::new(None),
        }
    }

    /// Whether a sweep is due: then it is this caller's to start (one
    /// caller per interval), and the next is due an interval from now.
    fn due(&self) -> bool {
        let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        let next = self.next.load(Ordering::Relaxed);
        let after = u64::try_from(self.interval.as_millis()).unwrap_or(u64::MAX);
        now >= next
            && self
                .next
                .compare_exchange(
                    next,
                    now.saturating_add(after),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
    }

    /// Starts a sweep with `job()` on the current runtime if one is due and
    /// the last one has ended; never waits.
    pub(crate) fn maybe_start(&self, job: impl FnOnce() -> SweepJob) {
        if !self.due() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut task = self.task.lock().unwrap_or_else(PoisonError::into_inner);
        if task.as_ref().is_some_and(|t| !t.is_finished()) {
            return;
        }
        *task = Some(runtime.spawn(job().run()));
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        // Each statement runs on a task of its own (`sql::send`), which
        // reads its reply to the end, so aborting here leaves no connection
        // mid-reply.
        if let Some(task) = self
            .task
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            task.abort();
        }
    }
}

impl SweepJob {
    async fn run(self) {
        let connected = tokio::time::timeout(self.timeout, async {
            let connect = self.tls.loaded(self.connect.clone()).await?;
            if let Some(pool) = &self.pool {
                pool.set_connect_options(connect.clone());
            }
            PgConnection::connect_with(&connect)
                .await
                .map_err(|e| errors::map(e, "connecting the sweep"))
        })
        .await;
        let mut conn = match connected {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "sweeping idle rows: no connection; trying again at the next sweep");
                return;
            }
            Err(_) => {
                tracing::debug!(timeout = ?self.timeout, "sweeping idle rows: no connection within the timeout; trying again at the next sweep");
                return;
            }
        };
        self.sweep(&mut conn).await;
        let _ = conn.close().await;
    }

    async fn sweep(&self, conn: &mut PgConnection) {
        for table in &self.tables {
            if table.refused.load(Ordering::Relaxed) {
                continue;
            }
            // Batch after batch until one is not full: every row idle for
            // the retention goes in one sweep (at most 5,000 did before, and
            // a namespace whose keys went idle faster than that grew
            // without bound). Each batch is a short statement of its own,
            // on the sweep's own connection.
            let mut deleted = 0;
            loop {
                match self.batch(conn, table).await {
                    Ok(done) => {
                        deleted += done;
                        if done < BATCH {
                            break;
                        }
                    }
                    Err(Failure::Refused(e)) => {
                        table.refused.store(true, Ordering::Relaxed);
                        tracing::warn!(table = %table.name, error = %e, "this role may not delete from the table: rows nobody holds are not reclaimed by this client (grant DELETE, see the crate docs on tables for DBAs)");
                        break;
                    }
                    Err(Failure::Other(e)) => {
                        tracing::debug!(table = %table.name, error = %e, "sweeping idle rows failed; trying again at the next sweep");
                        break;
                    }
                }
            }
            if deleted > 0 {
                tracing::debug!(table = %table.name, namespace = %self.namespace, deleted, "rows nobody held for the fencing retention deleted");
            }
        }
    }

    /// One delete statement: how many rows it deleted.
    async fn batch(&self, conn: &mut PgConnection, table: &SweptTable) -> Result<i64, Failure> {
        let retention = i64::try_from(self.retention.as_millis()).unwrap_or(i64::MAX);
        let call = Call::new(
            Protocol::of(&self.simple),
            &table.delete,
            vec![
                Arg::text(&self.namespace),
                Arg::Int(retention),
                Arg::Int(BATCH),
            ],
        );
        // Dropped on timeout, the connection is closed with the sweep.
        match tokio::time::timeout(self.timeout, sql::run::run(conn, &call)).await {
            Ok(Ok(reply)) => Ok(reply
                .row
                .and_then(|row| row.try_get::<i64, _>("done").ok())
                .unwrap_or(0)),
            Ok(Err(e)) if errors::is_permission_denied(&e) => Err(Failure::Refused(e.to_string())),
            Ok(Err(e)) => Err(Failure::Other(e.to_string())),
            Err(_) => Err(Failure::Other(format!(
                "no reply within {:?}",
                self.timeout
            ))),
        }
    }
}

/// Why a sweep statement deleted nothing.
enum Failure {
    /// No privilege to delete.
    Refused(String),
    Other(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_sweep_per_interval_and_the_first_at_once() {
        let sweeper = Sweeper::new(Duration::from_millis(200));
        assert_eq!(sweeper.interval, INTERVAL.0);
        assert!(sweeper.due(), "the first sweep is due at once");
        assert!(!sweeper.due(), "a second one within the interval");
        assert_eq!(Sweeper::new(Duration::from_secs(3600)).interval, INTERVAL.1);
        assert_eq!(
            Sweeper::new(Duration::from_secs(10)).interval,
            Duration::from_secs(5)
        );
    }
}
