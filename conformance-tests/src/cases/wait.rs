//! `wait::` — waiting with a deadline, wake-up, cancel safety, fairness of
//! hand-over (each waiter gets the lock exactly once).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{LockClient, LockOptions, Locker};

use super::support::{
    acquire, background_bound, eventually_acquire, expiry_bound, refused, until_attempts, within,
};
use crate::checker::ExclusionChecker;
use crate::context::{CaseResult, TestContext};
use crate::{check, check_eq, ObservedLock};

/// A waiter gets the lock once the holder releases it.
pub async fn waiter_gets_lock_after_release(ctx: TestContext) -> CaseResult {
    let holder = ctx.client().await?;
    let key = ctx.key("wait");
    let lease = acquire(&holder, &key, ctx.long_ttl(), "holder").await?;
    let observed = Arc::new(ObservedLock::new(ctx.client().await?));
    let locker = Locker::new(observed.clone());
    let options = LockOptions::new(ctx.long_ttl()).with_wait(Duration::from_secs(60));
    let waiter = {
        let key = key.clone();
        tokio::spawn(async move { locker.acquire(&key, &options).await })
    };
    // Release only once the waiter is blocked (its first attempt refused).
    until_attempts(&observed, 1, "the waiter").await?;
    holder.release(&lease).await?;
    // Bounded far below the holder's TTL: only the release can explain it.
    let guard = within(background_bound(), waiter, "waiter woken by the release")
        .await?
        .map_err(|e| format!("waiter panicked: {e}"))??;
    let guard = guard.ok_or("the waiter gave up although the lock was released")?;
    check!(
        guard.fencing_token() > lease.fencing_token(),
        "waiter's token grows"
    );
    refused(&holder, &key, "the waiter now holds it").await?;
    guard.release().await?;
    Ok(())
}

/// The client's lease-level `LockClient::acquire` waits for a release too.
pub async fn raw_acquire_waits_for_release(ctx: TestContext) -> CaseResult {
    let holder = ctx.client().await?;
    // Observed so the release waits until the waiter is blocked; its
    // `acquire` is the shared waiting loop over the backend's own `watch`
    // and `try_acquire`.
    let waiter = Arc::new(ObservedLock::new(ctx.client().await?));
    let waiter_client = LockClient::new(waiter.clone());
    let key = ctx.key("wait");
    let lease = acquire(&holder, &key, ctx.long_ttl(), "holder").await?;
    let task = {
        let key = key.clone();
        let ttl = ctx.long_ttl();
        let waiter = waiter_client.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            waiter.acquire(&key, ttl, deadline).await
        })
    };
    until_attempts(&waiter, 1, "the raw waiter").await?;
    holder.release(&lease).await?;
    let got = within(background_bound(), task, "raw waiter woken by the release")
        .await?
        .map_err(|e| format!("waiter panicked: {e}"))?;
    let got = got?.ok_or("raw acquire gave up although the lock was released")?;
    refused(&holder, &key, "the waiter holds it").await?;
    waiter_client.release(&got).await?;
    Ok(())
}

/// A holder that crashed (never releases) is noticed when its TTL runs out.
pub async fn waiter_gets_lock_after_crashed_holder(ctx: TestContext) -> CaseResult {
    let ttl = ctx.short_ttl();
    let key = ctx.key("wait");
    let crashed_token = {
        let holder = ctx.client().await?;
        let lease = acquire(&holder, &key, ttl, "holder").await?;
        // The holder goes away without releasing.
        drop(holder);
        lease.fencing_token()
    };
    let locker = ctx.locker().await?;
    let options = LockOptions::new(ctx.long_ttl()).with_wait(expiry_bound(ttl));
    let guard = locker.acquire(&key, &options).await?;
    let guard = guard.ok_or("the waiter never got the lock of a crashed holder")?;
    check!(
        guard.fencing_token() > crashed_token,
        "token grows past the crashed holder's"
    );
    guard.release().await?;
    Ok(())
}

/// A waiter gives up at its deadline, returns None and takes nothing.
pub async fn deadline_respected(ctx: TestContext) -> CaseResult {
    let holder = ctx.client().await?;
    let key = ctx.key("wait");
    let lease = acquire(&holder, &key, ctx.long_ttl(), "holder").await?;
    let locker = ctx.locker().await?;
    let options = LockOptions::new(ctx.long_ttl()).with_wait(Duration::from_millis(300));
    let got = within(
        Duration::from_secs(30),
        locker.acquire(&key, &options),
        "waiter with a 300 ms deadline",
    )
    .await??;
    check!(got.is_none(), "a waiter got a lock that was never released");
    // The raw trait method too.
    let raw = ctx.client().await?;
    let deadline = Instant::now() + Duration::from_millis(300);
    let got = within(
        Duration::from_secs(30),
        raw.acquire(&key, ctx.long_ttl(), deadline),
        "raw waiter",
    )
    .await??;
    check!(
        got.is_none(),
        "a raw waiter got a lock that was never released"
    );
    refused(&ctx.client().await?, &key, "holder keeps the lock").await?;
    holder.release(&lease).await?;
    // The timed-out waiters left nothing behind: the key is free at once.
    let fresh = ctx.client().await?;
    let next = acquire(&fresh, &key, ctx.long_ttl(), "after the holder released").await?;
    fresh.release(&next).await?;
    Ok(())
}

/// Dropping waiting futures at arbitrary points — before, around and after
/// the release — leaves no lock held.
pub async fn cancelled_waiters_leave_nothing_held(ctx: TestContext) -> CaseResult {
    let key = ctx.key("wait");
    let holder = ctx.client().await?;
    let lockers: Vec<Locker> = super::support::clients(&ctx, 6)
        .await?
        .into_iter()
        .map(Locker::new)
        .collect();
    for round in 0..5 {
        let lease = acquire(
            &holder,
            &key,
            ctx.long_ttl(),
            &format!("holder, round {round}"),
        )
        .await?;
        let got = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for (i, locker) in lockers.iter().enumerate() {
            let locker = locker.clone();
            let key = key.clone();
            let got = got.clone();
            // Waiters hold for the long TTL: a leaked grant would keep the
            // key far longer than the check below waits.
            let options = LockOptions::new(ctx.long_ttl()).with_wait(Duration::from_secs(60));
            let cancel_after = Duration::from_millis(rand::random_range(0..120));
            tasks.push(tokio::spawn(async move {
                let attempt = locker.acquire(&key, &options);
                let outcome = if i == 0 {
                    // Dropped before its first poll.
                    drop(attempt);
                    None
                } else {
                    tokio::select! {
                        result = attempt => Some(result),
                        _ = tokio::time::sleep(cancel_after) => None,
                    }
                };
                if let Some(result) = outcome {
                    if let Some(guard) = result? {
                        got.fetch_add(1, Ordering::SeqCst);
                        guard.release().await?;
                    }
                }
                Ok::<_, distlock_core::LockError>(())
            }));
        }
        tokio::time::sleep(Duration::from_millis(rand::random_range(20..80))).await;
        holder.release(&lease).await?;
        for task in tasks {
            within(Duration::from_secs(90), task, "waiter task")
                .await?
                .map_err(|e| format!("waiter task panicked: {e}"))??;
        }
        // Anything granted to a dropped waiter is released in the background;
        // a leak would hold the key for the long TTL.
        let fresh = ctx.client().await?;
        let lease = eventually_acquire(
            &fresh,
            &key,
            ctx.long_ttl(),
            background_bound(),
            &format!("fresh client after cancelled waiters, round {round}"),
        )
        .await?;
        fresh.release(&lease).await?;
    }
    Ok(())
}

/// 16 waiters on one key: each gets the lock exactly once, never two at a
/// time, with growing tokens.
pub async fn sixteen_waiters_each_once(ctx: TestContext) -> CaseResult {
    let key = ctx.key("wait");
    let holder = ctx.client().await?;
    let lease = acquire(&holder, &key, ctx.long_ttl(), "holder").await?;
    let checker = ExclusionChecker::new();
    let mut tasks = Vec::new();
    let mut observed = Vec::new();
    for i in 0..16 {
        let client = Arc::new(ObservedLock::new(ctx.client().await?));
        observed.push(client.clone());
        let locker = Locker::new(client);
        let key = key.clone();
        let checker = checker.clone();
        let options = LockOptions::new(ctx.long_ttl()).with_wait(Duration::from_secs(120));
        tasks.push(tokio::spawn(async move {
            let guard = locker.acquire(&key, &options).await?;
            let Some(guard) = guard else {
                return Ok::<_, distlock_core::LockError>(Err(format!("waiter {i} gave up")));
            };
            checker.critical_section(&key, guard.fencing_token()).await;
            guard.release().await?;
            Ok(Ok(()))
        }));
    }
    for (i, client) in observed.iter().enumerate() {
        until_attempts(client, 1, &format!("waiter {i}")).await?;
    }
    holder.release(&lease).await?;
    for task in tasks {
        within(Duration::from_secs(150), task, "waiter")
            .await?
            .map_err(|e| format!("waiter task panicked: {e}"))???;
    }
    let report = checker.verify()?;
    check_eq!(report.sections, 16, "each of 16 waiters held the lock once");
    check_eq!(
        report.counters.get(&key).copied(),
        Some(16),
        "guarded counter"
    );
    Ok(())
}

/// A waiter on one key is not blocked by a held look-alike key.
pub async fn waiter_on_free_key_not_blocked_by_other_key(ctx: TestContext) -> CaseResult {
    let holder = ctx.client().await?;
    let held = ctx.key("wait");
    let free = ctx.key("wait");
    let lease = acquire(&holder, &held, ctx.long_ttl(), "holder").await?;
    let locker = ctx.locker().await?;
    let options = LockOptions::new(ctx.long_ttl()).with_wait(Duration::from_secs(60));
    let guard = within(
        background_bound(),
        locker.acquire(&free, &options),
        "waiter on a free key",
    )
    .await??
    .ok_or("a free key was not acquired")?;
    guard.release().await?;
    holder.release(&lease).await?;
    Ok(())
}

/// A waiter dropped at the very moment the lock is handed to it (the
/// holder's release and the waiter's cancellation happen together, 100
/// times) leaves no lock held: a grant the caller never saw is released.
pub async fn cancel_at_grant_leaves_nothing_held(ctx: TestContext) -> CaseResult {
    let holder = ctx.client().await?;
    let observed = Arc::new(ObservedLock::new(ctx.client().await?));
    let locker = Locker::new(observed.clone());
    for round in 0..100 {
        let key = ctx.key("wait-race");
        let lease = acquire(&holder, &key, ctx.long_ttl(), "holder").await?;
        let attempts_before = observed.attempts_in_line();
        let stop = Arc::new(tokio::sync::Notify::new());
        let waiter = {
            let locker = locker.clone();
            let key = key.clone();
            let stop = stop.clone();
            // The waiter's grant would hold for the long TTL if leaked.
            let options = LockOptions::new(ctx.long_ttl()).with_wait(Duration::from_secs(60));
            tokio::spawn(async move {
                tokio::select! {
                    result = locker.acquire(&key, &options) => match result {
                        Ok(Some(guard)) => guard.release().await,
                        Ok(None) => Ok(()),
                        Err(e) => Err(e),
                    },
                    _ = stop.notified() => Ok(()),
                }
            })
        };
        // Once the waiter is blocked, release and cancel together.
        until_attempts(&observed, attempts_before + 1, "the waiter").await?;
        holder.release(&lease).await?;
        stop.notify_one();
        within(Duration::from_secs(60), waiter, "waiter task")
            .await?
            .map_err(|e| format!("waiter task panicked: {e}"))??;
        let fresh = eventually_acquire(
            &holder,
            &key,
            ctx.long_ttl(),
            background_bound(),
            &format!("round {round}: a waiter cancelled as it was granted the lock leaked it"),
        )
        .await?;
        holder.release(&fresh).await?;
    }
    Ok(())
}

/// Key shapes a server's channels, patterns, prefixes or identifiers may
/// mishandle: separators, hash tags, URL escapes, glob and regex
/// characters, whitespace and line breaks, quotes, Unicode.
const KEY_SHAPES: &[&str] = &[
    "",
    "a",
    "ab",
    "a/b",
    "a:b",
    "a.b",
    "a{b}",
    "{a}b",
    "a%2Fb",
    "a%",
    "*",
    "?",
    "[x]",
    "a*",
    "a?b",
    "[",
    "]",
    "\\",
    "a\\*",
    "^",
    "$",
    ".*",
    "a|b",
    "a b",
    " ",
    "a\nb",
    "\n",
    "\r\n",
    "\t",
    "a'b",
    "a\"b",
    "_",
    "-",
    "\u{e9}",
    "e\u{301}",
    "\u{65e5}\u{672c}",
    "\u{1f512}",
    "\u{ff41}",
    "a\u{200b}b",
];

/// Waiters are woken by the release of their own key whatever its shape:
/// every shape of [`KEY_SHAPES`] after a common random stem (so the keys are
/// prefixes of one another), some of them before it, and two keys of
/// exactly 512 bytes (ASCII, and multibyte) are held at once, a waiter
/// blocked on each (its first attempt refused). The waiters subscribe from
/// the last key to the first and the keys are released from the first to
/// the last, so a waiter queued or subscribed under a key's prefix instead
/// of the key itself is not the one woken. Each release must hand its key
/// to its waiter, far below the holder's TTL (a waiter its release did not
/// reach sleeps until the holder's expiry).
pub async fn waiters_woken_for_every_key_shape(ctx: TestContext) -> CaseResult {
    let stem = super::support::stem("shape");
    let mut keys = Vec::new();
    for shape in KEY_SHAPES {
        keys.push(super::support::key_with(&stem, shape)?);
    }
    for shape in ["*", "?", "[x]", "{a}", " ", "\n", "\u{65e5}", "/", "%2F"] {
        keys.push(super::support::key_with(shape, &stem)?);
    }
    for filler in ["x", "\u{e9}"] {
        let mut text = stem.clone();
        while text.len() + filler.len() <= distlock_core::MAX_KEY_BYTES {
            text.push_str(filler);
        }
        while text.len() < distlock_core::MAX_KEY_BYTES {
            text.push('y');
        }
        keys.push(super::support::key_with(&text, "")?);
    }
    let holder = ctx.client().await?;
    let waiter = ctx.client().await?;
    let mut leases = Vec::new();
    for key in &keys {
        leases.push(acquire(&holder, key, ctx.long_ttl(), &format!("holder of {key:?}")).await?);
    }
    let mut waiting = Vec::new();
    for key in keys.iter().rev() {
        let observed = Arc::new(ObservedLock::new(waiter.clone()));
        let locker = Locker::new(observed.clone());
        let options = LockOptions::new(ctx.long_ttl()).with_wait(Duration::from_secs(120));
        let task = {
            let key = key.clone();
            tokio::spawn(async move { locker.acquire(&key, &options).await })
        };
        until_attempts(&observed, 1, &format!("the waiter on {key:?}")).await?;
        waiting.push(task);
    }
    waiting.reverse();
    for (lease, task) in leases.iter().zip(waiting) {
        holder.release(lease).await?;
        let what = format!("the waiter on {:?} woken by its release", lease.key());
        let guard = within(background_bound(), task, &what)
            .await?
            .map_err(|e| format!("{what}: panicked: {e}"))??
            .ok_or_else(|| format!("{what}: gave up although the key was released"))?;
        check!(
            guard.fencing_token() > lease.fencing_token(),
            "{what}: its token grows"
        );
        guard.release().await?;
    }
    Ok(())
}
