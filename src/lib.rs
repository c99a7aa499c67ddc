//! **distlock** — one distributed-lock API over Redis, etcd, PostgreSQL and
//! memory.
//!
//! Job code is written once against [`Locker`] / [`LockClient`]; which
//! server holds the lock is a cargo feature plus a URL given to [`connect`].
//!
//! | URL scheme               | cargo feature | backend |
//! |--------------------------|---------------|---------|
//! | `memory://[name]`        | (always)      | [`MemoryLock`], in-process |
//! | `redis://`               | `redis`       | `distlock_redis::RedisLock` |
//! | `rediss://` (TLS)        | `redis` + `tls` | `distlock_redis::RedisLock` |
//! | `redis+sentinel://`, `redis+cluster://` | `redis` | `distlock_redis::RedisLock` (Sentinel, Cluster) |
//! | `rediss+sentinel://`, `rediss+cluster://` | `redis` + `tls` | the same over TLS |
//! | `etcd://`                | `etcd`        | `distlock_etcd::EtcdLock` |
//! | `etcds://` (TLS)         | `etcd` + `tls` | `distlock_etcd::EtcdLock` |
//! | `postgres://`, `postgresql://` | `postgres` | `distlock_postgres::PostgresLock` |
//!
//! `tls` turns on TLS for every enabled backend (rustls with the ring
//! provider); `redis-tls` is an alias of `redis` + `tls`. `full` enables
//! `redis`, `etcd` and `postgres` (not `tls`); `tower` adds
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
use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, OnceLock};

pub use distlock_core::{
    run_exclusive, AcquireAttempt, Capabilities, ClientOptions, ErrorKind, FencingToken, Fire,
    JobContext, JobKey, Lease, LockAdmin, LockBackend, LockClient, LockError, LockGuard, LockKey,
    LockOptions, LockState, Locker, LostReason, LostSignal, MemoryLock, OnLost, OwnerToken,
    Renewal, RunOptions, RunOutcome, ScheduledJob, ScheduledOutcome, SkipReason, DEFAULT_NAMESPACE,
    MAX_KEY_BYTES,
};

#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub mod layer;

#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use distlock_etcd as etcd;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use distlock_postgres as postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use distlock_redis as redis;

type Connecting = Pin<Box<dyn Future<Output = Result<LockClient, LockError>> + Send>>;

/// A backend the facade can open: the URL schemes it declares, each with the
/// cargo feature that enables it, and how to connect (`None` when the
/// backend's feature is off).
struct Backend {
    schemes: &'static [(&'static str, &'static str)],
    connect: Option<fn(String) -> Connecting>,
}

impl Backend {
    fn feature_for(&self, scheme: &str) -> Option<&'static str> {
        self.schemes
            .iter()
            .find(|(s, _)| *s == scheme)
            .map(|(_, feature)| *feature)
    }
}

/// `Some(connect)` for a backend whose feature is on, else `None`.
macro_rules! connector {
    ($feature:literal, $lock:path) => {{
        #[cfg(feature = $feature)]
        let connect: Option<fn(String) -> Connecting> = Some(|url| {
            Box::pin(async move {
                use $lock as Backend;
                Ok(LockClient::new(Backend::connect(&url).await?))
            })
        });
        #[cfg(not(feature = $feature))]
        let connect: Option<fn(String) -> Connecting> = None;
        connect
    }};
}

/// Every backend of the facade, whether or not its feature is on, so a URL
/// for a disabled one names the feature to enable. The schemes are each
/// backend crate's `SCHEMES` (checked by a test).
fn backends() -> [Backend; 3] {
    [
        Backend {
            // TLS needs `redis` + `tls`; with `redis` off, the error names
            // `redis-tls`, the one feature that turns on both.
            schemes: &[
                ("redis", "redis"),
                ("rediss", "redis-tls"),
                ("redis+sentinel", "redis"),
                ("rediss+sentinel", "redis-tls"),
                ("redis+cluster", "redis"),
                ("rediss+cluster", "redis-tls"),
            ],
            connect: connector!("redis", distlock_redis::RedisLock),
        },
        Backend {
            // TLS also needs `tls`; distlock-etcd says so.
            schemes: &[("etcd", "etcd"), ("etcds", "etcd")],
            connect: connector!("etcd", distlock_etcd::EtcdLock),
        },
        Backend {
            schemes: &[("postgres", "postgres"), ("postgresql", "postgres")],
            connect: connector!("postgres", distlock_postgres::PostgresLock),
        },
    ]
}

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
pub async fn connect(url: &str) -> Result<LockClient, LockError> {
    let known = || {
        let mut schemes = vec!["memory://".to_owned()];
        for backend in backends() {
            schemes.extend(backend.schemes.iter().map(|(s, _)| format!("{s}://")));
        }
        schemes.join(", ")
    };
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(LockError::config(format!(
            "{:?} is not a lock URL; expected one of {}",
            distlock_core::LockUrl::parse(url)
                .map_or_else(|_| "(unparsable)".to_owned(), |u| u.to_string()),
            known()
        )));
    };
    let scheme = scheme.to_ascii_lowercase();
    if scheme == "memory" {
        return Ok(memory_server(rest).client());
    }
    let Some((backend, feature)) = backends()
        .into_iter()
        .find_map(|b| b.feature_for(&scheme).map(|feature| (b, feature)))
    else {
        return Err(LockError::config(format!(
            "unknown lock URL scheme {scheme:?}; expected one of {}",
            known()
        )));
    };
    match backend.connect {
        Some(connect) => connect(url.to_owned()).await,
        None => Err(LockError::config(format!(
            "{scheme}:// URLs need the `{feature}` feature of distlock; enable it in Cargo.toml: distlock = {{ version = \"0.1\", features = [\"{feature}\"] }}"
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

#[cfg(test)]
mod tests {
    /// The facade's scheme list is each backend crate's own.
    #[cfg(any(feature = "redis", feature = "etcd", feature = "postgres"))]
    #[test]
    fn schemes_match_the_backend_crates() {
        for backend in super::backends() {
            let declared: &[&str] = match backend.schemes[0].0 {
                #[cfg(feature = "redis")]
                "redis" => distlock_redis::SCHEMES,
                #[cfg(feature = "etcd")]
                "etcd" => distlock_etcd::SCHEMES,
                #[cfg(feature = "postgres")]
                "postgres" => distlock_postgres::SCHEMES,
                _ => continue,
            };
            let schemes: Vec<&str> = backend.schemes.iter().map(|(s, _)| *s).collect();
            assert_eq!(schemes, declared);
        }
    }
}
