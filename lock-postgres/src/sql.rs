//! The SQL of the lease-table backend, and how its values reach the server.
//!
//! The statements are built once per client for its table. Only the
//! validated, quoted schema and table names are part of the text; every
//! value (namespace, key, owner, fencing, TTL, channel) is a parameter,
//! sent one of two ways ([`Protocol`]):
//!
//! - **extended** (the default): sqlx's named prepared statements, the
//!   values as bind parameters. Parsed and planned once per connection.
//! - **simple** (`pool_mode=transaction`, or a transaction pooler found
//!   at connect or by a statement): one `Query` message per
//!   statement, the values spliced in as literals by [`Sql::render`]. A
//!   transaction pooler may run each protocol message of a client on
//!   another server session, which breaks named statements (PgBouncer 1.18:
//!   `42P05 prepared statement "sqlx_s_1" already exists`, `26000 ... does
//!   not exist`) and even unnamed ones (sqlx sends `Parse`+`Describe`, waits
//!   for the reply, then `Bind`+`Execute`, and the pooler may put the second
//!   half on a session that never saw the first). A single `Query` message
//!   is one implicit transaction, so it always runs on one session.
//!
//! Literals cannot inject SQL, and are constants the planner sees as such
//! (as it sees bind parameters): a text value becomes a dollar-quoted
//! string (`$d$...$d$`, with a tag the value does not contain), in which
//! no character is special — not a quote, not a backslash — so it reads
//! the same whatever `standard_conforming_strings` and `backslash_quote`
//! say, and no escape is needed. The characters are sent as they are, in
//! UTF-8: sqlx opens every connection with `client_encoding` UTF8 (a
//! startup parameter, which wins over the `options` ones), and the server
//! converts the text to its own encoding exactly as it converts a bind
//! parameter — so both reach the same rows, on a `SQL_ASCII` database too,
//! which keeps the UTF-8 bytes as they are (escapes such as `\u00e9` are
//! refused there, 0A000). In UTF-8 no byte of a multibyte character is a
//! `$`, so nothing can end the string early. An integer becomes
//! `'<decimal digits>'::bigint`. Parameters are placed where the statement
//! template says (`$1`, `$2`, ...) when it is built, before the table name
//! is inserted, so a `$1` inside a table name is never taken for a
//! parameter.
//!
//! All times come from the database's wall clock (`clock_timestamp()`),
//! never the client's (see the crate docs on clocks). Acquire, extend and
//! release are one statement (one round trip) each, atomic on the server;
//! none keeps session state. How a statement is run (resent after a
//! notification, a conflict or a lost connection; cancelled safely) is in
//! [`run`].

pub(crate) mod run;

use std::fmt::Write as _;
use std::sync::Arc;

use sqlx::postgres::PgArguments;
use sqlx::query::Query;
use sqlx::{Execute, Postgres};

use crate::config::FORMAT_TABLE;
use crate::keys::{qualified_table, quote_identifier};

pub(crate) use run::{send, GiveBack, Reply};

/// How statements and their values are sent to the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// Named prepared statements with bind parameters.
    Extended,
    /// One `Query` message per statement, values as literals.
    Simple,
}

/// A value for a statement parameter.
#[derive(Debug, Clone)]
pub(crate) enum Arg {
    Text(String),
    Int(i64),
}

impl Arg {
    /// A text parameter.
    pub(crate) fn text(text: &str) -> Self {
        Arg::Text(text.to_owned())
    }

    /// The value as an SQL literal that no server setting reads otherwise
    /// (see the module docs).
    fn literal(&self, out: &mut String) {
        match self {
            Arg::Text(text) => {
                // `$d$`, else `$d1$`, ...: a tag whose first appearance in
                // the value followed by the tag is that closing tag (so the
                // value neither contains it nor ends with a start of it).
                let mut tag = String::from("$d$");
                let mut n = 0u32;
                while format!("{text}{tag}").find(&tag) != Some(text.len()) {
                    n += 1;
                    tag = format!("$d{n}$");
                }
                // The space keeps the tag apart from a preceding word.
                out.push(' ');
                out.push_str(&tag);
                out.push_str(text);
                out.push_str(&tag);
            }
            Arg::Int(n) => {
                let _ = write!(out, "'{n}'::bigint");
            }
        }
    }
}

/// One statement with numbered parameters.
#[derive(Debug, Clone)]
pub(crate) struct Sql {
    /// The text with `$1`, `$2`, ... (the extended protocol's form).
    text: String,
    /// The text split at its parameters: each piece of text is followed by
    /// the (0-based) parameter it precedes, the last by none.
    pieces: Vec<(String, Option<usize>)>,
}

impl Sql {
    /// Builds a statement from `template`, whose `$n` are parameters and
    /// whose `{t}` is replaced by `table` (after the parameters were found).
    fn new(template: &str, table: &str) -> Self {
        let mut pieces = Vec::new();
        let mut text = String::new();
        let mut rest = template;
        while let Some(at) = rest.find('$') {
            let digits = rest[at + 1..]
                .bytes()
                .take_while(u8::is_ascii_digit)
                .count();
            let (piece, after) = rest.split_at(at);
            if digits == 0 {
                // A `$` that is not a parameter (a regular expression's `$`).
                text.push_str(piece);
                text.push('$');
                rest = &after[1..];
                continue;
            }
            text.push_str(piece);
            let number: usize = after[1..=digits].parse().unwrap_or(0);
            pieces.push((text.replace("{t}", table), number.checked_sub(1)));
            text = String::new();
            rest = &after[1 + digits..];
        }
        text.push_str(rest);
        pieces.push((text.replace("{t}", table), None));
        let text = pieces
            .iter()
            .map(|(piece, param)| match param {
                Some(p) => format!("{piece}${}", p + 1),
                None => piece.clone(),
            })
            .collect();
        Self { text, pieces }
    }

    /// The statement with `args` spliced in as literals (simple protocol).
    pub(crate) fn render(&self, args: &[Arg]) -> String {
        let mut out = String::with_capacity(self.text.len() + 64 * args.len());
        for (piece, param) in &self.pieces {
            out.push_str(piece);
            if let Some(arg) = param.and_then(|p| args.get(p)) {
                arg.literal(&mut out);
            }
        }
        out
    }
}

/// A statement and its arguments, ready to be sent (again) by either
/// protocol. Owns everything, so that it can run on a task of its own.
#[derive(Debug)]
pub(crate) struct Call {
    sql: Arc<Sql>,
    args: Vec<Arg>,
    /// The rendered text, for the simple protocol.
    simple: Option<String>,
}

impl Call {
    pub(crate) fn new(protocol: Protocol, sql: &Arc<Sql>, args: Vec<Arg>) -> Self {
        let simple = (protocol == Protocol::Simple).then(|| sql.render(&args));
        Self {
            sql: sql.clone(),
            args,
            simple,
        }
    }

    /// Whether it is sent as a prepared statement (extended protocol).
    pub(crate) fn is_prepared(&self) -> bool {
        self.simple.is_none()
    }

    /// The same statement for the simple protocol.
    pub(crate) fn simple(&self) -> Self {
        Self::new(Protocol::Simple, &self.sql, self.args.clone())
    }

    /// A fresh statement to execute (one per attempt).
    pub(crate) fn statement(&self) -> Statement<'_> {
        match &self.simple {
            Some(text) => Statement::Simple(text),
            None => Statement::Prepared(self.args.iter().fold(
                sqlx::query(&self.sql.text),
                |query, arg| match arg {
                    Arg::Text(text) => query.bind(text.as_str()),
                    Arg::Int(n) => query.bind(*n),
                },
            )),
        }
    }
}

/// A statement of either protocol, for sqlx to execute.
pub(crate) enum Statement<'q> {
    /// Prepared (and cached by sqlx) with bind parameters.
    Prepared(Query<'q, Postgres, PgArguments>),
    /// Sent as it is in one `Query` message.
    Simple(&'q str),
}

impl<'q> Execute<'q, Postgres> for Statement<'q> {
    fn sql(&self) -> &'q str {
        match self {
            Statement::Prepared(query) => query.sql(),
            Statement::Simple(text) => text,
        }
    }

    fn statement(&self) -> Option<&<Postgres as sqlx::Database>::Statement<'q>> {
        match self {
            Statement::Prepared(query) => query.statement(),
            Statement::Simple(_) => None,
        }
    }

    fn take_arguments(&mut self) -> Result<Option<PgArguments>, sqlx::error::BoxDynError> {
        match self {
            Statement::Prepared(query) => query.take_arguments(),
            // No arguments: sqlx sends a simple `Query` message.
            Statement::Simple(_) => Ok(None),
        }
    }

    fn persistent(&self) -> bool {
        match self {
            Statement::Prepared(query) => query.persistent(),
            Statement::Simple(_) => false,
        }
    }
}

/// Marks a row that an owner token gave up (released, or given back by a
/// caller that left before the reply): the row keeps that owner, and its
/// `expires_at` is this many microseconds after the Unix epoch plus the
/// *send number* of the acquisition (see [`Statements::acquire`]). Such a
/// row is long expired, so it is free for everyone; but a send of that
/// owner token numbered at most that is refused, so an acquire the server
/// applies late can never take back a lock its owner already gave up.
/// Real expiries are `clock_timestamp() + ttl`, never before 2000.
pub(crate) const GIVEN_UP_BEFORE: &str = "'2000-01-01 00:00:00+00'::timestamptz";

/// The `expires_at` of a row given up by sends numbered up to `$n`.
fn given_up(n: u32) -> String {
    format!("('epoch'::timestamptz + ${n}::bigint * interval '1 microsecond')")
}

/// The statements for one lock table.
#[derive(Debug, Clone)]
pub(crate) struct Statements {
    /// `$1` schema name -> `exists bool`.
    pub schema_exists: Arc<Sql>,
    /// Creates the schema.
    pub create_schema: Arc<Sql>,
    /// `$1` qualified table name -> `exists bool`.
    pub table_exists: Arc<Sql>,
    /// Creates the table.
    pub create_table: Arc<Sql>,
    /// The quoted, qualified table of format markers.
    pub format_table: String,
    /// Creates the table of format markers.
    pub create_format_table: Arc<Sql>,
    /// `$1` lock table name, `$2` namespace -> `format text`: the marker, if
    /// any (a read, so a read-only user or server gets past it).
    pub read_format: Arc<Sql>,
    /// `$1` lock table name, `$2` namespace, `$3` this client's format ->
    /// `format text`: stores `$3` as the marker of the lock table and
    /// namespace if they have none, and returns the marker; no row when a
    /// concurrent first insert is committed but not in the statement's
    /// snapshot (sent again, it sees it).
    pub format: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` TTL in ms, `$5` send
    /// number -> `acquired bool, fencing bigint, owner text, expires_in_ms
    /// bigint, version text`: one row `acquired = true` with the fencing
    /// token and the version (`xmin`) of the row it wrote, or the holder's
    /// row (`acquired = false`), or no row (a concurrent first insert the
    /// statement's snapshot cannot see yet).
    ///
    /// Takes a free or expired lock with the next fencing token, and
    /// *adopts* a live lock held by `$3` itself (an earlier attempt of the
    /// same acquisition whose reply was lost): same fencing token, expiry
    /// reset to `$4` from now. A row that `$3` gave up with a send number
    /// of at least `$5` is refused (see [`GIVEN_UP_BEFORE`]). Send numbers
    /// grow with every acquisition a process starts, so a later
    /// acquisition with the same owner token is never refused that way.
    pub acquire: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` TTL in ms ->
    /// `done bigint, owner text, fencing bigint` (the row as it was before).
    pub extend: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` channel,
    /// `$6` the lease's send number -> `done bigint, owner text, fencing
    /// bigint, given_up bool` (the row as it was before); marks the row
    /// given up (see [`GIVEN_UP_BEFORE`]) and sends `NOTIFY channel, key`
    /// when it released.
    pub release: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` version, `$5` send
    /// number, `$6` channel -> `done bigint`: for an acquire whose caller
    /// left before the reply. Marks the row given up by `$3` up to send
    /// `$5` (see [`GIVEN_UP_BEFORE`]) if it is still exactly the version
    /// `$4` that acquire wrote (nothing adopted, extended or released it
    /// since), or if nobody holds it (so that an earlier send of the
    /// acquire that the server applies later is refused); creates it so
    /// marked if there is no row. Sends `NOTIFY channel, key` when it
    /// wrote.
    pub give_back: Arc<Sql>,
    /// `$1` namespace, `$2` key -> `held bool, owner text, fencing bigint,
    /// expires_in_ms bigint`, or no row for a key never locked.
    pub inspect: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` channel -> `done bigint, owner text,
    /// fencing bigint` (the row as it was before); frees a live lock of any
    /// owner distlock wrote and sends `NOTIFY channel, key`.
    pub force_release: Arc<Sql>,
}

impl Statements {
    pub(crate) fn new(schema: &str, table: &str) -> Self {
        let t = qualified_table(schema, table);
        let sql = |template: &str| Arc::new(Sql::new(template, &t));
        let format_table = qualified_table(schema, FORMAT_TABLE);
        let marker = |template: &str| Arc::new(Sql::new(template, &format_table));
        Self {
            create_format_table: marker(
                "CREATE TABLE IF NOT EXISTS {t} (
                    lock_table text NOT NULL,
                    namespace text NOT NULL,
                    format text NOT NULL,
                    PRIMARY KEY (lock_table, namespace)
                )",
            ),
            read_format: marker(
                "SELECT format FROM {t} WHERE lock_table = $1 AND namespace = $2",
            ),
            format: marker(
                "WITH stored AS (
                    INSERT INTO {t} (lock_table, namespace, format) VALUES ($1, $2, $3)
                    ON CONFLICT (lock_table, namespace) DO NOTHING
                    RETURNING format
                )
                SELECT format FROM stored
                UNION ALL
                SELECT format FROM {t} WHERE lock_table = $1 AND namespace = $2",
            ),
            format_table: format_table.clone(),
            schema_exists: sql(
                "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1) AS exists",
            ),
            create_schema: Arc::new(Sql::new(
                "CREATE SCHEMA IF NOT EXISTS {t}",
                &quote_identifier(schema),
            )),
            table_exists: sql("SELECT pg_catalog.to_regclass($1) IS NOT NULL AS exists"),
            create_table: sql("CREATE TABLE IF NOT EXISTS {t} (
                    namespace text NOT NULL,
                    key text NOT NULL,
                    owner text,
                    fencing bigint NOT NULL,
                    expires_at timestamptz NOT NULL,
                    PRIMARY KEY (namespace, key)
                )"),
            acquire: sql(&format!("WITH taken AS (
                    INSERT INTO {{t}} AS t (namespace, key, owner, fencing, expires_at)
                    VALUES ($1, $2, $3, 1, clock_timestamp() + $4::bigint * interval '1 millisecond')
                    ON CONFLICT (namespace, key) DO UPDATE
                        SET owner = excluded.owner,
                            fencing = CASE WHEN t.owner = excluded.owner AND t.expires_at > clock_timestamp()
                                           THEN t.fencing ELSE t.fencing + 1 END,
                            expires_at = clock_timestamp() + $4::bigint * interval '1 millisecond'
                        WHERE (t.owner IS NULL OR t.owner ~ '^[0-9a-f]{{32}}$')
                          AND t.fencing >= 0
                          AND (t.owner IS NULL OR t.expires_at <= clock_timestamp() OR t.owner = excluded.owner)
                          AND NOT coalesce(t.owner = excluded.owner AND t.expires_at < {GIVEN_UP_BEFORE}
                                           AND t.expires_at >= {up_to}, false)
                    RETURNING t.fencing, t.xmin::text AS version
                )
                SELECT true AS acquired, taken.fencing AS fencing, NULL::text AS owner,
                       NULL::bigint AS expires_in_ms, taken.version AS version
                FROM taken
                UNION ALL
                SELECT false, h.fencing, h.owner,
                       greatest(0, ceil(extract(epoch FROM (h.expires_at - clock_timestamp())) * 1000))::bigint,
                       NULL::text
                FROM {{t}} AS h
                WHERE h.namespace = $1 AND h.key = $2 AND NOT EXISTS (SELECT 1 FROM taken)",
                up_to = given_up(5))),
            extend: sql("WITH done AS (
                    UPDATE {t}
                    SET expires_at = clock_timestamp() + $5::bigint * interval '1 millisecond'
                    WHERE namespace = $1 AND key = $2 AND owner = $3 AND fencing = $4
                      AND expires_at > clock_timestamp()
                    RETURNING 1
                )
                SELECT (SELECT count(*) FROM done) AS done, h.owner AS owner, h.fencing AS fencing
                FROM (VALUES (1)) AS one (x)
                LEFT JOIN {t} AS h ON h.namespace = $1 AND h.key = $2"),
            release: sql(&format!("WITH done AS (
                    UPDATE {{t}}
                    SET expires_at = {up_to}
                    WHERE namespace = $1 AND key = $2 AND owner = $3 AND fencing = $4
                      AND expires_at > clock_timestamp()
                    RETURNING key
                )
                SELECT (SELECT count(*) FROM (SELECT pg_notify($5, done.key) FROM done) AS n) AS done,
                       h.owner AS owner, h.fencing AS fencing,
                       coalesce(h.expires_at < {GIVEN_UP_BEFORE}, false) AS given_up
                FROM (VALUES (1)) AS one (x)
                LEFT JOIN {{t}} AS h ON h.namespace = $1 AND h.key = $2",
                up_to = given_up(6))),
            give_back: sql(&format!("WITH done AS (
                    INSERT INTO {{t}} AS t (namespace, key, owner, fencing, expires_at)
                    VALUES ($1, $2, $3, 0, {up_to})
                    ON CONFLICT (namespace, key) DO UPDATE
                        SET owner = excluded.owner, expires_at = excluded.expires_at
                        WHERE (t.owner = excluded.owner AND t.xmin = $4::xid)
                           OR ((t.owner IS NULL OR (t.expires_at <= clock_timestamp()
                                                    AND t.expires_at >= {GIVEN_UP_BEFORE}))
                               AND (t.owner IS NULL OR t.owner ~ '^[0-9a-f]{{32}}$')
                               AND t.fencing >= 0)
                    RETURNING t.key
                )
                SELECT count(*) AS done FROM (SELECT pg_notify($6, done.key) FROM done) AS n",
                up_to = given_up(5))),
            inspect: sql("SELECT (owner IS NOT NULL AND expires_at > clock_timestamp()) AS held, owner, fencing,
                        greatest(0, ceil(extract(epoch FROM (expires_at - clock_timestamp())) * 1000))::bigint
                            AS expires_in_ms
                 FROM {t} WHERE namespace = $1 AND key = $2"),
            force_release: sql("WITH done AS (
                    UPDATE {t}
                    SET owner = NULL
                    WHERE namespace = $1 AND key = $2 AND owner IS NOT NULL
                      AND owner ~ '^[0-9a-f]{32}$' AND fencing >= 0
                      AND expires_at > clock_timestamp()
                    RETURNING key
                )
                SELECT (SELECT count(*) FROM (SELECT pg_notify($3, done.key) FROM done) AS n) AS done,
                       h.owner AS owner, h.fencing AS fencing
                FROM (VALUES (1)) AS one (x)
                LEFT JOIN {t} AS h ON h.namespace = $1 AND h.key = $2"),
        }
    }
}

/// `{a}` (a row of the semaphore table) is in the form distlock writes:
/// a limit of at least 1, three arrays of one length, each permit with an
/// owner token, a fencing token between 1 and the row's counter, an expiry.
fn well_formed(a: &str) -> String {
    format!(
        "({a}.permit_limit >= 1 AND {a}.fencing >= 0
          AND cardinality({a}.owners) = cardinality({a}.fencings)
          AND cardinality({a}.owners) = cardinality({a}.expires)
          AND NOT EXISTS (SELECT 1 FROM unnest({a}.owners, {a}.fencings, {a}.expires) AS w (o, f, e)
                          WHERE w.o IS NULL OR w.o !~ '^[0-9a-f]{{32}}$'
                             OR w.f IS NULL OR w.f < 1 OR w.f > {a}.fencing OR w.e IS NULL))"
    )
}

/// The fencing token of the permit `$3` holds live at `{now}` in row `{a}`
/// (a scalar subquery: NULL if none).
fn own_permit(a: &str, now: &str) -> String {
    format!(
        "(SELECT l.f FROM unnest({a}.owners, {a}.fencings, {a}.expires) AS l (o, f, e)
          WHERE l.o = $3::text AND l.e > {now} LIMIT 1)"
    )
}

/// Whether the permit `$3`, `$4` is live in row `{a}`.
fn holds_permit(a: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM unnest({a}.owners, {a}.fencings, {a}.expires) AS l (o, f, e)
                 WHERE l.o = $3::text AND l.f = $4::bigint AND l.e > clock_timestamp())"
    )
}

/// How many permits of row `{a}` are live at `{now}`.
fn live_permits(a: &str, now: &str) -> String {
    format!("(SELECT count(*) FROM unnest({a}.expires) AS l (e) WHERE l.e > {now})")
}

/// Rewrites the permits of row `t`: those of `rows` (over `l (o, f, e,
/// n)`, `n` their place), in order, each with expiry `expiry`.
fn permits_from(rows: &str, expiry: &str) -> String {
    format!(
        "(owners, fencings, expires) = (
            SELECT coalesce(array_agg(l.o ORDER BY l.n), '{{}}'),
                   coalesce(array_agg(l.f ORDER BY l.n), '{{}}'),
                   coalesce(array_agg({expiry} ORDER BY l.n), '{{}}')
            FROM ({rows}) AS l)"
    )
}

/// The permits of row `t` kept by `keep`, as rows for [`permits_from`].
fn permits_of_t(keep: &str) -> String {
    format!(
        "SELECT p.o, p.f, p.e, p.n FROM unnest(t.owners, t.fencings, t.expires) WITH ORDINALITY AS p (o, f, e, n)
         WHERE {keep}"
    )
}

/// The statements for one semaphore table.
///
/// A semaphore is one row `(namespace, key)` holding its limit, its fencing
/// counter (the last token granted) and its permits as three arrays of one
/// length (owner tokens, fencing tokens, expiries). Every statement writes
/// that one row: under `READ COMMITTED` its row lock, and the re-check of a
/// row changed while the statement waited for it, make each statement
/// atomic, with no lock on anything else — permits in rows of their own
/// could not be counted that way in one statement, whose snapshot predates
/// the row lock. Expired permits are dropped by every statement that
/// writes the row; the row itself stays, so the fencing counter keeps
/// growing.
#[derive(Debug, Clone)]
pub(crate) struct PermitStatements {
    /// Creates the table.
    pub create_table: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` TTL in ms, `$5` limit ->
    /// `granted bool, fencing bigint, permit_limit bigint, live bigint,
    /// expires_in_ms bigint, well_formed bool`: one row `granted = true`
    /// with the permit's fencing token, or the semaphore's row as the
    /// statement's snapshot saw it (`granted = false`: its limit, how many
    /// permits are live, when the first of them runs out), or no row (a
    /// concurrent first insert the snapshot cannot see yet).
    ///
    /// Grants if no permit is live (the limit `$5` then applies), or the
    /// limit is `$5` and `$3` holds a live permit (adopted: its fencing
    /// token, its expiry reset to `$4` from now) or fewer than `$5` are live
    /// (a new permit with the next fencing token).
    pub acquire: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` TTL in ms ->
    /// `done bigint, well_formed bool`.
    pub extend: Arc<Sql>,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` channel ->
    /// `done bigint, well_formed bool, given_up bool` (`given_up`: the row
    /// as it was before has the permit given up, by an earlier send of this
    /// release). Keeps the permit given up (its expiry
    /// [`GIVEN_UP_BEFORE`]) until the next statement on the row, and sends
    /// `NOTIFY channel, key` when it released.
    pub release: Arc<Sql>,
}

impl PermitStatements {
    pub(crate) fn new(schema: &str, table: &str) -> Self {
        let t = qualified_table(schema, table);
        let sql = |template: &str| Arc::new(Sql::new(template, &t));
        let ttl = |n: u32| format!("${n}::bigint * interval '1 millisecond'");
        let now = "excluded.updated_at";
        // The permit `$3`, `$4` (extend, release).
        let this = "(p.o = $3::text AND p.f = $4::bigint)";
        let found = "FROM (VALUES (1)) AS one (x)
                LEFT JOIN {t} AS h ON h.namespace = $1 AND h.key = $2";
        Self {
            create_table: sql("CREATE TABLE IF NOT EXISTS {t} (
                    namespace text NOT NULL,
                    key text NOT NULL,
                    permit_limit bigint NOT NULL,
                    fencing bigint NOT NULL,
                    owners text[] NOT NULL,
                    fencings bigint[] NOT NULL,
                    expires timestamptz[] NOT NULL,
                    updated_at timestamptz NOT NULL,
                    PRIMARY KEY (namespace, key)
                )"),
            acquire: sql(&format!(
                "WITH now AS (SELECT clock_timestamp() AS at),
                taken AS (
                    INSERT INTO {{t}} AS t (namespace, key, permit_limit, fencing, owners, fencings, expires, updated_at)
                    SELECT $1, $2, $5::bigint, 1, ARRAY[$3::text], ARRAY[1::bigint], ARRAY[now.at + {ttl4}], now.at
                    FROM now
                    ON CONFLICT (namespace, key) DO UPDATE
                        SET {permits},
                            fencing = t.fencing + CASE WHEN {own} IS NULL THEN 1 ELSE 0 END,
                            permit_limit = excluded.permit_limit,
                            updated_at = {now}
                        WHERE {well_formed_t}
                          AND ({live} = 0
                               OR (t.permit_limit = excluded.permit_limit
                                   AND ({own} IS NOT NULL OR {live} < excluded.permit_limit)))
                    RETURNING t.fencings[cardinality(t.fencings)] AS fencing
                )
                SELECT true AS granted, taken.fencing AS fencing, NULL::bigint AS permit_limit,
                       NULL::bigint AS live, NULL::bigint AS expires_in_ms, true AS well_formed
                FROM taken
                UNION ALL
                SELECT false, h.fencing, h.permit_limit, {live_h},
                       (SELECT greatest(0, ceil(extract(epoch FROM (min(l.e) - clock_timestamp())) * 1000))::bigint
                        FROM unnest(h.expires) AS l (e) WHERE l.e > clock_timestamp()),
                       coalesce({well_formed_h}, false)
                FROM {{t}} AS h
                WHERE h.namespace = $1 AND h.key = $2 AND NOT EXISTS (SELECT 1 FROM taken)",
                ttl4 = ttl(4),
                permits = permits_from(
                    &format!(
                        "{} UNION ALL SELECT $3::text, coalesce({own}, t.fencing + 1), excluded.expires[1], NULL",
                        permits_of_t(&format!("p.e > {now} AND p.o <> $3::text")),
                        own = own_permit("t", now),
                    ),
                    "l.e",
                ),
                own = own_permit("t", now),
                live = live_permits("t", now),
                live_h = live_permits("h", "clock_timestamp()"),
                well_formed_t = well_formed("t"),
                well_formed_h = well_formed("h"),
            )),
            extend: sql(&format!(
                "WITH done AS (
                    UPDATE {{t}} AS t
                    SET {permits}, updated_at = clock_timestamp()
                    WHERE t.namespace = $1 AND t.key = $2 AND {well_formed_t} AND {holds}
                    RETURNING 1
                )
                SELECT (SELECT count(*) FROM done) AS done, coalesce({well_formed_h}, true) AS well_formed
                {found}",
                // The permit was live when the row was checked: kept even
                // if it ran out since.
                permits = permits_from(
                    &permits_of_t(&format!("p.e > clock_timestamp() OR {this}")),
                    &format!(
                        "CASE WHEN l.o = $3::text AND l.f = $4::bigint THEN clock_timestamp() + {} ELSE l.e END",
                        ttl(5)
                    ),
                ),
                holds = holds_permit("t"),
                well_formed_t = well_formed("t"),
                well_formed_h = well_formed("h"),
            )),
            release: sql(&format!(
                "WITH done AS (
                    UPDATE {{t}} AS t
                    SET {permits}, updated_at = clock_timestamp()
                    WHERE t.namespace = $1 AND t.key = $2 AND {well_formed_t} AND {holds}
                    RETURNING t.key
                )
                SELECT (SELECT count(*) FROM (SELECT pg_notify($5, done.key) FROM done) AS n) AS done,
                       coalesce({well_formed_h}, true) AS well_formed,
                       coalesce((SELECT bool_or(l.o = $3::text AND l.f = $4::bigint AND l.e < {GIVEN_UP_BEFORE})
                                 FROM unnest(h.owners, h.fencings, h.expires) AS l (o, f, e)), false) AS given_up
                {found}",
                permits = permits_from(
                    &permits_of_t(&format!("p.e > clock_timestamp() OR {this}")),
                    "CASE WHEN l.o = $3::text AND l.f = $4::bigint THEN 'epoch'::timestamptz ELSE l.e END",
                ),
                holds = holds_permit("t"),
                well_formed_t = well_formed("t"),
                well_formed_h = well_formed("h"),
            )),
        }
    }
}

/// The text of the lock statements for the table `schema.table`, exactly as
/// the backend sends them over the extended protocol (`$1`, `$2`, ...
/// parameters): for the workspace benchmark, which runs them over a plain
/// sqlx pool beside the library, so its baseline is the library's own
/// SQL. Not a stable API.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct StatementTexts {
    /// `$1` namespace, `$2` key, `$3` owner (32 lowercase hex digits), `$4`
    /// TTL in ms, `$5` send number -> `acquired bool, fencing bigint, ...`.
    pub acquire: String,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` channel,
    /// `$6` the acquire's send number -> `done bigint, ...`.
    pub release: String,
}

impl StatementTexts {
    /// The statements for the lock table `schema.table` (unquoted names).
    pub fn new(schema: &str, table: &str) -> Self {
        let statements = Statements::new(schema, table);
        Self {
            acquire: statements.acquire.text.clone(),
            release: statements.release.text.clone(),
        }
    }
}

/// The text of the permit statements for the semaphore table
/// `schema.table`, as [`StatementTexts`] gives the lock's: for the
/// workspace benchmark's raw permit baseline. Not a stable API.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct PermitStatementTexts {
    /// `$1` namespace, `$2` key, `$3` owner (32 lowercase hex digits), `$4`
    /// TTL in ms, `$5` limit -> `granted bool, fencing bigint, ...`.
    pub acquire: String,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` channel ->
    /// `done bigint, ...`.
    pub release: String,
}

impl PermitStatementTexts {
    /// The statements for the semaphore table `schema.table` (unquoted
    /// names).
    pub fn new(schema: &str, table: &str) -> Self {
        let statements = PermitStatements::new(schema, table);
        Self {
            acquire: statements.acquire.text.clone(),
            release: statements.release.text.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn literal(arg: Arg) -> String {
        let mut out = String::new();
        arg.literal(&mut out);
        out
    }

    #[test]
    fn parameters_are_found_before_the_table_name_is_inserted() {
        let sql = Sql::new(
            "SELECT $1 FROM {t} WHERE k ~ '^a$' AND n = $12 AND t = $1",
            "\"s\".\"t$1\"",
        );
        assert_eq!(
            sql.text,
            "SELECT $1 FROM \"s\".\"t$1\" WHERE k ~ '^a$' AND n = $12 AND t = $1"
        );
        let mut args = vec![Arg::Int(0); 12];
        args[0] = Arg::text("x");
        args[11] = Arg::Int(-7);
        assert_eq!(
            sql.render(&args),
            "SELECT  $d$x$d$ FROM \"s\".\"t$1\" WHERE k ~ '^a$' AND n = '-7'::bigint AND t =  $d$x$d$"
        );
    }

    #[test]
    fn text_literals_are_dollar_quoted_with_a_tag_the_value_lacks() {
        // Quotes and backslashes need no escape inside dollar quotes;
        // other characters travel as they are.
        assert_eq!(literal(Arg::text("a'b\\c é\n😀")), " $d$a'b\\c é\n😀$d$");
        assert_eq!(literal(Arg::text("")), " $d$$d$");
        assert_eq!(literal(Arg::text("x$d$y")), " $d1$x$d$y$d1$");
        assert_eq!(literal(Arg::text("$d$$d1$")), " $d2$$d$$d1$$d2$");
        // A value ending in a start of the tag would close the quote
        // early with it.
        assert_eq!(literal(Arg::text("a$")), " $d$a$$d$");
        assert_eq!(literal(Arg::text("x$d")), " $d1$x$d$d1$");
        assert_eq!(literal(Arg::text("$d1")), " $d$$d1$d$");
        assert_eq!(
            literal(Arg::Int(i64::MIN)),
            "'-9223372036854775808'::bigint"
        );
    }
}
