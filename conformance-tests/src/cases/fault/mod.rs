//! `fault::` — mutual exclusion under real faults: a holder process killed
//! with SIGKILL, connections black-holed and reset by a TCP proxy, the
//! server killed and restarted, waiting futures dropped at random points,
//! and a torture run mixing them all.
//!
//! Clients in these cases carry short timeouts
//! ([`FAULT_CONNECT_TIMEOUT`](crate::FAULT_CONNECT_TIMEOUT),
//! [`FAULT_OPERATION_TIMEOUT`](crate::FAULT_OPERATION_TIMEOUT)). Cases that
//! kill or restart a server start their own, never touching the shared one.
//! Every bound below is a liveness bound (a hang detector) far above what a
//! conforming backend needs, never a performance assertion; measured times
//! are printed when `DISTLOCK_CONFORMANCE_MEASURE=1`.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Mutex;
use std::time::Duration;

use distlock_core::{ErrorKind, LockError};

use super::support::within;
use crate::context::{CaseError, TestContext};

mod partition;
mod process;
mod stall;
mod torture;
mod unreachable;

pub use self::partition::{
    black_holed_holder_loses_first, held_renewal_replies_lose_first,
    partitioned_leader_loses_first, resets_during_operations, run_exclusive_lost_to_partition,
};
pub use self::process::{
    killed_holder_process_expires, server_down_at_acquire, server_restart_with_holders_and_waiters,
};
pub use self::stall::stalled_server_waiters_recover;
pub use self::torture::{dropped_waiters_leave_nothing_held, exclusion_torture, permit_torture};
pub use self::unreachable::{
    renewal_outage_keeps_guard, unreachable_extend_and_release_are_errors,
    unreachable_is_an_error_not_held,
};

/// Slack on top of a TTL for "the server let the key go": far above any
/// conforming server's expiry delay (etcd revokes expired leases in
/// batches), so only a key that stays held for good fails it.
const EXPIRY_SLACK: Duration = Duration::from_secs(10);

/// The TTL fault cases hold with (rounded per the backend's capabilities).
fn fault_ttl(ctx: &TestContext, ttl: Duration) -> Result<Duration, CaseError> {
    Ok(ctx.capabilities().effective_ttl(ttl)?)
}

/// Prints a measured number for the report when
/// `DISTLOCK_CONFORMANCE_MEASURE` is set (test-harness output, not a check).
fn measure(ctx: &TestContext, case: &str, text: std::fmt::Arguments<'_>) {
    if std::env::var_os("DISTLOCK_CONFORMANCE_MEASURE").is_some() {
        let _ = writeln!(
            std::io::stderr(),
            "measure {} fault::{case}: {text}",
            ctx.backend_name()
        );
    }
}

/// Whether `e` is one of the kinds a fault may surface as.
fn is_fault_kind(e: &LockError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Unavailable | ErrorKind::Timeout | ErrorKind::NotHeld
    )
}

/// Counts errors by kind; anything but a fault kind fails the case.
#[derive(Debug, Default)]
struct ErrorTally(Mutex<BTreeMap<String, usize>>);

impl ErrorTally {
    fn record(&self, what: &str, e: LockError) -> Result<(), CaseError> {
        if !is_fault_kind(&e) {
            return Err(CaseError(format!(
                "{what}: a fault surfaced as an unexpected {:?} error: {e}",
                e.kind()
            )));
        }
        *self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(format!("{:?}", e.kind()))
            .or_default() += 1;
        Ok(())
    }

    fn summary(&self) -> String {
        format!("{:?}", self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

async fn join<T>(
    task: tokio::task::JoinHandle<Result<T, CaseError>>,
    bound: Duration,
    what: &str,
) -> Result<T, CaseError> {
    within(bound, task, what)
        .await?
        .map_err(|e| CaseError(format!("{what} panicked: {e}")))?
}
