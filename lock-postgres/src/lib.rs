//! PostgreSQL backend of distlock: locks as rows of a lease table.
//!
//! [`PostgresLock`] implements [`lock_core::DistributedLock`] on a table the
//! client creates on first use (`public.distlock_locks` by default). Each
//! lock is one row per `(namespace, key)` holding the owner token, a fencing
//! counter and an expiry computed by the **database clock**. Acquire,
//! extend and release are one SQL statement each, atomic on the server; keys
//! are always bind parameters. Waiters are woken by `LISTEN`/`NOTIFY` on one
//! shared connection per client, and by a timer set to the holder's
//! remaining lease in case the holder crashed.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use lock_core::{DistributedLock, LockKey, LockOptions, Locker};
//! use lock_postgres::PostgresLock;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), lock_core::LockError> {
//! let lock = PostgresLock::connect("postgres://app:secret@127.0.0.1:5432/app?namespace=jobs").await?;
//! let locker = Locker::new(Arc::new(lock));
//! let key = LockKey::new("nightly-report")?;
//! if let Some(guard) = locker.try_lock(&key, &LockOptions::new(Duration::from_secs(30))).await? {
//!     // ... run the job, passing guard.fencing_token() to what it writes ...
//!     guard.release().await?;
//! }
//! # Ok(()) }
//! ```
//!
//! The URL takes distlock's query parameters `namespace`, `schema`, `table`,
//! `connect_timeout_ms` and `operation_timeout_ms` (see [`PostgresConfig`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod backend;
mod config;
mod errors;
mod keys;
mod sql;
mod waiters;

pub use backend::PostgresLock;
pub use config::{PostgresConfig, DEFAULT_SCHEMA, DEFAULT_TABLE};
pub use keys::{channel_name, MAX_IDENTIFIER_BYTES};
pub use sqlx::postgres::{PgConnectOptions, PgPool};
