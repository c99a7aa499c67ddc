//! Redis pair vs the peer: sequential acquire + release pairs of fresh
//! keys, one task, three contenders in alternating batches of
//! [`PEER_BATCH`] (order rotated each round):
//!
//! - `peer_raw_fenced`: the raw fenced pair ([`Raw::fenced_acquire_release`]:
//!   `SET NX PX` + `INCR` in one script, then compare-and-delete, two
//!   EVALSHAs on one multiplexed connection), the baseline;
//! - `peer_rslock`: the `rslock` crate, `LockManager::lock` + `unlock` on
//!   the same single server (`SET NX PX`, then its compare-and-delete
//!   script; no fencing token);
//! - `peer_locker`: distlock's job-facing API, `Locker::try_lock` (default
//!   options: guard, renewal task, fencing token) + `LockGuard::release`.
//!
//! Ratios are p50 ÷ the raw fenced pair's p50.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use distlock::redis::redis;
use distlock::{LockClient, LockKey, LockOptions, Locker};
use rslock::LockManager;
use serde_json::json;

use crate::plan::{BenchResult, Plan, PEER_BATCH, TTL};
use crate::probe::Probe;
use crate::raw::Raw;
use crate::report::{Row, Samples};
use crate::servers::{Backend, Server};

/// Pairs of each contender run untimed, for the server's command counts.
const COUNTED_PAIRS: usize = 50;

/// Key prefix of the rslock pairs (outside every other row's keys).
const RSLOCK_PREFIX: &str = "rslockbench:";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Contender {
    RawFenced,
    Rslock,
    Locker,
}

impl Contender {
    const ALL: [Contender; 3] = [Contender::RawFenced, Contender::Rslock, Contender::Locker];

    fn scenario(self) -> &'static str {
        match self {
            Contender::RawFenced => "peer_raw_fenced",
            Contender::Rslock => "peer_rslock",
            Contender::Locker => "peer_locker",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Contender::RawFenced => "SET NX PX+INCR script, compare-and-delete script (EVALSHA x2)",
            Contender::Rslock => "rslock 0.10 LockManager::lock + unlock (no fencing token)",
            Contender::Locker => "Locker::try_lock + LockGuard::release (default options)",
        }
    }
}

/// The three peer rows (Redis only: empty for other backends).
pub async fn rows(
    plan: &Plan,
    server: &Server,
    lib: &LockClient,
    raw: Option<&Raw>,
    ping_p50: Option<f64>,
) -> BenchResult<Vec<Row>> {
    let (Backend::Redis, Some(raw), Some(port)) = (server.backend, raw, server.port()) else {
        return Ok(Vec::new());
    };
    // The harness's Redis has no password; rslock gets the same server,
    // through the same driver (one `redis` crate in the tree).
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .map_err(|e| format!("rslock client: {e}"))?;
    let manager = LockManager::from_clients(vec![client]);
    let locker = Locker::new(lib.clone());
    let options = LockOptions::new(TTL);
    let seq = AtomicU64::new(0);
    let mut samples = [Samples::default(), Samples::default(), Samples::default()];

    // Warm-up (connections, script caches), not recorded.
    for c in Contender::ALL {
        pairs(c, 20, raw, &manager, &locker, &options, &seq).await?;
    }
    let rounds = plan.peer_pairs.div_ceil(PEER_BATCH);
    for round in 0..rounds {
        for i in 0..Contender::ALL.len() {
            let c = Contender::ALL[(i + round) % Contender::ALL.len()];
            let s = pairs(c, PEER_BATCH, raw, &manager, &locker, &options, &seq).await?;
            samples[c as usize].merge(s);
        }
    }
    // Server commands per pair, from one more untimed batch each (the
    // server's own INFO commandstats, read around it).
    let mut probe = Probe::new(Backend::Redis, &server.url, port).await?;
    let mut commands = Vec::new();
    for c in Contender::ALL {
        let before = probe.count().await?;
        pairs(c, COUNTED_PAIRS, raw, &manager, &locker, &options, &seq).await?;
        let during = probe.count().await?.since(&before);
        commands.push(during);
    }
    // rslock's unlock reports nothing: check that every pair released.
    let left = raw.count_redis_keys(&format!("{RSLOCK_PREFIX}*")).await?;
    if left != 0 {
        return Err(format!("rslock left {left} of its locks held"));
    }

    let raw_p50 = samples[Contender::RawFenced as usize].pct(0.5);
    let mut rows = Vec::new();
    for c in Contender::ALL {
        let s = &samples[c as usize];
        let mut row = Row::new(Backend::Redis, c.scenario(), format!("pairs={}", s.ops));
        row.p50_us = s.pct(0.5);
        row.p99_us = s.pct(0.99);
        row.ops_per_s = s.ops_per_s();
        row.ratio_vs_raw = raw_p50.zip(s.pct(0.5)).map(|(r, p)| p / r);
        row.round_trips = ping_p50.zip(s.pct(0.5)).map(|(p, l)| l / p);
        let mean = s.mean();
        let per = COUNTED_PAIRS as f64;
        let sent = &commands[c as usize];
        // Every command the server ran, those inside scripts included
        // (INFO commandstats cannot tell them apart; the probe's own INFO
        // reads are left out).
        let per_pair = sent.all_calls.map(|t| t as f64 / per);
        // The server's own time running the pair's scripts, inner
        // commands included (rslock's lock is a plain SET, outside it).
        let script_us = sent.script_usec.map(|t| t as f64 / per);
        let fmt = |v: Option<f64>, unit: &str| {
            v.map(|v| format!("{v:.1}{unit}"))
                .unwrap_or_else(|| "-".to_owned())
        };
        row.note = Some(format!(
            "mean {}; server calls/pair incl. inside scripts {} ({}); server time in scripts/pair {} (INFO commandstats usec of EVALSHA); {}",
            fmt(mean, " µs"),
            fmt(per_pair, ""),
            sent.top(per, 6),
            fmt(script_us, " µs"),
            c.what()
        ));
        row.extra = vec![
            ("mean_us", json!(mean.map(|m| (m * 10.0).round() / 10.0))),
            ("server_calls_per_pair", json!(per_pair)),
            ("server_calls_detail", json!(sent.top(per, 12))),
            ("server_script_us_per_pair", json!(script_us)),
            (
                "pinning",
                json!("bench process on CPU 0, redis-server on CPU 1 (see the header)"),
            ),
        ];
        if let (Contender::Locker, Some(ratio)) = (c, row.ratio_vs_raw) {
            row.judge(
                "peer_within_1_05x_raw_fenced",
                ratio <= 1.05,
                format_args!("6, p50 {ratio:.2}x <= 1.05x the raw fenced pair"),
            );
        }
        rows.push(row);
    }
    Ok(rows)
}

/// `n` sequential pairs of fresh keys by `c`; each pair timed.
async fn pairs(
    c: Contender,
    n: usize,
    raw: &Raw,
    manager: &LockManager,
    locker: &Locker,
    options: &LockOptions,
    seq: &AtomicU64,
) -> BenchResult<Samples> {
    let started = Instant::now();
    let mut s = Samples::default();
    for _ in 0..n {
        let n = seq.fetch_add(1, Ordering::Relaxed);
        let t = Instant::now();
        match c {
            Contender::RawFenced => {
                raw.fenced_acquire_release(&format!("peer{n}"), n, TTL)
                    .await?;
            }
            Contender::Rslock => {
                let key = format!("{RSLOCK_PREFIX}{n}");
                let lock = manager
                    .lock(key.as_str(), TTL)
                    .await
                    .map_err(|e| format!("rslock lock: {e}"))?;
                manager.unlock(&lock).await;
            }
            Contender::Locker => {
                let key = LockKey::new(format!("peer{n}")).map_err(|e| e.to_string())?;
                let guard = locker
                    .try_lock(&key, options)
                    .await
                    .map_err(|e| format!("Locker::try_lock: {e}"))?
                    .ok_or_else(|| format!("peer: fresh key {key} was taken"))?;
                std::hint::black_box(guard.fencing_token());
                guard
                    .release()
                    .await
                    .map_err(|e| format!("LockGuard::release: {e}"))?;
            }
        }
        s.push(t.elapsed());
        s.ops += 1;
    }
    s.busy = started.elapsed();
    Ok(s)
}
