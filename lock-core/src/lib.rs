//! The distlock contract: one distributed-lock API over several lock servers.
//!
//! - [`LockBackend`] is what a backend implements: the few operations the
//!   server does atomically (acquire, extend, release, watch), over inputs
//!   already validated; [`LockAdmin`] adds the optional operator calls.
//! - [`LockClient`] wraps any backend and alone owns every lease rule: TTL
//!   validation, owner tokens, send times, lease deadlines, issuer checks,
//!   error wording, tracing and metrics.
//! - [`Locker`], [`LockGuard`] and [`run_exclusive`] are built once on top
//!   of it: waiting with a deadline, renewal, the lost signal, hold-at-least.
//! - [`ScheduledJob`] runs a job once per schedule fire across instances;
//!   [`JobKey`] derives a lock key from a job name and its arguments.
//! - [`MemoryLock`] is the in-process backend.
//! - [`BackendDescriptor`] is how a backend crate tells the `distlock`
//!   facade its URL schemes and how to connect.
//! - [`LockUrl`] and [`Listener`] are the kits backends build on: one URL
//!   parser, one notification listener.
//! - [`LockError`] carries an [`ErrorKind`] to match on.
//!
//! ```
//! use std::time::Duration;
//! use distlock_core::{Locker, LockKey, LockOptions, MemoryLock, RunOptions, RunOutcome};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), distlock_core::LockError> {
//! let locker = Locker::new(MemoryLock::new());
//! let key = LockKey::new("nightly-report")?;
//! let options = RunOptions::new(LockOptions::new(Duration::from_secs(30)));
//! match locker.run_exclusive(&key, &options, |ctx| async move { ctx.fencing_token }).await? {
//!     RunOutcome::Completed { output, .. } => println!("ran with token {output}"),
//!     RunOutcome::Skipped => println!("already running elsewhere, skipping this tick"),
//!     RunOutcome::Lost { reason, .. } => println!("lock lost mid-run: {reason}"),
//! }
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod backend;
mod capabilities;
mod client;
mod client_options;
mod contended;
mod descriptor;
mod election;
mod error;
mod fence;
mod format;
mod guard;
mod holder;
pub mod instrument;
mod job_key;
mod key;
mod lease;
mod listener;
mod locker;
mod memory;
mod notify;
mod options;
mod renewal;
mod run;
mod schedule;
mod semaphore;
#[cfg(test)]
mod tests;
mod tls;
mod url;
mod wait;
mod waits;

pub use backend::{
    AcquireReply, AcquireRequest, ExtendReply, Grant, HeldLock, LockAdmin, LockBackend, LockState,
    ReleaseReply,
};
pub use capabilities::Capabilities;
pub use client::{AcquireAttempt, LockClient};
pub use client_options::{with_timeout, ClientOptions, DEFAULT_NAMESPACE, MAX_TIMEOUT};
pub use contended::{ContendedKeys, CONTENDED_FOR};
pub use descriptor::{BackendDescriptor, Connecting};
pub use election::{Leader, LeaderWatch, Leadership, DEFAULT_OBSERVE_POLL};
pub use error::{request_message, ErrorKind, LockError, IN_LOCK_CALL};
pub use fence::{check_fence_retention, DEFAULT_FENCE_RETENTION, MAX_FENCE_RETENTION};
pub use format::{
    check_storage_format, foreign_storage_format, read_storage_format, STORAGE_FORMAT,
};
pub use guard::{LockGuard, LostReason, LostSignal};
pub use holder::{HolderId, MAX_HOLDER_BYTES};
pub use instrument::describe_metrics;
pub use job_key::JobKey;
pub use key::{LockKey, MAX_KEY_BYTES};
pub use lease::{FencingToken, Lease, OwnerToken};
pub use listener::{Listener, Notification, NotificationSource};
pub use locker::Locker;
pub use memory::MemoryLock;
pub use notify::{Departure, ReleaseNotifier, ReleaseWatch, Unclaimed};
pub use options::{LockOptions, Renewal};
pub use run::{run_exclusive, JobContext, OnLost, RunOptions, RunOutcome};
pub use schedule::{Fire, ScheduledJob, ScheduledOutcome, SkipReason};
pub use semaphore::{PermitReply, PermitRequest, PermitState, SemaphoreBackend};
pub use tls::{TlsAdvice, TlsFailure, TlsFiles, TlsPem};
pub use url::{LockUrl, UrlHost};
pub use waits::{OpenWaits, WaitLine, WaitPlace};

/// Re-exported so backends implement [`LockBackend`] with the same
/// `async_trait` version.
pub use async_trait::async_trait;
