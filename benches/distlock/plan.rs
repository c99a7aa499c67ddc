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

/// Handoffs run before the measured ones (connections, subscriptions),
/// beyond two per waiter ([`warmup_handoffs`]).
pub const WARMUP_HANDOFFS: usize = 10;

/// Handoffs run before the measured ones with `w` waiters: each worker's
/// client opens its notification connection at its first wait, so with
/// few warm-up handoffs the measured ones counted those connections (at
/// W = 64 on PostgreSQL, 0.42 connects and 0.83 `LISTEN`s a handoff).
pub fn warmup_handoffs(w: usize) -> usize {
    WARMUP_HANDOFFS + 2 * w
}

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
    /// Pairs per contender of the Redis peer row, run in batches of
    /// [`PEER_BATCH`].
    pub peer_pairs: usize,
    /// How long each crowd scenario runs (its acquires then drain).
    pub crowd_duration: Duration,
    /// The row groups to run (`DISTLOCK_BENCH_ROWS`); empty for all.
    pub only_rows: Vec<String>,
}

/// The row groups `DISTLOCK_BENCH_ROWS` may name.
pub const ROW_GROUPS: [&str; 6] = [
    "uncontended",
    "handoff",
    "renewal",
    "peer",
    "state",
    "crowd",
];

/// Pairs per batch of the Redis peer row: the three contenders alternate
/// batch by batch.
pub const PEER_BATCH: usize = 200;

/// Distinct keys the state row fires (acquires and releases once each).
pub const STATE_KEYS: usize = 10_000;

/// Tasks firing them.
pub const STATE_TASKS: usize = 32;

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
                peer_pairs: 1_000,
                crowd_duration: Duration::from_secs(5),
                only_rows: Vec::new(),
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
                peer_pairs: 2_000,
                crowd_duration: Duration::from_secs(15),
                only_rows: Vec::new(),
            }
        }
    }

    /// Whether row group `group` (one of [`ROW_GROUPS`]) runs.
    pub fn wants(&self, group: &str) -> bool {
        self.only_rows.is_empty() || self.only_rows.iter().any(|g| g == group)
    }
}
