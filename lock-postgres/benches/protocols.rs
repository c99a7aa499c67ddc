//! What the statement protocols and the ways of waiting cost, measured
//! against real servers the conformance harness starts on loopback:
//!
//! ```text
//! cargo bench -p distlock-postgres --bench protocols
//! ```
//!
//! 1. try-acquire + release on a direct connection with named prepared
//!    statements (`pool_mode=session`, the default) beside the simple query
//!    protocol with literals (`pool_mode=transaction`), interleaved in
//!    batches, with 1 task and with 16 tasks; a plain `SELECT 1` round trip
//!    for scale;
//! 2. handoff through PgBouncer in transaction mode: from the holder's
//!    release to the waiter holding the lock, with `listen_url` (woken by
//!    `NOTIFY`) and without (polling every `retry_interval_ms`, default 100).
//!
//! Prints one line per measurement. Not a test: nothing is asserted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_conformance::server::{PgBouncer, PoolMode, Postgres, ServerProcess};
use distlock_conformance::url::percent_encode;
use distlock_core::{LockClient, LockKey};
use distlock_postgres::PostgresLock;

const ROUNDS: usize = 10;
const BATCH: usize = 200;
const TASKS: usize = 16;
const HANDOFFS: usize = 40;
const TTL: Duration = Duration::from_secs(30);

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort_unstable();
    let at = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[at]
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

async fn client(url: &str) -> LockClient {
    LockClient::new(PostgresLock::connect(url).await.expect("connect"))
}

/// One task: `BATCH` try-acquire + release pairs, each timed.
async fn pairs(client: &LockClient, key: &LockKey, out: &mut Vec<Duration>) {
    for _ in 0..BATCH {
        let start = Instant::now();
        let lease = client.try_acquire(key, TTL).await.unwrap().lease().unwrap();
        client.release(&lease).await.unwrap();
        out.push(start.elapsed());
    }
}

/// `TASKS` tasks on one client, each `BATCH` pairs on its own key: pairs/s.
async fn throughput(client: &LockClient, label: &str) -> f64 {
    let start = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let client = client.clone();
            let key = LockKey::new(format!("{label}-{t}")).unwrap();
            tokio::spawn(async move {
                let mut ignored = Vec::new();
                pairs(&client, &key, &mut ignored).await;
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    (TASKS * BATCH) as f64 / start.elapsed().as_secs_f64()
}

async fn protocols(direct: &str) {
    let extended = client(&format!("{direct}?namespace=bench_extended")).await;
    let simple = client(&format!(
        "{direct}?namespace=bench_simple&pool_mode=transaction"
    ))
    .await;
    let pool = sqlx::PgPool::connect(direct).await.unwrap();
    let key = LockKey::new("bench").unwrap();
    // Warm up: connections open, statements prepared.
    let (mut e, mut s, mut ping) = (Vec::new(), Vec::new(), Vec::new());
    pairs(&extended, &key, &mut Vec::new()).await;
    pairs(&simple, &key, &mut Vec::new()).await;
    let (mut e_rate, mut s_rate) = (0.0, 0.0);
    for _ in 0..ROUNDS {
        pairs(&extended, &key, &mut e).await;
        pairs(&simple, &key, &mut s).await;
        for _ in 0..BATCH {
            let start = Instant::now();
            sqlx::query("SELECT 1").execute(&pool).await.unwrap();
            ping.push(start.elapsed());
        }
        e_rate += throughput(&extended, "extended").await / ROUNDS as f64;
        s_rate += throughput(&simple, "simple").await / ROUNDS as f64;
    }
    let (e50, s50) = (percentile(&mut e, 0.5), percentile(&mut s, 0.5));
    println!(
        "direct, 1 task, try-acquire + release: prepared p50 {} p99 {}; simple p50 {} p99 {}; simple/prepared p50 {:.2}x; SELECT 1 p50 {}",
        us(e50),
        us(percentile(&mut e, 0.99)),
        us(s50),
        us(percentile(&mut s, 0.99)),
        s50.as_secs_f64() / e50.as_secs_f64(),
        us(percentile(&mut ping, 0.5)),
    );
    println!(
        "direct, {TASKS} tasks, one client (8 connections): prepared {e_rate:.0} pairs/s; simple {s_rate:.0} pairs/s; simple/prepared {:.2}x",
        s_rate / e_rate
    );
}

/// From the holder's release to the waiter holding the lock, `HANDOFFS` times.
async fn handoffs(url: &str, label: &str) {
    let holder = client(url).await;
    let waiter = client(url).await;
    let key = LockKey::new(format!("handoff-{label}")).unwrap();
    let mut samples = Vec::new();
    for _ in 0..HANDOFFS {
        let lease = holder
            .try_acquire(&key, TTL)
            .await
            .unwrap()
            .lease()
            .unwrap();
        let waiting = {
            let waiter = waiter.clone();
            let key = key.clone();
            tokio::spawn(async move {
                let got = waiter
                    .acquire(&key, TTL, Instant::now() + Duration::from_secs(20))
                    .await
                    .unwrap()
                    .expect("handed over");
                (Instant::now(), got)
            })
        };
        // Let the waiter find the lock held and go to sleep; release at a
        // random moment of a poll interval.
        tokio::time::sleep(Duration::from_millis(rand::random_range(30..230))).await;
        let released = Instant::now();
        holder.release(&lease).await.unwrap();
        let (got_at, got) = waiting.await.unwrap();
        samples.push(got_at - released);
        waiter.release(&got).await.unwrap();
    }
    println!(
        "through PgBouncer (transaction mode), handoff {label}: p50 {} p90 {} max {}",
        us(percentile(&mut samples, 0.5)),
        us(percentile(&mut samples, 0.9)),
        us(percentile(&mut samples, 1.0)),
    );
}

fn main() {
    // `cargo bench` passes `--bench`; any other argument is ignored too.
    let postgres = ServerProcess::start(Arc::new(Postgres)).expect("start PostgreSQL");
    let bouncer = ServerProcess::start(Arc::new(PgBouncer::new(
        postgres.addr(),
        PoolMode::Transaction,
    )))
    .expect("start PgBouncer");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        protocols(&postgres.url()).await;
        let pooled = format!(
            "{}?namespace=bench_pooled&pool_mode=transaction",
            bouncer.url()
        );
        let listen = percent_encode(&postgres.url());
        handoffs(
            &format!("{pooled}&listen_url={listen}"),
            "with listen_url (NOTIFY)",
        )
        .await;
        handoffs(&pooled, "without listen_url (polling every 100 ms)").await;
    });
}
