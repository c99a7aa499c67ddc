//! How one statement is run on a pooled connection.
//!
//! [`send`] runs one statement on a task of its own, so that its reply is
//! read to the end even when the caller stops waiting for it (its
//! operation timeout passed, or its future was dropped): the connection
//! never goes back to the pool with a reply outstanding, and what an
//! acquire whose caller left was granted is known, and given back exactly
//! ([`GiveBack`]) instead of guessed at. [`run`], on that task, does three
//! things sqlx does not do for us:
//! - A `NotificationResponse` on a connection that is not a listener (it
//!   happens behind a transaction pooler, whose server sessions are shared
//!   with a session that ran `LISTEN`) makes sqlx fail the reply with a
//!   protocol error. PostgreSQL only delivers notifications outside a
//!   transaction, so one that follows `CommandComplete` came after the
//!   statement committed (a failed commit is reported before it): the reply
//!   is kept. One before it came while the session was idle, before the
//!   statement ran — which it may still do, since the statement may have
//!   been sent already: the statement is sent again and the caller learns
//!   that an earlier attempt may have taken effect ([`Reply::resent`]).
//!   Every lock statement reads correctly when repeated: an acquire adopts
//!   the lock its own owner token holds, a release finds it given up with
//!   its fencing token, extend and inspect simply run again.
//! - A statement the server rolled back because it conflicted with a
//!   concurrent transaction (serialization failure under a `REPEATABLE READ`
//!   or `SERIALIZABLE` default isolation, deadlock) had no effect: it is sent
//!   again, a bounded number of times.
//! - A connection lost under the statement is not retried here: the
//!   backend's `fetch` closes it and sends the statement again on another
//!   one, read as a repeat like the case above.

use std::sync::Arc;
use std::time::Duration;

use futures_util::TryStreamExt;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool, PgRow};
use sqlx::{Either, Executor, Postgres, Row};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{Arg, Call, Protocol, Statement, Statements};
use crate::errors;

/// How often a statement is sent in all when the server rolled it back or
/// a notification interrupted its reply.
const ATTEMPTS: u32 = 5;

/// Why a reply was not read.
enum Failure {
    /// The server rolled the statement back; it can be sent again.
    RolledBack(sqlx::Error),
    /// A notification came before the reply: the statement may or may not
    /// run; it can be sent again if repeating it is read correctly.
    Unknown(sqlx::Error),
    /// Report this.
    Fail(sqlx::Error),
}

/// The reply to a statement.
pub(crate) struct Reply<R = Option<PgRow>> {
    /// Its first row.
    pub(crate) row: R,
    /// The statement was sent again after an attempt whose reply was lost,
    /// so that attempt may have taken effect before this one ran.
    pub(crate) resent: bool,
}

/// Sends `call`'s statement and reads its first row, sending it again (up
/// to [`ATTEMPTS`] times) when its reply was lost to a notification or the
/// server rolled it back. Not bounded in time: the caller puts it under the
/// operation timeout.
pub(crate) async fn run(conn: &mut PgConnection, call: &Call) -> Result<Reply, sqlx::Error> {
    let mut attempt = 1;
    let mut resent = false;
    loop {
        let error = match read_reply(conn, call.statement()).await {
            Ok(row) => return Ok(Reply { row, resent }),
            Err(Failure::Unknown(error)) => {
                resent = true;
                error
            }
            Err(Failure::RolledBack(error)) => error,
            Err(Failure::Fail(error)) => return Err(error),
        };
        if attempt >= ATTEMPTS {
            return Err(error);
        }
        tracing::debug!(%error, attempt, "no reply to use; sending the statement again");
        // Spread concurrent retries of the same conflict apart.
        let pause = rand::random_range(0..1000 * u64::from(attempt));
        tokio::time::sleep(Duration::from_micros(pause)).await;
        attempt += 1;
    }
}

async fn read_reply(
    conn: &mut PgConnection,
    query: Statement<'_>,
) -> Result<Option<PgRow>, Failure> {
    let mut reply = conn.fetch_many(query);
    let mut row = None;
    let mut completed = false;
    loop {
        match reply.try_next().await {
            Ok(Some(Either::Left(_))) => completed = true,
            Ok(Some(Either::Right(r))) => {
                row.get_or_insert(r);
            }
            Ok(None) => return Ok(row),
            // sqlx drains the rest of this reply (up to ReadyForQuery,
            // skipping further notifications) before the connection's next
            // statement.
            Err(e) if errors::is_stray_notification(&e) => {
                return if completed {
                    tracing::debug!(
                        "a notification reached a pooled connection after its statement; ignored"
                    );
                    Ok(row)
                } else {
                    Err(Failure::Unknown(e))
                };
            }
            Err(e) if errors::is_conflict(&e) => return Err(Failure::RolledBack(e)),
            Err(e) => return Err(Failure::Fail(e)),
        }
    }
}

/// Gives back the lock granted to an acquire whose caller left before
/// its reply (see [`Statements::give_back`]).
#[derive(Debug, Clone)]
pub(crate) struct GiveBack {
    pub(crate) sql: Arc<Statements>,
    pub(crate) protocol: Protocol,
    pub(crate) namespace: String,
    pub(crate) key: String,
    pub(crate) owner: String,
    /// The acquisition's send number.
    pub(crate) send: i64,
    pub(crate) channel: String,
    /// The observers' channel, for a labelled acquisition (observers heard
    /// of its grant).
    pub(crate) observers: Option<String>,
}

/// How a statement sent with [`send`] ended, and the connection it ran on.
/// Dropping it gives the connection back to the pool, or closes it if the
/// statement found it broken.
pub(crate) struct Done {
    result: Option<Result<Reply, sqlx::Error>>,
    /// The connection broke under the statement.
    lost: bool,
    conn: Option<PoolConnection<Postgres>>,
}

impl Done {
    fn new(result: Result<Reply, sqlx::Error>, conn: PoolConnection<Postgres>) -> Self {
        Self {
            lost: matches!(&result, Err(e) if errors::is_connection_lost(e)),
            result: Some(result),
            conn: Some(conn),
        }
    }

    /// The statement's reply or error (once).
    pub(crate) fn take(&mut self) -> Option<Result<Reply, sqlx::Error>> {
        self.result.take()
    }
}

impl Drop for Done {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            if self.lost {
                drop(conn.detach());
            }
        }
    }
}

/// Why [`send_alone`] has no reply.
pub(crate) enum Missed {
    /// The statement (or getting a connection) failed.
    Failed(sqlx::Error),
    /// No pooled connection within the timeout.
    NoConnection,
    /// No reply within the timeout (the statement may still run).
    NoReply,
}

impl std::fmt::Display for Missed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Missed::Failed(e) => e.fmt(f),
            Missed::NoConnection => f.write_str("no connection within the operation timeout"),
            Missed::NoReply => f.write_str("no reply within the operation timeout"),
        }
    }
}

/// Runs `call` once on a connection of `pool`, for a statement no caller
/// waits for (leaving a waiter line): the connection within
/// `timeout`, the reply within `timeout` of that, read to the end on a
/// task of its own as [`send`] does (so dropping this future leaves no
/// connection mid-reply).
pub(crate) async fn send_alone(
    pool: &PgPool,
    call: Call,
    timeout: Duration,
) -> Result<Reply, Missed> {
    let deadline = Instant::now() + timeout;
    let conn = match tokio::time::timeout_at(deadline, pool.acquire()).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => return Err(Missed::Failed(e)),
        Err(_) => return Err(Missed::NoConnection),
    };
    let mut sent = send(conn, Arc::new(call), None, deadline + timeout, timeout);
    match sent.wait(deadline).await.and_then(|mut done| done.take()) {
        Some(Ok(reply)) => Ok(reply),
        Some(Err(e)) => Err(Missed::Failed(e)),
        None => Err(Missed::NoReply),
    }
}

/// A statement in flight on its own task; see the module docs.
pub(crate) struct Sent {
    reply: oneshot::Receiver<Done>,
    give_back: Option<GiveBack>,
    timeout: Duration,
}

/// Runs `call` on `conn` on a task of its own (see the module docs), which
/// reads the reply until `read_until` at the latest and then closes the
/// connection. If nobody takes the reply, a lock it granted is given back
/// with `give_back`, within `timeout`.
pub(crate) fn send(
    conn: PoolConnection<Postgres>,
    call: Arc<Call>,
    give_back: Option<GiveBack>,
    read_until: Instant,
    timeout: Duration,
) -> Sent {
    let (tx, reply) = oneshot::channel();
    let left_behind = give_back.clone();
    tokio::spawn(async move {
        let mut conn = conn;
        let Ok(result) = tokio::time::timeout_at(read_until, run(&mut conn, &call)).await else {
            // Its caller has long left and nobody can learn more.
            tracing::debug!("no reply to a statement its caller left; closing its connection");
            drop(conn.detach());
            return;
        };
        if let Err(done) = tx.send(Done::new(result, conn)) {
            abandon(done, left_behind, timeout).await;
        }
    });
    Sent {
        reply,
        give_back,
        timeout,
    }
}

impl Sent {
    /// How the statement ended, if it did by `deadline`; `None` if not (it
    /// goes on, see [`send`]).
    pub(crate) async fn wait(&mut self, deadline: Instant) -> Option<Done> {
        match tokio::time::timeout_at(deadline, &mut self.reply).await {
            Ok(done) => done.ok(),
            Err(_) => {
                // A reply that came just now is still taken.
                self.reply.close();
                self.reply.try_recv().ok()
            }
        }
    }
}

impl Drop for Sent {
    fn drop(&mut self) {
        // After close(), the task's send fails (and it deals with the
        // reply itself), or the reply it sent before is here to take.
        self.reply.close();
        if let Ok(done) = self.reply.try_recv() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(abandon(done, self.give_back.take(), self.timeout));
            }
        }
    }
}

/// Deals with the end of a statement nobody waits for any more: gives back
/// what an acquire was granted (the reply says which row version it wrote,
/// so nothing adopted or renewed since is touched), and marks a free row
/// given up so that an earlier send of the same acquire, applied late on a
/// lost connection, is refused.
async fn abandon(mut done: Done, give_back: Option<GiveBack>, timeout: Duration) {
    let Some(give_back) = give_back.filter(|_| !done.lost) else {
        return;
    };
    let Some(mut conn) = done.conn.take() else {
        return;
    };
    let version = match done.take() {
        Some(Ok(reply)) => reply
            .row
            .and_then(|row| row.try_get::<Option<String>, _>("version").ok().flatten()),
        _ => None,
    };
    let granted = version.is_some();
    let call = Call::new(
        give_back.protocol,
        &give_back.sql.give_back,
        vec![
            Arg::Text(give_back.namespace),
            Arg::Text(give_back.key.clone()),
            Arg::Text(give_back.owner),
            // No row version is 0 (InvalidTransactionId).
            Arg::Text(version.unwrap_or_else(|| "0".to_owned())),
            Arg::Int(give_back.send),
            Arg::Text(give_back.channel),
            // Only a grant changed who holds.
            Arg::Text(give_back.observers.filter(|_| granted).unwrap_or_default()),
        ],
    );
    let key = give_back.key;
    match tokio::time::timeout(timeout, run(&mut conn, &call)).await {
        Ok(Ok(reply)) => {
            let written = reply.row.and_then(|r| r.try_get::<i64, _>("done").ok());
            tracing::debug!(
                key = %key,
                granted,
                given_back = written.unwrap_or(0) > 0,
                "acquire left by its caller: what it was granted is given back"
            );
        }
        Ok(Err(error)) => {
            tracing::warn!(key = %key, granted, %error, "acquire left by its caller: a lock it may have been granted could not be given back and stays until its TTL");
            if errors::is_connection_lost(&error) {
                drop(conn.detach());
            }
        }
        Err(_) => {
            tracing::warn!(key = %key, granted, "acquire left by its caller: no reply to the give-back within the operation timeout; a lock it may have been granted stays until its TTL");
            drop(conn.detach());
        }
    }
}
