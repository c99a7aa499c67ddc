//! `fault::` — mutual exclusion under real faults: a holder process killed
//! with SIGKILL, connections black-holed and reset by a TCP proxy, the
//! server killed and restarted, waiting futures dropped at random points,
//! and a torture run mixing them all.
//!
//! Clients in these cases carry short timeouts
//! ([`FAULT_CONNECT_TIMEOUT`](crate::FAULT_CONNECT_TIMEOUT),
//! [`FAULT_OPERATION_TIMEOUT`](crate::FAULT_OPERATION_TIMEOUT)). Cases that
//! kill or restart a server start their own, never touching the shared one.
//! Every bound below is a liveness bound (a hang detector) far above what a
//! conforming backend needs, never a performance assertion; measured times
//! are printed when `DISTLOCK_CONFORMANCE_MEASURE=1`.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock_core::{
    AcquireAttempt, ErrorKind, LockClient, LockError, LockKey, LockOptions, Locker, LostReason,
    RunOptions, RunOutcome,
};
use tokio::sync::oneshot;

use super::support::{acquire, background_bound, eventually_acquire, refused, within};
use crate::checker::ExclusionChecker;
use crate::context::{CaseError, CaseResult, TestContext};
use crate::fault::{FaultPath, HolderProcess};
use crate::{check, check_eq};

/// The environment variable setting the torture run's length in seconds.
pub const TORTURE_SECS_ENV: &str = "DISTLOCK_TORTURE_SECS";

/// The torture run's length when [`TORTURE_SECS_ENV`] is not set.
pub const DEFAULT_TORTURE_SECS: u64 = 30;

/// Slack on top of a TTL for "the server let the key go": far above any
/// conforming server's expiry delay (etcd revokes expired leases in
/// batches), so only a key that stays held for good fails it.
const EXPIRY_SLACK: Duration = Duration::from_secs(10);

/// The TTL fault cases hold with (rounded per the backend's capabilities).
fn fault_ttl(ctx: &TestContext, ttl: Duration) -> Result<Duration, CaseError> {
    Ok(ctx.capabilities().effective_ttl(ttl)?)
}

/// Prints a measured number for the report when
/// `DISTLOCK_CONFORMANCE_MEASURE` is set (test-harness output, not a check).
fn measure(ctx: &TestContext, case: &str, text: std::fmt::Arguments<'_>) {
    if std::env::var_os("DISTLOCK_CONFORMANCE_MEASURE").is_some() {
        let _ = writeln!(
            std::io::stderr(),
            "measure {} fault::{case}: {text}",
            ctx.backend_name()
        );
    }
}

/// Whether `e` is one of the kinds a fault may surface as.
fn is_fault_kind(e: &LockError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Unavailable | ErrorKind::Timeout | ErrorKind::NotHeld
    )
}

/// Counts errors by kind; anything but a fault kind fails the case.
#[derive(Debug, Default)]
struct ErrorTally(Mutex<BTreeMap<String, usize>>);

impl ErrorTally {
    fn record(&self, what: &str, e: LockError) -> Result<(), CaseError> {
        if !is_fault_kind(&e) {
            return Err(CaseError(format!(
                "{what}: a fault surfaced as an unexpected {:?} error: {e}",
                e.kind()
            )));
        }
        *self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(format!("{:?}", e.kind()))
            .or_default() += 1;
        Ok(())
    }

    fn summary(&self) -> String {
        format!("{:?}", self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

async fn join<T>(
    task: tokio::task::JoinHandle<Result<T, CaseError>>,
    bound: Duration,
    what: &str,
) -> Result<T, CaseError> {
    within(bound, task, what)
        .await?
        .map_err(|e| CaseError(format!("{what} panicked: {e}")))?
}

/// A holder in a child process is killed with SIGKILL: nobody else gets the
/// lock before (a `try_acquire` right before the kill is refused, after the
/// child's guard renewed past its TTL), and another client gets it once the
/// server expires it (bounded by TTL + 10 s; the time is measured).
pub async fn killed_holder_process_expires(ctx: TestContext) -> CaseResult {
    let key = ctx.key("fault-sigkill");
    let ttl = fault_ttl(&ctx, Duration::from_secs(2))?;
    let holder = HolderProcess::spawn(ctx.url(), &key, ttl)
        .await
        .map_err(|e| format!("cannot start the holder process: {e}"))?;
    let child_token = holder.fencing_token();
    let other = ctx.client().await?;
    // Past one TTL: the child's guard keeps renewing.
    tokio::time::sleep(ttl + ttl / 2).await;
    refused(&other, &key, "the live child process holds the lock").await?;
    let killed_at = holder
        .kill()
        .await
        .map_err(|e| format!("cannot kill the holder process: {e}"))?;
    let lease = eventually_acquire(
        &other,
        &key,
        ttl,
        ttl + EXPIRY_SLACK,
        "another client after the holder's SIGKILL",
    )
    .await?;
    let waited = killed_at.elapsed();
    check!(
        lease.fencing_token() > child_token,
        "the new holder's token {} grows past the killed holder's {child_token}",
        lease.fencing_token()
    );
    measure(
        &ctx,
        "killed_holder_process_expires",
        format_args!("TTL {ttl:?}; SIGKILL to next acquire {waited:?}"),
    );
    other.release(&lease).await?;
    Ok(())
}

/// The holder's connection is black-holed: its guard's `lost()` fires, and
/// only after that (an ordering, not a duration) does a second client,
/// talking to the server directly, get the lock; the checker sees no
/// overlap between the holder's critical section (ended by `lost()`) and
/// the second client's.
pub async fn black_holed_holder_loses_first(ctx: TestContext) -> CaseResult {
    let proxy = ctx.fault_path().await?;
    let via_proxy = ctx.client_through(&proxy).await?;
    let direct = ctx.client().await?;
    let key = ctx.key("fault-blackhole");
    let ttl = fault_ttl(&ctx, Duration::from_secs(2))?;
    let guard = Locker::new(via_proxy)
        .try_lock(&key, &LockOptions::new(ttl))
        .await?
        .ok_or("the key should be free")?;
    let checker = ExclusionChecker::new();
    let holder_token = guard.fencing_token();
    let holder_section = {
        let checker = checker.clone();
        let key = key.clone();
        let lost = guard.lost();
        tokio::spawn(async move {
            let section = checker.enter(&key, holder_token);
            let reason = lost.await;
            let at = Instant::now();
            section.exit();
            Ok::<_, CaseError>((reason, at))
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.black_hole();
    let cut_at = Instant::now();
    let bound = ttl * 2 + EXPIRY_SLACK;
    let lease = eventually_acquire(&direct, &key, ttl, bound, "the direct client").await?;
    let acquired_at = Instant::now();
    checker.critical_section(&key, lease.fencing_token()).await;
    let (reason, lost_at) = join(holder_section, background_bound(), "the holder's lost()").await?;
    check_eq!(
        reason,
        LostReason::Expired,
        "why the black-holed holder lost"
    );
    check!(
        guard.lease().valid_until() <= acquired_at,
        "the holder's lease was still valid when the other client got the lock"
    );
    check!(
        lost_at <= acquired_at,
        "the holder's lost() fired {:?} after the other client acquired",
        lost_at - acquired_at
    );
    check!(
        lease.fencing_token() > holder_token,
        "the second client's token grows"
    );
    checker.verify()?;
    measure(
        &ctx,
        "black_holed_holder_loses_first",
        format_args!(
            "TTL {ttl:?}; black hole to lost {:?}; lost to other client's acquire {:?}",
            lost_at - cut_at,
            acquired_at - lost_at
        ),
    );
    direct.release(&lease).await?;
    drop(guard);
    drop(proxy);
    Ok(())
}

/// Connections reset at random points while three clients acquire, extend
/// and release on six keys (50 rounds each; before each operation a reset
/// of that client's connections is scheduled 0-3 ms later with
/// probability 0.3): every failure is a typed
/// error (Unavailable, Timeout or NotHeld), the checker sees no two holders,
/// and afterwards a fresh client gets every key within TTL + 10 s.
pub async fn resets_during_operations(ctx: TestContext) -> CaseResult {
    const CLIENTS: usize = 3;
    const ROUNDS: usize = 50;
    let ttl = fault_ttl(&ctx, Duration::from_secs(3))?;
    let keys: Arc<Vec<LockKey>> = Arc::new((0..6).map(|_| ctx.key("fault-reset")).collect());
    let checker = ExclusionChecker::new();
    let errors = Arc::new(ErrorTally::default());
    let resets = Arc::new(AtomicUsize::new(0));
    let refusals = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..CLIENTS {
        let proxy = ctx.fault_path().await?;
        let client = ctx.client_through(&proxy).await?;
        let proxy = Arc::new(proxy);
        let (keys, checker, errors, resets, refusals) = (
            keys.clone(),
            checker.clone(),
            errors.clone(),
            resets.clone(),
            refusals.clone(),
        );
        // Before an operation, maybe schedule a reset of this client's
        // connections a random 0-3 ms later: mid-request, mid-reply, or
        // just before or after.
        let chaos = move || {
            if rand::random_bool(0.3) {
                let (proxy, resets) = (proxy.clone(), resets.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_micros(rand::random_range(0..3000))).await;
                    proxy.drop_all();
                    resets.fetch_add(1, Ordering::SeqCst);
                });
            }
        };
        workers.push(tokio::spawn(async move {
            let mut held = 0usize;
            for _ in 0..ROUNDS {
                let key = &keys[rand::random_range(0..keys.len())];
                chaos();
                let lease = match client.try_acquire(key, ttl).await {
                    Ok(AcquireAttempt::Acquired(lease)) => lease,
                    Ok(AcquireAttempt::Held { .. }) => {
                        // Possibly a grant whose answer a reset lost: it
                        // runs out after its TTL.
                        refusals.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(30)).await;
                        continue;
                    }
                    Err(e) => {
                        errors.record("try_acquire", e)?;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                held += 1;
                let mut section = checker.enter(key, lease.fencing_token());
                section.increment().await;
                // Give up on the extension well inside the lease: the
                // section must end while the lease is surely valid.
                let give_up = lease.sent_at() + ttl / 2;
                chaos();
                let extended =
                    tokio::time::timeout_at(give_up.into(), client.extend(&lease, ttl)).await;
                section.exit();
                let current = match extended {
                    Ok(Ok(renewed)) => {
                        if renewed.fencing_token() != lease.fencing_token() {
                            return Err(CaseError("extend changed the fencing token".into()));
                        }
                        renewed
                    }
                    Ok(Err(e)) => {
                        errors.record("extend", e)?;
                        lease
                    }
                    Err(_) => lease,
                };
                chaos();
                if let Err(e) = client.release(&current).await {
                    errors.record("release", e)?;
                }
            }
            Ok(held)
        }));
    }
    let mut held = 0;
    for worker in workers {
        held += join(worker, Duration::from_secs(150), "a worker").await?;
    }
    checker.verify()?;
    // Nothing stays held past its TTL, whatever the resets left behind.
    let fresh = ctx.client().await?;
    let after = Instant::now();
    for key in keys.iter() {
        let lease = eventually_acquire(
            &fresh,
            key,
            ttl,
            ttl + EXPIRY_SLACK,
            "a fresh client after the resets",
        )
        .await?;
        fresh.release(&lease).await?;
    }
    measure(
        &ctx,
        "resets_during_operations",
        format_args!(
            "{} resets, {held} acquisitions, {} refusals, errors {}; all keys free again after {:?} (TTL {ttl:?})",
            resets.load(Ordering::SeqCst),
            refusals.load(Ordering::SeqCst),
            errors.summary(),
            after.elapsed()
        ),
    );
    Ok(())
}

/// How a holder's critical section ended.
#[derive(Debug)]
enum HolderEnd {
    Lost(LostReason),
    Released(Result<(), LockError>),
}

/// The server is killed and restarted (a dedicated one) while three
/// holders hold locks and six waiters wait. The checker proves no two
/// holders ever, as far as the guards believe (a holder's section ends when
/// `lost()` fires). If the backend is not durable (its data is gone after
/// the restart), the server stays down until every holder's `lost()` fired,
/// and the waiters then recover by themselves; tokens restart with the
/// data, so only exclusion is checked. If it is durable, the outage is
/// short: holders keep their locks or cleanly lose them, and fencing tokens
/// never go backwards across the restart.
pub async fn server_restart_with_holders_and_waiters(ctx: TestContext) -> CaseResult {
    let server = ctx.start_server().await?;
    let url = ctx.fault_url(server.addr())?;
    let durable = ctx.capabilities().durable;
    let ttl = fault_ttl(&ctx, Duration::from_secs(if durable { 5 } else { 2 }))?;
    let keys: Vec<LockKey> = (0..3).map(|_| ctx.key("fault-restart")).collect();
    let checker = ExclusionChecker::new();
    let errors = Arc::new(ErrorTally::default());
    let mut holders = Vec::new();
    let mut releases = Vec::new();
    let mut holder_tokens = Vec::new();
    let mut lost_signals = Vec::new();
    for key in &keys {
        let locker = Locker::new(ctx.client_at(&url).await?);
        let guard = locker
            .try_lock(key, &LockOptions::new(ttl))
            .await?
            .ok_or("the key should be free")?;
        holder_tokens.push(guard.fencing_token());
        lost_signals.push(guard.lost_signal());
        let (release_tx, release_rx) = oneshot::channel::<()>();
        releases.push(release_tx);
        let (checker, key) = (checker.clone(), key.clone());
        holders.push(tokio::spawn(async move {
            let section = checker.enter(&key, guard.fencing_token());
            let end = tokio::select! {
                reason = guard.lost() => {
                    section.exit();
                    HolderEnd::Lost(reason)
                }
                _ = release_rx => {
                    section.exit();
                    HolderEnd::Released(guard.release().await)
                }
            };
            Ok::<_, CaseError>(end)
        }));
    }
    let mut waiters = Vec::new();
    for key in keys.iter().flat_map(|k| [k.clone(), k.clone()]) {
        let locker = Locker::new(ctx.client_at(&url).await?);
        let (checker, errors) = (checker.clone(), errors.clone());
        waiters.push(tokio::spawn(async move {
            let give_up = Instant::now() + Duration::from_secs(90);
            loop {
                let options = LockOptions::new(ttl).wait(Duration::from_secs(60));
                match locker.acquire(&key, &options).await {
                    Ok(Some(guard)) => {
                        let token = guard.fencing_token();
                        let mut section = checker.enter(&key, token);
                        section.increment().await;
                        let lost = guard.lost();
                        tokio::select! {
                            _ = lost => {}
                            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                        }
                        section.exit();
                        if let Err(e) = guard.release().await {
                            errors.record("waiter release", e)?;
                        }
                        return Ok(token);
                    }
                    Ok(None) => {}
                    Err(e) => errors.record("waiter acquire", e)?,
                }
                if Instant::now() >= give_up {
                    return Err(CaseError(format!("a waiter for {key} never got the lock")));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    ctx.kill_server(&server).await?;
    let killed_at = Instant::now();
    if !durable {
        // The restarted server will have nothing: wait until every holder
        // knows it lost (its lease ran out), so no guard still believes.
        for signal in &lost_signals {
            within(
                ttl + EXPIRY_SLACK,
                signal.wait(),
                "a holder's lost() with the server down",
            )
            .await?;
        }
    } else {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let down_for = killed_at.elapsed();
    ctx.restart_server(&server).await?;
    let restarted_at = Instant::now();
    if durable {
        // Holders ride out the outage (or lose cleanly), then release.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    for release in releases {
        let _ = release.send(());
    }
    let mut kept = 0;
    let mut lost = 0;
    let mut reasons = Vec::new();
    for holder in holders {
        match join(holder, Duration::from_secs(60), "a holder").await? {
            HolderEnd::Lost(reason) => {
                lost += 1;
                reasons.push(reason);
            }
            HolderEnd::Released(Ok(())) => kept += 1,
            HolderEnd::Released(Err(e)) => {
                errors.record("holder release", e)?;
                lost += 1;
            }
        }
    }
    if !durable {
        check_eq!(
            lost,
            keys.len(),
            "holders that lost their lock with the data"
        );
    }
    let mut waiter_tokens = Vec::new();
    for waiter in waiters {
        waiter_tokens.push(join(waiter, Duration::from_secs(120), "a waiter").await?);
    }
    let recovered_in = restarted_at.elapsed();
    if durable {
        checker.verify()?;
        // And across the restart for a newcomer too.
        let fresh = ctx.client_at(&url).await?;
        for (key, before) in keys.iter().zip(&holder_tokens) {
            let lease = acquire(&fresh, key, ttl, "a fresh client after the restart").await?;
            check!(
                lease.fencing_token() > *before,
                "fencing token went backwards across the restart: {} after {before}",
                lease.fencing_token()
            );
            fresh.release(&lease).await?;
        }
    } else {
        checker.verify_exclusion_only()?;
    }
    let backwards = waiter_tokens
        .iter()
        .filter(|t| holder_tokens.iter().all(|h| *t <= h))
        .count();
    measure(
        &ctx,
        "server_restart_with_holders_and_waiters",
        format_args!(
            "durable {durable}, TTL {ttl:?}; down {down_for:?}; holders kept {kept}, lost {lost} {reasons:?}; all 6 waiters done {recovered_in:?} after restart; waiter tokens not above every pre-restart token: {backwards}/6 (tokens {holder_tokens:?} -> {waiter_tokens:?}); errors {}",
            errors.summary()
        ),
    );
    Ok(())
}

/// The server is down when a client acquires: a typed Unavailable or
/// Timeout error in bounded time (30 s is only the hang detector), for a
/// raw attempt and a waiting `Locker`; and once the server is back the same
/// client acquires again by itself.
pub async fn server_down_at_acquire(ctx: TestContext) -> CaseResult {
    let server = ctx.start_server().await?;
    let client = ctx.client_at(&ctx.fault_url(server.addr())?).await?;
    let key = ctx.key("fault-down");
    let ttl = fault_ttl(&ctx, Duration::from_secs(2))?;
    let lease = acquire(&client, &key, ttl, "with the server up").await?;
    client.release(&lease).await?;
    ctx.kill_server(&server).await?;
    let hang = Duration::from_secs(30);
    let started = Instant::now();
    let attempt = within(
        hang,
        client.try_acquire(&key, ttl),
        "try_acquire with the server down",
    )
    .await?;
    let raw_took = started.elapsed();
    match attempt {
        Err(e) if matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::Timeout) => {}
        other => {
            return Err(format!(
                "try_acquire with the server down: expected Unavailable or Timeout, got {other:?}"
            )
            .into())
        }
    }
    let locker = Locker::new(client.clone());
    let options = LockOptions::new(ttl).wait(Duration::from_secs(2));
    let started = Instant::now();
    let waited = within(
        hang,
        locker.acquire(&key, &options),
        "Locker::acquire with the server down",
    )
    .await?;
    let locker_took = started.elapsed();
    match waited {
        Err(e) if matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::Timeout) => {}
        Err(e) => {
            return Err(format!(
            "Locker::acquire with the server down: expected Unavailable or Timeout, got {:?}: {e}",
            e.kind()
        )
            .into())
        }
        Ok(got) => {
            return Err(format!("Locker::acquire with the server down returned {got:?}").into())
        }
    }
    ctx.restart_server(&server).await?;
    let restarted = Instant::now();
    // The attempts made while the server was down have unknown outcomes
    // (a pooler may queue them and apply them after the restart): the
    // client settles each in the background, taking and giving back what
    // it finds. Let that finish before asking whether the key is free.
    within(
        hang,
        client.idle(),
        "settling the attempts made while the server was down",
    )
    .await?;
    let errors = ErrorTally::default();
    let mut failed_attempts = 0u32;
    let lease = loop {
        match within(hang, client.try_acquire(&key, ttl), "try_acquire after the restart").await? {
            Ok(AcquireAttempt::Acquired(lease)) => break lease,
            Ok(AcquireAttempt::Held { expires_in }) if failed_attempts == 0 => {
                return Err(format!("the key is held after the restart (expires_in {expires_in:?}), though it was released").into())
            }
            Ok(AcquireAttempt::Held { expires_in }) => {
                // Held by one of the failed attempts, which the server
                // applied unseen and whose give-back failed too (the
                // server still recovering): it runs out by its TTL.
                let wait = expires_in.unwrap_or(ttl).min(ttl) + Duration::from_millis(50);
                tokio::time::sleep(wait).await;
            }
            Err(e) => {
                failed_attempts += 1;
                errors.record("try_acquire after the restart", e)?;
                // That attempt's outcome is unknown (the server may have
                // applied it while the client reconnected): the client
                // settles it in the background and gives back what it
                // took. Wait for that, or the next try finds our own
                // orphan held until its TTL.
                within(hang, client.idle(), "settling the failed attempt").await?;
            }
        }
        if restarted.elapsed() > Duration::from_secs(60) {
            return Err("the client did not recover within 60 s of the server's restart".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let recovered = restarted.elapsed();
    client.release(&lease).await?;
    measure(
        &ctx,
        "server_down_at_acquire",
        format_args!(
            "try_acquire failed after {raw_took:?}, Locker::acquire after {locker_took:?}; recovered {recovered:?} after the restart (errors meanwhile {})",
            errors.summary()
        ),
    );
    Ok(())
}

/// Waiting futures are dropped at random points under contention, hundreds
/// of times: afterwards nothing is held and a fresh client acquires at once
/// (far sooner than the waiters' 60 s TTL could explain).
pub async fn dropped_waiters_leave_nothing_held(ctx: TestContext) -> CaseResult {
    const ROUNDS: usize = 40;
    const WAITERS: usize = 8;
    let key = ctx.key("fault-cancel");
    let holder = ctx.locker().await?;
    let lockers: Vec<Locker> = super::support::clients(&ctx, WAITERS)
        .await?
        .into_iter()
        .map(Locker::new)
        .collect();
    let dropped = Arc::new(AtomicUsize::new(0));
    let granted = Arc::new(AtomicUsize::new(0));
    let holder_options = LockOptions::new(ctx.long_ttl()).wait(background_bound());
    for round in 0..ROUNDS {
        let guard = holder
            .acquire(&key, &holder_options)
            .await?
            .ok_or_else(|| {
                format!("round {round}: the key stayed held (a dropped waiter leaked it?)")
            })?;
        let mut tasks = Vec::new();
        for locker in &lockers {
            let (locker, key) = (locker.clone(), key.clone());
            let (dropped, granted) = (dropped.clone(), granted.clone());
            let options = LockOptions::new(ctx.long_ttl()).wait(Duration::from_secs(60));
            let drop_after = Duration::from_millis(rand::random_range(0..60));
            tasks.push(tokio::spawn(async move {
                let result = tokio::select! {
                    result = locker.acquire(&key, &options) => result,
                    _ = tokio::time::sleep(drop_after) => {
                        dropped.fetch_add(1, Ordering::SeqCst);
                        return Ok(());
                    }
                };
                if let Some(guard) = result? {
                    granted.fetch_add(1, Ordering::SeqCst);
                    if rand::random_bool(0.5) {
                        guard.release().await?;
                    } // else dropped: released in the background
                }
                Ok::<_, LockError>(())
            }));
        }
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..60))).await;
        if rand::random_bool(0.5) {
            guard.release().await?;
        } else {
            drop(guard);
        }
        for task in tasks {
            within(Duration::from_secs(90), task, "waiter task")
                .await?
                .map_err(|e| format!("waiter task panicked: {e}"))??;
        }
    }
    let fresh = ctx.client().await?;
    let started = Instant::now();
    let lease = eventually_acquire(
        &fresh,
        &key,
        ctx.long_ttl(),
        background_bound(),
        "a fresh client after all the dropped waiters",
    )
    .await?;
    let took = started.elapsed();
    fresh.release(&lease).await?;
    let dropped = dropped.load(Ordering::SeqCst);
    check!(
        dropped > 0,
        "no waiting future was dropped; the case tested nothing"
    );
    measure(
        &ctx,
        "dropped_waiters_leave_nothing_held",
        format_args!(
            "{} waiting futures: {dropped} dropped, {} granted; fresh client acquired after {took:?}",
            ROUNDS * WAITERS,
            granted.load(Ordering::SeqCst)
        ),
    );
    Ok(())
}

/// `run_exclusive` loses its lock mid-job to a real partition (the
/// holder's connection is black-holed): the job is stopped and the outcome
/// is `Lost` (reason: the lease ran out); afterwards another client gets
/// the lock with a newer token.
pub async fn run_exclusive_lost_to_partition(ctx: TestContext) -> CaseResult {
    let proxy = ctx.fault_path().await?;
    let locker = Locker::new(ctx.client_through(&proxy).await?);
    let key = ctx.key("fault-run");
    let ttl = fault_ttl(&ctx, Duration::from_secs(2))?;
    let (started_tx, started_rx) = oneshot::channel();
    let finished = Arc::new(AtomicBool::new(false));
    let run = {
        let (key, finished) = (key.clone(), finished.clone());
        tokio::spawn(async move {
            let options = RunOptions::new(LockOptions::new(ttl));
            locker
                .run_exclusive(&key, &options, |job| async move {
                    let _ = started_tx.send(job.fencing_token);
                    tokio::time::sleep(Duration::from_secs(120)).await;
                    finished.store(true, Ordering::SeqCst);
                })
                .await
        })
    };
    let token = within(Duration::from_secs(30), started_rx, "the job starting")
        .await?
        .map_err(|_| "run_exclusive did not start the job")?;
    proxy.black_hole();
    let cut_at = Instant::now();
    let outcome = within(
        ttl * 2 + Duration::from_secs(30),
        run,
        "run_exclusive after the partition",
    )
    .await?
    .map_err(|e| format!("run_exclusive panicked: {e}"))??;
    let stopped_after = cut_at.elapsed();
    match outcome {
        RunOutcome::Lost {
            output,
            fencing_token,
            reason,
        } => {
            check!(output.is_none(), "a stopped job has no output");
            check_eq!(fencing_token, token, "the outcome's token");
            check_eq!(reason, LostReason::Expired, "why the lock was lost");
        }
        other => return Err(format!("expected Lost, got {other:?}").into()),
    }
    check!(
        !finished.load(Ordering::SeqCst),
        "the job ran on after the loss"
    );
    let other = ctx.client().await?;
    let lease = eventually_acquire(
        &other,
        &key,
        ttl,
        ttl + EXPIRY_SLACK,
        "another client after the partition",
    )
    .await?;
    check!(
        lease.fencing_token() > token,
        "the next holder's token grows"
    );
    other.release(&lease).await?;
    measure(
        &ctx,
        "run_exclusive_lost_to_partition",
        format_args!("TTL {ttl:?}; partition to Lost outcome {stopped_after:?}"),
    );
    drop(proxy);
    Ok(())
}

/// Counts of what the torture did.
#[derive(Debug, Default)]
struct TortureStats {
    sections: AtomicU64,
    lost: AtomicU64,
    gave_up: AtomicU64,
    cancelled: AtomicU64,
    resets: AtomicU64,
    black_holes: AtomicU64,
    restarts: AtomicU64,
}

/// Exclusion torture: 16 clients contend for 4 keys for
/// `DISTLOCK_TORTURE_SECS` seconds (default 30), each critical section
/// ended as soon as its guard's `lost()` fires, while faults are injected
/// throughout: waiting futures dropped at random, guards released or
/// dropped, and, where faults can be injected, each client behind its own
/// proxy (or simulated link) with random connection resets and black holes
/// (some longer than the TTL, so guards lose their locks) and, on durable
/// backends the harness runs, server restarts. The checker then proves no overlap, no lost increment
/// of the guarded counter, and fencing tokens growing in the order the
/// sections ran.
///
/// No restarts on a backend that is not durable (Redis without
/// persistence): a restart there loses every lock and resets the fencing
/// counter, which legitimately lets two holders overlap (a guard only
/// learns at its next renewal) with tokens going backwards — the documented
/// limit that fencing at the resource, with a durable token source, exists
/// for. `fault::server_restart_with_holders_and_waiters` covers restarts
/// there with an outage longer than the TTL.
pub async fn exclusion_torture(ctx: TestContext) -> CaseResult {
    const CLIENTS: usize = 16;
    const KEYS: usize = 4;
    let secs = match std::env::var(TORTURE_SECS_ENV) {
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .map_err(|e| format!("{TORTURE_SECS_ENV}={v:?} is not a number of seconds: {e}"))?,
        Err(_) => DEFAULT_TORTURE_SECS,
    };
    let run_for = Duration::from_secs(secs);
    let ttl = fault_ttl(&ctx, Duration::from_secs(2))?;
    let server = if ctx.controls_servers() {
        Some(ctx.start_server().await?)
    } else {
        None
    };
    let restarts_allowed = server.is_some() && ctx.capabilities().durable;
    let mut proxies: Vec<Arc<FaultPath>> = Vec::new();
    let mut lockers = Vec::new();
    for _ in 0..CLIENTS {
        let client: LockClient = match &server {
            Some(server) => {
                let (proxy, client) = ctx.client_via_proxy(server.addr()).await?;
                proxies.push(Arc::new(FaultPath::Proxy(proxy)));
                client
            }
            None if ctx.can_inject_faults() => {
                let path = ctx.fault_path().await?;
                let client = ctx.client_through(&path).await?;
                proxies.push(Arc::new(path));
                client
            }
            None => ctx.client().await?,
        };
        lockers.push(Locker::new(client));
    }
    let keys: Arc<Vec<LockKey>> = Arc::new((0..KEYS).map(|_| ctx.key("fault-torture")).collect());
    let checker = ExclusionChecker::new();
    let errors = Arc::new(ErrorTally::default());
    let stats = Arc::new(TortureStats::default());
    let end = Instant::now() + run_for;
    let mut workers = Vec::new();
    // Which clients hold a lock right now: partitions aim at them half the
    // time, so guards really lose locks mid-section.
    let holding: Arc<Vec<AtomicBool>> =
        Arc::new((0..CLIENTS).map(|_| AtomicBool::new(false)).collect());
    for (index, locker) in lockers.into_iter().enumerate() {
        let (keys, checker, errors, stats, holding) = (
            keys.clone(),
            checker.clone(),
            errors.clone(),
            stats.clone(),
            holding.clone(),
        );
        workers.push(tokio::spawn(async move {
            while Instant::now() < end {
                let key = &keys[rand::random_range(0..keys.len())];
                let options =
                    LockOptions::new(ttl).wait(Duration::from_millis(rand::random_range(0..1500)));
                let attempt = locker.acquire(key, &options);
                let result = if rand::random_bool(0.15) {
                    let drop_after = Duration::from_millis(rand::random_range(0..200));
                    tokio::select! {
                        result = attempt => result,
                        _ = tokio::time::sleep(drop_after) => {
                            stats.cancelled.fetch_add(1, Ordering::SeqCst);
                            continue;
                        }
                    }
                } else {
                    attempt.await
                };
                let guard = match result {
                    Ok(Some(guard)) => guard,
                    Ok(None) => {
                        stats.gave_up.fetch_add(1, Ordering::SeqCst);
                        continue;
                    }
                    Err(e) => {
                        errors.record("acquire", e)?;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let mut section = checker.enter(key, guard.fencing_token());
                holding[index].store(true, Ordering::SeqCst);
                let lost = guard.lost();
                // Mostly short; sometimes past the TTL (renewal must work).
                let hold = if rand::random_bool(0.3) {
                    Duration::from_millis(rand::random_range(400..(ttl.as_millis() as u64 * 2)))
                } else {
                    Duration::from_millis(rand::random_range(0..400))
                };
                tokio::select! {
                    biased;
                    _ = lost => { stats.lost.fetch_add(1, Ordering::SeqCst); }
                    _ = async {
                        section.increment().await;
                        tokio::time::sleep(hold).await;
                    } => {}
                }
                section.exit();
                holding[index].store(false, Ordering::SeqCst);
                stats.sections.fetch_add(1, Ordering::SeqCst);
                if rand::random_bool(0.7) {
                    if let Err(e) = guard.release().await {
                        errors.record("release", e)?;
                    }
                } else {
                    drop(guard);
                }
            }
            Ok(())
        }));
    }
    let injector = {
        let (proxies, stats, ctx, server) =
            (proxies.clone(), stats.clone(), ctx.clone(), server.clone());
        tokio::spawn(async move {
            if proxies.is_empty() {
                return Ok(());
            }
            let mut partitions = Vec::new();
            while Instant::now() + Duration::from_secs(2) < end {
                tokio::time::sleep(Duration::from_millis(rand::random_range(50..400))).await;
                let holders: Vec<usize> = (0..proxies.len())
                    .filter(|&i| holding[i].load(Ordering::SeqCst))
                    .collect();
                let aim_at_holder = !holders.is_empty() && rand::random_bool(0.5);
                let target = if aim_at_holder {
                    holders[rand::random_range(0..holders.len())]
                } else {
                    rand::random_range(0..proxies.len())
                };
                let proxy = proxies[target].clone();
                let roll = rand::random_range(0..100);
                if roll < 45 {
                    proxy.drop_all();
                    stats.resets.fetch_add(1, Ordering::SeqCst);
                } else if roll < 90 || !restarts_allowed {
                    // A partition aimed at a holder outlasts its lease (its guard
                    // must lose the lock); others are random, sometimes
                    // shorter than a renewal period.
                    let ttl_ms = ttl.as_millis() as u64;
                    let length = Duration::from_millis(if aim_at_holder {
                        rand::random_range(ttl_ms..ttl_ms * 5 / 2)
                    } else {
                        rand::random_range(100..ttl_ms * 2)
                    });
                    stats.black_holes.fetch_add(1, Ordering::SeqCst);
                    proxy.black_hole();
                    partitions.push(tokio::spawn(async move {
                        tokio::time::sleep(length).await;
                        if rand::random_bool(0.5) {
                            proxy.drop_all();
                        }
                        proxy.heal();
                    }));
                } else if let Some(server) = &server {
                    ctx.restart_server(server).await?;
                    stats.restarts.fetch_add(1, Ordering::SeqCst);
                }
            }
            for partition in partitions {
                let _ = partition.await;
            }
            Ok::<_, CaseError>(())
        })
    };
    let bound = run_for + Duration::from_secs(60);
    join(injector, bound, "the fault injector").await?;
    for proxy in &proxies {
        proxy.heal();
    }
    for worker in workers {
        join(worker, bound, "a torture worker").await?;
    }
    let report = checker.verify()?;
    check!(report.sections > 0, "no critical section ran at all");
    // Nothing stays held for good after the faults.
    let fresh = match &server {
        Some(server) => ctx.client_at(&ctx.fault_url(server.addr())?).await?,
        None => ctx.client().await?,
    };
    for key in keys.iter() {
        let lease = eventually_acquire(
            &fresh,
            key,
            ttl,
            ttl + EXPIRY_SLACK,
            "a fresh client after the torture",
        )
        .await?;
        fresh.release(&lease).await?;
    }
    let per_key: Vec<usize> = keys
        .iter()
        .map(|k| report.sections_per_key.get(k).copied().unwrap_or(0))
        .collect();
    measure(
        &ctx,
        "exclusion_torture",
        format_args!(
            "{secs} s, TTL {ttl:?}: {} sections {per_key:?} per key, {} ended by lost(), {} waits gave up, {} waits dropped; faults: {} resets, {} black holes, {} restarts; errors {}",
            report.sections,
            stats.lost.load(Ordering::SeqCst),
            stats.gave_up.load(Ordering::SeqCst),
            stats.cancelled.load(Ordering::SeqCst),
            stats.resets.load(Ordering::SeqCst),
            stats.black_holes.load(Ordering::SeqCst),
            stats.restarts.load(Ordering::SeqCst),
            errors.summary()
        ),
    );
    Ok(())
}

/// What a fault turned a call into: a typed transient error is right;
/// anything that looks like an answer from the server is not.
fn expect_unreachable<T: std::fmt::Debug>(
    result: Result<T, LockError>,
    what: &str,
) -> Result<(), CaseError> {
    match result {
        Err(e) if matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::Timeout) => Ok(()),
        Err(e) => Err(CaseError(format!(
            "{what}: expected Unavailable or Timeout, got {:?}: {e}",
            e.kind()
        ))),
        Ok(answer) => Err(CaseError(format!(
            "{what}: expected Unavailable or Timeout, got an answer as if the server had replied: {answer:?} (a dead server must not look like a lock held elsewhere)"
        ))),
    }
}

/// A server that is down, or cut off by a black hole, yields `Unavailable`
/// or `Timeout` from `try_acquire` and `try_acquire_renewing` — on a free
/// key and on a key another client holds — and from `Locker::try_lock`
/// and `run_exclusive`; never `Held`/`None`/`Skipped`, which would make
/// every job skip silently while the lock server is dead. Afterwards the
/// same client works again by itself.
pub async fn unreachable_is_an_error_not_held(ctx: TestContext) -> CaseResult {
    let path = ctx.fault_path().await?;
    let client = ctx.client_through(&path).await?;
    let holder = ctx.client().await?;
    let ttl = fault_ttl(&ctx, Duration::from_secs(2))?;
    let free = ctx.key("fault-unreachable");
    let held = ctx.key("fault-unreachable");
    let held_lease = acquire(&holder, &held, ctx.long_ttl(), "the other holder").await?;
    let lease = acquire(&client, &free, ttl, "through the path, reachable").await?;
    client.release(&lease).await?;
    refused(&client, &held, "through the path, reachable").await?;
    let locker = Locker::new(client.clone());
    let hang = Duration::from_secs(30);
    for (fault, apply) in [("down", true), ("black-holed", false)] {
        if apply {
            path.down();
        } else {
            path.black_hole();
        }
        let options = LockOptions::new(ttl);
        let run_options = RunOptions::new(options.clone());
        let (plain_free, plain_held, renewing_free, renewing_held, guard, run) = tokio::join!(
            within(hang, client.try_acquire(&free, ttl), "try_acquire"),
            within(hang, client.try_acquire(&held, ttl), "try_acquire"),
            within(
                hang,
                client.try_acquire_renewing(&free, ttl),
                "try_acquire_renewing"
            ),
            within(
                hang,
                client.try_acquire_renewing(&held, ttl),
                "try_acquire_renewing"
            ),
            within(hang, locker.try_lock(&held, &options), "try_lock"),
            within(
                hang,
                locker.run_exclusive(&held, &run_options, |_| async {}),
                "run_exclusive"
            ),
        );
        expect_unreachable(
            plain_free?,
            &format!("server {fault}: try_acquire of a free key"),
        )?;
        expect_unreachable(
            plain_held?,
            &format!("server {fault}: try_acquire of a held key"),
        )?;
        expect_unreachable(
            renewing_free?,
            &format!("server {fault}: try_acquire_renewing of a free key"),
        )?;
        expect_unreachable(
            renewing_held?,
            &format!("server {fault}: try_acquire_renewing of a held key"),
        )?;
        expect_unreachable(
            guard?,
            &format!("server {fault}: Locker::try_lock of a held key"),
        )?;
        expect_unreachable(
            run?,
            &format!("server {fault}: run_exclusive of a held key"),
        )?;
        path.up();
        path.heal();
    }
    // Requests a black hole held back may land late and take the free key
    // for their TTL; the client recovers by itself either way.
    let errors = ErrorTally::default();
    let give_up = Instant::now() + ttl + EXPIRY_SLACK * 3;
    let lease = loop {
        match within(
            hang,
            client.try_acquire(&free, ttl),
            "try_acquire after the faults",
        )
        .await?
        {
            Ok(AcquireAttempt::Acquired(lease)) => break lease,
            Ok(AcquireAttempt::Held { .. }) => {}
            Err(e) => errors.record("try_acquire after the faults", e)?,
        }
        if Instant::now() >= give_up {
            return Err(format!(
                "the client did not recover after the server came back (errors {})",
                errors.summary()
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    client.release(&lease).await?;
    refused(&client, &held, "the other holder kept its lock").await?;
    holder.release(&held_lease).await?;
    Ok(())
}

/// How a case freezes "the server": SIGSTOP on a dedicated server process,
/// or a black hole on the simulated network every client shares.
enum Stall {
    Process(Arc<crate::server::ServerProcess>, String),
    Network(crate::fault::FaultPath),
}

impl Stall {
    async fn new(ctx: &TestContext) -> Result<Stall, CaseError> {
        if ctx.controls_servers() {
            let server = ctx.start_server().await?;
            let url = ctx.fault_url(server.addr())?;
            Ok(Stall::Process(server, url))
        } else {
            Ok(Stall::Network(ctx.fault_path().await?))
        }
    }

    async fn client(&self, ctx: &TestContext) -> Result<LockClient, CaseError> {
        match self {
            Stall::Process(_, url) => ctx.client_at(url).await,
            Stall::Network(path) => ctx.client_through(path).await,
        }
    }

    /// Freezes (`true`) or thaws (`false`) the server.
    async fn set_frozen(&self, frozen: bool) -> Result<(), CaseError> {
        match self {
            Stall::Process(server, _) => {
                let server = server.clone();
                tokio::task::spawn_blocking(move || {
                    if frozen {
                        server.pause()
                    } else {
                        server.resume()
                    }
                })
                .await
                .map_err(|e| format!("pause/resume panicked: {e}"))?
                .map_err(|e| CaseError(format!("cannot SIGSTOP/SIGCONT the server: {e}")))
            }
            Stall::Network(path) if frozen => {
                path.black_hole();
                Ok(())
            }
            Stall::Network(path) => {
                path.heal();
                Ok(())
            }
        }
    }
}

/// The server stalls (SIGSTOP on a dedicated server; a black hole for an
/// in-process backend) while two holders hold and four waiters wait (each
/// seen blocked first: its attempt was counted). One holder has a long TTL
/// and keeps its lock through the stall; the other's TTL is shorter than
/// the stall, so its guard's `lost()` fires while the server is frozen.
/// After the server resumes, the long holder releases: its waiters must be
/// woken by that release, i.e. granted the lock before the holder's first
/// lease could have run out (its `valid_until`), not by a timer; the short
/// holder's waiters get its lock once the server expired it. Every waiter
/// gets its lock, and the checker sees no overlap (a holder's section ends
/// when its `lost()` fires).
pub async fn stalled_server_waiters_recover(ctx: TestContext) -> CaseResult {
    let stall = Stall::new(&ctx).await?;
    let long_ttl = fault_ttl(&ctx, Duration::from_secs(20))?;
    let short_ttl = fault_ttl(&ctx, Duration::from_secs(2))?;
    let keep = ctx.key("fault-stall-keep");
    let lose = ctx.key("fault-stall-lose");
    let checker = ExclusionChecker::new();
    let errors = Arc::new(ErrorTally::default());
    let keeper = Locker::new(stall.client(&ctx).await?)
        .try_lock(&keep, &LockOptions::new(long_ttl))
        .await?
        .ok_or("the key should be free")?;
    let keeper_first_deadline = keeper.lease().valid_until();
    let loser = Locker::new(stall.client(&ctx).await?)
        .try_lock(&lose, &LockOptions::new(short_ttl))
        .await?
        .ok_or("the key should be free")?;
    let keeper_section = checker.enter(&keep, keeper.fencing_token());
    let loser_section = {
        let (checker, lose, lost) = (checker.clone(), lose.clone(), loser.lost());
        let token = loser.fencing_token();
        tokio::spawn(async move {
            let section = checker.enter(&lose, token);
            let reason = lost.await;
            section.exit();
            reason
        })
    };
    let mut waiters = Vec::new();
    let mut observed = Vec::new();
    for key in [&keep, &keep, &lose, &lose] {
        let client = Arc::new(crate::ObservedLock::new(stall.client(&ctx).await?));
        observed.push(client.clone());
        let locker = Locker::new(client);
        let (key, checker, errors) = (key.clone(), checker.clone(), errors.clone());
        waiters.push(tokio::spawn(async move {
            let give_up = Instant::now() + Duration::from_secs(90);
            loop {
                let wait = give_up.saturating_duration_since(Instant::now());
                match locker
                    .acquire(&key, &LockOptions::new(short_ttl).wait(wait))
                    .await
                {
                    Ok(Some(guard)) => {
                        let granted_at = Instant::now();
                        let mut section = checker.enter(&key, guard.fencing_token());
                        section.increment().await;
                        section.exit();
                        if let Err(e) = guard.release().await {
                            errors.record("waiter release", e)?;
                        }
                        return Ok::<_, CaseError>(granted_at);
                    }
                    Ok(None) => {
                        return Err(CaseError(format!(
                            "a waiter for {key} never got the lock after the stall"
                        )))
                    }
                    // The waiting loop gives up on a timeout with the
                    // server frozen; wait again.
                    Err(e) => errors.record("waiter acquire", e)?,
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }));
    }
    for (i, client) in observed.iter().enumerate() {
        super::support::until_attempts(client, 1, &format!("waiter {i}")).await?;
    }
    stall.set_frozen(true).await?;
    let frozen_at = Instant::now();
    let lost = within(
        short_ttl + EXPIRY_SLACK,
        loser.lost(),
        "the short holder's lost() with the server frozen",
    )
    .await;
    // Let the frozen server's clock run past the short lock's expiry.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stall.set_frozen(false).await?;
    let frozen_for = frozen_at.elapsed();
    check_eq!(
        lost?,
        LostReason::Expired,
        "why the short holder lost its lock"
    );
    check!(
        !keeper.is_lost(),
        "the long holder (TTL {long_ttl:?}) lost its lock in a stall of {frozen_for:?}"
    );
    keeper_section.exit();
    keeper.release().await?;
    let mut granted = Vec::new();
    for waiter in waiters {
        granted.push(join(waiter, Duration::from_secs(120), "a waiter").await?);
    }
    within(
        background_bound(),
        loser_section,
        "the short holder's section",
    )
    .await?
    .map_err(|e| format!("the short holder's section panicked: {e}"))?;
    for (i, at) in granted[..2].iter().enumerate() {
        check!(
            *at < keeper_first_deadline,
            "waiter {i} of the long holder's key got it only {:?} after the holder's first lease ran out: it was not woken by the release after the stall",
            at.saturating_duration_since(keeper_first_deadline)
        );
    }
    let report = checker.verify()?;
    check_eq!(report.sections, 6, "sections: 2 holders and 4 waiters");
    measure(
        &ctx,
        "stalled_server_waiters_recover",
        format_args!(
            "frozen {frozen_for:?}; errors meanwhile {}",
            errors.summary()
        ),
    );
    drop(loser);
    Ok(())
}

/// Where a renewal ended, as [`ExtendLog`] saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExtendOutcome {
    Extended,
    NotHeld,
    Failed(ErrorKind),
}

/// Forwards everything to the backend of a client, recording when each
/// `extend` started and how it ended, so a case can see a renewal meet a
/// fault and the next one succeed.
#[derive(Debug)]
struct ExtendLog {
    inner: Arc<dyn distlock_core::LockBackend>,
    extends: Mutex<Vec<(Instant, ExtendOutcome)>>,
}

impl ExtendLog {
    fn new(client: &LockClient) -> Arc<Self> {
        Arc::new(Self {
            inner: client.backend().clone(),
            extends: Mutex::new(Vec::new()),
        })
    }

    /// Waits for the first extend that started at or after `since` to end.
    async fn first_since(&self, since: Instant) -> ExtendOutcome {
        loop {
            let first = self
                .extends
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .find(|(started, _)| *started >= since)
                .map(|(_, outcome)| *outcome);
            if let Some(outcome) = first {
                return outcome;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits for an extend that started at or after `since` to succeed.
    async fn extended_since(&self, since: Instant) {
        loop {
            let extended = self
                .extends
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .any(|(started, outcome)| *started >= since && *outcome == ExtendOutcome::Extended);
            if extended {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

#[deny(clippy::missing_trait_methods)]
#[distlock_core::async_trait]
impl distlock_core::LockBackend for ExtendLog {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capabilities(&self) -> distlock_core::Capabilities {
        self.inner.capabilities()
    }

    async fn acquire(
        &self,
        request: distlock_core::AcquireRequest<'_>,
    ) -> Result<distlock_core::AcquireReply, LockError> {
        self.inner.acquire(request).await
    }

    async fn extend(
        &self,
        lock: distlock_core::HeldLock<'_>,
        ttl: Duration,
    ) -> Result<distlock_core::ExtendReply, LockError> {
        let started = Instant::now();
        let reply = self.inner.extend(lock, ttl).await;
        let outcome = match &reply {
            Ok(distlock_core::ExtendReply::Extended(_)) => ExtendOutcome::Extended,
            Ok(distlock_core::ExtendReply::NotHeld) => ExtendOutcome::NotHeld,
            Err(e) => ExtendOutcome::Failed(e.kind()),
        };
        self.extends
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((started, outcome));
        reply
    }

    async fn release(
        &self,
        lock: distlock_core::HeldLock<'_>,
    ) -> Result<distlock_core::ReleaseReply, LockError> {
        self.inner.release(lock).await
    }

    async fn watch(&self, key: &LockKey) -> Result<Option<distlock_core::ReleaseWatch>, LockError> {
        self.inner.watch(key).await
    }

    fn admin(&self) -> Option<&dyn distlock_core::LockAdmin> {
        self.inner.admin()
    }

    fn semaphore(&self) -> Option<&dyn distlock_core::SemaphoreBackend> {
        self.inner.semaphore()
    }
}

/// `release` of `lease` through `client`, retried while the client
/// reconnects after a fault (transient errors), until `bound`.
async fn release_after_fault(
    client: &LockClient,
    lease: &distlock_core::Lease,
    bound: Duration,
    what: &str,
) -> CaseResult {
    let give_up = Instant::now() + bound;
    loop {
        match client.release(lease).await {
            Ok(()) => return Ok(()),
            Err(e) if e.is_transient() && Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => {
                return Err(CaseError(format!(
                    "{what}: release after the fault failed with {:?}: {e}",
                    e.kind()
                )))
            }
        }
    }
}

/// An extend or a release that cannot reach the server (down: every call
/// refused; black-holed: no reply) is an `Unavailable` or `Timeout` error,
/// for a plain and a renewing lock: never `NotHeld` (a guard would give up
/// a lock the server still holds for it) and never a success (a job would
/// believe its lock renewed, or free for the next run). With the server
/// down nothing reached it, so afterwards the server still holds each lock
/// for its holder, and the holder releases it for real.
pub async fn unreachable_extend_and_release_are_errors(ctx: TestContext) -> CaseResult {
    let path = ctx.fault_path().await?;
    let client = ctx.client_through(&path).await?;
    let observer = ctx.client().await?;
    let ttl = fault_ttl(&ctx, Duration::from_secs(30))?;
    let hang = Duration::from_secs(30);
    for (fault, down) in [("down", true), ("black-holed", false)] {
        let mut leases = Vec::new();
        for renewing in [false, true] {
            let key = ctx.key("fault-unreachable-release");
            let attempt = if renewing {
                client.try_acquire_renewing(&key, ttl).await?
            } else {
                client.try_acquire(&key, ttl).await?
            };
            let AcquireAttempt::Acquired(lease) = attempt else {
                return Err(format!("a free key must be acquired, got {attempt:?}").into());
            };
            leases.push((renewing, lease));
        }
        if down {
            path.down();
        } else {
            path.black_hole();
        }
        for (renewing, lease) in &leases {
            let what = format!("server {fault}, renewing: {renewing}");
            let extended = within(hang, client.extend(lease, ttl), "extend").await?;
            expect_unreachable(extended, &format!("{what}: extend"))?;
            let released = within(hang, client.release(lease), "release").await?;
            expect_unreachable(released, &format!("{what}: release"))?;
        }
        path.up();
        path.heal();
        for (renewing, lease) in &leases {
            let what = format!("server {fault}, renewing: {renewing}");
            if down {
                // Nothing reached the server.
                check!(
                    super::support::still_held_by(&observer, lease.key(), lease.fencing_token())
                        .await?,
                    "{what}: after an extend and a release that failed, the server no longer holds the lock (token {}) for its holder",
                    lease.fencing_token()
                );
                release_after_fault(&client, lease, hang, &what).await?;
                let next = acquire(&observer, lease.key(), ctx.long_ttl(), &what).await?;
                observer.release(&next).await?;
            } else {
                // What the black hole held back may land late: the outcome
                // is unknown, the lock is released or runs out.
                let _ = client.release(lease).await;
            }
        }
    }
    Ok(())
}

/// A brief outage during one renewal does not lose the guard: the server
/// goes down (every call refused) right after a renewing guard is granted
/// its lock, until its first renewal (a third of the TTL in) has failed;
/// that renewal must fail with `Unavailable`/`Timeout`, not `NotHeld`.
/// Once the server is back the guard's retry renews the lock: the guard is
/// not lost, and the server holds the lock for it until it releases.
pub async fn renewal_outage_keeps_guard(ctx: TestContext) -> CaseResult {
    // A third of it between the failed renewal and the stop moment, for the
    // failure to surface and the client to reconnect.
    let ttl = fault_ttl(&ctx, Duration::from_secs(12))?;
    let path = ctx.fault_path().await?;
    let log = ExtendLog::new(&ctx.client_through(&path).await?);
    let observer = ctx.client().await?;
    let key = ctx.key("fault-renewal-outage");
    let guard = Locker::new(LockClient::new(log.clone()))
        .acquire(&key, &LockOptions::new(ttl).wait(Duration::from_secs(20)))
        .await?
        .ok_or("the key should be free")?;
    let down_at = Instant::now();
    path.down();
    let first = within(ttl, log.first_since(down_at), "the guard's first renewal").await;
    path.up();
    match first? {
        ExtendOutcome::Failed(ErrorKind::Unavailable | ErrorKind::Timeout) => {}
        ExtendOutcome::NotHeld => {
            return Err(
                "a renewal that could not reach the server (down) was answered NotHeld: the guard gives up a lock the server still holds for it".into(),
            )
        }
        outcome => {
            return Err(format!(
                "a renewal against a server that is down ended {outcome:?}; expected an Unavailable or Timeout error"
            )
            .into())
        }
    }
    let up_at = Instant::now();
    tokio::select! {
        renewed = within(ttl, log.extended_since(up_at), "a renewal after the outage") => renewed?,
        reason = guard.lost() => {
            return Err(format!("the guard was lost ({reason:?}) after one renewal failed transiently").into())
        }
    }
    check!(
        !guard.is_lost(),
        "the guard was lost ({:?}) although a renewal after the outage succeeded",
        guard.lost_signal().reason()
    );
    check!(
        super::support::still_held_by(&observer, &key, guard.fencing_token()).await?,
        "the server does not hold the lock for the renewed guard"
    );
    guard.release().await?;
    let next = acquire(&observer, &key, ctx.long_ttl(), "after the guard released").await?;
    observer.release(&next).await?;
    Ok(())
}
