//! Where the server is: sqlx's connect options from the URL's host,
//! credentials, database and the driver's own parameters.

use std::str::FromStr;

use distlock_core::{LockError, LockUrl};
use sqlx::postgres::PgConnectOptions;

/// The query parameters passed on to sqlx as they are (libpq's names and
/// sqlx's aliases for them; the TLS ones are read by distlock first); any
/// other parameter that is not distlock's is a configuration error.
const DRIVER_PARAMETERS: &[&str] = &[
    "application_name",
    "options",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
];

/// sqlx's options for the server of `url`, taking the driver parameters.
///
/// The URL is rebuilt for sqlx's own parser rather than fed to the
/// builder, so sqlx applies its environment defaults (`PGHOST`, ...) and
/// password file exactly as for a URL it parsed itself.
pub(crate) fn driver_options(url: &mut LockUrl) -> Result<PgConnectOptions, LockError> {
    let host = match url.hosts() {
        [] => String::new(),
        [host] => {
            let name = if host.name.contains(':') {
                format!("[{}]", host.name)
            } else {
                encode(&host.name)
            };
            match host.port {
                Some(port) => format!("{name}:{port}"),
                None => name,
            }
        }
        _ => {
            return Err(LockError::config(format!(
                "{url} names several hosts; a PostgreSQL URL names one (put a failover proxy or DNS name in front of replicas)"
            )))
        }
    };
    let mut driver = String::from("postgres://");
    if let Some(user) = url.username() {
        driver.push_str(&encode(user));
    }
    if let Some(password) = url.password() {
        driver.push(':');
        driver.push_str(&encode(password));
    }
    if url.username().is_some() || url.password().is_some() {
        driver.push('@');
    }
    driver.push_str(&host);
    if !url.path().is_empty() {
        driver.push('/');
        driver.push_str(&encode(url.path()));
    }
    let mut separator = '?';
    for name in DRIVER_PARAMETERS {
        if let Some(value) = url.take(name) {
            driver.push(separator);
            driver.push_str(name);
            driver.push('=');
            driver.push_str(&encode(&value));
            separator = '&';
        }
    }
    PgConnectOptions::from_str(&driver).map_err(|e| {
        LockError::config(format!(
            "invalid PostgreSQL URL {url} ({e}); expected postgres://user:password@host:port/database"
        ))
    })
}

/// Percent-encodes every byte but unreserved ones (RFC 3986).
pub(super) fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}
