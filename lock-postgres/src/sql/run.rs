//! How one statement is run on a pooled connection.
//!
//! [`run`] sends one statement on a pooled connection and does three
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
//!   Every lock statement reads correctly when repeated: an acquire finds
//!   the lock held by its own owner token, a release finds it freed with
//!   its fencing token, extend and inspect simply run again.
//! - A statement the server rolled back because it conflicted with a
//!   concurrent transaction (serialization failure under a `REPEATABLE READ`
//!   or `SERIALIZABLE` default isolation, deadlock) had no effect: it is sent
//!   again, a bounded number of times.
//! - A connection lost under the statement is not retried here: the
//!   backend's `fetch` closes it and sends the statement again on another
//!   one, read as a repeat like the case above.
//! - A call dropped while its statement is in flight (a caller's timeout)
//!   leaves the reply outstanding on the connection. [`InFlight`] then
//!   finishes in the background, bounded by the operation timeout: it gives
//!   back a lock the statement may have granted ([`Undo`]) or closes the
//!   connection, so the pool never waits on a reply nobody reads.

use std::sync::Arc;
use std::time::Duration;

use futures_util::TryStreamExt;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgRow};
use sqlx::{Either, Executor, Postgres, Row};

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
pub(crate) async fn run(conn: &mut PgConnection, call: &Call<'_>) -> Result<Reply, sqlx::Error> {
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

/// Gives back the lock an acquire may have been granted, if its caller went
/// away before the reply.
#[derive(Clone)]
pub(crate) struct Undo {
    pub(crate) sql: Arc<Statements>,
    pub(crate) protocol: Protocol,
    pub(crate) namespace: String,
    pub(crate) key: String,
    pub(crate) owner: String,
    pub(crate) channel: String,
}

/// A pooled connection with a statement in flight; see the module docs.
pub(crate) struct InFlight {
    conn: Option<PoolConnection<Postgres>>,
    undo: Option<Undo>,
    timeout: Duration,
}

impl InFlight {
    pub(crate) fn new(
        conn: PoolConnection<Postgres>,
        undo: Option<Undo>,
        timeout: Duration,
    ) -> Self {
        Self {
            conn: Some(conn),
            undo,
            timeout,
        }
    }

    /// The connection, for running the statement.
    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        self.conn
            .as_deref_mut()
            .expect("the connection is only taken by finish and drop")
    }

    /// The reply was read: the connection goes back to the pool.
    pub(crate) fn finish(mut self) {
        self.conn.take();
    }

    /// The connection broke: it is closed, not given back to the pool.
    pub(crate) fn close(mut self) {
        if let Some(conn) = self.conn.take() {
            drop(conn.detach());
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let (Some(undo), Ok(runtime)) = (self.undo.take(), tokio::runtime::Handle::try_current())
        else {
            // Nothing to give back: close the connection rather than wait
            // for a reply that may never come.
            drop(conn.detach());
            return;
        };
        let timeout = self.timeout;
        runtime.spawn(async move {
            // Runs after the dropped statement: sqlx first reads the rest
            // of its reply on this connection.
            let call = Call::new(
                undo.protocol,
                &undo.sql.abandon,
                vec![
                    Arg::Text(&undo.namespace),
                    Arg::Text(&undo.key),
                    Arg::Text(&undo.owner),
                    Arg::Text(&undo.channel),
                ],
            );
            let give_back = run(&mut conn, &call);
            match tokio::time::timeout(timeout, give_back).await {
                Ok(Ok(reply)) => {
                    let given_back = reply.row.and_then(|r| r.try_get::<i64, _>("done").ok());
                    tracing::debug!(
                        key = %undo.key,
                        given_back = given_back.unwrap_or(0) > 0,
                        "acquire dropped by its caller: a lock it was granted is given back"
                    );
                }
                Ok(Err(error)) => {
                    tracing::warn!(key = %undo.key, %error, "acquire dropped by its caller: a lock it may have been granted could not be given back and stays until its TTL");
                    drop(conn.detach());
                }
                Err(_) => {
                    tracing::warn!(key = %undo.key, "acquire dropped by its caller: no reply within the operation timeout; a lock it may have been granted stays until its TTL");
                    drop(conn.detach());
                }
            }
        });
    }
}
