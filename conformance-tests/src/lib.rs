//! The distlock conformance suite: one set of cases every backend — ours and
//! third parties' — runs against a real server.
//!
//! A backend opts in with a test target of about five lines
//! (`harness = false` in its `Cargo.toml`):
//!
//! ```no_run
//! // tests/conformance.rs
//! use distlock_conformance::{server, Suite};
//! use distlock_core::{LockClient, LockError, MemoryLock};
//!
//! # async fn connect_my_backend(_url: &str) -> Result<MemoryLock, LockError> { Ok(MemoryLock::new()) }
//! fn main() -> std::process::ExitCode {
//!     Suite::new("my-backend", |url: String| async move {
//!         let backend = connect_my_backend(&url).await?; // your LockBackend
//!         Ok(LockClient::new(backend))
//!     })
//!     .server(server::Redis::default()) // or your own `server::ServerKind`
//!     .run()
//! }
//! ```
//!
//! Every case becomes its own test named `group::case` (and
//! `variant::group::case` for each [`Variant`] the target declares with
//! [`Suite::variant`]: over TLS, through a pooler, against a cluster), so new
//! cases reach every backend automatically:
//!
//! - `basic::` — acquire, refuse, release, extend, expire, owner checks;
//! - `input::` — bad input gets a typed error, never a panic;
//! - `fencing::` — tokens strictly grow per key, unchanged by extend;
//! - `wait::` — waiting with a deadline, wake-up by release, cancel safety;
//! - `guard::` — renewal, the lost signal, max hold, drop, hold-at-least;
//! - `exclusion::` — many clients around a non-atomic counter;
//! - `run::` — `run_exclusive`: completed, skipped, lost;
//! - `admin::` — the operator calls `inspect` and `force_release`;
//! - `schedule::` — one run per scheduled fire across instances;
//! - `lease::` — a lease's deadline against the server's expiry: nobody is
//!   granted a lock before its holder's deadline, the deadline never
//!   outlives the server's expiry, release and extend stay atomic against
//!   an expiry and re-acquire, an acquire by the owner that holds the key
//!   adopts it (`lease::same_owner_*`);
//! - `cancel::` — the raw trait's futures dropped at random points;
//! - `fault::` — real faults: SIGKILLed holders, resets, black holes, a dead
//!   or stalled (SIGSTOPped) server, restarts, torture runs (locks and
//!   permits), and every
//!   operation applied while its reply is held past the client's timeout
//!   (`fault::late_reply_*`: its outcome unknown to the client).
//!
//! A case the backend cannot support (per its declared
//! [`Capabilities`](distlock_core::Capabilities)) is reported as `ignored` with
//! the reason, never as a pass. Each case uses fresh random keys; nothing
//! wipes shared state.
//!
//! The fault cases inject real faults through the hooks in [`fault`]: a
//! TCP proxy per client that delays, resets or black-holes its connections
//! or plays a dead server, a dedicated server per case that is killed,
//! restarted or paused (never the shared one), and a lock holder in a child
//! process (the test binary re-executed by [`Suite::run`]) killed with
//! SIGKILL. An in-process backend gets the same faults over a simulated
//! network ([`fault::Link`], [`Suite::simulated_network`]). They need
//! nothing more from the backend's test target than the five lines above;
//! where a hook cannot work (a server given by URL in the environment) the
//! case is ignored with the reason. `DISTLOCK_TORTURE_SECS` sets the length
//! of `fault::exclusion_torture` and `fault::permit_torture` (default 30), and
//! `DISTLOCK_CONFORMANCE_MEASURE=1` prints the fault cases' measured times.
//!
//! Third parties extend the suite with the same tools: cases of their own
//! ([`Suite::case`], [`cases::Case::new`]) written with [`TestContext`] and
//! the helpers in [`cases::support`]; a server they run themselves
//! ([`Suite::external_server`], or their own [`server::ServerKind`]); or
//! cases run under a harness of their own ([`TestContext::builder`],
//! [`Suite::run_cases`]).
//!
//! The suite's own measure is how many wrong backends it rejects: the
//! `mutants` test target of this crate runs it against a corpus of
//! `MemoryLock` wrappers that each inject one defect, and fails if any of
//! them passes.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod cases;
pub mod checker;
mod context;
pub mod fault;
pub mod naming;
mod observed;
pub mod server;
mod suite;
pub mod url;

pub use context::{
    connect_fn, CaseError, CaseResult, ClientFuture, ConnectFn, ContextBuilder, TestContext,
    FAULT_CONNECT_TIMEOUT, FAULT_OPERATION_TIMEOUT,
};
pub use observed::{Call, Granted, ObservedLock};
pub use suite::{CaseOutcome, CaseReport, CaseRun, Suite, Variant};

pub use url::{namespace_of, with_namespace};
