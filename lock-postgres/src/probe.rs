//! Telling a transaction pooler from a server session of one's own, at
//! connect ([`PoolMode::Auto`], a URL without `pool_mode`).
//!
//! What a transaction pooler (PgBouncer `pool_mode = transaction`, and the
//! poolers of hosted platforms) changes for a client is that a server
//! session is its own only for the length of a transaction: between two
//! of them, another client connection may run on it, and the next one may
//! run on another session. A direct connection, or a session pooler
//! (PgBouncer `pool_mode = session`), keeps one server session per client
//! connection for as long as it is connected, and never lets another
//! client connection on it meanwhile.
//!
//! The probe uses two client connections, A (from the pool) and B (opened
//! for the probe), both connected throughout. A marks its server session
//! (a session-level custom setting with a random value) and notes
//! `pg_backend_pid()`; then, alternately, B and A read the pid and the
//! mark, for a few rounds. Any of these proves a transaction pooler:
//!
//! - B sees A's pid or A's mark: another client connection ran on A's
//!   server session while A was connected;
//! - A sees another pid or loses its mark: A's transactions moved to
//!   another server session;
//! - a `NOTIFY` reaches A or B: a session shared with some `LISTEN`er.
//!
//! None of them can happen on a direct connection or a session pool, so
//! those are never taken for a transaction pooler. Behind PgBouncer in
//! transaction mode the first read of B proves it whenever PgBouncer hands
//! it the session A just gave back, which it does when nothing else runs
//! between (its idle servers are reused last-in first-out) and always with
//! one server session; a busy pooler may instead hand A and B sessions
//! that look like their own for every round. What catches that (rare)
//! miss is the backend's check of every statement: the errors a shared
//! session gives prepared statements (`42P05`, `26000`, a `Bind` for
//! another statement) switch the client to the simple protocol for good,
//! and the statement, which did not run, is sent again.
//!
//! Every probe statement is a simple `Query` (one implicit transaction),
//! so the probe itself never leaves prepared statements behind.

use std::time::Duration;

use distlock_core::LockError;
use futures_util::TryStreamExt;
use sqlx::postgres::{PgConnection, PgPool, PgRow};
use sqlx::{Connection, Either, Executor, Row};

use crate::config::PoolMode;
use crate::errors;

/// The custom setting that marks A's server session.
const MARK: &str = "distlock.pooler_probe";

/// How often B and A read in turn.
const ROUNDS: usize = 3;

/// What a probe statement saw.
enum Seen {
    /// The server session's pid and the mark it carries ("" for none).
    Session { pid: i64, mark: String },
    /// A notification came in on the connection: its server session is
    /// shared with a `LISTEN`er.
    Shared,
}

/// Runs `text` (a simple query returning `pid`, `mark`) on `conn`.
async fn read(conn: &mut PgConnection, text: &str) -> Result<Seen, sqlx::Error> {
    let mut reply = conn.fetch_many(sqlx::raw_sql(text));
    let mut row: Option<PgRow> = None;
    loop {
        match reply.try_next().await {
            Ok(Some(Either::Right(r))) => {
                row.get_or_insert(r);
            }
            Ok(Some(Either::Left(_))) => {}
            Ok(None) => break,
            Err(e) if errors::is_stray_notification(&e) => return Ok(Seen::Shared),
            Err(e) => return Err(e),
        }
    }
    let row = row.ok_or_else(|| sqlx::Error::RowNotFound)?;
    Ok(Seen::Session {
        pid: row.try_get("pid")?,
        mark: row.try_get("mark")?,
    })
}

/// The query that reads the pid and the mark.
fn read_text() -> String {
    format!("SELECT pg_backend_pid()::bigint AS pid, coalesce(current_setting('{MARK}', true), '') AS mark")
}

/// Whether `pool` reaches a transaction pooler (see the module docs):
/// [`PoolMode::Transaction`] if the probe proved it, otherwise
/// [`PoolMode::Session`]. An error of A's first statement is returned
/// (the client could not work anyway); if B cannot be opened or answer
/// within `timeout` (a session pool with no server session to spare, a
/// connection limit), the probe proves nothing and says `Session`.
pub(crate) async fn detect(pool: &PgPool, timeout: Duration) -> Result<PoolMode, LockError> {
    let what = "checking for a transaction pooler";
    let map = |e: sqlx::Error| errors::map(e, what);
    let mut a = pool.acquire().await.map_err(map)?;
    let token = format!("{:032x}", rand::random::<u128>());
    let marked = distlock_core::with_timeout(timeout, what, async {
        read(
            &mut a,
            &format!("SELECT pg_backend_pid()::bigint AS pid, set_config('{MARK}', '{token}', false) AS mark"),
        )
        .await
        .map_err(map)
    })
    .await?;
    let a_pid = match marked {
        Seen::Shared => return Ok(found("a notification reached a pooled connection")),
        Seen::Session { pid, .. } => pid,
    };
    let connect = (*pool.connect_options()).clone();
    let probe = async {
        let mut b = PgConnection::connect_with(&connect).await?;
        let verdict = rounds(&mut a, &mut b, a_pid, &token).await;
        let _ = b.close().await;
        verdict
    };
    let verdict = match tokio::time::timeout(timeout, probe).await {
        Ok(Ok(verdict)) => verdict,
        Ok(Err(e)) => {
            // B could not get in (connection limits), or A broke (its next
            // statement reports it): nothing proven.
            tracing::debug!(error = %e, "the transaction pooler probe proved nothing");
            None
        }
        Err(_) => {
            tracing::debug!("the transaction pooler probe's second connection got no server session in time; taking the connection for a session of its own");
            None
        }
    };
    Ok(match verdict {
        Some(evidence) => found(evidence),
        None => {
            // A's session is its own: take the mark off again.
            let _ = a
                .execute(sqlx::raw_sql(&format!(
                    "SELECT set_config('{MARK}', '', false)"
                )))
                .await;
            PoolMode::Session
        }
    })
}

/// B and A read in turn; `Some(evidence)` once one proves a transaction pooler.
async fn rounds(
    a: &mut PgConnection,
    b: &mut PgConnection,
    a_pid: i64,
    token: &str,
) -> Result<Option<&'static str>, sqlx::Error> {
    let text = read_text();
    let mut b_pid = None;
    for _ in 0..ROUNDS {
        match read(b, &text).await? {
            Seen::Shared => return Ok(Some("a notification reached a pooled connection")),
            Seen::Session { pid, mark } => {
                if pid == a_pid || mark == token {
                    return Ok(Some("two client connections ran on one server session"));
                }
                if *b_pid.get_or_insert(pid) != pid {
                    return Ok(Some("a client connection moved to another server session"));
                }
            }
        }
        match read(a, &text).await? {
            Seen::Shared => return Ok(Some("a notification reached a pooled connection")),
            Seen::Session { pid, mark } => {
                if pid != a_pid || mark != token {
                    return Ok(Some("a client connection moved to another server session"));
                }
            }
        }
    }
    Ok(None)
}

fn found(evidence: &str) -> PoolMode {
    tracing::warn!(
        evidence,
        "the PostgreSQL URL reaches a transaction pooler: using the simple query protocol (values as literals) instead of prepared statements; \
         add pool_mode=transaction to the URL to skip this check, and listen_url=<a URL past the pooler> so that waiters are woken by NOTIFY instead of polling"
    );
    PoolMode::Transaction
}
