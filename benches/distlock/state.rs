//! State after [`STATE_KEYS`] distinct fired keys: a scheduler firing a new
//! key per run acquires and releases each key once; what does the server
//! keep for them? [`STATE_TASKS`] tasks fire the keys (try-acquire +
//! release, TTL [`STATE_TTL`]) in a namespace of their own, then the
//! namespace's state is counted (Redis: keys `NS:*`; etcd: keys under
//! `NS/`; PostgreSQL: rows of the namespace in the lock table and in the
//! table of waiter lines; memory: [`MemoryLock::held_count`], the only
//! count it exposes).
//!
//! Where the backend reclaims state after a retention (Redis's
//! `fence_retention_ms`; PostgreSQL's when its URL accepts the same
//! parameter), the client is given [`RETENTION_MS`] and the count is taken
//! again past it, and once more after more fired keys, one a second, until
//! the count stops falling (a backend that reclaims on write gets its
//! chance).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock::{LockClient, LockKey, MemoryLock};
use serde_json::{json, Value};

use crate::plan::{BenchResult, STATE_KEYS, STATE_TASKS};
use crate::raw::Raw;
use crate::report::{Row, Samples};
use crate::servers::{Backend, Server};

/// The namespace the keys are fired in (nothing else uses it).
const NAMESPACE: &str = "benchstate";

/// TTL of the fired keys: short, so that the Redis fencing counters'
/// retention (the longer of `fence_retention_ms` and twice the TTL) is
/// [`RETENTION_MS`].
const STATE_TTL: Duration = Duration::from_secs(1);

/// The retention the row asks for, where the backend has one.
const RETENTION_MS: u64 = 2000;

/// How long past the retention the row waits before counting again.
const RETENTION_SLACK: Duration = Duration::from_millis(500);

/// The state row of `server`'s backend.
pub async fn rows(server: &Server, raw: Option<&Raw>) -> BenchResult<Vec<Row>> {
    let backend = server.backend;
    let join = if server.url.contains('?') { '&' } else { '?' };
    let plain = format!("{}{join}namespace={NAMESPACE}", server.url);
    let with_retention = format!("{plain}&fence_retention_ms={RETENTION_MS}");
    // Whether the backend takes a retention; for PostgreSQL, whatever its
    // URL parser says (the parameter is newer there).
    let (retention, refused) = match backend {
        Backend::Redis => (true, None),
        Backend::Postgres => match distlock::postgres::PostgresConfig::from_url(&with_retention) {
            Ok(_) => (true, None),
            Err(e) => (false, Some(e.to_string())),
        },
        Backend::Etcd | Backend::Memory => (false, None),
    };
    let memory = MemoryLock::new();
    let client = match backend {
        Backend::Memory => memory.client(),
        _ => {
            let url = if retention { &with_retention } else { &plain };
            distlock::connect(url)
                .await
                .map_err(|e| format!("connecting to {url}: {e}"))?
        }
    };

    let fired = fire(&client, backend, 0, STATE_KEYS).await?;
    let count = async || -> BenchResult<Vec<(&'static str, u64)>> {
        match raw {
            Some(raw) => raw.state_counts(NAMESPACE).await,
            // Live locks: the only count MemoryLock exposes.
            None => Ok(vec![("held_count", memory.held_count() as u64)]),
        }
    };
    let left = count().await?;
    let mut after_retention = None;
    let mut after_next = None;
    let mut fired_after = 0;
    if retention {
        tokio::time::sleep(Duration::from_millis(RETENTION_MS) + RETENTION_SLACK).await;
        after_retention = Some(count().await?);
        // A backend that reclaims from acquisitions in the background
        // (PostgreSQL: one sweep per interval and client) needs
        // some: one key a second, as a scheduler fires, until the count
        // stops falling (at most 10).
        let mut last = count().await?;
        for next in 0..10 {
            fire(&client, backend, STATE_KEYS + next, 1).await?;
            tokio::time::sleep(Duration::from_secs(1)).await;
            let now = count().await?;
            let settled = now == last && next > 0;
            last = now;
            fired_after = next + 1;
            if settled {
                break;
            }
        }
        after_next = Some(last);
    }

    let show = |counts: &[(&str, u64)]| {
        counts
            .iter()
            .map(|(what, n)| format!("{what} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut note = format!("left: {}", show(&left));
    match (&after_retention, &after_next) {
        (Some(after), Some(next)) => note.push_str(&format!(
            "; after retention {RETENTION_MS} ms (+{} ms): {}; after {fired_after} more fired keys, one a second: {}",
            RETENTION_SLACK.as_millis(),
            show(after),
            show(next)
        )),
        _ => note.push_str(match (backend, &refused) {
            (Backend::Postgres, Some(_)) => "; not reclaimed (fence_retention_ms refused)",
            _ => "; no retention",
        }),
    }
    note.push_str(&format!(
        "; {STATE_TASKS} tasks, TTL {} s",
        STATE_TTL.as_secs()
    ));
    let to_json = |counts: &[(&str, u64)]| {
        Value::Object(
            counts
                .iter()
                .map(|(what, n)| ((*what).to_owned(), json!(n)))
                .collect(),
        )
    };
    let mut row = Row::new(
        backend,
        "state_after_fired_keys",
        format!("keys={STATE_KEYS}"),
    );
    row.p50_us = fired.pct(0.5);
    row.p99_us = fired.pct(0.99);
    row.ops_per_s = fired.ops_per_s();
    row.note = Some(note);
    row.extra = vec![
        ("left", to_json(&left)),
        ("retention_ms", json!(retention.then_some(RETENTION_MS))),
        (
            "after_retention",
            after_retention
                .as_deref()
                .map(to_json)
                .unwrap_or(Value::Null),
        ),
        (
            "after_next_fired_key",
            after_next.as_deref().map(to_json).unwrap_or(Value::Null),
        ),
        ("fired_after_retention", json!(fired_after)),
        ("retention_refused", json!(refused)),
    ];
    Ok(vec![row])
}

/// Keys `first..first + n` of the namespace, each acquired and released
/// once, by up to [`STATE_TASKS`] tasks; each pair timed.
async fn fire(
    client: &LockClient,
    backend: Backend,
    first: usize,
    n: usize,
) -> BenchResult<Samples> {
    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(first));
    let end = first + n;
    let mut handles = Vec::new();
    for _ in 0..STATE_TASKS.min(n) {
        let (client, next) = (client.clone(), Arc::clone(&next));
        handles.push(tokio::spawn(async move {
            let mut s = Samples::default();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= end {
                    return Ok::<_, String>(s);
                }
                let key = LockKey::new(format!("job-{i}")).map_err(|e| e.to_string())?;
                let t = Instant::now();
                let lease = client
                    .try_acquire(&key, STATE_TTL)
                    .await
                    .map_err(|e| format!("{} state try-acquire: {e}", backend.name()))?
                    .lease()
                    .ok_or_else(|| format!("state: fresh key {key} was taken"))?;
                client
                    .release(&lease)
                    .await
                    .map_err(|e| format!("{} state release: {e}", backend.name()))?;
                s.push(t.elapsed());
                s.ops += 1;
            }
        }));
    }
    let mut all = Samples::default();
    for h in handles {
        all.merge(h.await.map_err(|e| e.to_string())??);
    }
    all.busy = started.elapsed();
    Ok(all)
}
