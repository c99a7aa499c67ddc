//! [`PostgresConfig`]: where the server is and how the lock table is named.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use lock_core::{ClientOptions, LockError};
use sqlx::postgres::PgConnectOptions;

use crate::keys::validate_identifier;

/// The schema of the lock table unless configured.
pub const DEFAULT_SCHEMA: &str = "public";
/// The name of the lock table unless configured.
pub const DEFAULT_TABLE: &str = "distlock_locks";

/// Settings of a [`PostgresLock`](crate::PostgresLock) client.
///
/// Built from a URL — `postgres://user:password@host:port/database` plus
/// distlock's own query parameters, which are removed before the URL reaches
/// sqlx:
///
/// - `namespace=NAME` (default `distlock`), `connect_timeout_ms=N`,
///   `operation_timeout_ms=N` (see [`ClientOptions`]);
/// - `schema=NAME` (default `public`) and `table=NAME` (default
///   `distlock_locks`): where the lock table lives;
/// - `listen_url=URL` (percent-encoded): where waiters `LISTEN` for
///   releases, when the main URL goes through a transaction pooler (see
///   [`listen_via`](Self::listen_via)).
///
/// Other parameters (`sslmode`, `application_name`, ...) go to sqlx.
///
/// ```
/// use std::time::Duration;
/// use lock_postgres::PostgresConfig;
/// let config = PostgresConfig::from_url(
///     "postgres://app:secret@127.0.0.1:5432/app?namespace=jobs&table=locks&connect_timeout_ms=500",
/// )?
/// .operation_timeout(Duration::from_secs(2));
/// assert_eq!(config.client_options().namespace, "jobs");
/// assert_eq!(config.table_name(), "locks");
/// assert_eq!(config.schema_name(), "public");
/// # Ok::<(), lock_core::LockError>(())
/// ```
#[derive(Clone)]
pub struct PostgresConfig {
    pub(crate) connect: Option<PgConnectOptions>,
    pub(crate) listen: Option<PgConnectOptions>,
    pub(crate) client: ClientOptions,
    pub(crate) schema: String,
    pub(crate) table: String,
    pub(crate) max_connections: u32,
}

impl Default for PostgresConfig {
    /// Default settings without a server: usable with
    /// [`PostgresLock::from_pool`](crate::PostgresLock::from_pool).
    fn default() -> Self {
        Self {
            connect: None,
            listen: None,
            client: ClientOptions::default(),
            schema: DEFAULT_SCHEMA.to_owned(),
            table: DEFAULT_TABLE.to_owned(),
            max_connections: 8,
        }
    }
}

impl fmt::Debug for PostgresConfig {
    // By hand: sqlx's options would print the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let server = |c: &PgConnectOptions| {
            format!(
                "{}@{}:{}/{}",
                c.get_username(),
                c.get_host(),
                c.get_port(),
                c.get_database().unwrap_or("")
            )
        };
        f.debug_struct("PostgresConfig")
            .field("server", &self.connect.as_ref().map(server))
            .field("listen", &self.listen.as_ref().map(server))
            .field("client", &self.client)
            .field("schema", &self.schema)
            .field("table", &self.table)
            .field("max_connections", &self.max_connections)
            .finish()
    }
}

impl PostgresConfig {
    /// Parses a `postgres://` or `postgresql://` URL with distlock's query
    /// parameters (see the type's documentation).
    pub fn from_url(url: &str) -> Result<Self, LockError> {
        let (url, client) = ClientOptions::from_url(url)?;
        let mut config = Self {
            client,
            ..Self::default()
        };
        let driver_url = match url.split_once('?') {
            None => url.clone(),
            Some((base, query)) => {
                let mut rest = Vec::new();
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
                    match name {
                        "schema" => config.schema = percent_decode(value)?,
                        "table" => config.table = percent_decode(value)?,
                        "listen_url" => {
                            config.listen = Some(driver_options(&percent_decode(value)?)?)
                        }
                        _ => rest.push(pair),
                    }
                }
                if rest.is_empty() {
                    base.to_owned()
                } else {
                    format!("{base}?{}", rest.join("&"))
                }
            }
        };
        config.connect = Some(driver_options(&driver_url)?);
        config.validate()?;
        Ok(config)
    }

    /// Settings for the server described by sqlx's connect options.
    pub fn new(connect: PgConnectOptions) -> Self {
        Self {
            connect: Some(connect),
            ..Self::default()
        }
    }

    /// Makes waiters `LISTEN` for releases on a connection with `listen`
    /// instead of the main server's options.
    ///
    /// Needed when the main URL goes through a transaction pooler
    /// (PgBouncer `pool_mode = transaction`): a `LISTEN` sent through it
    /// stays on whichever server session ran it, so releases would reach
    /// other clients' statements instead of the waiters, which would then
    /// wake only when the holder's lease runs out. Point `listen` at the
    /// same database directly, or through a session-mode pool.
    pub fn listen_via(mut self, listen: PgConnectOptions) -> Self {
        self.listen = Some(listen);
        self
    }

    /// Sets the namespace (default `distlock`).
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.client = self.client.namespace(namespace);
        self
    }

    /// Sets the connect timeout (default 5 s); also the pool's acquire timeout.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.client = self.client.connect_timeout(timeout);
        self
    }

    /// Sets the operation timeout (default 5 s).
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.client = self.client.operation_timeout(timeout);
        self
    }

    /// Replaces namespace and timeouts at once.
    pub fn with_client_options(mut self, client: ClientOptions) -> Self {
        self.client = client;
        self
    }

    /// Sets the schema of the lock table (default `public`).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Sets the name of the lock table (default `distlock_locks`).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Sets the most connections the client's pool opens (default 8), not
    /// counting the one shared listener connection for waiters.
    pub fn max_connections(mut self, max: u32) -> Self {
        self.max_connections = max.max(1);
        self
    }

    /// Namespace and timeouts.
    pub fn client_options(&self) -> &ClientOptions {
        &self.client
    }

    /// The schema of the lock table.
    pub fn schema_name(&self) -> &str {
        &self.schema
    }

    /// The name of the lock table.
    pub fn table_name(&self) -> &str {
        &self.table
    }

    /// Checks namespace, timeouts, schema and table names.
    pub fn validate(&self) -> Result<(), LockError> {
        self.client.validate()?;
        validate_identifier("schema", &self.schema)?;
        validate_identifier("table", &self.table)
    }
}

/// sqlx's options for a plain `postgres://` URL.
fn driver_options(url: &str) -> Result<PgConnectOptions, LockError> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(LockError::config(
            "a PostgreSQL URL starts with postgres:// or postgresql:// (postgres://user:password@host:port/database)",
        ));
    }
    PgConnectOptions::from_str(url).map_err(|e| {
        LockError::config(format!(
            "invalid PostgreSQL URL ({e}); expected postgres://user:password@host:port/database"
        ))
    })
}

/// Decodes `%XX` escapes in a query parameter value.
fn percent_decode(value: &str) -> Result<String, LockError> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = value
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    LockError::config(format!("bad %-escape in URL parameter {value:?}"))
                })?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out)
        .map_err(|_| LockError::config(format!("URL parameter {value:?} is not UTF-8")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_our_parameters() {
        let config = PostgresConfig::from_url(
            "postgres://u:p@127.0.0.1:5/db?sslmode=disable&schema=s%22x&table=t&namespace=n",
        )
        .unwrap();
        assert_eq!(config.schema, "s\"x");
        assert_eq!(config.table, "t");
        assert_eq!(config.client.namespace, "n");
        let debug = format!("{config:?}");
        assert!(!debug.contains(":p@"), "{debug}");
        assert!(PostgresConfig::from_url("redis://127.0.0.1").is_err());
        let config = PostgresConfig::from_url(
            "postgres://u:p@127.0.0.1:6432/db?listen_url=postgres%3A%2F%2Fu%3Ap%40127.0.0.1%3A5432%2Fdb",
        )
        .unwrap();
        let listen = config.listen.as_ref().expect("listen_url parsed");
        assert_eq!(
            (listen.get_port(), config.connect.unwrap().get_port()),
            (5432, 6432)
        );
        assert!(PostgresConfig::from_url("postgres://u@h/db?listen_url=redis%3A%2F%2Fh").is_err());
        assert!(PostgresConfig::from_url("postgres://u@h/db?table=").is_err());
    }
}
