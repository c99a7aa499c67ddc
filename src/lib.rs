//! **distlock** — one distributed-lock API over Redis, etcd, PostgreSQL and
//! memory.
//!
//! Job code is written once against [`Locker`] / [`DistributedLock`]; which
//! server holds the lock is a cargo feature plus a URL given to [`connect`].
//!
//! | URL scheme               | cargo feature | backend |
//! |--------------------------|---------------|---------|
//! | `memory://[name]`        | (always)      | [`MemoryLock`], in-process |
//! | `redis://`               | `redis`       | `lock_redis::RedisLock` |
//! | `rediss://` (TLS)        | `redis-tls`   | `lock_redis::RedisLock` |
//! | `etcd://`                | `etcd`        | `lock_etcd::EtcdLock` |
//! | `postgres://`, `postgresql://` | `postgres` | `lock_postgres::PostgresLock` |
//!
//! `full` enables `redis`, `etcd` and `postgres`; `tower` adds
//! `layer::LockLayer`. Building with `etcd` needs `protoc` and the protobuf
//! well-known types (see the README).
//!
//! ```
//! use std::time::Duration;
//! use distlock::{LockKey, LockOptions, Locker, RunOptions, RunOutcome};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), distlock::LockError> {
//! // Swap "memory://" for "redis://127.0.0.1:6379" (feature `redis`), etc.
//! let locker = Locker::new(distlock::connect("memory://").await?);
//! let key = LockKey::new("nightly-report")?;
//! let options = RunOptions::new(LockOptions::new(Duration::from_secs(30)));
//! match locker.run_exclusive(&key, &options, |job| async move { job.fencing_token }).await? {
//!     RunOutcome::Completed { output, .. } => println!("ran with fencing token {output}"),
//!     RunOutcome::Skipped => println!("already running elsewhere; skipping this tick"),
//!     RunOutcome::Lost { reason, .. } => println!("lock lost mid-run: {reason}"),
//! }
//! # Ok(()) }
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub use lock_core::*;

#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub mod layer;

#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use lock_etcd as etcd;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use lock_postgres as postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use lock_redis as redis;

/// Opens a lock client for `url`, choosing the backend by scheme.
///
/// `memory://NAME` clients of one process share one in-memory server per
/// name (`memory://` is the name ""). A scheme whose cargo feature is not
/// enabled gives an [`ErrorKind::Config`] error naming the feature.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let err = distlock::connect("zookeeper://127.0.0.1:2181").await.unwrap_err();
/// assert_eq!(err.kind(), distlock::ErrorKind::Config);
/// # }
/// ```
pub async fn connect(url: &str) -> Result<Arc<dyn DistributedLock>, LockError> {
    let scheme = url
        .split_once("://")
        .map(|(scheme, _)| scheme.to_ascii_lowercase())
        .ok_or_else(|| {
            LockError::config(format!(
                "{url:?} is not a lock URL; expected memory://, redis://, rediss://, etcd:// or postgres://"
            ))
        })?;
    match scheme.as_str() {
        "memory" => Ok(memory_server(&url["memory://".len()..]).client()),
        "redis" | "rediss" => connect_redis(url).await,
        "etcd" => connect_etcd(url).await,
        "postgres" | "postgresql" => connect_postgres(url).await,
        other => Err(LockError::config(format!(
            "unknown lock URL scheme {other:?}; expected memory://, redis://, rediss://, etcd:// or postgres://"
        ))),
    }
}

/// The process-wide in-memory server called `name`.
fn memory_server(name: &str) -> MemoryLock {
    static SERVERS: OnceLock<Mutex<HashMap<String, MemoryLock>>> = OnceLock::new();
    let servers = SERVERS.get_or_init(Default::default);
    let mut servers = servers.lock().unwrap_or_else(|e| e.into_inner());
    servers.entry(name.to_owned()).or_default().clone()
}

#[cfg(not(all(feature = "redis", feature = "etcd", feature = "postgres")))]
fn missing_feature(feature: &str, url: &str) -> LockError {
    LockError::config(format!(
        "{url:?} needs the `{feature}` feature of distlock; enable it in Cargo.toml: distlock = {{ version = \"0.1\", features = [\"{feature}\"] }}"
    ))
}

#[cfg(feature = "redis")]
async fn connect_redis(url: &str) -> Result<Arc<dyn DistributedLock>, LockError> {
    Ok(Arc::new(lock_redis::RedisLock::connect(url).await?))
}
#[cfg(not(feature = "redis"))]
async fn connect_redis(url: &str) -> Result<Arc<dyn DistributedLock>, LockError> {
    // `redis-tls` turns on `redis` as well; naming it saves a second round.
    let tls = url
        .get(..9)
        .is_some_and(|s| s.eq_ignore_ascii_case("rediss://"));
    let feature = if tls { "redis-tls" } else { "redis" };
    Err(missing_feature(feature, url))
}

#[cfg(feature = "etcd")]
async fn connect_etcd(url: &str) -> Result<Arc<dyn DistributedLock>, LockError> {
    Ok(Arc::new(lock_etcd::EtcdLock::connect(url).await?))
}
#[cfg(not(feature = "etcd"))]
async fn connect_etcd(url: &str) -> Result<Arc<dyn DistributedLock>, LockError> {
    Err(missing_feature("etcd", url))
}

#[cfg(feature = "postgres")]
async fn connect_postgres(url: &str) -> Result<Arc<dyn DistributedLock>, LockError> {
    Ok(Arc::new(lock_postgres::PostgresLock::connect(url).await?))
}
#[cfg(not(feature = "postgres"))]
async fn connect_postgres(url: &str) -> Result<Arc<dyn DistributedLock>, LockError> {
    Err(missing_feature("postgres", url))
}
