//! Mapping of sqlx errors to [`LockError`] kinds.

use std::time::Duration;

use lock_core::LockError;

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
        sqlx::Error::Io(e) => LockError::unavailable(format!(
            "{what}{on_key} failed: cannot talk to the PostgreSQL server ({e}); is it running and reachable?"
        )),
        sqlx::Error::Tls(e) => LockError::unavailable(format!(
            "{what}{on_key} failed: TLS error talking to the PostgreSQL server ({e})"
        )),
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
                Some(code::INVALID_PASSWORD | code::INVALID_AUTHORIZATION) => LockError::config(format!(
                    "PostgreSQL authentication failed ({message}); check the user and password in the URL"
                )),
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
