//! Uncontended try-acquire + release of fresh keys, the library beside the
//! raw commands and a plain round trip, at 1 and 64 tasks.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use distlock::{LockClient, LockKey};

use crate::plan::{BenchResult, Plan, TTL};
use crate::raw::Raw;
use crate::report::{Row, Samples};
use crate::servers::{self, Backend, Server};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Lib,
    Raw,
    Ping,
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
        let (lib_s, raw_s, ping_s) = uncontended(plan, server, lib, raw, tasks).await?;
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
    Ok((rows, ping_p50))
}

/// Uncontended try-acquire + release of fresh keys with `tasks` concurrent
/// tasks, library / raw / ping batches interleaved.
async fn uncontended(
    plan: &Plan,
    server: &Server,
    lib: &LockClient,
    raw: Option<&Raw>,
    tasks: usize,
) -> BenchResult<(Samples, Option<Samples>, Option<Samples>)> {
    let backend = server.backend;
    let mut kinds = vec![Kind::Lib];
    if raw.is_some() {
        kinds.extend([Kind::Raw, Kind::Ping]);
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
    Ok((
        out.remove(&(Kind::Lib as u8)).unwrap_or_default(),
        out.remove(&(Kind::Raw as u8)),
        out.remove(&(Kind::Ping as u8)),
    ))
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
