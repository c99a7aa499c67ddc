//! PostgreSQL backend of distlock: locks as rows of a lease table.
//!
//! [`PostgresLock`] implements [`lock_core::LockBackend`] (and
//! [`lock_core::LockAdmin`]) on a table the client creates on first use (`public.distlock_locks` by default). Each
//! lock is one row per `(namespace, key)` holding the owner token, a fencing
//! counter and an expiry computed by the **database clock**. Acquire,
//! extend and release are one SQL statement each, atomic on the server; keys
//! are always bind parameters. Waiters are woken by `LISTEN`/`NOTIFY` on one
//! shared connection per client (lock-core's
//! [`Listener`](lock_core::Listener)), and by a timer set to the holder's
//! remaining lease in case the holder crashed. TTLs, owner tokens, lease
//! deadlines and the waiting loop are lock-core's
//! [`LockClient`](lock_core::LockClient), which job code uses.
//!
//! ```no_run
//! use std::time::Duration;
//! use lock_core::{LockKey, LockOptions, Locker};
//! use lock_postgres::PostgresLock;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), lock_core::LockError> {
//! let lock = PostgresLock::connect("postgres://app:secret@127.0.0.1:5432/app?namespace=jobs").await?;
//! let locker = Locker::new(lock);
//! let key = LockKey::new("nightly-report")?;
//! if let Some(guard) = locker.try_lock(&key, &LockOptions::new(Duration::from_secs(30))).await? {
//!     // ... run the job, passing guard.fencing_token() to what it writes ...
//!     guard.release().await?;
//! }
//! # Ok(()) }
//! ```
//!
//! URLs are `postgres://` or `postgresql://` ([`SCHEMES`]) and take the query
//! parameters `namespace`, `schema`, `table`, `listen_url`,
//! `connect_timeout_ms`, `operation_timeout_ms` and the driver's own
//! (`sslmode`, `application_name`, ...); any other is a configuration error
//! naming it (see [`PostgresConfig`]).
//!
//! # Clocks
//!
//! A lock's expiry is `clock_timestamp() + ttl` when the statement runs,
//! and every later statement compares it with `clock_timestamp()`: the
//! **wall clock** (`CLOCK_REALTIME`) of the database host. Client clocks
//! never matter; a client dates its lease with its own monotonic clock from
//! the moment *before* it sent the acquire, so it believes in the lock no
//! longer than the server keeps it — as long as the database's wall clock
//! advances at the rate of real time. What breaks that:
//!
//! - a forward **step** of Δ on the database host (NTP stepping, an
//!   operator's `date -s`, a VM resumed with a stale clock then corrected)
//!   expires every live lock up to Δ early: another client can acquire while
//!   the holder's guard still counts time it does not have, so two holders
//!   overlap for up to Δ. A backward step keeps locks up to Δ longer
//!   (waiters wait longer; safety is not affected);
//! - a **failover** to another host (a promoted replica) carries the
//!   expiries over, to be compared with that host's clock: the offset
//!   between the two clocks acts as a step.
//!
//! So run the database host with a disciplined clock that slews rather than
//! steps once the server is up (chrony's default `makestep` only corrects
//! at boot; ntpd's `-x`), keep replicas synchronised the same way, and if
//! a step larger than the guard's safety margin is possible, choose TTLs
//! and margins that absorb it. PostgreSQL offers no monotonic clock to SQL
//! (`now()`, `statement_timestamp()`, `clock_timestamp()` and `timeofday()`
//! all read the wall clock; the monotonic timer behind `EXPLAIN ANALYZE` is
//! not exposed), and a monotonic reading would not survive a server restart
//! or failover, which the stored expiries must; so this backend uses the
//! wall clock and states the assumption here.
//!
//! # Behind a connection pooler
//!
//! No lock statement keeps session state, but the driver and `LISTEN` do:
//!
//! - **Session pooling** (PgBouncer `pool_mode = session`): works.
//! - **Transaction pooling** (PgBouncer `pool_mode = transaction`):
//!   - Waiters need `listen_url` pointing past the pooler (directly, or
//!     through a session-mode pool): a `LISTEN` sent through the pooler
//!     stays on whichever server session ran it, and waiters then wake only
//!     when the holder's lease runs out or their deadline passes.
//!   - A notification that reaches one of the client's pooled connections
//!     (its server session listens because someone sent `LISTEN` through
//!     the pooler) never fails an operation: it is skipped, and a statement
//!     it interrupted before running is sent again.
//!   - Statements are sqlx's named prepared statements (`sqlx_s_1`, ...),
//!     which PgBouncer before 1.21 does not track across server sessions:
//!     through PgBouncer 1.18 in transaction mode only a client whose pool
//!     has a single connection (`max_connections(1)`), alone on the
//!     pooler, works; several connections fail with SQLSTATE 42P05
//!     (`prepared statement "sqlx_s_1" already exists`) or 26000. PgBouncer
//!     1.21+ with `max_prepared_statements` set tracks them.
//!
//! # Cancellation
//!
//! Every future of [`PostgresLock`] may be dropped at any await point (a
//! caller's timeout). A connection whose statement was in flight is never
//! returned to the pool with the reply unread: for an acquire, a background
//! task reads the reply and gives back a lock the statement may have been
//! granted (bounded by the operation timeout; if that fails, the lock
//! expires after its TTL); for other statements the connection is closed. A
//! dropped extend or release may or may not have taken effect.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod backend;
mod config;
mod errors;
mod keys;
mod listener;
mod sql;

pub use backend::PostgresLock;
pub use config::{PoolMode, PostgresConfig, DEFAULT_POLL_INTERVAL, DEFAULT_SCHEMA, DEFAULT_TABLE};
pub use keys::{channel_name, MAX_IDENTIFIER_BYTES};
/// The driver, for building pools and connect options by hand.
pub use sqlx;
pub use sqlx::postgres::{PgConnectOptions, PgPool};

/// The URL schemes of this backend.
pub const SCHEMES: &[&str] = &["postgres", "postgresql"];
