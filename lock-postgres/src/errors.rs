//! Mapping of sqlx errors to [`LockError`] kinds.

use std::time::Duration;

use distlock_core::LockError;
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
    /// Class 08: connection exceptions (PgBouncer reports a server
    /// connection lost under a transaction as 08P01).
    pub const CONNECTION_EXCEPTION_CLASS: &str = "08";
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

/// A TLS problem found in an I/O error (rustls reports handshake failures
/// as `InvalidData` errors wrapping its own).
#[cfg(feature = "tls")]
fn tls_problem(error: &std::io::Error, what: &str) -> Option<LockError> {
    use rustls::{AlertDescription as Alert, CertificateError as Cert, Error as Tls};
    let tls = error.get_ref()?.downcast_ref::<Tls>()?;
    Some(match tls {
        Tls::InvalidCertificate(Cert::NotValidForName | Cert::NotValidForNameContext { .. }) => {
            LockError::config(format!(
                "{what} failed: TLS certificate problem: the PostgreSQL server's certificate is not valid for the host name in the URL ({tls}); \
                 connect with a name its certificate lists"
            ))
        }
        Tls::InvalidCertificate(_) => LockError::config(format!(
            "{what} failed: TLS certificate problem: the PostgreSQL server's certificate is not trusted ({tls}); \
             give the CA that signed it with sslrootcert=PATH or tls_ca_file=PATH"
        )),
        Tls::AlertReceived(
            Alert::BadCertificate
            | Alert::UnknownCA
            | Alert::CertificateRequired
            | Alert::CertificateUnknown
            | Alert::CertificateExpired
            | Alert::CertificateRevoked
            | Alert::UnsupportedCertificate
            | Alert::AccessDenied,
        ) => LockError::config(format!(
            "{what} failed: TLS certificate problem: the PostgreSQL server refused this client's certificate ({tls}); {CLIENT_CERT_ADVICE}"
        )),
        _ => LockError::config(format!(
            "{what} failed: TLS connection problem: the TLS handshake with the PostgreSQL server failed ({tls})"
        )),
    })
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

/// Maps a driver error met while doing `what` (on `key`, if any) to a
/// [`LockError`] a caller can match on.
pub(crate) fn map(
    error: sqlx::Error,
    what: &str,
    key: Option<&str>,
    connect_timeout: Duration,
) -> LockError {
    let on_key = key.map(|k| format!(" on lock {k:?}")).unwrap_or_default();
    let mapped = match &error {
        sqlx::Error::Configuration(e) => {
            LockError::config(format!("invalid PostgreSQL connection settings: {e}"))
        }
        sqlx::Error::Io(e) => match tls_problem(e, what) {
            Some(tls) => tls,
            // sqlx reads the TLS files again for each new connection.
            None if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
            ) =>
            {
                LockError::config(format!(
                    "{what}{on_key} failed: cannot read a TLS file named in the URL ({e}); check sslrootcert, sslcert, sslkey or tls_*_file"
                ))
            }
            None => LockError::unavailable(format!(
                "{what}{on_key} failed: cannot talk to the PostgreSQL server ({e}); is it running and reachable?"
            )),
        },
        sqlx::Error::Tls(e) => {
            let text = e.to_string();
            if text.contains("does not support TLS") {
                LockError::config(format!(
                    "{what} failed: TLS connection problem: the PostgreSQL server does not accept TLS connections (ssl = off), but the URL's sslmode requires TLS; \
                     turn ssl on in the server's postgresql.conf, or connect with sslmode=prefer or disable"
                ))
            } else if text.contains("without TLS support") {
                LockError::config(format!(
                    "{what} failed: the connection settings (sslmode, or PGSSLMODE in the environment) require TLS, but distlock was built without it: enable the `tls` cargo feature (of distlock, or of distlock-postgres)"
                ))
            } else {
                LockError::config(format!(
                    "{what} failed: TLS problem ({text}); check sslrootcert, sslcert and sslkey (or tls_ca_file, tls_cert_file, tls_key_file)"
                ))
            }
        }
        sqlx::Error::Protocol(e) => LockError::unavailable(format!(
            "{what}{on_key} failed: PostgreSQL protocol error ({e})"
        )),
        sqlx::Error::PoolTimedOut => LockError::unavailable(format!(
            "{what}{on_key} failed: no connection to the PostgreSQL server within the connect timeout of {connect_timeout:?}; is it running and reachable?"
        )),
        sqlx::Error::PoolClosed => {
            LockError::unavailable(format!("{what}{on_key} failed: the connection pool was closed"))
        }
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::RowNotFound => LockError::corrupted(format!(
            "{what}{on_key}: the lock table returned data distlock did not write ({error}); it is left untouched"
        )),
        sqlx::Error::Database(db) => {
            let message = db.message().to_owned();
            match db.code().as_deref() {
                Some(code::INVALID_PASSWORD) => LockError::config(format!(
                    "PostgreSQL authentication failed ({message}); check the user and password in the URL"
                )),
                Some(code::INVALID_AUTHORIZATION) => refused(&message),
                Some(code::INVALID_CATALOG_NAME) => LockError::config(format!(
                    "PostgreSQL refused the connection ({message}); check the database name in the URL"
                )),
                Some(code::INSUFFICIENT_PRIVILEGE) => LockError::config(format!(
                    "{what}{on_key} failed: permission denied ({message}); grant the user access to the lock table and its schema"
                )),
                Some(code::UNDEFINED_TABLE) => LockError::config(format!(
                    "{what}{on_key} failed ({message}): the lock table was dropped after this client created it; \
                     distlock does not recreate it behind your back (fencing tokens would restart), create a new client"
                )),
                Some(code::UNDEFINED_COLUMN | code::DATATYPE_MISMATCH) => LockError::config(format!(
                    "{what}{on_key} failed ({message}): the lock table exists but does not have the layout distlock expects; configure another table name"
                )),
                Some(code::NUMERIC_VALUE_OUT_OF_RANGE) => LockError::corrupted(format!(
                    "{what}{on_key}: the lock row holds a value out of range ({message}); it is left untouched"
                )),
                Some(c) if c.starts_with("08") || c.starts_with("57") || c.starts_with("53") => {
                    LockError::unavailable(format!(
                        "{what}{on_key} failed: the PostgreSQL server is not available ({message})"
                    ))
                }
                _ => LockError::unavailable(format!(
                    "{what}{on_key} failed: PostgreSQL error {}: {message}",
                    db.code().unwrap_or_default()
                )),
            }
        }
        _ => LockError::unavailable(format!("{what}{on_key} failed: {error}")),
    };
    mapped.with_source(error)
}
