//! Mapping of sqlx errors to [`LockError`] kinds.

use distlock_core::{request_message, LockError};
use sqlx::postgres::{PgDatabaseError, PgSeverity};

/// SQLSTATE codes we treat specially.
mod code {
    pub const INVALID_PASSWORD: &str = "28P01";
    pub const INVALID_AUTHORIZATION: &str = "28000";
    pub const INVALID_CATALOG_NAME: &str = "3D000";
    pub const INSUFFICIENT_PRIVILEGE: &str = "42501";
    pub const UNDEFINED_COLUMN: &str = "42703";
    pub const UNDEFINED_TABLE: &str = "42P01";
    pub const DATATYPE_MISMATCH: &str = "42804";
    pub const NUMERIC_VALUE_OUT_OF_RANGE: &str = "22003";
    pub const UNIQUE_VIOLATION: &str = "23505";
    pub const DUPLICATE_TABLE: &str = "42P07";
    pub const DUPLICATE_SCHEMA: &str = "42P06";
    pub const DUPLICATE_OBJECT: &str = "42710";
    pub const SERIALIZATION_FAILURE: &str = "40001";
    pub const DEADLOCK_DETECTED: &str = "40P01";
    pub const READ_ONLY_TRANSACTION: &str = "25006";
    pub const UNDEFINED_FUNCTION: &str = "42883";
    pub const UNTRANSLATABLE_CHARACTER: &str = "22P05";
    pub const CHARACTER_NOT_IN_REPERTOIRE: &str = "22021";
    pub const DATA_CORRUPTED: &str = "XX001";
    pub const INDEX_CORRUPTED: &str = "XX002";
    pub const LOCK_NOT_AVAILABLE: &str = "55P03";
    pub const DATABASE_DROPPED: &str = "57P04";
    pub const DUPLICATE_PREPARED_STATEMENT: &str = "42P05";
    pub const INVALID_SQL_STATEMENT_NAME: &str = "26000";
    pub const PROTOCOL_VIOLATION: &str = "08P01";
    /// Class 08: connection exceptions (PgBouncer reports a server
    /// connection lost under a transaction as 08P01).
    pub const CONNECTION_EXCEPTION_CLASS: &str = "08";
    /// Class 53: insufficient resources (disk full, out of memory, too many
    /// connections).
    pub const INSUFFICIENT_RESOURCES_CLASS: &str = "53";
    /// Class 57: operator intervention (shutdown, cannot connect now,
    /// idle session timeout, statement canceled).
    pub const OPERATOR_INTERVENTION_CLASS: &str = "57";
}

/// Whether a statement that failed with SQLSTATE `code` may succeed when
/// sent again later: the connection or the server was unavailable (class
/// 08; class 57 — shutting down, starting up, a session or statement ended
/// by the server — but for a dropped database), the server lacked
/// resources (class 53), or the statement lost to a concurrent
/// transaction (serialization failure, deadlock, `lock_timeout`). Every
/// other error — a read-only server, a missing function, a rejected value
/// or literal, a broken trigger — comes back the same however often it is
/// sent, so a waiting acquire reports it at once.
pub(crate) fn is_transient_sqlstate(code: &str) -> bool {
    code.starts_with(code::CONNECTION_EXCEPTION_CLASS)
        || code.starts_with(code::INSUFFICIENT_RESOURCES_CLASS)
        || (code.starts_with(code::OPERATOR_INTERVENTION_CLASS) && code != code::DATABASE_DROPPED)
        || matches!(
            code,
            code::SERIALIZATION_FAILURE | code::DEADLOCK_DETECTED | code::LOCK_NOT_AVAILABLE
        )
}

/// The SQLSTATE of a database error, if it is one.
pub(crate) fn sqlstate(error: &sqlx::Error) -> Option<String> {
    match error {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// Whether `error` is the loser's side of two clients creating the same
/// schema or table at once (`CREATE ... IF NOT EXISTS` is not race-free:
/// it can fail with a unique violation on the system catalogs).
pub(crate) fn is_concurrent_create(error: &LockError) -> bool {
    let driver = std::error::Error::source(error).and_then(|e| e.downcast_ref::<sqlx::Error>());
    matches!(
        driver.and_then(sqlstate).as_deref(),
        Some(
            code::UNIQUE_VIOLATION
                | code::DUPLICATE_TABLE
                | code::DUPLICATE_SCHEMA
                | code::DUPLICATE_OBJECT
        )
    )
}

/// Whether the server refused the statement for want of a privilege (a role
/// that may not delete from a table a DBA created).
pub(crate) fn is_permission_denied(error: &sqlx::Error) -> bool {
    sqlstate(error).as_deref() == Some(code::INSUFFICIENT_PRIVILEGE)
}

/// Whether the server rolled the statement back because it conflicted with
/// a concurrent transaction: a serialization failure (the database or role
/// defaults to `REPEATABLE READ` or `SERIALIZABLE`) or a deadlock. The
/// statement had no effect, so it can be sent again.
pub(crate) fn is_conflict(error: &sqlx::Error) -> bool {
    matches!(
        sqlstate(error).as_deref(),
        Some(code::SERIALIZATION_FAILURE | code::DEADLOCK_DETECTED)
    )
}

/// Whether sqlx gave up on a reply because a `NotificationResponse` came
/// in on a connection that is not a listener. sqlx reports it only as a
/// protocol error naming the message, hence the text match; the tests that
/// run through PgBouncer fail if sqlx ever words it differently.
pub(crate) fn is_stray_notification(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Protocol(message) if message.contains("NotificationResponse"))
}

/// Whether `error` is what a transaction pooler does to the driver's
/// prepared statements (a client connection's statements land on a server
/// session that another client connection prepared its own in, or that
/// never saw them): `42P05 prepared statement "sqlx_s_1" already exists`
/// (at `Parse`), `26000 prepared statement ... does not exist` (at `Bind`
/// or `Describe`), or `08P01 bind message supplies N parameters, but
/// prepared statement ... requires M`. The statement was refused before it
/// ran. Only meaningful for a statement sent prepared: this backend never
/// prepares statements in SQL.
pub(crate) fn is_shared_prepared_statement(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = error else {
        return false;
    };
    match db.code().as_deref() {
        Some(code::DUPLICATE_PREPARED_STATEMENT | code::INVALID_SQL_STATEMENT_NAME) => true,
        Some(code::PROTOCOL_VIOLATION) => {
            let message = db.message();
            message.contains("bind message") && message.contains("prepared statement")
        }
        _ => false,
    }
}

/// Whether the connection is gone after `error` (met while a statement
/// ran on it): an I/O error, a `FATAL` report (the server ends the session
/// after one: `pg_terminate_backend`, `idle_session_timeout`, a shutdown),
/// or a connection exception. The statement may or may not have run.
pub(crate) fn is_connection_lost(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(db) => {
            let fatal = db
                .try_downcast_ref::<PgDatabaseError>()
                .is_some_and(|pg| matches!(pg.severity(), PgSeverity::Fatal | PgSeverity::Panic));
            fatal
                || db
                    .code()
                    .is_some_and(|c| c.starts_with(code::CONNECTION_EXCEPTION_CLASS))
        }
        _ => false,
    }
}

/// The advice for a certificate the server did not trust.
const CLIENT_CERT_ADVICE: &str = "give a client certificate signed by a CA the server trusts (its ssl_ca_file) with sslcert/sslkey or tls_cert_file/tls_key_file";

/// What a PostgreSQL user changes for each TLS failure.
#[cfg(feature = "tls")]
const TLS_ADVICE: distlock_core::TlsAdvice = distlock_core::TlsAdvice {
    server: "PostgreSQL",
    trust: "sslrootcert=PATH or tls_ca_file=PATH",
    client_certificate:
        "sslcert/sslkey or tls_cert_file/tls_key_file (signed by a CA in the server's ssl_ca_file)",
    plaintext: "connect with sslmode=disable or sslmode=prefer",
};

/// A TLS problem found in an I/O error (rustls reports handshake failures
/// as `InvalidData` errors wrapping its own).
#[cfg(feature = "tls")]
fn tls_problem(error: &std::io::Error, what: &str) -> Option<LockError> {
    let tls = error.get_ref()?.downcast_ref::<rustls::Error>()?;
    let failure = distlock_core::TlsFailure::of_rustls(tls);
    Some(failure.error(what, tls, &TLS_ADVICE))
}

#[cfg(not(feature = "tls"))]
fn tls_problem(_: &std::io::Error, _: &str) -> Option<LockError> {
    None
}

/// A connection refused by the server's `pg_hba.conf` (SQLSTATE 28000),
/// worded by what the server's message says is missing.
fn refused(message: &str) -> LockError {
    if message.contains("no encryption") || message.contains("SSL off") {
        LockError::config(format!(
            "TLS connection problem: the PostgreSQL server accepts only TLS connections from this client (pg_hba.conf has hostssl lines only) and this connection did not use TLS ({message}); \
             connect with sslmode=verify-full (with sslrootcert or tls_ca_file) or sslmode=require"
        ))
    } else if message.contains("client certificate") {
        LockError::config(format!(
            "TLS certificate problem: the PostgreSQL server requires a client certificate ({message}); {CLIENT_CERT_ADVICE}"
        ))
    } else if message.contains("certificate") {
        LockError::config(format!(
            "TLS certificate problem: the PostgreSQL server did not accept this client's certificate for this user ({message}); \
             the certificate's common name must be the user name in the URL (or mapped to it in pg_ident.conf)"
        ))
    } else if message.contains("pg_hba.conf") {
        LockError::config(format!(
            "the PostgreSQL server refuses this connection ({message}); check the user, database and TLS settings in the URL against the server's pg_hba.conf"
        ))
    } else {
        LockError::config(format!(
            "PostgreSQL authentication failed ({message}); check the user and password in the URL"
        ))
    }
}

/// Maps a driver error met while doing `what` (empty inside a lock call,
/// see [`request_message`]) to a [`LockError`] a caller can match on.
pub(crate) fn map(error: sqlx::Error, what: &str) -> LockError {
    // "creating the lock table failed: ...", or nothing in a lock call.
    let failed = if what.is_empty() {
        String::new()
    } else {
        format!("{what} failed")
    };
    let (kind, message): (fn(String) -> LockError, String) = match &error {
        sqlx::Error::Configuration(e) => {
            return LockError::config(format!("invalid PostgreSQL connection settings: {e}"))
                .with_source(error)
        }
        sqlx::Error::Database(db) => match db.code().as_deref() {
            // A refused connection: there is no request to name.
            Some(code::INVALID_PASSWORD) => {
                return LockError::config(format!(
                    "PostgreSQL authentication failed ({}); check the user and password in the URL",
                    db.message()
                ))
                .with_source(error)
            }
            Some(code::INVALID_AUTHORIZATION) => {
                return refused(db.message()).with_source(error)
            }
            Some(code::INVALID_CATALOG_NAME) => {
                return LockError::config(format!(
                    "PostgreSQL refused the connection ({}); check the database name in the URL",
                    db.message()
                ))
                .with_source(error)
            }
            code => database(code, db.message()),
        },
        sqlx::Error::Io(e) => match tls_problem(e, &failed) {
            Some(tls) => return tls.with_source(error),
            // sqlx reads the TLS files again for each new connection.
            None if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
            ) =>
            {
                (
                    LockError::config,
                    format!("cannot read a TLS file named in the URL ({e}); check sslrootcert, sslcert, sslkey or tls_*_file"),
                )
            }
            None => (
                LockError::unavailable,
                format!("cannot talk to the PostgreSQL server ({e}); is it running and reachable?"),
            ),
        },
        sqlx::Error::Tls(e) => {
            let text = e.to_string();
            let message = if text.contains("does not support TLS") {
                "TLS connection problem: the PostgreSQL server does not accept TLS connections (ssl = off), but the URL's sslmode requires TLS; \
                 turn ssl on in the server's postgresql.conf, or connect with sslmode=prefer or disable".to_owned()
            } else if text.contains("without TLS support") {
                "the connection settings (sslmode, or PGSSLMODE in the environment) require TLS, but distlock was built without it: enable the `tls` cargo feature (of distlock, or of distlock-postgres)".to_owned()
            } else {
                format!("TLS problem ({text}); check sslrootcert, sslcert and sslkey (or tls_ca_file, tls_cert_file, tls_key_file)")
            };
            (LockError::config, message)
        }
        sqlx::Error::Protocol(e) => (
            LockError::unavailable,
            format!("PostgreSQL protocol error ({e})"),
        ),
        sqlx::Error::PoolTimedOut => (
            LockError::unavailable,
            "no connection to the PostgreSQL server within the connect timeout (connect_timeout_ms); is it running and reachable?".to_owned(),
        ),
        sqlx::Error::PoolClosed => (
            LockError::unavailable,
            "the connection pool was closed".to_owned(),
        ),
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::RowNotFound => (
            LockError::corrupted,
            format!("the lock table returned data distlock did not write ({error}); it is left untouched"),
        ),
        _ => (LockError::unavailable, error.to_string()),
    };
    kind(request_message(&failed, message)).with_source(error)
}

/// The kind and message of a statement's database error with SQLSTATE
/// `code` and the server's `message`.
fn database(code: Option<&str>, message: &str) -> (fn(String) -> LockError, String) {
    match code {
        Some(code::INSUFFICIENT_PRIVILEGE) => (
            LockError::config,
            format!("permission denied ({message}); grant the user access to the lock table and its schema"),
        ),
        Some(code::UNDEFINED_TABLE) => (
            LockError::config,
            format!(
                "the lock table was dropped after this client created it ({message}); \
                 distlock does not recreate it behind your back (fencing tokens would restart), create a new client"
            ),
        ),
        Some(code::UNDEFINED_COLUMN | code::DATATYPE_MISMATCH) => (
            LockError::config,
            format!("the lock table exists but does not have the layout distlock expects ({message}); configure another table name"),
        ),
        Some(code::NUMERIC_VALUE_OUT_OF_RANGE) => (
            LockError::corrupted,
            format!("the lock row holds a value out of range ({message}); it is left untouched"),
        ),
        Some(c) if is_transient_sqlstate(c) => (
            LockError::unavailable,
            format!("the PostgreSQL server is not available ({c}: {message})"),
        ),
        Some(c @ code::READ_ONLY_TRANSACTION) => (
            LockError::config,
            format!(
                "the server only allows reads ({c}: {message}): a hot standby, or default_transaction_read_only = on for this user or database; \
                 connect to the primary with a user and database that may write"
            ),
        ),
        Some(c @ code::UNDEFINED_FUNCTION) => (
            LockError::config,
            format!(
                "a function or operator the statement needs does not exist ({c}: {message}); \
                 check the lock table's layout and any trigger on it (PostgreSQL 13 or newer is needed)"
            ),
        ),
        Some(c @ (code::UNTRANSLATABLE_CHARACTER | code::CHARACTER_NOT_IN_REPERTOIRE)) => (
            LockError::invalid_input,
            format!(
                "the database's encoding cannot store this key or namespace ({c}: {message}); \
                 use characters it can store, or a UTF8 database"
            ),
        ),
        Some(c @ (code::DATA_CORRUPTED | code::INDEX_CORRUPTED)) => (
            LockError::corrupted,
            format!("the server reports damaged data in the lock table ({c}: {message})"),
        ),
        code => (
            LockError::config,
            format!(
                "PostgreSQL error {}: {message}; sending it again cannot help (check the server's settings, the lock table and any trigger on it)",
                code.unwrap_or_default()
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlock_core::{ErrorKind, IN_LOCK_CALL};

    /// Inside a lock call the message is the failure alone (the client
    /// names the call); elsewhere it starts with the request.
    #[test]
    fn only_requests_outside_lock_calls_are_named() {
        let in_call = map(sqlx::Error::PoolClosed, IN_LOCK_CALL);
        assert_eq!(in_call.kind(), ErrorKind::Unavailable);
        assert_eq!(in_call.message(), "the connection pool was closed");
        let other = map(sqlx::Error::PoolClosed, "creating the lock table");
        assert_eq!(
            other.message(),
            "creating the lock table failed: the connection pool was closed"
        );
    }

    #[test]
    fn only_connection_resource_and_conflict_errors_are_transient() {
        for transient in [
            "08000", "08006", "08P01", "53100", "53200", "53300", "57P01", "57P02", "57P03",
            "57P05", "57014", "40001", "40P01", "55P03",
        ] {
            assert!(is_transient_sqlstate(transient), "{transient}");
        }
        for permanent in [
            "22P06", "22P05", "22021", "25006", "42883", "42P01", "42501", "0A000", "23505",
            "57P04", "P0001", "XX000", "XX001", "58030", "40002",
        ] {
            assert!(!is_transient_sqlstate(permanent), "{permanent}");
        }
    }
}
