//! The SQL of the lease-table backend, and how its values reach the server.
//!
//! The statements are built once per client for its table. Only the
//! validated, quoted schema and table names are part of the text; every
//! value (namespace, key, owner, fencing, TTL, channel) is a parameter,
//! sent one of two ways ([`Protocol`]):
//!
//! - **extended** (the default): sqlx's named prepared statements, the
//!   values as bind parameters. Parsed and planned once per connection.
//! - **simple** (`pool_mode=transaction`): one `Query` message per
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
//! (as it sees bind parameters): a text value becomes an escape string
//! `E'...'` in which `\` and `'` are escaped with a backslash and every
//! character outside printable ASCII is written `\uXXXX` or `\UXXXXXXXX`,
//! so the text sent is printable ASCII whatever the value, the client
//! encoding (no byte of a multibyte character is ever sent) and
//! `standard_conforming_strings` (an `E'...'` string reads backslashes
//! the same either way); an integer becomes `'<decimal digits>'::bigint`.
//! The server turns the escapes back into the characters in its own
//! encoding, exactly as it converts a bind parameter. Parameters are placed
//! where the statement template says (`$1`, `$2`, ...) when it is built,
//! before the table name is inserted, so a `$1` inside a table name is never
//! taken for a parameter.
//!
//! All times come from the database's wall clock (`clock_timestamp()`),
//! never the client's (see the crate docs on clocks). Acquire, extend and
//! release are one statement (one round trip) each, atomic on the server;
//! none keeps session state. How a statement is run (resent after a
//! notification, a conflict or a lost connection; cancelled safely) is in
//! [`run`].

pub(crate) mod run;

use std::fmt::Write as _;

use sqlx::postgres::PgArguments;
use sqlx::query::Query;
use sqlx::{Execute, Postgres};

use crate::keys::{qualified_table, quote_identifier};

pub(crate) use run::{run, InFlight, Reply, Undo};

/// How statements and their values are sent to the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// Named prepared statements with bind parameters.
    Extended,
    /// One `Query` message per statement, values as literals.
    Simple,
}

/// A value for a statement parameter.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg<'a> {
    Text(&'a str),
    Int(i64),
}

impl Arg<'_> {
    /// The value as an SQL literal made of printable ASCII only (see the
    /// module docs).
    fn literal(&self, out: &mut String) {
        match self {
            Arg::Text(text) => {
                out.push_str("E'");
                for c in text.chars() {
                    match c {
                        '\\' => out.push_str("\\\\"),
                        '\'' => out.push_str("\\'"),
                        ' '..='~' => out.push(c),
                        c if u32::from(c) <= 0xffff => {
                            let _ = write!(out, "\\u{:04x}", u32::from(c));
                        }
                        c => {
                            let _ = write!(out, "\\U{:08x}", u32::from(c));
                        }
                    }
                }
                out.push('\'');
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
    pub(crate) fn render(&self, args: &[Arg<'_>]) -> String {
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
/// protocol.
pub(crate) struct Call<'a> {
    sql: &'a Sql,
    args: Vec<Arg<'a>>,
    /// The rendered text, for the simple protocol.
    simple: Option<String>,
}

impl<'a> Call<'a> {
    pub(crate) fn new(protocol: Protocol, sql: &'a Sql, args: Vec<Arg<'a>>) -> Self {
        let simple = (protocol == Protocol::Simple).then(|| sql.render(&args));
        Self { sql, args, simple }
    }

    /// A fresh statement to execute (one per attempt).
    pub(crate) fn statement(&self) -> Statement<'_> {
        match &self.simple {
            Some(text) => Statement::Simple(text),
            None => Statement::Prepared(self.args.iter().fold(
                sqlx::query(&self.sql.text),
                |query, arg| match arg {
                    Arg::Text(text) => query.bind(*text),
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

/// The statements for one lock table.
#[derive(Debug, Clone)]
pub(crate) struct Statements {
    /// `$1` schema name -> `exists bool`.
    pub schema_exists: Sql,
    /// Creates the schema.
    pub create_schema: Sql,
    /// `$1` qualified table name -> `exists bool`.
    pub table_exists: Sql,
    /// Creates the table.
    pub create_table: Sql,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` TTL in ms ->
    /// `acquired bool, fencing bigint, owner text, expires_in_ms bigint`:
    /// one row `acquired = true` with the new fencing token, or the holder's
    /// row (`acquired = false`), or no row (a concurrent first insert the
    /// statement's snapshot cannot see yet).
    pub acquire: Sql,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` TTL in ms ->
    /// `done bigint, owner text, fencing bigint` (the row as it was before).
    pub extend: Sql,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` fencing, `$5` channel ->
    /// `done bigint, owner text, fencing bigint` (the row as it was before);
    /// sends `NOTIFY channel, key` when it released.
    pub release: Sql,
    /// `$1` namespace, `$2` key, `$3` owner, `$4` channel -> `done bigint`:
    /// frees the lock if `owner` holds it, whatever its fencing token, and
    /// sends `NOTIFY channel, key`. Gives back a lock granted to an acquire
    /// whose caller went away before the reply (the owner token is fresh
    /// per acquisition, so it matches that grant only).
    pub abandon: Sql,
    /// `$1` namespace, `$2` key -> `held bool, owner text, fencing bigint,
    /// expires_in_ms bigint`, or no row for a key never locked.
    pub inspect: Sql,
    /// `$1` namespace, `$2` key, `$3` channel -> `done bigint, owner text,
    /// fencing bigint` (the row as it was before); frees a live lock of any
    /// owner distlock wrote and sends `NOTIFY channel, key`.
    pub force_release: Sql,
}

impl Statements {
    pub(crate) fn new(schema: &str, table: &str) -> Self {
        let t = qualified_table(schema, table);
        let sql = |template: &str| Sql::new(template, &t);
        Self {
            schema_exists: sql(
                "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1) AS exists",
            ),
            create_schema: Sql::new("CREATE SCHEMA IF NOT EXISTS {t}", &quote_identifier(schema)),
            table_exists: sql("SELECT pg_catalog.to_regclass($1) IS NOT NULL AS exists"),
            create_table: sql("CREATE TABLE IF NOT EXISTS {t} (
                    namespace text NOT NULL,
                    key text NOT NULL,
                    owner text,
                    fencing bigint NOT NULL,
                    expires_at timestamptz NOT NULL,
                    PRIMARY KEY (namespace, key)
                )"),
            acquire: sql("WITH taken AS (
                    INSERT INTO {t} AS t (namespace, key, owner, fencing, expires_at)
                    VALUES ($1, $2, $3, 1, clock_timestamp() + $4::bigint * interval '1 millisecond')
                    ON CONFLICT (namespace, key) DO UPDATE
                        SET owner = excluded.owner,
                            fencing = t.fencing + 1,
                            expires_at = clock_timestamp() + $4::bigint * interval '1 millisecond'
                        WHERE (t.owner IS NULL OR t.expires_at <= clock_timestamp())
                          AND (t.owner IS NULL OR t.owner ~ '^[0-9a-f]{32}$')
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
                WHERE h.namespace = $1 AND h.key = $2 AND NOT EXISTS (SELECT 1 FROM taken)"),
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
            release: sql("WITH done AS (
                    UPDATE {t}
                    SET owner = NULL
                    WHERE namespace = $1 AND key = $2 AND owner = $3 AND fencing = $4
                      AND expires_at > clock_timestamp()
                    RETURNING key
                )
                SELECT (SELECT count(*) FROM (SELECT pg_notify($5, done.key) FROM done) AS n) AS done,
                       h.owner AS owner, h.fencing AS fencing
                FROM (VALUES (1)) AS one (x)
                LEFT JOIN {t} AS h ON h.namespace = $1 AND h.key = $2"),
            abandon: sql("WITH done AS (
                    UPDATE {t}
                    SET owner = NULL
                    WHERE namespace = $1 AND key = $2 AND owner = $3
                      AND expires_at > clock_timestamp()
                    RETURNING key
                )
                SELECT count(*) AS done FROM (SELECT pg_notify($4, done.key) FROM done) AS n"),
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

#[cfg(test)]
mod tests {
    use super::*;

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
        args[0] = Arg::Text("x");
        args[11] = Arg::Int(-7);
        assert_eq!(
            sql.render(&args),
            "SELECT E'x' FROM \"s\".\"t$1\" WHERE k ~ '^a$' AND n = '-7'::bigint AND t = E'x'"
        );
    }

    #[test]
    fn literals_are_printable_ascii_escape_strings() {
        let literal = |arg: Arg<'_>| {
            let mut out = String::new();
            arg.literal(&mut out);
            out
        };
        assert_eq!(
            literal(Arg::Text("a'b\\c é\n😀")),
            "E'a\\'b\\\\c \\u00e9\\u000a\\U0001f600'"
        );
        let nasty = literal(Arg::Text("'); DROP TABLE t; --\\\u{7f}\u{ff}"));
        assert!(nasty.bytes().all(|b| (b' '..=b'~').contains(&b)), "{nasty}");
        assert_eq!(
            literal(Arg::Int(i64::MIN)),
            "'-9223372036854775808'::bigint"
        );
    }
}
