//! The etcd v3 backend of distlock.
//!
//! A lock is an etcd key in the client's namespace (`NS/lock/<escaped key>`)
//! attached to an etcd lease with the lock's TTL, written by a transaction
//! that succeeds only if the key does not exist. etcd deletes the key when
//! the lease runs out, by its own clock, so a crashed holder cannot wedge a
//! lock. The fencing token is the key's `create_revision`, from etcd's
//! global, durable revision counter. Waiters are woken by an etcd watch on
//! the holder's key, not by polling.
//!
//! A lock whose guard renews it goes on a lease shared by the client's
//! renewed locks (one per TTL, kept alive by one keep-alive stream), so
//! taking it costs one round trip and renewing it one small confirming
//! request; locks without renewal get a lease of their own, two round trips,
//! so their TTL is exact. See [`EtcdLock`] for the costs of each operation.
//!
//! TTLs are whole seconds: shorter or fractional TTLs are rounded up (1.2 s
//! becomes 2 s), and a server with default settings grants at least 2 s
//! (1.5 × its election timeout). [`EtcdLock`]'s
//! [`capabilities`](lock_core::LockBackend::capabilities) declare a 1 s
//! minimum and 1 s granularity, so [`LockClient`](lock_core::LockClient)
//! rounds up before asking.
//!
//! [`EtcdLock`] is the raw [`LockBackend`](lock_core::LockBackend) (plus
//! [`LockAdmin`](lock_core::LockAdmin)); job code uses it through
//! [`LockClient`](lock_core::LockClient) or [`Locker`](lock_core::Locker),
//! which own owner tokens, lease deadlines, waiting and renewal.
//!
//! URL: `etcd://[user:password@]host[:port][,host[:port]...][?namespace=N&connect_timeout_ms=N&operation_timeout_ms=N]`
//! (see [`EtcdConfig`]).
//!
//! ```no_run
//! use std::time::Duration;
//! use lock_core::{Locker, LockKey, LockOptions};
//! use lock_etcd::EtcdLock;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), lock_core::LockError> {
//! let lock = EtcdLock::connect("etcd://locker:secret@127.0.0.1:2379?namespace=jobs").await?;
//! let locker = Locker::new(lock);
//! let key = LockKey::new("nightly-report")?;
//! if let Some(guard) = locker.try_lock(&key, &LockOptions::new(Duration::from_secs(30))).await? {
//!     // ... run the job; the guard renews the lease ...
//!     guard.release().await?;
//! }
//! # Ok(()) }
//! ```
//!
//! With authentication enabled in etcd, the URL's user needs a role with
//! readwrite permission on the prefix `NS/lock/` (see
//! [`EtcdLock::key_prefix`]); a wrong password is reported as
//! [`ErrorKind::Config`](lock_core::ErrorKind::Config).
//!
//! # Building
//!
//! The etcd client's build script compiles etcd's `.proto` files, so
//! building this crate needs `protoc` and the protobuf well-known types
//! (`google/protobuf/descriptor.proto` and friends):
//!
//! - Debian/Ubuntu: `apt-get install protobuf-compiler libprotobuf-dev`
//!   (the second is only a recommendation of the first);
//! - macOS: `brew install protobuf`;
//! - elsewhere: unpack a `protoc-*.zip` release from
//!   <https://github.com/protocolbuffers/protobuf/releases> and set
//!   `PROTOC=<dir>/bin/protoc` and `PROTOC_INCLUDE=<dir>/include`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod admin;
mod backend;
mod config;
mod errors;
mod health;
mod keepalive;
mod keys;
mod listener;
mod queue;
mod session;
#[cfg(feature = "tls")]
mod tls;
mod txn;

/// The URL schemes this backend opens (`etcds://` needs the `tls` feature).
pub const SCHEMES: &[&str] = &["etcd", "etcds"];

pub use backend::EtcdLock;
pub use config::{EtcdConfig, DEFAULT_PORT};

/// The etcd client crate this backend is built on, for
/// [`EtcdLock::from_client`].
pub use etcd_client;
