//! The distlock conformance suite: one set of cases every backend — ours and
//! third parties' — runs against a real server.
//!
//! A backend opts in with a test target of about five lines
//! (`harness = false` in its `Cargo.toml`):
//!
//! ```no_run
//! // tests/conformance.rs
//! use std::sync::Arc;
//! use conformance_tests::{server, Suite};
//! use lock_core::{DistributedLock, LockError, MemoryLock};
//!
//! # async fn connect_my_backend(_url: &str) -> Result<MemoryLock, LockError> { Ok(MemoryLock::new()) }
//! fn main() -> std::process::ExitCode {
//!     Suite::new("my-backend", |url: String| async move {
//!         let lock = connect_my_backend(&url).await?;
//!         Ok(Arc::new(lock) as Arc<dyn DistributedLock>)
//!     })
//!     .server(server::Redis::default()) // or your own `server::ServerKind`
//!     .run()
//! }
//! ```
//!
//! Every case becomes its own test named `group::case` (`basic::`, `input::`,
//! `fencing::`, `wait::`, `guard::`, `exclusion::`, `run::`, `fault::`), so
//! new cases reach every backend automatically. A case the backend cannot
//! support (per its declared [`Capabilities`](lock_core::Capabilities)) is
//! reported as `ignored` with the reason, never as a pass. Each case uses
//! fresh random keys; nothing wipes shared state.
//!
//! The `fault::` cases inject real faults through the hooks in [`fault`]: a
//! TCP proxy per client that resets or black-holes its connections, a
//! dedicated server per case that is killed and restarted (never the shared
//! one), and a lock holder in a child process (the test binary re-executed
//! by [`Suite::run`]) killed with SIGKILL. They need nothing more from the
//! backend's test target than the five lines above; where a hook cannot
//! work (an in-process backend, a server given by URL in the environment)
//! the case is ignored with the reason. `DISTLOCK_TORTURE_SECS` sets the
//! length of `fault::exclusion_torture` (default 30), and
//! `DISTLOCK_CONFORMANCE_MEASURE=1` prints the fault cases' measured times.
#![warn(missing_docs)]

pub mod cases;
pub mod checker;
mod context;
pub mod fault;
mod observed;
pub mod server;
mod suite;

pub use context::{
    connect_fn, CaseError, CaseResult, ClientFuture, ConnectFn, ContextBuilder, TestContext,
    FAULT_CONNECT_TIMEOUT, FAULT_OPERATION_TIMEOUT,
};
pub use observed::ObservedLock;
pub use suite::{CaseOutcome, CaseReport, CaseRun, Suite};
