//! The SQL of the lease-table backend, and how one statement is run.
//!
//! The statements are built once per client for its table. Every value (namespace, key, owner, fencing, TTL, channel) is a
//! bind parameter; only the validated, quoted table name is in the text.
//!
//! All times come from the database's wall clock (`clock_timestamp()`),
//! never the client's (see the crate docs on clocks). Acquire, extend and
//! release are one statement (one round trip) each, atomic on the server;
//! none keeps session state (see the crate docs on poolers for what the
//! driver does).
//!
//! # Running one statement
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
//! - A call dropped while its statement is in flight (a caller's timeout)
//!   leaves the reply outstanding on the connection. [`InFlight`] then
//!   finishes in the background, bounded by the operation timeout: it gives
//!   back a lock the statement may have granted ([`Undo`]) or closes the
//!   connection, so the pool never waits on a reply nobody reads.

use std::sync::Arc;
use std::time::Duration;

use futures_util::TryStreamExt;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgConnection, PgRow};
use sqlx::query::Query;
use sqlx::{Either, Executor, Postgres, Row};

use crate::errors;
use crate::keys::{qualified_table, quote_identifier};

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

/// Sends the statement `make` builds and reads its first row, sending it
/// again (up to [`ATTEMPTS`] times) when its reply was lost to a
/// notification or the server rolled it back. Not bounded in time: the
/// caller puts it under the operation timeout.
pub(crate) async fn run<'q>(
    conn: &mut PgConnection,
    make: impl Fn() -> Query<'q, Postgres, PgArguments>,
) -> Result<Reply, sqlx::Error> {
    let mut attempt = 1;
    let mut resent = false;
    loop {
        let error = match read_reply(conn, make()).await {
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
    query: Query<'_, Postgres, PgArguments>,
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
            let give_back = run(&mut conn, || {
                sqlx::query(&undo.sql.abandon)
                    .bind(&undo.namespace)
                    .bind(&undo.key)
                    .bind(&undo.owner)
                    .bind(&undo.channel)
            });
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

/// The statements for one lock table.
#[derive(Debug, Clone)]
pub(crate) struct Statements {
    /// `$1` schema name -> `exists bool`.
    pub schema_exists: String,
    /// Creates the schema.
    pub create_schema: String,
    /// `$1` qualified table name -> `exists bool`.
    pub table_exists: String,
    /// Creates the table.
    pub create_table: String,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` TTL in ms ->
    /// `acquired bool, fencing bigint, owner text, expires_in_ms bigint`:
    /// one row `acquired = true` with the new fencing token, or the holder's
    /// row (`acquired = false`), or no row (a concurrent first insert the
    /// statement's snapshot cannot see yet).
    pub acquire: String,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` TTL in ms ->
    /// `done bigint, owner text, fencing bigint` (the row as it was before).
    pub extend: String,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` channel ->
    /// `done bigint, owner text, fencing bigint` (the row as it was before);
    /// sends `NOTIFY channel, key` when it released.
    pub release: String,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` channel -> `done bigint`:
    /// frees the lock if `owner` holds it, whatever its fencing token, and
    /// sends `NOTIFY channel, key`. Gives back a lock granted to an acquire
    /// whose caller went away before the reply (the owner token is fresh
    /// per acquisition, so it matches that grant only).
    pub abandon: String,
    /// `$1` namespace, `$2` key -> `held bool, owner text, fencing bigint,
    /// expires_in_ms bigint`, or no row for a key never locked.
    pub inspect: String,
    /// `$1` namespace, `$2` key, `$3` channel -> `done bigint, owner text,
    /// fencing bigint` (the row as it was before); frees a live lock of any
    /// owner distlock wrote and sends `NOTIFY channel, key`.
    pub force_release: String,
}

impl Statements {
    pub(crate) fn new(schema: &str, table: &str) -> Self {
        let t = qualified_table(schema, table);
        Self {
            schema_exists: "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1) AS exists"
                .to_owned(),
            create_schema: format!("CREATE SCHEMA IF NOT EXISTS {}", quote_identifier(schema)),
            table_exists: "SELECT pg_catalog.to_regclass($1) IS NOT NULL AS exists".to_owned(),
            create_table: format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    namespace text NOT NULL,
                    key text NOT NULL,
                    owner text,
                    fencing bigint NOT NULL,
                    expires_at timestamptz NOT NULL,
                    PRIMARY KEY (namespace, key)
                )"
            ),
            acquire: format!(
                "WITH taken AS (
                    INSERT INTO {t} AS t (namespace, key, owner, fencing, expires_at)
                    VALUES ($1, $2, $3, 1, clock_timestamp() + $4::bigint * interval '1 millisecond')
                    ON CONFLICT (namespace, key) DO UPDATE
                        SET owner = excluded.owner,
                            fencing = t.fencing + 1,
                            expires_at = clock_timestamp() + $4::bigint * interval '1 millisecond'
                        WHERE (t.owner IS NULL OR t.expires_at <= clock_timestamp())
                          AND (t.owner IS NULL OR t.owner ~ '^[0-9a-f]{{32}}$')
                          AND t.fencing >= 0
                    RETURNING t.fencing
                )
                SELECT true AS acquired, taken.fencing AS fencing, NULL::text AS owner,
                       NULL::bigint AS expires_in_ms
                FROM taken
                UNION ALL
                SELECT false, h.fencing, h.owner,
                       greatest(0, ceil(extract(epoch FROM (h.expires_at - clock_timestamp())) * 1000))::bigint
                FROM {t} AS h
                WHERE h.namespace = $1 AND h.key = $2 AND NOT EXISTS (SELECT 1 FROM taken)"
            ),
            extend: format!(
                "WITH done AS (
                    UPDATE {t}
                    SET expires_at = clock_timestamp() + $5::bigint * interval '1 millisecond'
                    WHERE namespace = $1 AND key = $2 AND owner = $3 AND fencing = $4
                      AND expires_at > clock_timestamp()
                    RETURNING 1
                )
                SELECT (SELECT count(*) FROM done) AS done, h.owner AS owner, h.fencing AS fencing
                FROM (VALUES (1)) AS one (x)
                LEFT JOIN {t} AS h ON h.namespace = $1 AND h.key = $2"
            ),
            release: format!(
                "WITH done AS (
                    UPDATE {t}
                    SET owner = NULL
                    WHERE namespace = $1 AND key = $2 AND owner = $3 AND fencing = $4
                      AND expires_at > clock_timestamp()
                    RETURNING key
                )
                SELECT (SELECT count(*) FROM (SELECT pg_notify($5, done.key) FROM done) AS n) AS done,
                       h.owner AS owner, h.fencing AS fencing
                FROM (VALUES (1)) AS one (x)
                LEFT JOIN {t} AS h ON h.namespace = $1 AND h.key = $2"
            ),
            abandon: format!(
                "WITH done AS (
                    UPDATE {t}
                    SET owner = NULL
                    WHERE namespace = $1 AND key = $2 AND owner = $3
                      AND expires_at > clock_timestamp()
                    RETURNING key
                )
                SELECT count(*) AS done FROM (SELECT pg_notify($4, done.key) FROM done) AS n"
            ),
            inspect: format!(
                "SELECT (owner IS NOT NULL AND expires_at > clock_timestamp()) AS held, owner, fencing,
                        greatest(0, ceil(extract(epoch FROM (expires_at - clock_timestamp())) * 1000))::bigint
                            AS expires_in_ms
                 FROM {t} WHERE namespace = $1 AND key = $2"
            ),
            force_release: format!(
                "WITH done AS (
                    UPDATE {t}
                    SET owner = NULL
                    WHERE namespace = $1 AND key = $2 AND owner IS NOT NULL
                      AND owner ~ '^[0-9a-f]{{32}}$' AND fencing >= 0
                      AND expires_at > clock_timestamp()
                    RETURNING key
                )
                SELECT (SELECT count(*) FROM (SELECT pg_notify($3, done.key) FROM done) AS n) AS done,
                       h.owner AS owner, h.fencing AS fencing
                FROM (VALUES (1)) AS one (x)
                LEFT JOIN {t} AS h ON h.namespace = $1 AND h.key = $2"
            ),
        }
    }
}
