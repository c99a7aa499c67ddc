//! The sizes of one run (`--quick` or full) and the constants every
//! scenario shares.

use std::time::Duration;

/// What a scenario returns; the message says what failed.
pub type BenchResult<T> = Result<T, String>;

/// TTL of the uncontended and handoff locks: long enough that none expires
/// during a run.
pub const TTL: Duration = Duration::from_secs(10);

/// The limit of the semaphores the uncontended permit rows take a permit
/// of (each fresh, so never full).
pub const PERMIT_LIMIT: u32 = 3;

/// Handoffs run before the measured ones (connections, subscriptions).
pub const WARMUP_HANDOFFS: usize = 10;

/// Sizes of one run.
#[derive(Debug, Clone)]
pub struct Plan {
    pub quick: bool,
    /// Interleaved rounds of (library batch, raw batch, ping batch).
    pub rounds: usize,
    /// Operations per batch with 1 task.
    pub batch_1: usize,
    /// Operations per task per batch with 64 tasks.
    pub batch_64_per_task: usize,
    /// Handoffs measured per W (after a warm-up).
    pub handoffs: usize,
    pub waiters: Vec<usize>,
    pub hold: Duration,
    pub guards: Vec<usize>,
    pub renewal_window: Duration,
    pub renewal_ttl: Duration,
}

impl Plan {
    pub fn new(quick: bool) -> Self {
        if quick {
            Plan {
                quick,
                rounds: 4,
                batch_1: 100,
                batch_64_per_task: 4,
                handoffs: 60,
                waiters: vec![1, 16, 64],
                hold: Duration::from_millis(10),
                guards: vec![1, 1000],
                renewal_window: Duration::from_secs(4),
                renewal_ttl: Duration::from_secs(3),
            }
        } else {
            Plan {
                quick,
                rounds: 12,
                batch_1: 250,
                batch_64_per_task: 8,
                handoffs: 300,
                waiters: vec![1, 16, 64],
                hold: Duration::from_millis(10),
                guards: vec![1, 1000, 10_000],
                renewal_window: Duration::from_secs(30),
                renewal_ttl: Duration::from_secs(15),
            }
        }
    }
}
