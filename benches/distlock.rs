//! distlock benchmark: every backend beside its raw driver, in one run.
//!
//! ```text
//! cargo bench --features full --bench distlock -- --quick   # < 3 min
//! cargo bench --features full --bench distlock              # full run
//! ```
//!
//! Starts Redis, etcd and PostgreSQL like the conformance harness (free
//! loopback ports, temporary directories), pins them to CPU 1 and itself to
//! CPU 0 (`taskset`), and measures for memory, Redis, etcd and PostgreSQL:
//! uncontended try-acquire + release beside the raw commands and a plain
//! round trip; handoff latency with W waiters; server work per handoff;
//! renewal cost of H held guards (each H in a child process, so resident
//! memory is measured from a clean heap). Prints a table and writes
//! `target/distlock-bench.json`.

#[path = "distlock/counting.rs"]
mod counting;
#[path = "distlock/raw.rs"]
mod raw;
#[path = "distlock/servers.rs"]
mod servers;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock::{DistributedLock, LockKey, LockOptions, Locker, MemoryLock, Renewal};
use serde_json::{json, Value};
use tokio::sync::watch;

use counting::{Calls, Counters, Counting};
use raw::Raw;
use servers::{Backend, Server};

/// Sizes of one run.
#[derive(Debug, Clone)]
struct Plan {
    quick: bool,
    /// Interleaved rounds of (library batch, raw batch, ping batch).
    rounds: usize,
    /// Operations per batch with 1 task.
    batch_1: usize,
    /// Operations per task per batch with 64 tasks.
    batch_64_per_task: usize,
    /// Handoffs measured per W (after a warm-up).
    handoffs: usize,
    waiters: Vec<usize>,
    hold: Duration,
    guards: Vec<usize>,
    renewal_window: Duration,
    renewal_ttl: Duration,
}

impl Plan {
    fn new(quick: bool) -> Self {
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

const TTL: Duration = Duration::from_secs(10);
const WARMUP_HANDOFFS: usize = 10;

/// One output row.
#[derive(Debug, Clone, Default)]
struct Row {
    backend: &'static str,
    scenario: &'static str,
    param: String,
    p50_us: Option<f64>,
    p99_us: Option<f64>,
    ops_per_s: Option<f64>,
    ratio_vs_raw: Option<f64>,
    round_trips: Option<f64>,
    note: Option<String>,
}

impl Row {
    fn new(backend: Backend, scenario: &'static str, param: impl Into<String>) -> Self {
        Row {
            backend: backend.name(),
            scenario,
            param: param.into(),
            ..Row::default()
        }
    }

    fn json(&self) -> Value {
        json!({
            "backend": self.backend,
            "scenario": self.scenario,
            "param": self.param,
            "p50_us": self.p50_us.map(round1),
            "p99_us": self.p99_us.map(round1),
            "ops_per_s": self.ops_per_s.map(round1),
            "ratio_vs_raw": self.ratio_vs_raw.map(round3),
            "round_trips": self.round_trips.map(round3),
            "note": self.note,
        })
    }
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}
fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Latency samples.
#[derive(Debug, Default, Clone)]
struct Samples {
    us: Vec<f64>,
    ops: usize,
    busy: Duration,
    /// CPU ns used by this process / the server during the batches.
    client_ns: u64,
    server_ns: u64,
}

impl Samples {
    fn push(&mut self, d: Duration) {
        self.us.push(d.as_secs_f64() * 1e6);
    }
    fn merge(&mut self, other: Samples) {
        self.us.extend(other.us);
        self.ops += other.ops;
        self.busy += other.busy;
        self.client_ns += other.client_ns;
        self.server_ns += other.server_ns;
    }

    /// "CPU µs/op client C, server S".
    fn cpu_note(&self, server: bool) -> String {
        let per_op = |ns: u64| ns as f64 / 1e3 / self.ops.max(1) as f64;
        if server {
            format!(
                "CPU µs/op: client {:.1}, server {:.1}",
                per_op(self.client_ns),
                per_op(self.server_ns)
            )
        } else {
            format!("CPU µs/op: {:.1}", per_op(self.client_ns))
        }
    }
    fn pct(&self, p: f64) -> Option<f64> {
        if self.us.is_empty() {
            return None;
        }
        let mut v = self.us.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let i = ((v.len() as f64 - 1.0) * p).round() as usize;
        Some(v[i.min(v.len() - 1)])
    }
    fn ops_per_s(&self) -> Option<f64> {
        (self.busy > Duration::ZERO).then(|| self.ops as f64 / self.busy.as_secs_f64())
    }
}

type BenchResult<T> = Result<T, String>;

fn main() -> std::process::ExitCode {
    if let Ok(spec) = std::env::var("DISTLOCK_BENCH_RENEWAL_CHILD") {
        return renewal_child(&spec);
    }
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    match run(Plan::new(quick)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("distlock bench failed: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|s| s.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_else(|| "?".to_owned())
}

fn run(plan: Plan) -> BenchResult<()> {
    let started = Instant::now();
    let ncpu = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let pin = ncpu >= 2;
    let mut servers = Vec::new();
    for backend in Backend::ALL {
        servers.push(Server::start(backend, pin.then_some(1))?);
    }
    let own_pin = if pin && servers::taskset_all(std::process::id(), 0) {
        format!(
            "bench process pinned to CPU 0 (Cpus_allowed_list {})",
            servers::own_cpus()
        )
    } else {
        format!(
            "bench process NOT pinned (Cpus_allowed_list {})",
            servers::own_cpus()
        )
    };
    // One worker thread: the process has one CPU.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;

    let mut header = String::new();
    let _ = writeln!(
        header,
        "distlock benchmark ({} run)",
        if plan.quick { "--quick" } else { "full" }
    );
    let _ = writeln!(header, "machine: nproc {ncpu}, CPU {}", cpu_model());
    let _ = writeln!(header, "pinning: {own_pin}; tokio current_thread runtime");
    let versions = runtime.block_on(server_versions(&servers));
    for server in &servers {
        let _ = writeln!(
            header,
            "  {:<8} {} — {}",
            server.backend.name(),
            versions
                .get(server.backend.name())
                .cloned()
                .unwrap_or_default(),
            server.pinning
        );
    }
    let _ = writeln!(
        header,
        "interleaving: library / raw / ping batches alternate ({} rounds, order rotated each round)",
        plan.rounds
    );
    print!("{header}");

    let mut rows = Vec::new();
    for server in &servers {
        let t = Instant::now();
        let backend_rows = runtime.block_on(bench_backend(&plan, server))?;
        eprintln!("[{}] done in {:.1?}", server.backend.name(), t.elapsed());
        rows.extend(backend_rows);
    }
    drop(runtime);

    let table = render(&rows);
    println!("{table}");
    println!("total time {:.1?}", started.elapsed());
    let json = Value::Array(rows.iter().map(Row::json).collect());
    let target = std::env::var("CARGO_TARGET_DIR")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target").to_owned());
    let path = std::path::Path::new(&target).join("distlock-bench.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?,
    )
    .map_err(|e| format!("writing {}: {e}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

async fn server_versions(servers: &[Server]) -> BTreeMap<&'static str, String> {
    let mut out = BTreeMap::new();
    for s in servers {
        let v = match s.backend {
            Backend::Memory => Ok("in-process MemoryLock".to_owned()),
            Backend::Redis => {
                async {
                    let client = distlock::redis::redis::Client::open(s.url.as_str())
                        .map_err(|e| e.to_string())?;
                    let mut c = client
                        .get_multiplexed_async_connection()
                        .await
                        .map_err(|e| e.to_string())?;
                    let info: String = distlock::redis::redis::cmd("INFO")
                        .arg("server")
                        .query_async(&mut c)
                        .await
                        .map_err(|e| e.to_string())?;
                    Ok::<_, String>(
                        info.lines()
                            .find_map(|l| l.strip_prefix("redis_version:"))
                            .map(|v| format!("redis {}", v.trim()))
                            .unwrap_or_default(),
                    )
                }
                .await
            }
            Backend::Etcd => servers::http_get(s.port().unwrap_or(0), "/version")
                .map(|v| format!("etcd {}", v.trim())),
            Backend::Postgres => {
                async {
                    let pool = sqlx::postgres::PgPoolOptions::new()
                        .max_connections(1)
                        .connect(&s.url)
                        .await
                        .map_err(|e| e.to_string())?;
                    let v: String = sqlx::query_scalar("SHOW server_version")
                        .fetch_one(&pool)
                        .await
                        .map_err(|e| e.to_string())?;
                    pool.close().await;
                    Ok(format!("PostgreSQL {v}"))
                }
                .await
            }
        };
        out.insert(
            s.backend.name(),
            v.unwrap_or_else(|e| format!("version unknown: {e}")),
        );
    }
    out
}

/// A lock client of `backend` at `url`, counted.
async fn client(
    backend: Backend,
    url: &str,
    memory: &MemoryLock,
    counters: &Arc<Counters>,
) -> BenchResult<Arc<dyn DistributedLock>> {
    let inner: Arc<dyn DistributedLock> = match backend {
        Backend::Memory => memory.client(),
        _ => distlock::connect(url)
            .await
            .map_err(|e| format!("connecting to {url}: {e}"))?,
    };
    Ok(Arc::new(Counting {
        inner,
        counters: counters.clone(),
    }))
}

/// Server-side counters, as far as the server offers them.
#[derive(Debug, Clone, Default)]
struct ServerCount {
    /// Commands/RPCs the server executed (None: no server-side count).
    total: Option<u64>,
    /// Redis: every command including those run inside scripts.
    all_calls: Option<u64>,
    detail: BTreeMap<String, u64>,
}

/// The commands lock-redis's scripts run inside EVALSHA.
const REDIS_SCRIPT_INNER: &[&str] = &[
    "type", "get", "set", "del", "pttl", "pexpire", "publish", "time",
];

struct Probe {
    backend: Backend,
    port: u16,
    redis: Option<distlock::redis::redis::aio::MultiplexedConnection>,
}

impl Probe {
    async fn new(backend: Backend, url: &str, port: u16) -> BenchResult<Self> {
        let redis = match backend {
            Backend::Redis => {
                let client =
                    distlock::redis::redis::Client::open(url).map_err(|e| e.to_string())?;
                Some(
                    client
                        .get_multiplexed_async_connection()
                        .await
                        .map_err(|e| e.to_string())?,
                )
            }
            _ => None,
        };
        Ok(Probe {
            backend,
            port,
            redis,
        })
    }

    /// Redis: `INFO commandstats` calls (excluding the INFO calls of this
    /// probe; commands run inside scripts are counted too). etcd: gRPC
    /// requests started (`grpc_server_started_total`). Others: none.
    async fn count(&mut self) -> BenchResult<ServerCount> {
        match self.backend {
            Backend::Redis => {
                let Some(conn) = self.redis.as_mut() else {
                    return Ok(ServerCount::default());
                };
                let info: String = distlock::redis::redis::cmd("INFO")
                    .arg("commandstats")
                    .query_async(conn)
                    .await
                    .map_err(|e| e.to_string())?;
                let mut detail = servers::parse_commandstats(&info);
                detail.remove("info");
                // Commands the lock scripts call inside EVALSHA: server
                // work, but not round trips.
                let inner: u64 = detail
                    .iter()
                    .filter(|(k, _)| REDIS_SCRIPT_INNER.contains(&k.as_str()))
                    .map(|(_, v)| *v)
                    .sum();
                let all: u64 = detail.values().sum();
                Ok(ServerCount {
                    total: Some(all - inner),
                    all_calls: Some(all),
                    detail,
                })
            }
            Backend::Etcd => {
                let port = self.port;
                let detail = tokio::task::spawn_blocking(move || servers::etcd_grpc_started(port))
                    .await
                    .map_err(|e| e.to_string())??;
                Ok(ServerCount {
                    total: Some(detail.values().sum()),
                    all_calls: None,
                    detail,
                })
            }
            _ => Ok(ServerCount::default()),
        }
    }
}

fn delta(after: &ServerCount, before: &ServerCount) -> ServerCount {
    let mut detail = BTreeMap::new();
    for (k, v) in &after.detail {
        let d = v - before.detail.get(k).copied().unwrap_or(0).min(*v);
        if d > 0 {
            detail.insert(k.clone(), d);
        }
    }
    ServerCount {
        total: after
            .total
            .zip(before.total)
            .map(|(a, b)| a.saturating_sub(b)),
        all_calls: after
            .all_calls
            .zip(before.all_calls)
            .map(|(a, b)| a.saturating_sub(b)),
        detail,
    }
}

async fn bench_backend(plan: &Plan, server: &Server) -> BenchResult<Vec<Row>> {
    let backend = server.backend;
    let memory = MemoryLock::new();
    let counters = Arc::new(Counters::default());
    let lib = client(backend, &server.url, &memory, &counters).await?;
    let raw = match backend {
        Backend::Memory => None,
        _ => Some(Raw::connect(backend, &server.url, server.port().unwrap_or(0)).await?),
    };
    let mut rows = Vec::new();

    // 1. Uncontended.
    let mut ping_p50 = None;
    for tasks in [1usize, 64] {
        let (lib_s, raw_s, ping_s) = uncontended(plan, server, &lib, raw.as_ref(), tasks).await?;
        let raw_ops = raw_s.as_ref().and_then(Samples::ops_per_s);
        let lib_ops = lib_s.ops_per_s();
        let ops_ratio = raw_ops.zip(lib_ops).map(|(r, l)| r / l);
        let ratio = raw_s
            .as_ref()
            .and_then(|r| r.pct(0.5))
            .zip(lib_s.pct(0.5))
            .map(|(r, l)| l / r);
        if tasks == 1 {
            ping_p50 = ping_s.as_ref().and_then(|p| p.pct(0.5));
        }
        let mut row = Row::new(backend, "uncontended_library", format!("tasks={tasks}"));
        row.p50_us = lib_s.pct(0.5);
        row.p99_us = lib_s.pct(0.99);
        row.ops_per_s = lib_ops;
        row.ratio_vs_raw = ratio;
        row.round_trips = ping_p50.zip(lib_s.pct(0.5)).map(|(p, l)| l / p);
        row.note = Some(match ops_ratio {
            Some(r) => format!("ops/s ratio {r:.2}; {}", lib_s.cpu_note(true)),
            None => lib_s.cpu_note(false),
        });
        rows.push(row);
        if let Some(raw_s) = raw_s {
            let mut row = Row::new(backend, "uncontended_raw", format!("tasks={tasks}"));
            row.p50_us = raw_s.pct(0.5);
            row.p99_us = raw_s.pct(0.99);
            row.ops_per_s = raw_ops;
            row.round_trips = ping_p50.zip(raw_s.pct(0.5)).map(|(p, l)| l / p);
            row.note = Some(raw_s.cpu_note(true));
            rows.push(row);
        }
        if let Some(ping_s) = ping_s {
            let mut row = Row::new(backend, "round_trip", format!("tasks={tasks}"));
            row.p50_us = ping_s.pct(0.5);
            row.p99_us = ping_s.pct(0.99);
            row.ops_per_s = ping_s.ops_per_s();
            row.round_trips = Some(1.0);
            row.note = Some(
                match backend {
                    Backend::Redis => "PING",
                    Backend::Etcd => "Range (get)",
                    Backend::Postgres => "SELECT 1",
                    Backend::Memory => "",
                }
                .to_owned(),
            );
            rows.push(row);
        }
    }
    eprintln!("[{}] uncontended done", backend.name());

    // 2 + 3. Handoff latency and server work per handoff.
    let max_w = plan.waiters.iter().copied().max().unwrap_or(1);
    let mut clients = Vec::new();
    for _ in 0..=max_w {
        clients.push(client(backend, &server.url, &memory, &counters).await?);
    }
    let mut probe = Probe::new(backend, &server.url, server.port().unwrap_or(0)).await?;
    for &w in &plan.waiters {
        let outcome = handoff(plan, &clients[..=w], &counters, &mut probe, w).await?;
        let mut row = Row::new(backend, "handoff", format!("W={w}"));
        row.p50_us = outcome.latency.pct(0.5);
        row.p99_us = outcome.latency.pct(0.99);
        row.ops_per_s = None;
        row.round_trips = ping_p50.zip(row.p50_us).map(|(p, l)| l / p);
        row.note = Some(format!(
            "{} handoffs, hold {:?}, p99 {}",
            outcome.latency.us.len(),
            plan.hold,
            ping_p50
                .zip(row.p99_us)
                .map(|(p, l)| format!("{:.1} round trips", l / p))
                .unwrap_or_else(|| "-".to_owned())
        ));
        rows.push(row);
        let n = outcome.handoffs as f64;
        let calls = outcome.calls;
        let mut row = Row::new(backend, "client_calls_per_handoff", format!("W={w}"));
        row.round_trips = Some(calls.ops() as f64 / n);
        row.note = Some(format!(
            "try_acquire {:.2}, release {:.2}, extend {:.2}, watch {:.2} per handoff (counted at the client)",
            calls.try_acquire as f64 / n,
            calls.release as f64 / n,
            calls.extend as f64 / n,
            calls.watch as f64 / n
        ));
        rows.push(row);
        let mut row = Row::new(backend, "server_work_per_handoff", format!("W={w}"));
        match outcome.server.total {
            Some(total) => {
                row.round_trips = Some(total as f64 / n);
                let mut detail: Vec<_> = outcome.server.detail.iter().collect();
                detail.sort_by(|a, b| b.1.cmp(a.1));
                row.note = Some(format!(
                    "{}: {}",
                    match (backend, outcome.server.all_calls) {
                        (Backend::Redis, Some(all)) => format!(
                            "redis commands sent (INFO commandstats minus those run inside the scripts); {:.2} incl. inside scripts",
                            all as f64 / n
                        ),
                        _ => "etcd gRPC requests (grpc_server_started_total)".to_owned(),
                    },
                    detail
                        .iter()
                        .take(6)
                        .map(|(k, v)| format!("{k} {:.2}", **v as f64 / n))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            None => {
                // One statement per lock call; the pool's health-check ping
                // before each statement is not counted here.
                row.round_trips = Some(calls.ops() as f64 / n);
                row.note = Some(match backend {
                    Backend::Postgres => "lock statements counted at the client (no pg_stat_statements without a config change); excludes sqlx's test-before-acquire ping per statement".to_owned(),
                    _ => "backend calls counted at the client (in-process)".to_owned(),
                });
            }
        }
        rows.push(row);
        eprintln!("[{}] handoff W={w} done", backend.name());
    }
    drop(clients);

    // 4. Renewal, each H in a fresh child process.
    for &h in &plan.guards {
        let r = renewal_in_child(plan, server, h)?;
        let mut row = Row::new(backend, "renewal_server_rt_per_period", format!("H={h}"));
        row.round_trips = Some(r.server_per_period);
        row.note = Some(format!(
            "{} per renewal period {:?} (TTL {:?}) = {:.2} per guard; client extends/period {:.1}; {} of {h} guards lost; rss/guard {:.0} B; acquiring all took {:.1} s",
            r.source, plan.renewal_ttl / 3, plan.renewal_ttl, r.server_per_period / h as f64, r.extends_per_period, r.lost, r.rss_per_guard, r.acquire_secs
        ));
        rows.push(row);
        let mut row = Row::new(backend, "renewal_rss_per_guard_bytes", format!("H={h}"));
        row.round_trips = None;
        row.note = Some(format!("{:.0}", r.rss_per_guard));
        rows.push(row);
        eprintln!("[{}] renewal H={h} done", backend.name());
    }
    Ok(rows)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Lib,
    Raw,
    Ping,
}

/// Uncontended try-acquire + release of fresh keys with `tasks` concurrent
/// tasks, library / raw / ping batches interleaved.
async fn uncontended(
    plan: &Plan,
    server: &Server,
    lib: &Arc<dyn DistributedLock>,
    raw: Option<&Raw>,
    tasks: usize,
) -> BenchResult<(Samples, Option<Samples>, Option<Samples>)> {
    let backend = server.backend;
    let mut kinds = vec![Kind::Lib];
    if raw.is_some() {
        kinds.extend([Kind::Raw, Kind::Ping]);
    }
    let mut out: BTreeMap<u8, Samples> = BTreeMap::new();
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    // Warm-up (connections, pools, prepared statements), not recorded.
    for kind in &kinds {
        run_batch(*kind, backend, lib, raw, tasks.min(8), 4, &SEQ).await?;
    }
    for round in 0..plan.rounds {
        for i in 0..kinds.len() {
            let kind = kinds[(i + round) % kinds.len()];
            let per_task = if tasks == 1 {
                plan.batch_1
            } else {
                plan.batch_64_per_task
            };
            let client0 = servers::proc_cpu_ns(std::process::id());
            let server0 = server.cpu_ns().unwrap_or(0);
            let mut s = run_batch(kind, backend, lib, raw, tasks, per_task, &SEQ).await?;
            s.client_ns = servers::proc_cpu_ns(std::process::id()).saturating_sub(client0);
            s.server_ns = server.cpu_ns().unwrap_or(0).saturating_sub(server0);
            out.entry(kind as u8).or_default().merge(s);
        }
    }
    Ok((
        out.remove(&(Kind::Lib as u8)).unwrap_or_default(),
        out.remove(&(Kind::Raw as u8)),
        out.remove(&(Kind::Ping as u8)),
    ))
}

async fn run_batch(
    kind: Kind,
    backend: Backend,
    lib: &Arc<dyn DistributedLock>,
    raw: Option<&Raw>,
    tasks: usize,
    per_task: usize,
    seq: &'static std::sync::atomic::AtomicU64,
) -> BenchResult<Samples> {
    let started = Instant::now();
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let lib = lib.clone();
        let raw = raw.cloned();
        handles.push(tokio::spawn(async move {
            let mut s = Samples::default();
            for _ in 0..per_task {
                let n = seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let key = format!("u{n}");
                let t = Instant::now();
                match kind {
                    Kind::Lib => {
                        let key = LockKey::new(key).map_err(|e| e.to_string())?;
                        let lease = lib
                            .try_acquire(&key, TTL)
                            .await
                            .map_err(|e| format!("{} try_acquire: {e}", backend.name()))?
                            .lease()
                            .ok_or_else(|| format!("fresh key {key} was held"))?;
                        lib.release(&lease)
                            .await
                            .map_err(|e| format!("{} release: {e}", backend.name()))?;
                    }
                    Kind::Raw => {
                        if let Some(raw) = &raw {
                            raw.acquire_release(&key, n, TTL).await?;
                        }
                    }
                    Kind::Ping => {
                        if let Some(raw) = &raw {
                            raw.ping().await?;
                        }
                    }
                }
                s.push(t.elapsed());
                s.ops += 1;
            }
            Ok::<_, String>(s)
        }));
    }
    let mut all = Samples::default();
    for h in handles {
        all.merge(h.await.map_err(|e| e.to_string())??);
    }
    all.busy = started.elapsed();
    Ok(all)
}

struct HandoffOutcome {
    latency: Samples,
    handoffs: usize,
    calls: Calls,
    server: ServerCount,
}

#[derive(Default)]
struct HandoffState {
    released_at: Option<Instant>,
    acquisitions: usize,
    latency: Samples,
    calls_at_start: Option<Calls>,
    calls_at_end: Option<Calls>,
}

/// W waiters (each its own client, so its own connections) and one holder
/// cycle through one key. After releasing, a worker waits until someone else
/// acquired before it queues again, so every handoff goes to a waiter that
/// was already waiting.
async fn handoff(
    plan: &Plan,
    clients: &[Arc<dyn DistributedLock>],
    counters: &Arc<Counters>,
    probe: &mut Probe,
    w: usize,
) -> BenchResult<HandoffOutcome> {
    static RUN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let run = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let key = LockKey::new(format!("handoff-{run}-w{w}")).map_err(|e| e.to_string())?;
    let options = LockOptions::new(TTL)
        .wait(Duration::from_secs(120))
        .renewal(Renewal::Off);
    let state = Arc::new(Mutex::new(HandoffState::default()));
    let (gen_tx, gen_rx) = watch::channel(0usize);
    let gen_tx = Arc::new(gen_tx);
    let target = WARMUP_HANDOFFS + plan.handoffs;
    // The probe is read at acquisition number WARMUP and WARMUP + handoffs,
    // by the acquirer, while it holds the lock (before its hold time).
    let (probe_tx, mut probe_rx) =
        tokio::sync::mpsc::channel::<tokio::sync::oneshot::Sender<()>>(2);
    let mut handles = Vec::new();
    for c in clients {
        let locker = Locker::new(c.clone());
        let key = key.clone();
        let options = options.clone();
        let state = state.clone();
        let gen_tx = gen_tx.clone();
        let mut gen_rx = gen_rx.clone();
        let counters = counters.clone();
        let probe_tx = probe_tx.clone();
        let hold = plan.hold;
        handles.push(tokio::spawn(async move {
            loop {
                let guard = locker
                    .acquire(&key, &options)
                    .await
                    .map_err(|e| format!("handoff acquire: {e}"))?
                    .ok_or("handoff acquire timed out")?;
                let now = Instant::now();
                let n = {
                    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
                    s.acquisitions += 1;
                    let n = s.acquisitions;
                    let released = s.released_at.take();
                    let measure = n > WARMUP_HANDOFFS + 1 && n <= target + 1;
                    if measure {
                        s.latency.push(
                            released
                                .map(|r| now.saturating_duration_since(r))
                                .unwrap_or_default(),
                        );
                    }
                    if n == WARMUP_HANDOFFS + 1 {
                        s.calls_at_start = Some(counters.snapshot());
                    }
                    if n == target + 1 {
                        s.calls_at_end = Some(counters.snapshot());
                    }
                    n
                };
                if n == WARMUP_HANDOFFS + 1 || n == target + 1 {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    let _ = probe_tx.send(tx).await;
                    let _ = rx.await;
                }
                let done = n > target;
                if !done {
                    tokio::time::sleep(hold).await;
                }
                guard
                    .release()
                    .await
                    .map_err(|e| format!("handoff release: {e}"))?;
                state.lock().unwrap_or_else(|e| e.into_inner()).released_at = Some(Instant::now());
                gen_tx.send_replace(n);
                if done {
                    return Ok::<(), String>(());
                }
                // Queue again only once someone else took the lock (or the run ended).
                let mine = n;
                loop {
                    if *gen_rx.borrow_and_update() != mine {
                        break;
                    }
                    if gen_rx.changed().await.is_err() {
                        break;
                    }
                }
            }
        }));
    }
    drop(probe_tx);
    let mut counts = Vec::new();
    while let Some(reply) = probe_rx.recv().await {
        counts.push(probe.count().await?);
        let _ = reply.send(());
    }
    for h in handles {
        h.await.map_err(|e| e.to_string())??;
    }
    let s = std::mem::take(&mut *state.lock().unwrap_or_else(|e| e.into_inner()));
    let calls = match (s.calls_at_start, s.calls_at_end) {
        (Some(a), Some(b)) => b.since(&a),
        _ => Calls::default(),
    };
    let server = match counts.as_slice() {
        [a, b] => delta(b, a),
        _ => ServerCount::default(),
    };
    Ok(HandoffOutcome {
        handoffs: plan.handoffs,
        latency: s.latency,
        calls,
        server,
    })
}

/// What a renewal child reports.
struct RenewalResult {
    server_per_period: f64,
    extends_per_period: f64,
    rss_per_guard: f64,
    lost: usize,
    acquire_secs: f64,
    source: String,
}

fn renewal_in_child(plan: &Plan, server: &Server, h: usize) -> BenchResult<RenewalResult> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let spec = format!(
        "{} {} {} {} {} {}",
        server.backend.name(),
        h,
        plan.renewal_window.as_millis(),
        plan.renewal_ttl.as_millis(),
        server.port().unwrap_or(0),
        server.url
    );
    let output = std::process::Command::new(exe)
        .env("DISTLOCK_BENCH_RENEWAL_CHILD", spec)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("renewal child: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .ok_or_else(|| {
            format!(
                "renewal child for {} H={h} failed: {stdout}",
                server.backend.name()
            )
        })?;
    let v: Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let f = |k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    Ok(RenewalResult {
        server_per_period: f("server_per_period"),
        extends_per_period: f("extends_per_period"),
        rss_per_guard: f("rss_per_guard"),
        lost: v.get("lost").and_then(Value::as_u64).unwrap_or(0) as usize,
        acquire_secs: f("acquire_secs"),
        source: v
            .get("source")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned(),
    })
}

fn renewal_child(spec: &str) -> std::process::ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("renewal child: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(renewal(spec)) {
        Ok(v) => {
            println!("RESULT {v}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("renewal child ({spec}): {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Holds H guards (default renewal: every TTL/3) for the window and counts
/// the server's work and this process's resident memory.
async fn renewal(spec: &str) -> BenchResult<Value> {
    let parts: Vec<&str> = spec.splitn(6, ' ').collect();
    let [name, h, window, ttl, port, url] = parts.as_slice() else {
        return Err(format!("bad spec {spec:?}"));
    };
    let backend = Backend::parse(name).ok_or("bad backend")?;
    let h: usize = h.parse().map_err(|_| "bad H")?;
    let window = Duration::from_millis(window.parse().map_err(|_| "bad window")?);
    let ttl = Duration::from_millis(ttl.parse().map_err(|_| "bad ttl")?);
    let port: u16 = port.parse().map_err(|_| "bad port")?;
    let memory = MemoryLock::new();
    let counters = Arc::new(Counters::default());
    let lib = client(backend, url, &memory, &counters).await?;
    let locker = Locker::new(lib.clone());
    let options = LockOptions::new(ttl);
    let mut probe = Probe::new(backend, url, port).await?;
    // Warm up the client, then measure from here.
    let warm = LockKey::new("renew-warm").map_err(|e| e.to_string())?;
    if let Some(g) = locker
        .try_lock(&warm, &options)
        .await
        .map_err(|e| e.to_string())?
    {
        g.release().await.map_err(|e| e.to_string())?;
    }
    let rss0 = servers::rss_bytes();
    let started = Instant::now();
    let mut guards = Vec::with_capacity(h);
    let run = std::process::id();
    let mut next = 0;
    while next < h {
        let chunk = (h - next).min(256);
        let mut handles = Vec::with_capacity(chunk);
        for i in next..next + chunk {
            let locker = locker.clone();
            let options = options.clone();
            handles.push(tokio::spawn(async move {
                let key = LockKey::new(format!("renew-{run}-{i}")).map_err(|e| e.to_string())?;
                locker
                    .try_lock(&key, &options)
                    .await
                    .map_err(|e| format!("renewal acquire: {e}"))?
                    .ok_or_else(|| format!("fresh key {key} was held"))
            }));
        }
        for handle in handles {
            guards.push(handle.await.map_err(|e| e.to_string())??);
        }
        next += chunk;
    }
    let acquire_secs = started.elapsed().as_secs_f64();
    let rss1 = servers::rss_bytes();
    let c0 = counters.snapshot();
    let s0 = probe.count().await?;
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let s1 = probe.count().await?;
    let c1 = counters.snapshot();
    let elapsed = t0.elapsed();
    let rss2 = servers::rss_bytes();
    let lost = guards.iter().filter(|g| g.is_lost()).count();
    let periods = elapsed.as_secs_f64() / (ttl / 3).as_secs_f64();
    let calls = c1.since(&c0);
    let server = delta(&s1, &s0);
    let (server_total, source) = match server.total {
        Some(t) => (
            t as f64,
            match (backend, server.all_calls) {
                (Backend::Redis, Some(all)) => format!(
                    "redis commands sent (INFO commandstats; {:.0}/period incl. inside scripts)",
                    all as f64 / periods
                ),
                _ => "etcd gRPC requests (grpc_server_started_total)".to_owned(),
            },
        ),
        None => (
            calls.ops() as f64,
            match backend {
                Backend::Postgres => "lock statements counted at the client",
                _ => "backend calls (in-process)",
            }
            .to_owned(),
        ),
    };
    // Release concurrently.
    let mut handles = Vec::new();
    while !guards.is_empty() {
        let take = guards.len().min(256);
        let batch: Vec<_> = guards.drain(..take).collect();
        for g in batch {
            handles.push(tokio::spawn(async move {
                let _ = g.release().await;
            }));
        }
        for handle in handles.drain(..) {
            let _ = handle.await;
        }
    }
    Ok(json!({
        "h": h,
        "server_per_period": server_total / periods,
        "extends_per_period": calls.extend as f64 / periods,
        "rss_per_guard": (rss1.max(rss2).saturating_sub(rss0)) as f64 / h as f64,
        "lost": lost,
        "acquire_secs": acquire_secs,
        "source": source,
        "detail": server.detail,
    }))
}

fn fmt_opt(v: Option<f64>, prec: usize) -> String {
    v.map(|x| format!("{x:.prec$}"))
        .unwrap_or_else(|| "-".to_owned())
}

fn render(rows: &[Row]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n{:<9} {:<29} {:<9} {:>9} {:>9} {:>10} {:>6} {:>8}  note",
        "backend", "scenario", "param", "p50 µs", "p99 µs", "ops/s", "ratio", "RTs"
    );
    let mut last = "";
    for r in rows {
        if r.backend != last && !last.is_empty() {
            out.push('\n');
        }
        last = r.backend;
        let _ = writeln!(
            out,
            "{:<9} {:<29} {:<9} {:>9} {:>9} {:>10} {:>6} {:>8}  {}",
            r.backend,
            r.scenario,
            r.param,
            fmt_opt(r.p50_us, 1),
            fmt_opt(r.p99_us, 1),
            fmt_opt(r.ops_per_s, 0),
            fmt_opt(r.ratio_vs_raw, 2),
            fmt_opt(r.round_trips, 2),
            r.note.as_deref().unwrap_or("")
        );
    }
    let _ = writeln!(
        out,
        "\nratio = library p50 ÷ raw p50 (1.00 = as fast as the raw commands; the note gives raw ops/s ÷ library ops/s). \
         RTs = p50 ÷ the 1-task round-trip p50 (latency rows), or server commands/RPCs/statements per handoff or per renewal period."
    );
    out
}
