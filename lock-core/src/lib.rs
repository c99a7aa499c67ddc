//! The distlock contract: one distributed-lock API over several lock servers.
//!
//! - [`DistributedLock`] is what a backend implements: a few operations the
//!   server does atomically (try-acquire, extend, release, watch), and
//!   optionally the operator calls inspect and force-release
//!   ([`Capabilities::admin`]).
//! - [`Locker`], [`LockGuard`] and [`run_exclusive`] are built once on top
//!   of it: waiting with a deadline, renewal, the lost signal, hold-at-least.
//! - [`ScheduledJob`] runs a job once per schedule fire across instances;
//!   [`JobKey`] derives a lock key from a job name and its arguments.
//! - [`MemoryLock`] is the in-process backend.
//! - [`LockError`] carries an [`ErrorKind`] to match on.
//!
//! ```
//! use std::time::Duration;
//! use lock_core::{Locker, LockKey, LockOptions, MemoryLock, RunOptions, RunOutcome};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), lock_core::LockError> {
//! let locker = Locker::new(std::sync::Arc::new(MemoryLock::new()));
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
mod client_options;
mod error;
mod guard;
mod job_key;
mod key;
mod lease;
mod locker;
mod memory;
mod notify;
mod options;
mod run;
mod schedule;
pub mod wait;

pub use backend::{AcquireAttempt, DistributedLock, LockState};
pub use capabilities::Capabilities;
pub use client_options::{with_timeout, ClientOptions, DEFAULT_NAMESPACE};
pub use error::{ErrorKind, LockError};
pub use guard::{LockGuard, LostReason, LostSignal};
pub use job_key::JobKey;
pub use key::{LockKey, MAX_KEY_BYTES};
pub use lease::{FencingToken, Lease, LeaseIssuer, OwnerToken};
pub use locker::Locker;
pub use memory::MemoryLock;
pub use notify::{ReleaseNotifier, ReleaseWatch};
pub use options::{LockOptions, Renewal};
pub use run::{run_exclusive, JobContext, OnLost, RunOptions, RunOutcome};
pub use schedule::{Fire, ScheduledJob, ScheduledOutcome, SkipReason};

/// Re-exported so backends implement [`DistributedLock`] with the same
/// `async_trait` version.
pub use async_trait::async_trait;
