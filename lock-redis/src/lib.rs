//! The Redis backend of distlock.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use lock_core::{DistributedLock, Locker, LockKey, LockOptions};
//! use lock_redis::RedisLock;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), lock_core::LockError> {
//! let lock: Arc<dyn DistributedLock> =
//!     Arc::new(RedisLock::connect("redis://:secret@127.0.0.1:6379/0?namespace=jobs").await?);
//! let locker = Locker::new(lock);
//! let key = LockKey::new("nightly-report")?;
//! if let Some(guard) = locker.try_lock(&key, &LockOptions::new(Duration::from_secs(30))).await? {
//!     // ... the job ...
//!     guard.release().await?;
//! }
//! # Ok(()) }
//! ```
//!
//! # Connecting
//!
//! - [`RedisLock::connect`]`("redis://[user:password@]host[:port][/db]")`;
//!   with an ACL user, `redis://user:password@host`; with the legacy
//!   `requirepass`, `redis://:password@host`. Wrong credentials give
//!   [`ErrorKind::Config`](lock_core::ErrorKind) saying authentication failed.
//! - `rediss://…` connects over TLS (rustls, the platform's root
//!   certificates) when the cargo feature **`tls`** is enabled; without it a
//!   `rediss://` URL is refused with a message naming the feature. (TLS is
//!   not exercised by this crate's tests, which use a plain loopback server.)
//! - [`RedisLock::from_connection_manager`] reuses an application's
//!   [`ConnectionManager`](redis::aio::ConnectionManager).
//! - Query parameters `namespace`, `connect_timeout_ms`,
//!   `operation_timeout_ms`, `fence_retention_ms` configure distlock (see
//!   [`RedisConfig`]); the others go to the redis driver.
//!
//! Every request runs under the operation timeout; the command connection
//! reconnects by itself when the server comes back.
//!
//! # How it works
//!
//! Keys (see the table in `keys.rs`): for lock `K` in namespace `NS`,
//! `NS:{K'}:lock`, `NS:{K'}:fence` and the channel `NS:{K'}:released`, where
//! `K'` is `K` with `%`, `{`, `}` percent-escaped — injective, and the hash
//! tag `{K'}` puts all three in one Redis Cluster slot whatever `K` contains.
//!
//! - **Acquire** is one `EVALSHA` of a Lua script: if the lock key exists it
//!   returns the holder's `PTTL` (filling
//!   [`AcquireAttempt::Held::expires_in`](lock_core::AcquireAttempt)); else
//!   it computes the fencing token, `SET lock dl1:<owner>:<token> PX ttl`,
//!   stores the token in the fence key and returns it.
//! - **Extend** is one script: compares the stored value with the lease's,
//!   then `PEXPIRE`; a missing key is never recreated.
//! - **Release** is one script: compares, `DEL`, `PUBLISH` on the channel.
//! - **Waiting**: one pub/sub connection per client, shared by all waiters;
//!   the first waiter of a key subscribes to its channel before its first
//!   attempt; a release wakes the waiters; a holder that crashed is covered
//!   by a timer set to its `PTTL`. No polling.
//! - A value distlock did not write (another type, another format, a lock
//!   without expiry) gives [`ErrorKind::Corrupted`](lock_core::ErrorKind)
//!   naming the Redis key; nothing is overwritten or deleted.
//!
//! # Fencing tokens without a key per lock name forever
//!
//! The token is `max(counter + 1, server TIME in microseconds)`, and the
//! counter key expires [`fence_retention`](RedisConfig::fence_retention)
//! (default one hour, and at least twice the TTL) after the last
//! acquisition. So a lock name nobody uses any more leaves nothing behind
//! after the retention, while tokens keep growing: within the retention the
//! counter orders them; after it, the server's clock has moved past every
//! token issued before (tokens track the clock to within the number of
//! acquisitions per microsecond).
//!
//! **Assumption**: the Redis server's clock never steps back by more than
//! the retention (NTP slews, it does not jump hours back). A bigger backward
//! step followed by a counter expiry could issue a token lower than an
//! earlier one. Like every Redis lock, tokens also restart if the server
//! loses its data (no persistence, failover to a lagging replica):
//! `Capabilities::durable` is `false`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod backend;
mod config;
mod errors;
mod keys;
mod scripts;
mod waiters;

pub use backend::RedisLock;
pub use config::{RedisConfig, DEFAULT_FENCE_RETENTION};
pub use scripts::acquire_script_sha;

/// The redis driver this backend is built on, re-exported so applications
/// build a [`ConnectionManager`](redis::aio::ConnectionManager) with the same
/// version.
pub use redis;
