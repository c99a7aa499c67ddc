//! Renewal: the cost of H held guards per renewal period, and the memory
//! each guard takes. Each H runs in a child process of the bench (the same
//! executable, told so by an environment variable), so resident memory is
//! measured from a clean heap.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use distlock::{LockGuard, LockKey, LockOptions, Locker};
use distlock_conformance::fault::Link;
use serde_json::{json, Value};

use crate::plan::{BenchResult, Plan};
use crate::probe::{self, Calls, Probe};
use crate::report::Row;
use crate::servers::{self, Backend, Server};

/// The guard count target 4 is judged at (a full run's largest): at most
/// 50 requests a renewal period in all, at most 2 KB a held guard.
const TARGET_GUARDS: usize = 10_000;

/// The environment variable that makes the bench a renewal child; its value
/// is the child's spec.
pub const CHILD_ENV: &str = "DISTLOCK_BENCH_RENEWAL_CHILD";

/// What a renewal child reports.
struct RenewalResult {
    server_per_period: f64,
    extends_per_period: f64,
    rss_per_guard: f64,
    lost: usize,
    acquire_secs: f64,
    source: String,
}

/// The renewal rows for every H of the plan.
pub fn rows(plan: &Plan, server: &Server) -> BenchResult<Vec<Row>> {
    let backend = server.backend;
    let mut rows = Vec::new();
    for &h in &plan.guards {
        // A child that fails (a server too slow to grant 10,000 leases on a
        // loaded machine) costs its row, not the rest of the run.
        let r = match in_child(plan, server, h) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("[{}] renewal H={h} failed: {e}", backend.name());
                let mut row = Row::new(backend, "renewal_server_rt_per_period", format!("H={h}"));
                row.note = Some(format!("failed: {e}"));
                rows.push(row);
                continue;
            }
        };
        let mut row = Row::new(backend, "renewal_server_rt_per_period", format!("H={h}"));
        row.round_trips = Some(r.server_per_period);
        let judged = h == TARGET_GUARDS;
        row.note = Some(format!(
            "{} per renewal period {:?} (TTL {:?}) = {:.2} per guard; client extends/period {:.1}; {} of {h} guards lost; rss/guard {:.0} B; acquiring all took {:.1} s",
            r.source, plan.renewal_ttl / 3, plan.renewal_ttl, r.server_per_period / h as f64, r.extends_per_period, r.lost, r.rss_per_guard, r.acquire_secs
        ));
        if judged {
            row.judge(
                "renewal_at_most_50_per_period",
                r.server_per_period <= 50.0,
                format_args!("4, {:.1} <= 50 a period", r.server_per_period),
            );
        }
        rows.push(row);
        let mut row = Row::new(backend, "renewal_rss_per_guard_bytes", format!("H={h}"));
        row.note = Some(format!("{:.0}", r.rss_per_guard));
        if judged {
            row.judge(
                "memory_at_most_2_kb_per_guard",
                r.rss_per_guard <= 2048.0,
                format_args!("4, {:.0} <= 2048 B a guard", r.rss_per_guard),
            );
        }
        rows.push(row);
        eprintln!("[{}] renewal H={h} done", backend.name());
    }
    Ok(rows)
}

fn in_child(plan: &Plan, server: &Server, h: usize) -> BenchResult<RenewalResult> {
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
        .env(CHILD_ENV, spec)
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

/// The child's `main`: runs [`renewal`] and prints its result on a
/// `RESULT ` line.
pub fn child_main(spec: &str) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("renewal child: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(renewal(spec)) {
        Ok(v) => {
            println!("RESULT {v}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("renewal child ({spec}): {e}");
            ExitCode::FAILURE
        }
    }
}

/// Holds H guards (default renewal: every TTL/3) for the window and counts
/// the server's work and this process's resident memory. The client sits
/// behind a conformance [`Link`] (a transparent hop that counts the calls
/// it carries) for the client-side extends; nothing here is timed, and the
/// link keeps no state per guard.
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
    let link = Link::new();
    let client = crate::client(backend, url, &distlock::MemoryLock::new()).await?;
    let locker = Locker::new(link.wrap(client, Duration::from_secs(30)));
    let options = LockOptions::new(ttl);
    let mut probe = Probe::new(backend, url, port).await?;
    // Warm up the client with one chunk of concurrent acquisitions and
    // releases, then measure from here: the buffers of CHUNK requests in
    // flight are the client's, not any guard's.
    let run = std::process::id();
    let warm = acquire_all(&locker, &options, &format!("renew-warm-{run}"), CHUNK).await?;
    release_all(warm).await;
    let rss0 = servers::rss_bytes();
    let started = Instant::now();
    let guards = acquire_all(&locker, &options, &format!("renew-{run}"), h).await?;
    let acquire_secs = started.elapsed().as_secs_f64();
    let rss1 = servers::rss_bytes();
    let c0 = Calls::of(&link);
    let s0 = probe.count().await?;
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let s1 = probe.count().await?;
    let c1 = Calls::of(&link);
    let elapsed = t0.elapsed();
    let rss2 = servers::rss_bytes();
    let lost = guards.iter().filter(|g| g.is_lost()).count();
    let periods = elapsed.as_secs_f64() / (ttl / 3).as_secs_f64();
    let calls = c1.since(&c0);
    let server = s1.since(&s0);
    let (server_total, source) = match server.total {
        Some(t) => (t as f64, probe::source(backend, &server, periods)),
        None => (
            calls.ops() as f64,
            match backend {
                Backend::Memory => "backend calls (in-process)",
                _ => "lock calls counted at the client",
            }
            .to_owned(),
        ),
    };
    release_all(guards).await;
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

/// Acquisitions in flight at once.
const CHUNK: usize = 256;

/// `n` guards on keys `<prefix>-<i>`, acquired [`CHUNK`] at a time.
async fn acquire_all(
    locker: &Locker,
    options: &LockOptions,
    prefix: &str,
    n: usize,
) -> BenchResult<Vec<LockGuard>> {
    let mut guards = Vec::with_capacity(n);
    let mut next = 0;
    while next < n {
        let chunk = (n - next).min(CHUNK);
        let mut handles = Vec::with_capacity(chunk);
        for i in next..next + chunk {
            let locker = locker.clone();
            let options = options.clone();
            let key = format!("{prefix}-{i}");
            handles.push(tokio::spawn(async move {
                let key = LockKey::new(key).map_err(|e| e.to_string())?;
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
    Ok(guards)
}

/// Releases `guards`, [`CHUNK`] at a time.
async fn release_all(mut guards: Vec<LockGuard>) {
    while !guards.is_empty() {
        let take = guards.len().min(CHUNK);
        let handles: Vec<_> = guards
            .drain(..take)
            .map(|g| {
                tokio::spawn(async move {
                    let _ = g.release().await;
                })
            })
            .collect();
        for handle in handles {
            let _ = handle.await;
        }
    }
}
