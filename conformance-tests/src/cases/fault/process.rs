//! `fault::` cases that kill processes: a lock holder's (SIGKILL, no
//! chance to release), and the server's (killed and restarted under
//! holders and waiters, or down when a client acquires).

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{
    AcquireAttempt, ErrorKind, LockError, LockKey, LockOptions, Locker, LostReason,
};
use tokio::sync::oneshot;

use super::{fault_ttl, join, measure, ErrorTally, EXPIRY_SLACK};
use crate::cases::support::{acquire, eventually_acquire, refused, within};
use crate::checker::ExclusionChecker;
use crate::context::{CaseError, CaseResult, TestContext};
use crate::fault::HolderProcess;
use crate::{check, check_eq};

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
                let options = LockOptions::new(ttl).with_wait(Duration::from_secs(60));
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
    let options = LockOptions::new(ttl).with_wait(Duration::from_secs(2));
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
