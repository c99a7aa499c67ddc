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
//! `layer::LockLayer`. A URL whose features are off gives an error naming
//! each feature to enable. [`BACKENDS`] lists the backends of this build,
//! each by its crate's [`BackendDescriptor`]. Building with `etcd` needs
//! `protoc` and the protobuf well-known types (see the README).
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

pub use distlock_core::{
    run_exclusive, AcquireAttempt, BackendDescriptor, Capabilities, ClientOptions, Connecting,
    ErrorKind, FencingToken, Fire, HolderId, JobContext, JobKey, Leader, LeaderWatch, Leadership,
    Lease, LockAdmin, LockBackend, LockClient, LockError, LockGuard, LockKey, LockOptions,
    LockState, Locker, LostReason, LostSignal, MemoryLock, OnLost, OwnerToken, PermitState,
    Renewal, RunOptions, RunOutcome, ScheduledJob, ScheduledOutcome, SkipReason, DEFAULT_NAMESPACE,
    DEFAULT_OBSERVE_POLL, MAX_HOLDER_BYTES, MAX_KEY_BYTES,
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

/// A backend this build of distlock opens, with the cargo feature of
/// distlock that brings it.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Backend {
    /// The feature (`"redis"`, `"etcd"`, `"postgres"`), or `None` for the
    /// in-memory backend, which is always there.
    pub feature: Option<&'static str>,
    /// The backend crate's own descriptor: its schemes and how to connect.
    pub descriptor: BackendDescriptor,
}

/// The backends this build opens: memory, then each one whose feature is
/// on. [`connect`] picks among them by URL scheme.
///
/// ```
/// let schemes: Vec<&str> = distlock::BACKENDS
///     .iter()
///     .flat_map(|backend| backend.descriptor.schemes())
///     .copied()
///     .collect();
/// assert_eq!(schemes[0], "memory");
/// ```
pub const BACKENDS: &[Backend] = &[
    Backend {
        feature: None,
        descriptor: MemoryLock::DESCRIPTOR,
    },
    #[cfg(feature = "redis")]
    Backend {
        feature: Some("redis"),
        descriptor: distlock_redis::DESCRIPTOR,
    },
    #[cfg(feature = "etcd")]
    Backend {
        feature: Some("etcd"),
        descriptor: distlock_etcd::DESCRIPTOR,
    },
    #[cfg(feature = "postgres")]
    Backend {
        feature: Some("postgres"),
        descriptor: distlock_postgres::DESCRIPTOR,
    },
];

/// Each backend feature of distlock and its backend's URL schemes, whether
/// or not the feature is on, so that a URL for a backend this build leaves
/// out names the feature to enable. For a backend that is in the build its
/// descriptor decides; a unit test checks that each entry is its
/// descriptor's list.
const FEATURE_SCHEMES: &[(&str, &[&str])] = &[
    (
        "redis",
        &[
            "redis",
            "rediss",
            "redis+sentinel",
            "rediss+sentinel",
            "redis+cluster",
            "rediss+cluster",
        ],
    ),
    ("etcd", &["etcd", "etcds"]),
    ("postgres", &["postgres", "postgresql"]),
];

/// The schemes of [`FEATURE_SCHEMES`] that also need the `tls` feature.
const TLS_SCHEMES: &[&str] = &["rediss", "rediss+sentinel", "rediss+cluster", "etcds"];

/// The cargo features a URL with `scheme` needs, when its backend is not in
/// this build.
fn features_for(scheme: &str) -> Option<Vec<&'static str>> {
    let (feature, _) = FEATURE_SCHEMES
        .iter()
        .find(|(_, schemes)| schemes.contains(&scheme))?;
    let mut features = vec![*feature];
    if !cfg!(feature = "tls") && TLS_SCHEMES.contains(&scheme) {
        features.push("tls");
    }
    Some(features)
}

/// Opens a lock client for `url`, choosing the backend by scheme among
/// [`BACKENDS`].
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
        let builtin = MemoryLock::DESCRIPTOR.schemes().iter();
        let features = FEATURE_SCHEMES.iter().flat_map(|(_, schemes)| *schemes);
        let schemes: Vec<String> = builtin.chain(features).map(|s| format!("{s}://")).collect();
        schemes.join(", ")
    };
    let Some((scheme, _)) = url.split_once("://") else {
        return Err(LockError::config(format!(
            "{:?} is not a lock URL; expected one of {}",
            distlock_core::LockUrl::parse(url)
                .map_or_else(|_| "(unparsable)".to_owned(), |u| u.to_string()),
            known()
        )));
    };
    let scheme = scheme.to_ascii_lowercase();
    if let Some(backend) = BACKENDS.iter().find(|b| b.descriptor.opens(&scheme)) {
        return backend.descriptor.connect(url).await;
    }
    match features_for(&scheme) {
        Some(features) => {
            let named: Vec<String> = features
                .iter()
                .map(|f| format!("the `{f}` feature"))
                .collect();
            let quoted: Vec<String> = features.iter().map(|f| format!("\"{f}\"")).collect();
            Err(LockError::config(format!(
                "{scheme}:// URLs need {} of distlock; enable {} in Cargo.toml: distlock = {{ version = \"0.1\", features = [{}] }}",
                named.join(" and "),
                if features.len() == 1 { "it" } else { "them" },
                quoted.join(", ")
            )))
        }
        None => Err(LockError::config(format!(
            "unknown lock URL scheme {scheme:?}; expected one of {}",
            known()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::{FEATURE_SCHEMES, TLS_SCHEMES};

    /// For each backend in this build, the facade's scheme list for its
    /// feature is the one its descriptor declares.
    #[test]
    fn feature_schemes_match_the_descriptors() {
        for backend in super::BACKENDS {
            let Some(feature) = backend.feature else {
                continue;
            };
            let listed = FEATURE_SCHEMES.iter().find(|(f, _)| *f == feature);
            assert_eq!(
                listed.map(|(_, schemes)| *schemes),
                Some(backend.descriptor.schemes()),
                "{feature}"
            );
        }
    }

    /// Every TLS scheme belongs to some backend feature.
    #[test]
    fn tls_schemes_are_backend_schemes() {
        for scheme in TLS_SCHEMES {
            assert!(
                FEATURE_SCHEMES
                    .iter()
                    .any(|(_, schemes)| schemes.contains(scheme)),
                "{scheme}"
            );
        }
    }

    /// A scheme of a backend left out of this build names its feature.
    #[cfg(not(feature = "redis"))]
    #[tokio::test]
    async fn left_out_backend_names_its_feature() {
        let err = super::connect("redis+cluster://127.0.0.1:7000")
            .await
            .unwrap_err();
        assert_eq!(err.kind(), super::ErrorKind::Config, "{err}");
        assert!(err.to_string().contains("the `redis` feature"), "{err}");
    }

    /// A TLS scheme of a left-out backend also names `tls` when it is off.
    #[cfg(not(any(feature = "redis", feature = "tls")))]
    #[tokio::test]
    async fn left_out_tls_scheme_names_both_features() {
        let err = super::connect("rediss://127.0.0.1:6379").await.unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains("the `redis` feature and the `tls` feature"),
            "{message}"
        );
        assert!(
            message.contains(r#"features = ["redis", "tls"]"#),
            "{message}"
        );
    }
}
