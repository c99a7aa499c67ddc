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
//! uncontended try-acquire + release of a lock, and of a permit of a
//! semaphore of 3, beside the raw commands and a plain round trip; handoff
//! latency with W waiters, of a lock and of a semaphore of 1, beside the
//! raw handoff (the release telling one waiter, its acquire write); server
//! work per handoff;
//! renewal cost of H held guards (each H in a child process, so resident
//! memory is measured from a clean heap); for Redis, the job-facing pair
//! beside the `rslock` crate's and a raw fenced pair; the state a namespace
//! keeps after 10,000 distinct fired keys, and after a retention; crowds
//! (256 tasks on one key, 512 over 64 keys, through `Locker::acquire` on a
//! multi-thread runtime) beside the raw acquire write and a round trip of
//! the same run. Prints a table and writes `target/distlock-bench.json`.
//!
//! `DISTLOCK_BENCH_ONLY=redis,etcd` runs only those backends,
//! `DISTLOCK_BENCH_ROWS=peer,state` only those row groups (`uncontended`,
//! `handoff`, `renewal`, `peer`, `state`, `crowd`).
//!
//! Nothing wraps the library client while it is timed: the servers count
//! their own work (Redis `INFO commandstats`, etcd's gRPC counters,
//! PostgreSQL's `pg_stat_statements`), read between measurements; the
//! client-side counts come from untimed passes through the conformance
//! toolkit's counting `Link`.
//!
//! Modules: `plan` (run sizes), `servers` (start, pin, /proc readings),
//! `probe` (server counters and versions), `raw` (the driver baselines),
//! `baseline` (the raw write and round trip targets 3 and 7 are held to),
//! `raw_handoff` (the driver's handoff floor),
//! `uncontended`, `handoff`, `renewal`, `peer`, `state`, `crowd` (the
//! scenarios),
//! `report` (table and JSON).

#[path = "distlock/baseline.rs"]
mod baseline;
#[path = "distlock/crowd.rs"]
mod crowd;
#[path = "distlock/handoff.rs"]
mod handoff;
#[path = "distlock/peer.rs"]
mod peer;
#[path = "distlock/plan.rs"]
mod plan;
#[path = "distlock/probe.rs"]
mod probe;
#[path = "distlock/raw.rs"]
mod raw;
#[path = "distlock/raw_crowd.rs"]
mod raw_crowd;
#[path = "distlock/raw_handoff.rs"]
mod raw_handoff;
#[path = "distlock/renewal.rs"]
mod renewal;
#[path = "distlock/report.rs"]
mod report;
#[path = "distlock/servers.rs"]
mod servers;
#[path = "distlock/state.rs"]
mod state;
#[path = "distlock/uncontended.rs"]
mod uncontended;

use std::fmt::Write as _;
use std::time::Instant;

use distlock::{LockClient, MemoryLock};

use plan::{BenchResult, Plan};
use raw::Raw;
use report::Row;
use servers::{Backend, Server};

fn main() -> std::process::ExitCode {
    if let Ok(spec) = std::env::var(renewal::CHILD_ENV) {
        return renewal::child_main(&spec);
    }
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let mut plan = Plan::new(quick);
    // `DISTLOCK_BENCH_ROWS=peer,state`: only those row groups.
    let rows = std::env::var("DISTLOCK_BENCH_ROWS").unwrap_or_default();
    plan.only_rows = rows
        .split(',')
        .map(|g| g.trim().to_owned())
        .filter(|g| !g.is_empty())
        .collect();
    if let Some(bad) = plan
        .only_rows
        .iter()
        .find(|g| !plan::ROW_GROUPS.contains(&g.as_str()))
    {
        eprintln!(
            "DISTLOCK_BENCH_ROWS: no row group {bad:?} (groups: {})",
            plan::ROW_GROUPS.join(", ")
        );
        return std::process::ExitCode::FAILURE;
    }
    match run(plan) {
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
    // `DISTLOCK_BENCH_ONLY=redis,etcd`: only those backends (say, to
    // profile one); all of them otherwise.
    let only = std::env::var("DISTLOCK_BENCH_ONLY").unwrap_or_default();
    let mut servers = Vec::new();
    for backend in Backend::ALL {
        if only.is_empty() || only.split(',').any(|name| name.trim() == backend.name()) {
            servers.push(Server::start(backend, pin.then_some(1))?);
        }
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
    let versions = runtime.block_on(probe::server_versions(&servers));
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
    if plan.wants("peer") {
        let _ = writeln!(
            header,
            "peer (redis): raw fenced pair / rslock / Locker alternate in batches of {} pairs, 1 task, same pinning",
            plan::PEER_BATCH
        );
    }
    if plan.wants("crowd") {
        let _ = writeln!(
            header,
            "crowd: a multi-thread runtime of {} workers per backend (pinned with the process), one client per scenario shared by all its tasks",
            crowd::CROWD_WORKERS
        );
    }
    if !plan.only_rows.is_empty() {
        let _ = writeln!(header, "row groups: {}", plan.only_rows.join(", "));
    }
    print!("{header}");

    let mut rows = Vec::new();
    for server in &servers {
        let t = Instant::now();
        let backend_rows = runtime.block_on(bench_backend(&plan, server))?;
        rows.extend(backend_rows);
        // Its own multi-thread runtime, built outside the main one.
        if plan.wants("crowd") {
            rows.extend(crowd::rows(&plan, server)?);
        }
        eprintln!("[{}] done in {:.1?}", server.backend.name(), t.elapsed());
    }
    drop(runtime);

    let table = report::render(&rows);
    println!("{table}");
    println!("total time {:.1?}", started.elapsed());
    let path = report::write_json(&rows)?;
    println!("wrote {}", path.display());
    Ok(())
}

/// A lock client of `backend` at `url` (memory: a client of `memory`),
/// with its own connections.
async fn client(backend: Backend, url: &str, memory: &MemoryLock) -> BenchResult<LockClient> {
    match backend {
        Backend::Memory => Ok(memory.client()),
        _ => distlock::connect(url)
            .await
            .map_err(|e| format!("connecting to {url}: {e}")),
    }
}

/// Every scenario against one backend.
async fn bench_backend(plan: &Plan, server: &Server) -> BenchResult<Vec<Row>> {
    let backend = server.backend;
    let memory = MemoryLock::new();
    let lib = client(backend, &server.url, &memory).await?;
    let raw = match backend {
        Backend::Memory => None,
        _ => Some(Raw::connect(backend, &server.url, server.port().unwrap_or(0)).await?),
    };
    let (mut rows, mut ping_p50) = (Vec::new(), None);
    if plan.wants("uncontended") {
        let (uncontended, p50) = uncontended::rows(plan, server, &lib, raw.as_ref()).await?;
        (rows, ping_p50) = (uncontended, p50);
        eprintln!("[{}] uncontended done", backend.name());
    }

    if plan.wants("peer") {
        rows.extend(peer::rows(plan, server, &lib, raw.as_ref(), ping_p50).await?);
    }

    if plan.wants("handoff") {
        let max_w = plan.waiters.iter().copied().max().unwrap_or(1);
        let mut clients = Vec::new();
        for _ in 0..=max_w {
            clients.push(client(backend, &server.url, &memory).await?);
        }
        rows.extend(handoff::rows(plan, server, &clients, ping_p50).await?);
    }

    if plan.wants("renewal") {
        rows.extend(renewal::rows(plan, server)?);
    }

    if plan.wants("state") {
        let t = Instant::now();
        rows.extend(state::rows(server, raw.as_ref()).await?);
        eprintln!("[{}] state done in {:.1?}", backend.name(), t.elapsed());
    }
    Ok(rows)
}
