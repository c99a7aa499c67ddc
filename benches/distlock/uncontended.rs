//! Uncontended try-acquire + release of fresh keys, the library beside the
//! raw commands and a plain round trip, at 1 and 64 tasks; the same for a
//! permit of a fresh semaphore of [`PERMIT_LIMIT`], in the same interleaved
//! batches.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use distlock::{LockClient, LockKey};

use crate::plan::{BenchResult, Plan, PERMIT_LIMIT, TTL};
use crate::raw::Raw;
use crate::report::{Row, Samples};
use crate::servers::{self, Backend, Server};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Lib,
    Raw,
    Ping,
    LibPermit,
    RawPermit,
    /// Redis: the raw pair with a fencing token (`SET NX PX` and `INCR` in
    /// one script, then compare-and-delete), the least a fenced lock sends.
    RawFenced,
}

/// The uncontended rows (library, raw, round trip per task count) and the
/// 1-task round-trip p50 every other latency is expressed in.
pub async fn rows(
    plan: &Plan,
    server: &Server,
    lib: &LockClient,
    raw: Option<&Raw>,
) -> BenchResult<(Vec<Row>, Option<f64>)> {
    let backend = server.backend;
    let mut rows = Vec::new();
    let mut ping_p50 = None;
    for tasks in [1usize, 64] {
        let mut samples = uncontended(plan, server, lib, raw, tasks).await?;
        let mut take = |kind: Kind| samples.remove(&(kind as u8));
        let (lib_s, raw_s, ping_s) = (take(Kind::Lib), take(Kind::Raw), take(Kind::Ping));
        let (permit_s, raw_permit_s) = (take(Kind::LibPermit), take(Kind::RawPermit));
        let fenced_s = take(Kind::RawFenced);
        if tasks == 1 {
            ping_p50 = ping_s.as_ref().and_then(|p| p.pct(0.5));
        }
        let param = format!("tasks={tasks}");
        let raw_p50 = raw_s.as_ref().and_then(|r| r.pct(0.5));
        let lock = ["uncontended_library", "uncontended_raw"];
        let mut lock_rows = beside_raw(backend, lock, &param, lib_s, raw_s, ping_p50, "");
        if let Some(fenced_s) = fenced_s {
            let row = fenced_row(backend, &param, &fenced_s, raw_p50, ping_p50);
            if let (Some(library), Some(ratio)) = (lock_rows.first_mut(), row.ratio_vs_raw) {
                // What a fenced lock cannot go below, beside target 1's verdict.
                if let Some(note) = library.note.as_mut() {
                    note.push_str(&format!(
                        "; the raw fenced pair of the same batches: {ratio:.2}x raw"
                    ));
                }
            }
            lock_rows.push(row);
        }
        rows.extend(lock_rows);
        if let Some(ping_s) = ping_s {
            let mut row = Row::new(backend, "round_trip", param.clone());
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
        let permit = ["uncontended_permit_library", "uncontended_permit_raw"];
        let limit = format!("limit {PERMIT_LIMIT}; ");
        rows.extend(beside_raw(
            backend,
            permit,
            &param,
            permit_s,
            raw_permit_s,
            ping_p50,
            &limit,
        ));
    }
    Ok((rows, ping_p50))
}

/// The raw fenced pair's row: its p50 as a ratio to the raw (unfenced)
/// pair's, which shows how much of target 1 a fencing token alone costs.
fn fenced_row(
    backend: Backend,
    param: &str,
    fenced_s: &Samples,
    raw_p50: Option<f64>,
    ping_p50: Option<f64>,
) -> Row {
    let note = "SET NX PX and INCR in one script, then compare-and-delete: the least a lock with fencing tokens sends; ";
    let mut row = raw_row(
        backend,
        "uncontended_raw_fenced",
        param,
        fenced_s,
        ping_p50,
        note,
    );
    row.ratio_vs_raw = raw_p50.zip(fenced_s.pct(0.5)).map(|(r, f)| f / r);
    row
}

/// A raw driver's row of `raw_s`: its latencies, rate and round trips,
/// and its CPU per operation after `note`.
fn raw_row(
    backend: Backend,
    name: &'static str,
    param: &str,
    raw_s: &Samples,
    ping_p50: Option<f64>,
    note: &str,
) -> Row {
    let mut row = Row::new(backend, name, param);
    row.p50_us = raw_s.pct(0.5);
    row.p99_us = raw_s.pct(0.99);
    row.ops_per_s = raw_s.ops_per_s();
    row.round_trips = ping_p50.zip(raw_s.pct(0.5)).map(|(p, l)| l / p);
    row.note = Some(format!("{note}{}", raw_s.cpu_note(true)));
    row
}

/// The library's row (its p50 as a ratio to the raw one's) and the raw
/// commands' row, named `names`; `note` starts each note.
fn beside_raw(
    backend: Backend,
    names: [&'static str; 2],
    param: &str,
    lib_s: Option<Samples>,
    raw_s: Option<Samples>,
    ping_p50: Option<f64>,
    note: &str,
) -> Vec<Row> {
    let mut rows = Vec::new();
    let lib_s = lib_s.unwrap_or_default();
    let raw_ops = raw_s.as_ref().and_then(Samples::ops_per_s);
    let lib_ops = lib_s.ops_per_s();
    let ops_ratio = raw_ops.zip(lib_ops).map(|(r, l)| r / l);
    let mut row = Row::new(backend, names[0], param);
    row.p50_us = lib_s.pct(0.5);
    row.p99_us = lib_s.pct(0.99);
    row.ops_per_s = lib_ops;
    row.ratio_vs_raw = raw_s
        .as_ref()
        .and_then(|r| r.pct(0.5))
        .zip(lib_s.pct(0.5))
        .map(|(r, l)| l / r);
    row.round_trips = ping_p50.zip(lib_s.pct(0.5)).map(|(p, l)| l / p);
    row.note = Some(match ops_ratio {
        Some(r) => format!("{note}ops/s ratio {r:.2}; {}", lib_s.cpu_note(true)),
        None => format!("{note}{}", lib_s.cpu_note(false)),
    });
    // Target 1 is the lock's pair; the permit rows are shown beside it.
    if let (true, Some(ratio)) = (names[0] == "uncontended_library", row.ratio_vs_raw) {
        row.judge(
            "uncontended_within_1_10x_raw",
            ratio <= 1.10,
            format_args!("1, p50 {ratio:.2}x <= 1.10x raw"),
        );
    }
    rows.push(row);
    if let Some(raw_s) = raw_s {
        rows.push(raw_row(backend, names[1], param, &raw_s, ping_p50, note));
    }
    rows
}

/// Uncontended try-acquire + release of fresh keys (and of permits of
/// fresh semaphores) with `tasks` concurrent tasks, library / raw / ping
/// batches interleaved; the samples of each kind.
async fn uncontended(
    plan: &Plan,
    server: &Server,
    lib: &LockClient,
    raw: Option<&Raw>,
    tasks: usize,
) -> BenchResult<BTreeMap<u8, Samples>> {
    let backend = server.backend;
    let mut kinds = vec![Kind::Lib, Kind::LibPermit];
    if raw.is_some() {
        kinds.extend([Kind::Raw, Kind::Ping, Kind::RawPermit]);
        if backend == Backend::Redis {
            kinds.push(Kind::RawFenced);
        }
    }
    let mut out: BTreeMap<u8, Samples> = BTreeMap::new();
    static SEQ: AtomicU64 = AtomicU64::new(0);
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
    Ok(out)
}

async fn run_batch(
    kind: Kind,
    backend: Backend,
    lib: &LockClient,
    raw: Option<&Raw>,
    tasks: usize,
    per_task: usize,
    seq: &'static AtomicU64,
) -> BenchResult<Samples> {
    let started = Instant::now();
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let lib = lib.clone();
        let raw = raw.cloned();
        handles.push(tokio::spawn(async move {
            let mut s = Samples::default();
            for _ in 0..per_task {
                let n = seq.fetch_add(1, Ordering::Relaxed);
                let key = format!("u{n}");
                let t = Instant::now();
                match kind {
                    Kind::Lib | Kind::LibPermit => {
                        let key = LockKey::new(key).map_err(|e| e.to_string())?;
                        let attempt = if kind == Kind::LibPermit {
                            lib.try_acquire_permit(&key, PERMIT_LIMIT, TTL).await
                        } else {
                            lib.try_acquire(&key, TTL).await
                        };
                        let lease = attempt
                            .map_err(|e| format!("{} {kind:?} try-acquire: {e}", backend.name()))?
                            .lease()
                            .ok_or_else(|| format!("{kind:?}: fresh key {key} was taken"))?;
                        lib.release(&lease)
                            .await
                            .map_err(|e| format!("{} {kind:?} release: {e}", backend.name()))?;
                    }
                    Kind::Raw => {
                        if let Some(raw) = &raw {
                            raw.acquire_release(&key, n, TTL).await?;
                        }
                    }
                    Kind::RawPermit => {
                        if let Some(raw) = &raw {
                            raw.permit_acquire_release(&key, n, PERMIT_LIMIT, TTL)
                                .await?;
                        }
                    }
                    Kind::RawFenced => {
                        if let Some(raw) = &raw {
                            raw.fenced_acquire_release(&key, n, TTL).await?;
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
