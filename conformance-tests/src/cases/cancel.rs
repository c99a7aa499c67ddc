//! `cancel::` — futures dropped at random points, mid-flight where faults
//! can delay traffic: the raw backend's (`LockBackend::acquire` plain and
//! renewing, `watch`, `extend`, `release`) and the client's (`try_acquire`,
//! a waiting `acquire`).
//!
//! A dropped grant whose reply nobody read may stay held, but only until
//! its TTL. What must hold after any drop: nothing stays held beyond its
//! TTL, and the waiters that come later are still woken by a release (not
//! by their deadline or a timer).

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{AcquireRequest, Lease, LockClient, LockKey, OwnerToken};

use super::support::{acquire, eventually_acquire, until_attempts, within};
use crate::context::{CaseError, CaseResult, TestContext};
use crate::fault::{Direction, FaultPath};
use crate::{check, ObservedLock};

/// Clients whose calls are dropped, and rounds of drops per client.
const CLIENTS: usize = 4;

const ROUNDS: usize = 14;

/// Slack on top of a TTL for "the server let the key go" (etcd revokes
/// expired leases in batches); only a key held for good fails it.
const EXPIRY_SLACK: Duration = Duration::from_secs(10);

/// Which call is dropped.
#[derive(Debug, Clone, Copy)]
enum Call {
    /// The raw backend's acquire, without and with renewal.
    RawAcquire,
    RawAcquireRenewing,
    /// The client's single attempt.
    TryAcquire,
    /// A waiting `acquire` on a key held throughout.
    AcquireHeld,
    /// A waiting `acquire` on a key released at a random moment.
    AcquireReleased,
    Watch,
    Extend,
    Release,
}

const CALLS: [Call; 8] = [
    Call::RawAcquire,
    Call::RawAcquireRenewing,
    Call::TryAcquire,
    Call::AcquireHeld,
    Call::AcquireReleased,
    Call::Watch,
    Call::Extend,
    Call::Release,
];

/// A random moment within `span` (inclusive of zero: dropped before the
/// first poll does anything).
fn random_within(span: Duration) -> Duration {
    Duration::from_micros(rand::random_range(0..=span.as_micros() as u64))
}

/// One dropped call by `client`; returns the keys it touched.
async fn drop_one(
    ctx: &TestContext,
    client: &LockClient,
    holder: &LockClient,
    busy: &LockKey,
    what: Call,
    ttl: Duration,
    span: Duration,
) -> Result<Vec<LockKey>, CaseError> {
    let fresh = ctx.key("cancel");
    let cut = random_within(span);
    let raw = client.backend();
    match what {
        Call::RawAcquire | Call::RawAcquireRenewing => {
            let request = AcquireRequest {
                key: &fresh,
                owner: OwnerToken::random(),
                ttl: client.capabilities().effective_ttl(ttl)?,
                renewing: matches!(what, Call::RawAcquireRenewing),
                settling: false,
                holder: None,
            };
            let _ = tokio::time::timeout(cut, raw.acquire(request)).await;
        }
        Call::TryAcquire => {
            let _ = tokio::time::timeout(cut, client.try_acquire(&fresh, ttl)).await;
        }
        Call::AcquireHeld => {
            let deadline = Instant::now() + Duration::from_secs(5);
            let _ = tokio::time::timeout(cut, client.acquire(busy, ttl, deadline)).await;
            return Ok(Vec::new());
        }
        Call::AcquireReleased => {
            let lease = acquire(holder, &fresh, ctx.long_ttl(), "holder of a released key").await?;
            let release_after = random_within(span);
            let releaser = {
                let holder = holder.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(release_after).await;
                    holder.release(&lease).await
                })
            };
            let deadline = Instant::now() + Duration::from_secs(5);
            let _ = tokio::time::timeout(cut * 2, client.acquire(&fresh, ttl, deadline)).await;
            releaser
                .await
                .map_err(|e| format!("releaser panicked: {e}"))??;
        }
        Call::Watch => {
            if let Ok(Ok(Some(watch))) =
                tokio::time::timeout(cut, raw.watch(busy, OwnerToken::random())).await
            {
                tokio::time::sleep(random_within(span)).await;
                drop(watch);
            }
            return Ok(Vec::new());
        }
        Call::Extend => {
            let lease = acquire(client, &fresh, ttl, "before a dropped extend").await?;
            let ttl = client.capabilities().effective_ttl(ttl)?;
            let _ = tokio::time::timeout(cut, raw.extend(lease.held(), ttl)).await;
        }
        Call::Release => {
            let lease = acquire(client, &fresh, ttl, "before a dropped release").await?;
            let _ = tokio::time::timeout(cut, raw.release(lease.held())).await;
        }
    }
    Ok(vec![fresh])
}

/// What a storm of dropped calls left behind.
struct Storm {
    holder: LockClient,
    /// The key held throughout, where waits and watches were dropped.
    busy: LockKey,
    busy_lease: Lease,
    /// The clients whose calls were dropped (still alive).
    clients: Vec<LockClient>,
    /// Every other key a dropped call touched.
    touched: Vec<LockKey>,
    /// The TTL the dropped acquisitions asked for.
    ttl: Duration,
    /// Kept so the clients stay connected through their paths.
    _paths: Vec<FaultPath>,
}

/// Every raw call dropped at random points, `CLIENTS` x `ROUNDS` times
/// (after a watch and a wait on the busy key dropped at their first poll),
/// each client behind a path that delays its requests and replies by 0, 2,
/// 8 or 20 ms, so drops land before, during and after the server handled
/// the call.
async fn storm(ctx: &TestContext) -> Result<Storm, CaseError> {
    let ttl = ctx.capabilities().effective_ttl(Duration::from_secs(1))?;
    let holder = ctx.client().await?;
    let busy = ctx.key("cancel-busy");
    let busy_ttl = ctx.capabilities().effective_ttl(Duration::from_secs(30))?;
    let busy_lease = acquire(&holder, &busy, busy_ttl, "holder of the busy key").await?;
    // Each client's path delays requests and replies by its own amount.
    let delays = [0, 2, 8, 20].map(Duration::from_millis);
    let mut paths: Vec<FaultPath> = Vec::new();
    let mut clients = Vec::new();
    for delay in delays.iter().take(CLIENTS) {
        if ctx.can_inject_faults() {
            let path = ctx.fault_path().await?;
            clients.push(
                ctx.client_through_with(&path, Duration::from_secs(5))
                    .await?,
            );
            path.delay(Direction::ToServer, *delay);
            path.delay(Direction::ToClient, *delay);
            paths.push(path);
        } else {
            clients.push(ctx.client().await?);
        }
    }
    let mut workers = Vec::new();
    for (index, client) in clients.iter().enumerate() {
        let (ctx, client, holder, busy) =
            (ctx.clone(), client.clone(), holder.clone(), busy.clone());
        // Three crossings and a handshake cover every stage of a call.
        let span = delays[index] * 4 + Duration::from_millis(3);
        workers.push(tokio::spawn(async move {
            // First a watch and a wait dropped right after their first poll:
            // mid-subscribe wherever subscribing awaits the server, whatever
            // the random cuts below happen to hit.
            let mut touched = Vec::new();
            for what in [Call::Watch, Call::AcquireHeld] {
                touched.extend(
                    drop_one(&ctx, &client, &holder, &busy, what, ttl, Duration::ZERO).await?,
                );
            }
            for round in 0..ROUNDS {
                let what = CALLS[(round + index) % CALLS.len()];
                touched.extend(drop_one(&ctx, &client, &holder, &busy, what, ttl, span).await?);
            }
            Ok::<_, CaseError>(touched)
        }));
    }
    let mut touched = Vec::new();
    for worker in workers {
        touched.extend(
            within(Duration::from_secs(120), worker, "a dropping client")
                .await?
                .map_err(|e| format!("a dropping client panicked: {e}"))??,
        );
    }
    for path in &paths {
        path.delay(Direction::ToServer, Duration::ZERO);
        path.delay(Direction::ToClient, Duration::ZERO);
    }

    Ok(Storm {
        holder,
        busy,
        busy_lease,
        clients,
        touched,
        ttl,
        _paths: paths,
    })
}

/// After a storm of dropped raw calls (see `storm`), later waiters —
/// one per client whose calls were dropped, each seen blocked first — on
/// the key that saw dropped waits and watches are all granted it, one
/// after the other, once its holder releases: each before the holder's
/// lease could have run out, so woken by the release, not by a timer or
/// their deadline.
pub async fn dropped_calls_leave_later_waiters_woken(ctx: TestContext) -> CaseResult {
    // The storm's fault paths stay up (its clients connected) to the end.
    let storm = storm(&ctx).await?;
    let (holder, busy, busy_lease, clients) = (
        &storm.holder,
        &storm.busy,
        &storm.busy_lease,
        &storm.clients,
    );
    let deadline = busy_lease.valid_until() + Duration::from_secs(5);
    let mut waiters = Vec::new();
    let mut observed = Vec::new();
    for client in clients {
        let observer = Arc::new(ObservedLock::new(client.clone()));
        observed.push(observer.clone());
        let waiter = LockClient::new(observer);
        let (busy, long) = (busy.clone(), ctx.long_ttl());
        waiters.push(tokio::spawn(async move {
            let lease = waiter.acquire(&busy, long, deadline).await?;
            let granted_at = Instant::now();
            if let Some(lease) = &lease {
                waiter.release(lease).await?;
            }
            Ok::<_, distlock_core::LockError>(lease.map(|_| granted_at))
        }));
    }
    for (i, waiter) in observed.iter().enumerate() {
        until_attempts(waiter, 1, &format!("later waiter {i}")).await?;
    }
    holder.release(busy_lease).await?;
    for (i, waiter) in waiters.into_iter().enumerate() {
        let granted_at = within(
            deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(30),
            waiter,
            "a later waiter",
        )
        .await?
        .map_err(|e| format!("a later waiter panicked: {e}"))??
        .ok_or_else(|| {
            format!("later waiter {i} gave up at its deadline although the key was released")
        })?;
        check!(
            granted_at < busy_lease.valid_until(),
            "later waiter {i} got the released key only {:?} after its holder's lease would have run out: it was not woken by the release (a dropped call left a waiter's wake-up broken)",
            granted_at.saturating_duration_since(busy_lease.valid_until())
        );
    }

    drop(storm);
    Ok(())
}

/// After a storm of dropped raw calls (see `storm`), every key a dropped
/// call touched is free again within its TTL (plus slack for servers that
/// expire in batches), with the clients that dropped them still alive.
pub async fn dropped_calls_leave_nothing_held(ctx: TestContext) -> CaseResult {
    // The storm's fault paths stay up (its clients connected) to the end.
    let storm = storm(&ctx).await?;
    let ttl = storm.ttl;
    storm.holder.release(&storm.busy_lease).await?;
    let fresh = ctx.client().await?;
    let mut frees = Vec::new();
    for key in &storm.touched {
        let (fresh, long, key) = (fresh.clone(), ctx.long_ttl(), key.clone());
        frees.push(tokio::spawn(async move {
            let lease = eventually_acquire(
                &fresh,
                &key,
                long,
                ttl + EXPIRY_SLACK,
                "a key touched by a dropped call",
            )
            .await?;
            fresh.release(&lease).await?;
            Ok::<_, CaseError>(())
        }));
    }
    for free in frees {
        within(ttl + EXPIRY_SLACK * 2, free, "a touched key")
            .await?
            .map_err(|e| format!("a check panicked: {e}"))??;
    }
    drop(storm);
    Ok(())
}
