//! Crowds (issue 28, target 7): many tasks of one process take turns on
//! few keys through the job-facing API, `Locker::acquire` with a 20 s wait
//! and the default renewing guard, hold, then release, for a fixed time.
//!
//! Each scenario has one client shared by all its tasks (a process with
//! many workers, as the probe), on a multi-thread tokio runtime of
//! its own ([`CROWD_WORKERS`] workers, pinned with the process to CPU 0).
//! The same runtime first times the raw driver's acquire write alone and a
//! plain round trip, interleaved: the baseline the handoff rate is held to.
//!
//! Every acquire called before the deadline runs to its end (the crowd
//! drains, nobody requeues), so a waiter starved while others came and
//! went shows its whole wait. A per-key flag, set after an acquire
//! returns a guard and cleared before its release, counts overlapping
//! holders (must be 0). To show how the turns went, each key also records
//! its last holder (a re-take: the task that just released acquired again
//! before any waiter, so the woken one lost its turn) and when its last
//! release was called (the handoff gap; a long one: a wake-up lost, the
//! next holder woken only by a timer).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock::{ErrorKind, LockClient, LockKey, LockOptions, Locker, MemoryLock};
use serde_json::json;

use crate::baseline::Baseline;
use crate::plan::{BenchResult, Plan, TTL};
use crate::probe::{self, Probe, ServerCount};
use crate::raw::Raw;
use crate::raw_crowd;
use crate::report::{Row, Samples};
use crate::servers::{self, Backend, Server};

/// Worker threads of the crowd's runtime (both on CPU 0 with the process).
pub const CROWD_WORKERS: usize = 2;

/// How long each acquire waits before giving up.
const WAIT: Duration = Duration::from_secs(20);

/// Share of `1 / (hold + raw acquire write + 1 round trip)` a one-key
/// crowd must hand off per second (target 7).
const RATE_SHARE: f64 = 0.6;

/// How much longer than FIFO order (waiters x mean handoff time) the
/// longest wait may be (target 7).
const FIFO_SLACK: f64 = 1.5;

/// The p99 wait the many-key crowd must stay under (target 7).
const MANY_KEYS_P99: Duration = Duration::from_secs(1);

/// Pause after an acquire or release error before the task goes on, so a
/// failing server is not hammered in a loop.
const ERROR_PAUSE: Duration = Duration::from_millis(10);

/// Interleaved rounds of the baseline (ping batch, raw acquire batch).
const BASELINE_ROUNDS: usize = 5;

/// One crowd: `tasks` tasks spread evenly over `keys` keys.
#[derive(Debug, Clone, Copy)]
struct Scenario {
    param: &'static str,
    tasks: usize,
    keys: usize,
    hold: Duration,
}

const SCENARIOS: [Scenario; 2] = [
    Scenario {
        param: "256/1key",
        tasks: 256,
        keys: 1,
        hold: Duration::from_millis(1),
    },
    Scenario {
        param: "512/64key",
        tasks: 512,
        keys: 64,
        hold: Duration::from_millis(5),
    },
];

/// The crowd rows of `server`: the baseline, then each scenario. Builds
/// and drops the crowd's own runtime (call it outside any runtime).
pub fn rows(plan: &Plan, server: &Server) -> BenchResult<Vec<Row>> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(CROWD_WORKERS)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let rows = runtime.block_on(crowd_rows(plan, server));
    // Background work of the clients (renewals, give-backs) is done or moot.
    runtime.shutdown_timeout(Duration::from_secs(5));
    rows
}

async fn crowd_rows(plan: &Plan, server: &Server) -> BenchResult<Vec<Row>> {
    let backend = server.backend;
    let mut rows = Vec::new();
    let baseline = match backend {
        Backend::Memory => None,
        _ => {
            let raw = Raw::connect(backend, &server.url, server.port().unwrap_or(0)).await?;
            Some(Baseline::measure(&raw, plan.batch_1, BASELINE_ROUNDS).await?)
        }
    };
    if let Some(b) = &baseline {
        let mut row = b.row(backend, "crowd_baseline");
        row.note = Some(format!(
            "raw acquire write alone ({}), {} samples; round trip p50 {:.1} µs, p99 {:.1} µs; interleaved, on the crowd runtime",
            match backend {
                Backend::Redis => "SET NX PX",
                Backend::Etcd => "the put txn, lease granted before",
                _ => "the library's acquire statement",
            },
            b.acquire.us.len(),
            b.ping_p50().unwrap_or(0.0),
            b.ping.pct(0.99).unwrap_or(0.0),
        ));
        rows.push(row);
    }
    if backend == Backend::Etcd {
        rows.push(raw_crowd_row(plan, server, baseline.as_ref()).await?);
    }
    let memory = MemoryLock::new();
    let mut probe = Probe::new(backend, &server.url, server.port().unwrap_or(0)).await?;
    for scenario in SCENARIOS {
        let client = match backend {
            Backend::Memory => memory.client(),
            _ => distlock::connect(&server.url)
                .await
                .map_err(|e| format!("connecting to {}: {e}", server.url))?,
        };
        let client0 = servers::proc_cpu_ns(std::process::id());
        let server0 = server.cpu_ns().unwrap_or(0);
        let count0 = probe.count().await?;
        let outcome = crowd(&client, &scenario, plan.crowd_duration, server.cpu).await?;
        let work = probe.count().await?.since(&count0);
        let cpu = (
            servers::proc_cpu_ns(std::process::id()).saturating_sub(client0),
            server.cpu_ns().unwrap_or(0).saturating_sub(server0),
        );
        rows.push(scenario_row(
            backend,
            &scenario,
            plan.crowd_duration,
            &outcome,
            baseline.as_ref(),
            cpu,
            &work,
        ));
        eprintln!("[{}] crowd {} done", backend.name(), scenario.param);
    }
    Ok(rows)
}

/// The raw driver's one-key crowd ([`raw_crowd`]), judged by the rate
/// target as the library's.
async fn raw_crowd_row(
    plan: &Plan,
    server: &Server,
    baseline: Option<&Baseline>,
) -> BenchResult<Row> {
    let scenario = SCENARIOS[0];
    let server0 = server.cpu_ns().unwrap_or(0);
    let busy_from = server.cpu.and_then(servers::cpu_ticks);
    let outcome =
        raw_crowd::etcd(server, scenario.tasks, scenario.hold, plan.crowd_duration).await?;
    let busy = servers::busy_share(busy_from, server.cpu.and_then(servers::cpu_ticks));
    let server_s = server.cpu_ns().unwrap_or(0).saturating_sub(server0) as f64 / 1e9;
    let rate = outcome.handoffs as f64 / plan.crowd_duration.as_secs_f64();
    let target = baseline
        .and_then(|b| b.rate_bound(scenario.hold))
        .map(|b| RATE_SHARE * b);
    let mut row = Row::new(server.backend, "crowd_raw", scenario.param);
    row.ops_per_s = Some(rate);
    row.note = Some(format!(
        "etcd's FIFO lock recipe, raw: {} tasks on 1 key, hold {:?}, {:?}; {} handoffs, overlaps {}; server CPU {:.1} s, busy {} (drain included); rate target {}: {}",
        scenario.tasks,
        scenario.hold,
        plan.crowd_duration,
        outcome.handoffs,
        outcome.overlaps,
        server_s,
        busy.map(|b| format!("{:.0}%", b * 100.0))
            .unwrap_or_else(|| "-".to_owned()),
        target.map_or_else(|| "-".to_owned(), |t| format!("{t:.0}/s")),
        target.map_or("-", |t| met(rate >= t)),
    ));
    row.extra = vec![
        ("tasks", json!(scenario.tasks)),
        ("handoffs", json!(outcome.handoffs)),
        ("overlaps", json!(outcome.overlaps)),
        ("server_cpu_s", json!(server_s)),
        ("server_cpu_busy", json!(busy)),
        ("handoff_rate_target_per_s", json!(target.map(f64::round))),
    ];
    eprintln!("[{}] raw crowd done", server.backend.name());
    Ok(row)
}

/// What one crowd measured.
#[derive(Default)]
struct Outcome {
    /// Every acquire called before the deadline, from the call to its
    /// return (with or without the lock).
    waits: Samples,
    /// Acquisitions returned by the deadline.
    handoffs: usize,
    gave_up: usize,
    errors: usize,
    overlaps: usize,
    /// How long the guards were held in all (the hold asked for, plus the
    /// timer's lateness), and how many.
    held_for: Duration,
    held: u32,
    /// Acquisitions by the key's previous holder (by the deadline).
    retakes: usize,
    /// From a release called to the key's next acquire returning (by the
    /// deadline).
    gaps: Samples,
    first_error: Option<String>,
    /// The busy share of the CPU the server is pinned to
    /// ([`servers::cpu_ticks`]), from the tasks' start to the deadline
    /// (warm-up and drain left out).
    server_busy: Option<f64>,
}

/// What a key remembers of its last turn.
#[derive(Default)]
struct Turn {
    holder: Option<usize>,
    released_at: Option<Instant>,
}

impl Outcome {
    fn error(&mut self, what: String) {
        self.errors += 1;
        self.first_error.get_or_insert(what);
    }

    fn merge(&mut self, other: Outcome) {
        self.waits.merge(other.waits);
        self.handoffs += other.handoffs;
        self.gave_up += other.gave_up;
        self.errors += other.errors;
        self.overlaps += other.overlaps;
        self.retakes += other.retakes;
        self.held_for += other.held_for;
        self.held += other.held;
        self.gaps.merge(other.gaps);
        self.first_error = self.first_error.take().or(other.first_error);
    }
}

/// Runs `scenario` for `duration` on `client` (shared by all its tasks).
async fn crowd(
    client: &LockClient,
    scenario: &Scenario,
    duration: Duration,
    server_cpu: Option<usize>,
) -> BenchResult<Outcome> {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    let locker = Locker::new(client.clone());
    let options = LockOptions::new(TTL).with_wait(WAIT);
    let mut keys = Vec::new();
    for k in 0..scenario.keys {
        let key = LockKey::new(format!("crowd-{run}-{}-{k}", scenario.param))
            .map_err(|e| e.to_string())?;
        // Warm-up: connections, subscriptions, the key's server state.
        let guard = locker
            .acquire(&key, &options)
            .await
            .map_err(|e| format!("crowd warm-up acquire: {e}"))?
            .ok_or("crowd warm-up acquire timed out")?;
        guard
            .release()
            .await
            .map_err(|e| format!("crowd warm-up release: {e}"))?;
        keys.push(key);
    }
    let held: Arc<Vec<AtomicBool>> =
        Arc::new((0..scenario.keys).map(|_| AtomicBool::new(false)).collect());
    let turns: Arc<Vec<Mutex<Turn>>> =
        Arc::new((0..scenario.keys).map(|_| Mutex::default()).collect());
    let hold_clock = Arc::new(HoldClock::default());
    let deadline = Instant::now() + duration;
    let busy_from = server_cpu.and_then(servers::cpu_ticks);
    let busy_until = tokio::spawn(async move {
        tokio::time::sleep_until(deadline.into()).await;
        server_cpu.and_then(servers::cpu_ticks)
    });
    let mut handles = Vec::new();
    for task in 0..scenario.tasks {
        let slot = task % scenario.keys;
        let (locker, key, options) = (locker.clone(), keys[slot].clone(), options.clone());
        let (held, turns, hold_clock) = (held.clone(), turns.clone(), hold_clock.clone());
        let hold = scenario.hold;
        handles.push(tokio::spawn(async move {
            let mut out = Outcome::default();
            while Instant::now() < deadline {
                let called = Instant::now();
                let attempt = locker.acquire(&key, &options).await;
                let returned = Instant::now();
                out.waits.push(returned - called);
                match attempt {
                    Ok(Some(guard)) => {
                        if held[slot].swap(true, Ordering::SeqCst) {
                            out.overlaps += 1;
                        }
                        {
                            let mut t = turns[slot].lock().unwrap_or_else(|e| e.into_inner());
                            if returned <= deadline {
                                out.handoffs += 1;
                                out.retakes += usize::from(t.holder == Some(task));
                                if let Some(released) = t.released_at {
                                    out.gaps.push(returned.saturating_duration_since(released));
                                }
                            }
                            t.holder = Some(task);
                        }
                        hold_clock.hold(returned, hold).await;
                        held[slot].store(false, Ordering::SeqCst);
                        let released_at = Instant::now();
                        out.held_for += released_at - returned;
                        out.held += 1;
                        turns[slot]
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .released_at = Some(released_at);
                        if let Err(e) = guard.release().await {
                            out.error(format!("release: {e}"));
                            tokio::time::sleep(ERROR_PAUSE).await;
                        }
                    }
                    Ok(None) => out.gave_up += 1,
                    Err(e) if e.kind() == ErrorKind::Timeout => out.gave_up += 1,
                    Err(e) => {
                        out.error(format!("acquire: {e}"));
                        tokio::time::sleep(ERROR_PAUSE).await;
                    }
                }
            }
            out
        }));
    }
    let mut all = Outcome::default();
    for h in handles {
        all.merge(h.await.map_err(|e| e.to_string())?);
    }
    let busy_until = busy_until.await.map_err(|e| e.to_string())?;
    all.server_busy = servers::busy_share(busy_from, busy_until);
    Ok(all)
}

/// Holds a lock for the scenario's hold, off the runtime: tokio's timer
/// ticks in whole milliseconds, so its 1 ms sleep lasted 2.1 ms on
/// average (alone a cap of 470 handoffs/s, below the target's bound); a
/// thread's sleep is precise to tens of µs. The task resumes some 0.1 ms
/// after the thread wakes (measured means of 1.13 to 1.16 ms for a 1 ms
/// hold), so the thread wakes that much early: the mean of that lateness
/// over the run so far. The row reports the hold measured either way.
#[derive(Debug, Default)]
pub struct HoldClock {
    /// How late the task resumed after its thread's deadline, a running
    /// mean (each new lateness weighs 1/8), in ns.
    late_ns: AtomicU64,
}

impl HoldClock {
    /// Holds from `from` (the acquire's return) for `hold`.
    pub async fn hold(&self, from: Instant, hold: Duration) {
        let until = from + hold;
        // Never more than half the hold early: a stalled machine's lateness
        // must not turn into no hold at all.
        let early = Duration::from_nanos(self.late_ns.load(Ordering::Relaxed)).min(hold / 2);
        let wake = until - early;
        let sleep = move || std::thread::sleep(wake.saturating_duration_since(Instant::now()));
        if tokio::task::spawn_blocking(sleep).await.is_err() {
            // The blocking pool is shutting down: hold on the runtime's timer.
            tokio::time::sleep_until(until.into()).await;
            return;
        }
        let late = u64::try_from(Instant::now().saturating_duration_since(wake).as_nanos())
            .unwrap_or(u64::MAX);
        // A lost update between tasks only delays the mean's convergence.
        let mean = self.late_ns.load(Ordering::Relaxed);
        let next = mean - mean / 8 + late / 8;
        self.late_ns.store(next, Ordering::Relaxed);
    }
}

fn secs(us: f64) -> String {
    format!("{:.3} s", us / 1e6)
}

fn met(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "NOT MET"
    }
}

/// The row of one scenario, with its targets judged.
fn scenario_row(
    backend: Backend,
    scenario: &Scenario,
    duration: Duration,
    outcome: &Outcome,
    baseline: Option<&Baseline>,
    (client_ns, server_ns): (u64, u64),
    work: &ServerCount,
) -> Row {
    let waits = &outcome.waits;
    let rate = outcome.handoffs as f64 / duration.as_secs_f64();
    let longest = waits.pct(1.0).unwrap_or(0.0);
    // FIFO order: a waiter waits for the others of its key, each one mean
    // handoff time (the key's share of the run per acquisition);
    // tasks/keys x keys x duration / handoffs.
    let fifo_bound_us = FIFO_SLACK * scenario.tasks as f64 * duration.as_secs_f64() * 1e6
        / outcome.handoffs.max(1) as f64;
    // Memory has no raw driver: its bound is the hold alone.
    let rate_bound = match baseline {
        Some(b) => b.rate_bound(scenario.hold),
        None => Some(1.0 / scenario.hold.as_secs_f64()),
    };
    let rate_target = rate_bound.map(|b| RATE_SHARE * b);
    // The bound with the hold as measured (a sleep overshoots), for
    // comparison.
    let mean_hold = outcome.held_for / outcome.held.max(1);
    let measured_bound = match baseline {
        Some(b) => b.rate_bound(mean_hold),
        None => Some(1.0 / mean_hold.as_secs_f64().max(1e-6)),
    };
    let p99 = waits.pct(0.99).unwrap_or(0.0);
    let one_key = scenario.keys == 1;

    let mut row = Row::new(backend, "crowd", scenario.param);
    row.p50_us = waits.pct(0.5);
    row.p99_us = waits.pct(0.99);
    row.ops_per_s = Some(rate);
    let mut note = format!(
        "{} tasks on {} key(s), 1 client, hold {:?} (measured mean {:.2} ms), {:?}; {} handoffs, wait longest {}, gave up {}, errors {}, overlaps {}; re-takes by the last holder {:.0}%, handoff gap p50 {:.2} ms, max {:.1} ms; CPU s client {:.1}, server {:.1}; server's CPU busy {} until the deadline (/proc/stat, its kernel work included); targets: ",
        scenario.tasks,
        scenario.keys,
        scenario.hold,
        mean_hold.as_secs_f64() * 1e3,
        duration,
        outcome.handoffs,
        secs(longest),
        outcome.gave_up,
        outcome.errors,
        outcome.overlaps,
        100.0 * outcome.retakes as f64 / outcome.handoffs.max(1) as f64,
        outcome.gaps.pct(0.5).unwrap_or(0.0) / 1e3,
        outcome.gaps.pct(1.0).unwrap_or(0.0) / 1e3,
        client_ns as f64 / 1e9,
        server_ns as f64 / 1e9,
        outcome
            .server_busy
            .map(|b| format!("{:.0}%", b * 100.0))
            .unwrap_or_else(|| "-".to_owned()),
    );
    let mut targets = serde_json::Map::new();
    if one_key {
        if let Some(target) = rate_target {
            note.push_str(&format!(
                "(1) {rate:.0}/s >= {target:.0}/s ({:.0}% of {:.0}): {} (60% of the bound with the measured hold: {:.0}/s); ",
                RATE_SHARE * 100.0,
                target / RATE_SHARE,
                met(rate >= target),
                measured_bound.unwrap_or(0.0) * RATE_SHARE,
            ));
            targets.insert("handoff_rate".into(), json!(rate >= target));
        }
    }
    note.push_str(&format!(
        "(2) none gave up: {}; ",
        met(outcome.gave_up == 0)
    ));
    targets.insert("none_gave_up".into(), json!(outcome.gave_up == 0));
    let fifo = longest <= fifo_bound_us;
    if one_key {
        note.push_str(&format!(
            "(3) longest {} <= {}: {}",
            secs(longest),
            secs(fifo_bound_us),
            met(fifo)
        ));
        targets.insert("longest_within_fifo".into(), json!(fifo));
    } else {
        let under = p99 < MANY_KEYS_P99.as_secs_f64() * 1e6;
        note.push_str(&format!(
            "(4) p99 {} < {:?}: {} (longest vs 1.5x FIFO {}: {})",
            secs(p99),
            MANY_KEYS_P99,
            met(under),
            secs(fifo_bound_us),
            if fifo { "within" } else { "beyond" }
        ));
        targets.insert("p99_under_1s".into(), json!(under));
    }
    let safe = outcome.errors == 0 && outcome.overlaps == 0;
    targets.insert("no_errors_no_overlaps".into(), json!(safe));
    // The server's own count (read before and after, so it includes the
    // warm-up and the drain): what a handoff costs it, and where.
    let per_handoff = outcome.handoffs.max(1) as f64;
    if let Some(total) = work.total {
        note.push_str(&format!(
            "; server work per handoff {:.2} ({}; {})",
            total as f64 / per_handoff,
            probe::source(backend, work, per_handoff),
            work.top(per_handoff, 4)
        ));
    }
    if let Some(e) = &outcome.first_error {
        note.push_str(&format!("; first error: {e}"));
    }
    row.note = Some(note);
    row.extra = vec![
        ("tasks", json!(scenario.tasks)),
        ("keys", json!(scenario.keys)),
        ("hold_ms", json!(scenario.hold.as_secs_f64() * 1e3)),
        ("duration_s", json!(duration.as_secs_f64())),
        ("handoffs", json!(outcome.handoffs)),
        ("acquires", json!(waits.us.len())),
        ("wait_longest_us", json!(longest.round())),
        ("wait_mean_us", json!(waits.mean().map(f64::round))),
        ("gave_up", json!(outcome.gave_up)),
        ("errors", json!(outcome.errors)),
        ("overlaps", json!(outcome.overlaps)),
        ("retakes", json!(outcome.retakes)),
        (
            "handoff_gap_p50_us",
            json!(outcome.gaps.pct(0.5).map(f64::round)),
        ),
        (
            "handoff_gap_max_us",
            json!(outcome.gaps.pct(1.0).map(f64::round)),
        ),
        ("fifo_longest_bound_us", json!(fifo_bound_us.round())),
        (
            "handoff_rate_bound_per_s",
            json!(rate_bound.map(f64::round)),
        ),
        (
            "hold_measured_mean_us",
            json!((mean_hold.as_secs_f64() * 1e6).round()),
        ),
        (
            "handoff_rate_bound_measured_hold_per_s",
            json!(measured_bound.map(f64::round)),
        ),
        ("client_cpu_s", json!(client_ns as f64 / 1e9)),
        ("server_cpu_s", json!(server_ns as f64 / 1e9)),
        ("server_cpu_busy", json!(outcome.server_busy)),
        (
            "server_work_per_handoff",
            json!(work.total.map(|t| t as f64 / per_handoff)),
        ),
    ];
    row.targets = targets;
    row
}
