//! The raw handoff: the floor of a handoff with the same driver and the
//! same runtime as the library's rows. One holder and one waiter (W = 1),
//! each with its own connections; the holder holds for the plan's hold,
//! then releases with the minimal command that also tells the waiter
//! (Redis: compare-and-delete and `PUBLISH` in one script; etcd: the delete
//! transaction, which the waiter's watch sees; PostgreSQL: the library's
//! release statement, whose `NOTIFY` the waiter's `LISTEN` connection
//! receives). The waiter, told, sends the acquire write alone (Redis: `SET
//! NX PX`; etcd: the put transaction on a lease granted before; PostgreSQL:
//! the library's acquire statement). Measured as the library's handoff
//! rows are: from the release returning to the waiter's acquire returning,
//! 0 when the acquire returned first.
//!
//! This is the wake notice plus one write, with whatever the machine adds
//! to it after an idle hold. Run it on a quiet machine: a process woken
//! from the hold's sleep waits for its CPU when other work runs there (an
//! in-process handoff through the memory backend took 4 µs p50 after a
//! 10 ms hold on an idle machine, about 50 µs with a test run beside it).

use std::time::{Duration, Instant};

use distlock::etcd::etcd_client::{
    Client as EtcdClient, Compare, CompareOp, ConnectOptions, EventType, PutOptions, Txn, TxnOp,
    WatchOptions,
};
use distlock::redis::redis::{self, Script};
use futures_util::StreamExt;
use sqlx::postgres::PgListener;
use tokio::sync::mpsc;

use crate::plan::{warmup_handoffs, BenchResult, Plan, TTL};
use crate::raw::{Raw, PG_CHANNEL};
use crate::report::Samples;
use crate::servers::{Backend, Server};

/// Compare-and-delete that tells the waiter: KEYS lock; ARGV owner,
/// channel.
const REDIS_RELEASE_TELLING: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]); redis.call('PUBLISH', ARGV[2], '1'); return 1 else return 0 end";

/// How long one step may take before the run fails.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// The raw handoff's samples (W = 1), or `None` for memory (no raw client).
pub async fn samples(plan: &Plan, server: &Server) -> BenchResult<Option<Samples>> {
    let handoffs = warmup_handoffs(1) + plan.handoffs;
    let measured = match server.backend {
        Backend::Memory => return Ok(None),
        Backend::Redis => redis_handoffs(server, handoffs, plan.hold).await?,
        Backend::Etcd => etcd_handoffs(server, handoffs, plan.hold).await?,
        Backend::Postgres => postgres_handoffs(server, handoffs, plan.hold).await?,
    };
    let mut samples = Samples::default();
    for d in measured.into_iter().skip(warmup_handoffs(1)) {
        samples.push(d);
    }
    Ok(Some(samples))
}

/// From `released` to `acquired`, 0 if the acquire returned first.
fn handoff(released: Instant, acquired: Instant) -> Duration {
    acquired.saturating_duration_since(released)
}

/// `n` handoffs: each runs `holder(i)` (acquire, hold, release), then
/// takes the waiter's acquisition time from `acquired`.
async fn cycles<F, Fut>(
    n: usize,
    acquired: &mut mpsc::Receiver<Result<Instant, String>>,
    mut holder: F,
) -> BenchResult<Vec<Duration>>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        holder(i).await?;
        let released_at = Instant::now();
        let acquired_at = tokio::time::timeout(STEP_TIMEOUT, acquired.recv())
            .await
            .map_err(|_| format!("raw handoff: the waiter's acquire took over {STEP_TIMEOUT:?}"))?
            .ok_or_else(|| "the raw waiter stopped".to_owned())??;
        out.push(handoff(released_at, acquired_at));
    }
    Ok(out)
}

async fn redis_handoffs(server: &Server, n: usize, hold: Duration) -> BenchResult<Vec<Duration>> {
    let key = format!("rawbench:{{handoff-{}}}:lock", std::process::id());
    let channel = format!("{key}:released");
    let client = redis::Client::open(server.url.as_str()).map_err(|e| e.to_string())?;
    let mut holder = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    let mut waiter = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    let mut pubsub = client.get_async_pubsub().await.map_err(|e| e.to_string())?;
    pubsub
        .subscribe(&channel)
        .await
        .map_err(|e| e.to_string())?;
    let release = Script::new(REDIS_RELEASE_TELLING);
    release
        .load_async(&mut holder)
        .await
        .map_err(|e| e.to_string())?;
    let (holder_owner, waiter_owner) = ("raw-holder", "raw-waiter");
    let ttl_ms = TTL.as_millis() as u64;
    let (acquired_tx, mut acquired_rx) = mpsc::channel::<Result<Instant, String>>(1);
    let waiter_task = {
        let key = key.clone();
        tokio::spawn(async move {
            let mut messages = pubsub.on_message();
            while messages.next().await.is_some() {
                let taken: Option<String> = match redis::cmd("SET")
                    .arg(&key)
                    .arg(waiter_owner)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl_ms)
                    .query_async(&mut waiter)
                    .await
                {
                    Ok(taken) => taken,
                    Err(e) => {
                        let _ = acquired_tx.send(Err(e.to_string())).await;
                        return;
                    }
                };
                let at = Instant::now();
                if taken.is_none() {
                    let _ = acquired_tx
                        .send(Err("raw waiter refused after the release".to_owned()))
                        .await;
                    return;
                }
                // Given back untold (the holder takes it back when told so).
                let deleted: Result<i64, _> =
                    redis::cmd("DEL").arg(&key).query_async(&mut waiter).await;
                let sent = match deleted {
                    Ok(_) => acquired_tx.send(Ok(at)).await,
                    Err(e) => acquired_tx.send(Err(e.to_string())).await,
                };
                if sent.is_err() {
                    return;
                }
            }
        })
    };
    let out = cycles(n, &mut acquired_rx, |_| {
        let (mut holder, key, channel, release) = (holder.clone(), &key, &channel, &release);
        async move {
            let taken: Option<String> = redis::cmd("SET")
                .arg(key)
                .arg(holder_owner)
                .arg("NX")
                .arg("PX")
                .arg(ttl_ms)
                .query_async(&mut holder)
                .await
                .map_err(|e| e.to_string())?;
            if taken.is_none() {
                return Err(format!("raw holder refused on {key}"));
            }
            tokio::time::sleep(hold).await;
            let released: i64 = release
                .key(key)
                .arg(holder_owner)
                .arg(channel)
                .invoke_async(&mut holder)
                .await
                .map_err(|e| e.to_string())?;
            if released != 1 {
                return Err(format!("raw holder's release did not delete {key}"));
            }
            Ok(())
        }
    })
    .await;
    waiter_task.abort();
    out
}

async fn etcd_handoffs(server: &Server, n: usize, hold: Duration) -> BenchResult<Vec<Duration>> {
    let port = server.port().unwrap_or(0);
    let raw = Raw::connect(Backend::Etcd, &server.url, port).await?;
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_timeout(Duration::from_secs(5));
    let mut waiter = EtcdClient::connect([format!("http://127.0.0.1:{port}")], Some(options))
        .await
        .map_err(|e| e.to_string())?;
    let name = format!("handoff-{}", std::process::id());
    let key = format!("rawbench/lock/{name}");
    // The waiter's lease, granted before: its acquire is the put alone.
    let lease = waiter
        .lease_grant(TTL.as_secs().max(1) as i64 * 4, None)
        .await
        .map_err(|e| e.to_string())?
        .id();
    let mut events = waiter
        .watch(key.as_str(), Some(WatchOptions::new()))
        .await
        .map_err(|e| e.to_string())?;
    let mut kv = waiter.kv_client();
    let put = Txn::new()
        .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(
            key.as_str(),
            "raw-waiter",
            Some(PutOptions::new().with_lease(lease)),
        )]);
    let (acquired_tx, mut acquired_rx) = mpsc::channel::<Result<Instant, String>>(1);
    let waiter_task = {
        let key = key.clone();
        tokio::spawn(async move {
            // Deletions to pass over: the waiter's own.
            let mut own = 0usize;
            loop {
                let reply = match events.message().await {
                    Ok(Some(reply)) => reply,
                    Ok(None) => return,
                    Err(e) => {
                        let _ = acquired_tx.send(Err(e.to_string())).await;
                        return;
                    }
                };
                for event in reply.events() {
                    if event.event_type() != EventType::Delete {
                        continue;
                    }
                    if own > 0 {
                        own -= 1;
                        continue;
                    }
                    let result = match kv.txn(put.clone()).await {
                        Ok(r) if r.succeeded() => Ok(Instant::now()),
                        Ok(_) => Err("raw waiter refused after the release".to_owned()),
                        Err(e) => Err(e.to_string()),
                    };
                    if result.is_ok() {
                        own += 1;
                        if let Err(e) = kv.delete(key.as_str(), None).await {
                            let _ = acquired_tx.send(Err(e.to_string())).await;
                            return;
                        }
                    }
                    if acquired_tx.send(result).await.is_err() {
                        return;
                    }
                }
            }
        })
    };
    let (raw, name) = (&raw, &name);
    let out = cycles(n, &mut acquired_rx, |i| async move {
        let (held, _) = raw.acquire(name, i as u64, TTL).await?;
        tokio::time::sleep(hold).await;
        raw.release(held).await
    })
    .await;
    waiter_task.abort();
    out
}

async fn postgres_handoffs(
    server: &Server,
    n: usize,
    hold: Duration,
) -> BenchResult<Vec<Duration>> {
    let holder = Raw::connect(Backend::Postgres, &server.url, 0).await?;
    let waiter = Raw::connect(Backend::Postgres, &server.url, 0).await?;
    let key = format!("handoff-{}", std::process::id());
    let mut listener = PgListener::connect(&server.url)
        .await
        .map_err(|e| e.to_string())?;
    listener
        .listen(PG_CHANNEL)
        .await
        .map_err(|e| e.to_string())?;
    let (acquired_tx, mut acquired_rx) = mpsc::channel::<Result<Instant, String>>(1);
    let waiter_task = {
        let key = key.clone();
        tokio::spawn(async move {
            let mut next = 1u64 << 32;
            loop {
                let told = match listener.recv().await {
                    Ok(told) => told,
                    Err(e) => {
                        let _ = acquired_tx.send(Err(e.to_string())).await;
                        return;
                    }
                };
                if told.payload() != key {
                    continue;
                }
                next += 1;
                let result = match waiter.acquire(&key, next, TTL).await {
                    Ok((held, _)) => {
                        let at = Instant::now();
                        // Given back untold: its release notifies no one.
                        waiter.release_quietly(held).await.map(|()| at)
                    }
                    Err(e) => Err(e),
                };
                if acquired_tx.send(result).await.is_err() {
                    return;
                }
            }
        })
    };
    let (holder, key) = (&holder, &key);
    let out = cycles(n, &mut acquired_rx, |i| async move {
        let (held, _) = holder.acquire(key, i as u64, TTL).await?;
        tokio::time::sleep(hold).await;
        holder.release(held).await
    })
    .await;
    waiter_task.abort();
    out
}
