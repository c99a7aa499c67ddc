//! The SQL of the lease-table backend: how a statement and its values
//! reach the server, and the statements themselves.
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
//! none keeps session state. The statements are [`locks`] (the lock table
//! and the format marker), [`permits`] (the semaphore table) and
//! [`sweep`] (deleting rows nobody has held for the fencing retention); how a
//! statement is run (resent after a notification, a conflict or a lost
//! connection; cancelled safely) is in [`run`].

mod index;
mod line;
mod locks;
mod permits;
pub(crate) mod run;
mod sweep;

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use sqlx::postgres::PgArguments;
use sqlx::query::Query;
use sqlx::{Execute, Postgres};

pub(crate) use index::Index;
pub use locks::StatementTexts;
pub(crate) use locks::Statements;
pub use permits::PermitStatementTexts;
pub(crate) use permits::PermitStatements;
pub(crate) use run::{send, send_alone, GiveBack, Missed, Reply};
pub(crate) use sweep::{Sweep, BATCH};

/// How statements and their values are sent to the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// Named prepared statements with bind parameters.
    Extended,
    /// One `Query` message per statement, values as literals.
    Simple,
}

impl Protocol {
    /// The protocol a client's switch (set once it uses the simple
    /// protocol for good) says.
    pub(crate) fn of(simple: &AtomicBool) -> Self {
        if simple.load(Ordering::Relaxed) {
            Protocol::Simple
        } else {
            Protocol::Extended
        }
    }
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
        Self::with_tables(template, table, "")
    }

    /// [`new`](Self::new), `{w}` also replaced by `waiters` (the table of
    /// waiter lines).
    fn with_tables(template: &str, table: &str, waiters: &str) -> Self {
        // One pass, so that a table name holding `{w}` stays as it is.
        let names = |piece: &str| {
            let mut out = String::with_capacity(piece.len() + table.len());
            let mut rest = piece;
            while let Some(at) = rest.find(['{']) {
                out.push_str(&rest[..at]);
                let after = &rest[at..];
                if let Some(tail) = after.strip_prefix("{t}") {
                    out.push_str(table);
                    rest = tail;
                } else if let Some(tail) = after.strip_prefix("{w}") {
                    out.push_str(waiters);
                    rest = tail;
                } else {
                    out.push('{');
                    rest = &after[1..];
                }
            }
            out.push_str(rest);
            out
        };
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
            pieces.push((names(&text), number.checked_sub(1)));
            text = String::new();
            rest = &after[1 + digits..];
        }
        text.push_str(rest);
        pieces.push((names(&text), None));
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
    fn table_names_are_inserted_once_each() {
        let sql = Sql::with_tables(
            "SELECT $1 FROM {t}, {w} WHERE k ~ '^a{2}$'",
            "\"{w}\"",
            "\"w$2\"",
        );
        assert_eq!(
            sql.text,
            "SELECT $1 FROM \"{w}\", \"w$2\" WHERE k ~ '^a{2}$'"
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
