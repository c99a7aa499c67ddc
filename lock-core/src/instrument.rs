//! Metrics, emitted once here for every backend through the `metrics`
//! crate (a no-op until the application installs a recorder).
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `distlock_attempts_total` | counter | `backend` |
//! | `distlock_acquired_total` | counter | `backend` |
//! | `distlock_held_elsewhere_total` | counter | `backend` |
//! | `distlock_errors_total` | counter | `backend`, `op`, `kind` |
//! | `distlock_lost_total` | counter | `backend`, `reason` |
//! | `distlock_wait_seconds` | histogram | `backend`, `outcome` (`acquired`, `timed_out`, `error`) |
//! | `distlock_hold_seconds` | histogram | `backend` |

use std::time::Duration;

use crate::{ErrorKind, LockError};

/// Metric names, for dashboards and tests.
pub mod names {
    /// Acquisition attempts (one atomic try each).
    pub const ATTEMPTS: &str = "distlock_attempts_total";
    /// Attempts that got the lock.
    pub const ACQUIRED: &str = "distlock_acquired_total";
    /// Attempts that found the lock held by someone else.
    pub const HELD_ELSEWHERE: &str = "distlock_held_elsewhere_total";
    /// Failed operations, by operation and error kind.
    pub const ERRORS: &str = "distlock_errors_total";
    /// Guards that lost their lock, by reason.
    pub const LOST: &str = "distlock_lost_total";
    /// Time spent in a waiting acquire.
    pub const WAIT_SECONDS: &str = "distlock_wait_seconds";
    /// Time a guard held its lock, acquisition to release or loss.
    pub const HOLD_SECONDS: &str = "distlock_hold_seconds";
}

pub(crate) fn attempt(backend: &'static str, acquired: bool) {
    metrics::counter!(names::ATTEMPTS, "backend" => backend).increment(1);
    if acquired {
        metrics::counter!(names::ACQUIRED, "backend" => backend).increment(1);
    } else {
        metrics::counter!(names::HELD_ELSEWHERE, "backend" => backend).increment(1);
    }
}

pub(crate) fn error(backend: &'static str, op: &'static str, error: &LockError) {
    metrics::counter!(names::ERRORS, "backend" => backend, "op" => op, "kind" => kind_label(error.kind()))
        .increment(1);
}

pub(crate) fn lost(backend: &'static str, reason: &'static str) {
    metrics::counter!(names::LOST, "backend" => backend, "reason" => reason).increment(1);
}

pub(crate) fn waited(backend: &'static str, outcome: &'static str, waited: Duration) {
    metrics::histogram!(names::WAIT_SECONDS, "backend" => backend, "outcome" => outcome)
        .record(waited.as_secs_f64());
}

pub(crate) fn held(backend: &'static str, held: Duration) {
    metrics::histogram!(names::HOLD_SECONDS, "backend" => backend).record(held.as_secs_f64());
}

fn kind_label(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidInput => "invalid_input",
        ErrorKind::NotHeld => "not_held",
        ErrorKind::Unavailable => "unavailable",
        ErrorKind::Timeout => "timeout",
        ErrorKind::Corrupted => "corrupted",
        ErrorKind::Config => "config",
        ErrorKind::Unsupported => "unsupported",
    }
}
