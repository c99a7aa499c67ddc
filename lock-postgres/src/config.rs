//! [`PostgresConfig`]: where the server is, how it is reached (TLS, a
//! pooler) and how the lock table is named.
//!
//! Naming rule, as for every config type in distlock (see
//! [`ClientOptions`]): fields are private, a getter is named after its
//! setting (`table()`), a setter consumes and returns the config and is
//! named `with_` and the setting (`with_table("locks")`).

mod server;
mod tls;

use std::fmt;
use std::time::Duration;

use distlock_core::{check_fence_retention, ClientOptions, LockError, LockUrl};
pub use distlock_core::{DEFAULT_FENCE_RETENTION, MAX_FENCE_RETENTION};
use sqlx::postgres::PgConnectOptions;

use crate::keys::validate_identifier;
use crate::SCHEMES;

use self::server::driver_options;
pub(crate) use self::tls::TlsSettings;

/// The schema of the lock table unless configured.
pub const DEFAULT_SCHEMA: &str = "public";
/// The name of the lock table unless configured.
pub const DEFAULT_TABLE: &str = "distlock_locks";
/// The name of the semaphore table (in the lock table's schema) unless
/// configured.
pub const DEFAULT_SEMAPHORE_TABLE: &str = "distlock_semaphores";
/// The table of format markers (in the lock table's schema): one row per
/// lock table and namespace, holding the
/// [`STORAGE_FORMAT`](distlock_core::STORAGE_FORMAT) its rows are in.
pub const FORMAT_TABLE: &str = "distlock_format";
/// The table of waiter lines (in the lock table's schema): one row per
/// waiter queued for a lock or a semaphore of a lock or semaphore table,
/// so that a release wakes the first one alone (see the crate docs).
pub const WAITER_TABLE: &str = "distlock_waiters";

/// The index of [`WAITER_TABLE`] by arrival (beside it, in its schema).
pub const WAITER_INDEX: &str = "distlock_waiters_line";

/// How often a waiter tries again when it cannot be woken by `NOTIFY`
/// (behind a transaction pooler without `listen_url`), unless configured.
pub const DEFAULT_RETRY_INTERVAL: Duration = Duration::from_millis(100);

/// How the server connections of the main URL are pooled: the
/// `pool_mode` URL parameter, named after PgBouncer's setting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum PoolMode {
    /// No `pool_mode` in the URL (or `pool_mode=auto`): the client finds
    /// out at connect which of the two others it is, with a probe of two
    /// client connections (a few statements, one extra connection while
    /// it runs): a transaction pooler is one that runs a client
    /// connection's transactions on another server session, or another
    /// client connection's on its own. Found, the client works as with
    /// [`Transaction`](Self::Transaction) (waiters on `listen_url` if
    /// given, else polling) and logs a warning that names
    /// `pool_mode=transaction` and `listen_url`; otherwise as with
    /// [`Session`](Self::Session). [`PostgresLock::pool_mode`](crate::PostgresLock::pool_mode)
    /// says which. A busy transaction pooler can pass for a session pool
    /// during the probe; then the first statement that meets another
    /// client's prepared statements (`42P05`, `26000`) switches the client
    /// to the simple protocol for good and is sent again (it did not run).
    /// [`PostgresLock::from_pool`](crate::PostgresLock::from_pool) does not
    /// probe: there it means `Session` (with the same switch).
    #[default]
    Auto,
    /// `pool_mode=session`: a direct connection, or a pooler that gives a
    /// client one server session for as long as it is connected; taken
    /// as said, without the probe (for a pooler that keeps prepared
    /// statements working in transaction mode, such as PgBouncer 1.21+
    /// with `max_prepared_statements`). Statements are named prepared
    /// statements (parsed and planned once per connection); waiters
    /// `LISTEN` on the same server unless `listen_url` says otherwise. A
    /// statement that fails with `42P05` or `26000` (a transaction pooler
    /// after all) switches the client to the simple protocol.
    Session,
    /// `pool_mode=transaction` (or `statement`): a pooler that may run each
    /// transaction on another server session (PgBouncer `pool_mode =
    /// transaction`, the default of many hosted platforms). Statements are
    /// sent with the simple query protocol, values as literals, so nothing
    /// outlives a transaction; waiters `LISTEN` on `listen_url` if given,
    /// and otherwise poll (see [`PostgresConfig::retry_interval`]).
    Transaction,
}

/// Settings of a [`PostgresLock`](crate::PostgresLock) client.
///
/// Built from a URL — `postgres://user:password@host:port/database` (or
/// `postgresql://`) with these query parameters (any other is a
/// [`Config`](distlock_core::ErrorKind::Config) error naming it):
///
/// | parameter | meaning | default |
/// |---|---|---|
/// | `namespace` | the namespace of every lock (the shared [`ClientOptions`] in [`client`](Self::client), as the two timeouts) | `distlock` |
/// | `connect_timeout_ms` | connecting to the server, and waiting for a pooled connection | 5000 |
/// | `operation_timeout_ms` | one statement's reply | 5000 |
/// | `schema`, `table` | where the lock table lives | `public`, `distlock_locks` |
/// | `semaphore_table` | the table of semaphores and their permits, in the same schema | `distlock_semaphores` |
/// | `pool_mode` | `auto`, `session`, `transaction` or `statement` (the last two mean the same here): what pools the URL's connections ([`PoolMode`]); without it a probe at connect tells a transaction pooler from a direct connection or session pool, and the client then works as with `transaction` | `auto` |
/// | `listen_url` | percent-encoded URL where waiters `LISTEN` for releases when the main URL goes through a transaction pooler (see [`with_listen_options`](Self::with_listen_options)); it takes the driver's parameters below, and the main URL's TLS settings unless it has its own | the main URL |
/// | `retry_interval_ms` | how often waiters try again when nothing can wake them (a transaction pooler without `listen_url`) | 100 |
/// | `fence_retention_ms` | minimum life of an idle fencing counter (a key's row once nobody holds it), 1 ms to 365 days ([`fence_retention`](Self::fence_retention)) | 3600000 |
/// | `sslmode`, `sslrootcert`, `sslcert`, `sslkey` (sqlx's aliases `ssl-mode`, `ssl-root-cert`, `ssl-ca`, `ssl-cert`, `ssl-key`) | libpq's TLS settings (cargo feature `tls`; see below) | `PGSSLMODE`, else `prefer` |
/// | `tls_ca_file`, `tls_cert_file`, `tls_key_file` | distlock's shared names for `sslrootcert`, `sslcert`, `sslkey` | |
/// | `application_name`, `options`, `statement-cache-capacity`, `host`, `hostaddr`, `port`, `dbname`, `user`, `password` | the driver's own, passed on to sqlx | sqlx's |
///
/// TLS (needs the `tls` cargo feature): `sslmode` is `disable`, `allow`,
/// `prefer`, `require`, `verify-ca` or `verify-full`. Giving both names of
/// one file (`tls_ca_file` and `sslrootcert`, ...) is an error. A CA file
/// is trusted in addition to the platform's roots. Without `sslmode`,
/// naming a CA file, a client certificate or `sslrootcert=system` means
/// `verify-full`; `require` with a CA file means `verify-ca` (as in libpq);
/// without any, sqlx's default applies (`PGSSLMODE`, else `prefer`: TLS if
/// the server offers it, unverified). `allow` connects without TLS (sqlx
/// does not implement libpq's retry). Files are checked when the client
/// connects: a missing, unreadable or non-PEM file is a `Config` error
/// naming its parameter.
///
/// `Debug` never shows the password.
///
/// ```
/// use std::time::Duration;
/// use distlock_postgres::{PoolMode, PostgresConfig};
/// let config = PostgresConfig::from_url(
///     "postgres://app:secret@127.0.0.1:5432/app?namespace=jobs&table=locks&connect_timeout_ms=500&sslmode=disable",
/// )?;
/// let client = config.client().clone().with_operation_timeout(Duration::from_secs(2));
/// let config = config.with_client(client).with_schema("jobs");
/// assert_eq!(config.client().namespace(), "jobs");
/// assert_eq!(config.table(), "locks");
/// assert_eq!(config.schema(), "jobs");
/// assert!(!format!("{config:?}").contains("secret"));
///
/// let pooled = PostgresConfig::from_url(
///     "postgres://app@127.0.0.1:6432/app?pool_mode=transaction&listen_url=postgres%3A%2F%2Fapp%40127.0.0.1%3A5432%2Fapp",
/// )?;
/// assert_eq!(pooled.pool_mode(), PoolMode::Transaction);
/// assert_eq!(pooled.listen_options().map(|l| l.get_port()), Some(5432));
///
/// let typo = PostgresConfig::from_url("postgres://app@127.0.0.1/app?tabel=locks").unwrap_err();
/// assert!(typo.to_string().contains("tabel"));
/// # Ok::<(), distlock_core::LockError>(())
/// ```
#[derive(Clone)]
pub struct PostgresConfig {
    // Crate-visible for `PostgresLock::map_err`; every other field is read
    // through its getter.
    pub(crate) client: ClientOptions,
    connect: Option<PgConnectOptions>,
    listen: Option<PgConnectOptions>,
    /// The TLS files of the main URL and of `listen_url`, checked at connect.
    tls: TlsSettings,
    listen_tls: TlsSettings,
    schema: String,
    table: String,
    semaphore_table: String,
    max_connections: u32,
    pool_mode: PoolMode,
    retry_interval: Duration,
    fence_retention: Duration,
}

impl Default for PostgresConfig {
    /// Default settings without a server: usable with
    /// [`PostgresLock::from_pool`](crate::PostgresLock::from_pool).
    fn default() -> Self {
        Self {
            client: ClientOptions::default(),
            connect: None,
            listen: None,
            tls: TlsSettings::default(),
            listen_tls: TlsSettings::default(),
            schema: DEFAULT_SCHEMA.to_owned(),
            table: DEFAULT_TABLE.to_owned(),
            semaphore_table: DEFAULT_SEMAPHORE_TABLE.to_owned(),
            max_connections: 8,
            pool_mode: PoolMode::Auto,
            retry_interval: DEFAULT_RETRY_INTERVAL,
            fence_retention: DEFAULT_FENCE_RETENTION,
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
            .field("client", &self.client)
            .field("server", &self.connect.as_ref().map(server))
            .field("listen", &self.listen.as_ref().map(server))
            .field("schema", &self.schema)
            .field("table", &self.table)
            .field("semaphore_table", &self.semaphore_table)
            .field("max_connections", &self.max_connections)
            .field("pool_mode", &self.pool_mode)
            .field("retry_interval", &self.retry_interval)
            .field("fence_retention", &self.fence_retention)
            .finish()
    }
}

impl PostgresConfig {
    /// Parses a `postgres://` or `postgresql://` URL with the query
    /// parameters listed in the type's documentation.
    pub fn from_url(url: &str) -> Result<Self, LockError> {
        let mut url = LockUrl::parse(url)?;
        url.expect_scheme("PostgreSQL", SCHEMES)?;
        let mut config = Self {
            client: url.take_client_options()?,
            ..Self::default()
        };
        if let Some(schema) = url.take("schema") {
            config.schema = schema;
        }
        if let Some(table) = url.take("table") {
            config.table = table;
        }
        if let Some(table) = url.take("semaphore_table") {
            config.semaphore_table = table;
        }
        if let Some(mode) = url.take("pool_mode") {
            config.pool_mode = match mode.as_str() {
                "auto" => PoolMode::Auto,
                "session" => PoolMode::Session,
                "transaction" | "statement" => PoolMode::Transaction,
                _ => {
                    return Err(LockError::config(format!(
                        "pool_mode={mode:?} is not a pool mode; use session (a direct connection or a session pool), transaction (a transaction or statement pool) or auto (the default: find out at connect)"
                    )))
                }
            };
        }
        if let Some(interval) = url.take_millis("retry_interval_ms")? {
            config.retry_interval = interval;
        }
        if let Some(retention) = url.take_millis("fence_retention_ms")? {
            check_fence_retention(retention, "URL parameter fence_retention_ms")?;
            config.fence_retention = retention;
        }
        config.tls = TlsSettings::take(&mut url, config.client.tls())?;
        if let Some(listen) = url.take("listen_url") {
            let in_listen = |e: LockError| LockError::config(format!("listen_url: {e}"));
            let mut listen = LockUrl::parse(&listen).map_err(in_listen)?;
            listen.expect_scheme("PostgreSQL", SCHEMES)?;
            let shared = listen.take_tls_files();
            let own = TlsSettings::take(&mut listen, &shared).map_err(in_listen)?;
            // The listener reaches the same database: without TLS settings
            // of its own it uses the main URL's.
            config.listen_tls = if own.is_empty() {
                config.tls.clone()
            } else {
                own
            };
            let options = driver_options(&mut listen).map_err(in_listen)?;
            listen.finish().map_err(in_listen)?;
            config.listen = Some(config.listen_tls.apply(options));
        }
        config.connect = Some(config.tls.apply(driver_options(&mut url)?));
        url.finish()?;
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

    /// Namespace, timeouts and TLS files. The connect timeout also bounds
    /// the wait for a pooled connection.
    pub fn client(&self) -> &ClientOptions {
        &self.client
    }

    /// Sets the [namespace, timeouts and TLS files](Self::client).
    pub fn with_client(mut self, client: ClientOptions) -> Self {
        self.client = client;
        self
    }

    /// Makes waiters `LISTEN` for releases on a connection with `listen`
    /// instead of the main server's options (the `listen_url` URL
    /// parameter; read back with [`listen_options`](Self::listen_options)).
    ///
    /// Needed for waiters to be woken by `NOTIFY` when the main URL goes
    /// through a transaction pooler ([`PoolMode::Transaction`]): a `LISTEN`
    /// sent through it stays on whichever server session ran it, so
    /// releases would reach other clients' statements instead of the
    /// waiters. Point `listen` at the same database directly, or through a
    /// session-mode pool. Without it, waiters behind a transaction pooler
    /// poll (see [`retry_interval`](Self::retry_interval)).
    pub fn with_listen_options(mut self, listen: PgConnectOptions) -> Self {
        self.listen = Some(listen);
        // These options carry their own TLS settings.
        self.listen_tls = TlsSettings::default();
        self
    }

    /// Sets the [schema of the lock table](Self::schema).
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Sets the [name of the lock table](Self::table).
    pub fn with_table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Sets the [name of the semaphore table](Self::semaphore_table).
    pub fn with_semaphore_table(mut self, table: impl Into<String>) -> Self {
        self.semaphore_table = table.into();
        self
    }

    /// Says [how the main server's connections are pooled](Self::pool_mode).
    pub fn with_pool_mode(mut self, mode: PoolMode) -> Self {
        self.pool_mode = mode;
        self
    }

    /// Sets [how often waiters try again](Self::retry_interval) when
    /// nothing can wake them.
    pub fn with_retry_interval(mut self, interval: Duration) -> Self {
        self.retry_interval = interval;
        self
    }

    /// Sets the [fencing-counter retention](Self::fence_retention).
    pub fn with_fence_retention(mut self, retention: Duration) -> Self {
        self.fence_retention = retention;
        self
    }

    /// Sets the [most connections](Self::max_connections) the client's
    /// pool opens (at least 1).
    pub fn with_max_connections(mut self, max: u32) -> Self {
        self.max_connections = max.max(1);
        self
    }

    /// How the main server's connections are pooled, as configured (the
    /// `pool_mode` URL parameter; see [`PoolMode`]; default
    /// [`PoolMode::Auto`]).
    pub fn pool_mode(&self) -> PoolMode {
        self.pool_mode
    }

    /// How often waiters try again when nothing can wake them: with
    /// [`PoolMode::Transaction`] (or a transaction pooler found by
    /// [`PoolMode::Auto`]) and no [`listen_options`](Self::listen_options)
    /// (default [`DEFAULT_RETRY_INTERVAL`], 100 ms; the `retry_interval_ms`
    /// URL parameter). A release is then noticed half this late on
    /// average, and each waiter runs one acquire statement per interval.
    pub fn retry_interval(&self) -> Duration {
        self.retry_interval
    }

    /// The minimum time a key's row (its fencing counter) is kept once
    /// nobody holds it: a lock row free or expired for longer than this,
    /// whose last acquisition is older than this, is deleted by the
    /// clients' background sweep; a semaphore row likewise once every
    /// permit is. A held lock or permit is never deleted, whatever its TTL.
    /// Tokens stay strictly increasing as long as the database server's
    /// clock never steps back by more than this; see the crate docs,
    /// [Fencing tokens](crate#fencing-tokens-without-a-row-per-lock-name-forever).
    /// Default [`DEFAULT_FENCE_RETENTION`] (the `fence_retention_ms` URL
    /// parameter).
    pub fn fence_retention(&self) -> Duration {
        self.fence_retention
    }

    /// The most connections the client's pool opens (default 8), not
    /// counting the listener connections for waiters (one for lock waiters,
    /// one for permit waiters, each opened with its first waiter).
    pub fn max_connections(&self) -> u32 {
        self.max_connections
    }

    /// The server's connect options, if the config names a server.
    pub fn connect_options(&self) -> Option<&PgConnectOptions> {
        self.connect.as_ref()
    }

    /// The connect options of the listener connection, if set apart from
    /// the server's.
    pub fn listen_options(&self) -> Option<&PgConnectOptions> {
        self.listen.as_ref()
    }

    /// The main URL's TLS settings (none for [`PostgresConfig::new`]).
    pub(crate) fn tls(&self) -> &TlsSettings {
        &self.tls
    }

    /// The TLS settings of `listen_url` (its own, else the main URL's).
    pub(crate) fn listen_tls(&self) -> &TlsSettings {
        &self.listen_tls
    }

    /// The schema of the lock table (default [`DEFAULT_SCHEMA`], `public`).
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The name of the lock table, unquoted (default [`DEFAULT_TABLE`],
    /// `distlock_locks`).
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The name of the semaphore table, in the lock table's schema
    /// (default [`DEFAULT_SEMAPHORE_TABLE`], `distlock_semaphores`).
    pub fn semaphore_table(&self) -> &str {
        &self.semaphore_table
    }

    /// Checks namespace, timeouts, retry interval, fencing-counter
    /// retention (more than zero, at most [`MAX_FENCE_RETENTION`]), schema
    /// and table names.
    pub fn validate(&self) -> Result<(), LockError> {
        self.client.validate()?;
        check_fence_retention(self.fence_retention, "fence_retention")?;
        if self.retry_interval.is_zero() {
            return Err(LockError::config(
                "retry_interval_ms is zero; waiters need a pause between attempts",
            ));
        }
        validate_identifier("schema", &self.schema)?;
        validate_identifier("table", &self.table)?;
        validate_identifier("semaphore table", &self.semaphore_table)?;
        for (name, what) in [
            (FORMAT_TABLE, "table of format markers"),
            (WAITER_TABLE, "table of waiter lines"),
            (WAITER_INDEX, "index of waiter lines"),
        ] {
            if self.table == name || self.semaphore_table == name {
                return Err(LockError::config(format!(
                    "the table name {name:?} is distlock's {what}; name the lock and semaphore tables otherwise"
                )));
            }
        }
        if self.semaphore_table == self.table {
            return Err(LockError::config(format!(
                "the semaphore table and the lock table are both named {:?}; they hold different rows and need tables of their own",
                self.table
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[cfg(feature = "tls")]
    use super::server::encode;
    use distlock_core::ErrorKind;
    use sqlx::postgres::PgSslMode;

    use super::*;

    #[test]
    fn the_semaphore_table_is_named_apart_from_the_lock_table() {
        let config = PostgresConfig::from_url("postgres://u@h/db").unwrap();
        assert_eq!(config.semaphore_table(), DEFAULT_SEMAPHORE_TABLE);
        let config = PostgresConfig::from_url("postgres://u@h/db?semaphore_table=sem").unwrap();
        assert_eq!(config.semaphore_table(), "sem");
        let same = PostgresConfig::from_url("postgres://u@h/db?table=x&semaphore_table=x");
        assert_eq!(same.unwrap_err().kind(), ErrorKind::Config);
        assert!(PostgresConfig::from_url("postgres://u@h/db?semaphore_table=").is_err());
        for clash in ["table", "semaphore_table"] {
            let url = format!("postgres://u@h/db?{clash}={FORMAT_TABLE}");
            let err = PostgresConfig::from_url(&url).unwrap_err();
            assert!(err.to_string().contains("format markers"), "{err}");
            let url = format!("postgres://u@h/db?{clash}={WAITER_TABLE}");
            let err = PostgresConfig::from_url(&url).unwrap_err();
            assert!(err.to_string().contains("waiter lines"), "{err}");
        }
    }

    #[test]
    fn parses_our_parameters() {
        let config = PostgresConfig::from_url(
            "postgres://u:p@127.0.0.1:5/db?sslmode=disable&schema=s%22x&table=t&namespace=n",
        )
        .unwrap();
        assert_eq!(config.schema, "s\"x");
        assert_eq!(config.table, "t");
        assert_eq!(config.client().namespace(), "n");
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

    #[test]
    fn driver_parameters_reach_sqlx() {
        let config = PostgresConfig::from_url(
            "postgresql://u%40x:p%2Fw@[::1]:7/d%20b?sslmode=prefer&application_name=my%20app&options=-c%20search_path%3Dx",
        )
        .unwrap();
        let connect = config.connect_options().unwrap();
        assert_eq!(connect.get_username(), "u@x");
        // As sqlx parses `[::1]` itself.
        assert_eq!(connect.get_host(), "[::1]");
        assert_eq!(connect.get_port(), 7);
        assert_eq!(connect.get_database(), Some("d b"));
        assert!(matches!(connect.get_ssl_mode(), PgSslMode::Prefer));
        assert_eq!(connect.get_application_name(), Some("my app"));
        assert_eq!(connect.get_options(), Some("-c search_path=x"));
    }

    #[test]
    fn fence_retention_is_bounded_as_redis_bounds_it() {
        let config = PostgresConfig::from_url("postgres://u@h/db?fence_retention_ms=200").unwrap();
        assert_eq!(config.fence_retention(), Duration::from_millis(200));
        let config = config.with_fence_retention(MAX_FENCE_RETENTION);
        assert!(config.validate().is_ok());
        for bad in [
            Duration::ZERO,
            MAX_FENCE_RETENTION + Duration::from_millis(1),
        ] {
            let err = config
                .clone()
                .with_fence_retention(bad)
                .validate()
                .unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config);
            assert!(err.to_string().contains(": fence_retention "), "{err}");
        }
    }

    #[test]
    fn pool_mode_and_retry_interval() {
        let config =
            PostgresConfig::from_url("postgres://u@h/db?pool_mode=statement&retry_interval_ms=20")
                .unwrap();
        assert_eq!(config.pool_mode(), PoolMode::Transaction);
        assert_eq!(config.retry_interval(), Duration::from_millis(20));
        let config = PostgresConfig::from_url("postgres://u@h/db").unwrap();
        assert_eq!(config.pool_mode(), PoolMode::Auto);
        assert_eq!(config.fence_retention(), DEFAULT_FENCE_RETENTION);
        for (mode, expected) in [("auto", PoolMode::Auto), ("session", PoolMode::Session)] {
            let config =
                PostgresConfig::from_url(&format!("postgres://u@h/db?pool_mode={mode}")).unwrap();
            assert_eq!(config.pool_mode(), expected);
        }
        for (url, name) in [
            ("postgres://u@h/db?pool_mode=bouncy", "bouncy"),
            ("postgres://u@h/db?retry_interval_ms=0", "retry_interval_ms"),
            (
                "postgres://u@h/db?fence_retention_ms=x",
                "fence_retention_ms",
            ),
            (
                "postgres://u@h/db?fence_retention_ms=0",
                "fence_retention_ms",
            ),
            (
                "postgres://u@h/db?fence_retention_ms=31536000001",
                "fence_retention_ms",
            ),
            ("postgres://u@h/db?poll_interval_ms=20", "poll_interval_ms"),
            ("postgres://u@h/db?schema=a%00b", "schema"),
            ("postgres://u@h/db?namespace=a/b", "namespace"),
        ] {
            let err = PostgresConfig::from_url(url).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{url}");
            assert!(err.to_string().contains(name), "{url}: {err}");
        }
    }

    #[cfg(feature = "tls")]
    #[test]
    fn listen_url_takes_the_main_tls_settings_unless_it_has_its_own() {
        let listen = |own: &str| {
            let listen_url = encode(&format!("postgres://u@h2/db{own}"));
            let config = PostgresConfig::from_url(&format!(
                "postgres://u@h/db?tls_ca_file=/ca.pem&listen_url={listen_url}"
            ))
            .unwrap();
            assert!(matches!(
                config.connect.unwrap().get_ssl_mode(),
                PgSslMode::VerifyFull
            ));
            config.listen.unwrap().get_ssl_mode()
        };
        assert!(matches!(listen(""), PgSslMode::VerifyFull));
        assert!(matches!(listen("?sslmode=disable"), PgSslMode::Disable));
        assert!(matches!(listen("?sslmode=require"), PgSslMode::Require));
    }

    #[test]
    fn unknown_parameters_are_named() {
        for (url, name) in [
            ("postgres://u@h/db?tabel=x", "tabel"),
            ("postgres://u@h/db?sslmode=disable&bogus=1", "bogus"),
            (
                "postgres://u@h/db?listen_url=postgres%3A%2F%2Fu%40h%2Fdb%3Fnamespace%3Dx",
                "namespace",
            ),
        ] {
            let err = PostgresConfig::from_url(url).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{url}");
            assert!(err.to_string().contains(name), "{url}: {err}");
        }
        let err = PostgresConfig::from_url("postgres://u@h1,h2/db").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
    }
}
